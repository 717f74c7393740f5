"""The sm100-nvrtc backend's host side and self-test gate, on the CPU.

`emulate_kernel` reads the prepared operands byte for byte the way the kernel addresses them (128-byte
K stages, four 32-byte MMAs per stage, scale atom i*N//4 at scale-factor ID (i*N) % 4 of the 128x4
layout, zeros past the tensor as TMA fills them) and computes the product in float64. It stands in for
run_gemm so the backend's glue (activation quantization, padding, scale views, alpha, bias, bf16 out)
and the shared first-use self-test gate (microscale.kernels.selftest) run here; the MMA itself only
runs on a B200.
"""

import warnings

import pytest
import torch

from microscale.formats import e2m1_decode, e4m3_decode, e8m0_decode, get_format, unpack_fp4
from microscale.kernels import selftest
from microscale.kernels.sm100 import descriptors as D
from microscale.kernels.sm100 import tcgen05_backend as T
from microscale.kernels.sm100.operands import pad_codes, prepare_weight
from microscale.quant import quantize


def emulate_kernel(variant, a_data, a_scale, b_data, b_scale, alpha, bias, m, n, sf_ids=None):
    spec = get_format(variant.fmt)
    kind = D.mma_kind(spec)
    sf_ids = D.mma_sf_ids(spec) if sf_ids is None else sf_ids
    atoms = D.scale_atoms_per_stage(spec)
    k_stages = -(-a_data.shape[1] // D.SWIZZLE_ROW_BYTES)

    def values(data):
        data = torch.nn.functional.pad(data.view(torch.uint8), (0, k_stages * 128 - data.shape[1]))  # TMA zero fill
        if spec.packed:
            return e2m1_decode(unpack_fp4(data)).double()
        return e4m3_decode(data.view(torch.float8_e4m3fn)).double()

    def scales(table, rows):
        rp, cp = table.shape
        flat = table.contiguous().view(torch.uint8).reshape(-1)
        r = torch.arange(rows)[:, None]
        cols = []
        for k in range(k_stages):
            for i, sf in enumerate(sf_ids):
                atom = k * atoms + i * kind.scales_per_mma // 4
                for j in range(kind.scales_per_mma):
                    off = (r // 128) * (cp // 4) * 512 + atom * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + sf + j
                    inside = (atom < cp // 4) & (r < rp)
                    byte = torch.where(inside, flat[off.clamp(max=flat.numel() - 1)], flat.new_zeros(()))
                    cols.append(byte)
        s = torch.cat(cols, dim=1)
        s = e4m3_decode(s.view(torch.float8_e4m3fn)) if spec.scale == "e4m3" else e8m0_decode(s)
        return s.double().repeat_interleave(spec.block, dim=1)

    a = values(a_data) * scales(a_scale, m)
    b = values(b_data) * scales(b_scale, n)
    y = a @ b.T
    if alpha is not None:
        y = y * float(alpha)
    if bias is not None:
        y = y + bias.double()
    return y.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", list(T.FORMAT_INDEX))
@pytest.mark.parametrize("m, n, k", [(300, 136, 544), (1, 7, 64), (129, 128, 1024)])
def test_kernel_addressing_reproduces_the_reference(fmt, m, n, k, seed):
    """Prepared operands read the kernel's way give dequant(x) @ dequant(W).T (the MMA's definition).
    Both variants address K and the scales identically; they differ in which CTA loads which rows."""
    variant = T.VARIANTS[(fmt, 1)]
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 3
    wq, xq = quantize(w, variant.fmt), quantize(x, variant.fmt, scale_layout="swizzled")
    b_data, b_scale, gw = prepare_weight(wq)
    alpha = None if gw is None else (1 / xq.global_scale) * (1 / gw)
    y = emulate_kernel(variant, pad_codes(xq.data, xq.fmt), xq.scale, b_data, b_scale, alpha, None, m, n)
    ref = xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T
    # bf16 output rounding; the absolute part covers NVFP4's float32 scale / global_scale in the reference
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-5 * ref.abs().max().item())


@pytest.fixture
def emulated_launch(monkeypatch):
    monkeypatch.setattr(T, "run_gemm", emulate_kernel)


@pytest.mark.parametrize("correct", [True, False])
def test_available_on_sm100_only_after_the_self_test_passes(monkeypatch, correct):
    """The whole gate on the CPU: compute capability 10.0 faked, the launch emulated, right or with the
    scale-factor IDs a wrong descriptor would give (all 0): that must switch the backend off."""
    monkeypatch.setattr(T, "compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(T, "run_gemm", emulate_kernel if correct else
                        lambda v, *a: emulate_kernel(v, *a, sf_ids=(0, 0, 0, 0)))
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    if correct:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert T._available(torch.device("cpu"))
        return
    with pytest.warns(RuntimeWarning, match="sm100-nvrtc.*failed its self-test") as record:
        assert not T._available(torch.device("cpu"))
    message = str(record[0].message)
    assert "mxfp4 x mxfp4" in message and "mxfp8 x mxfp8" in message
    assert "nvfp4 x nvfp4" not in message  # NVFP4 reads SF ID 0 for every MMA anyway


def assert_gemm_close(y, ref, mag, k):
    """y (bf16) against the float64 product ref of the quantized operands: 2**-7 relative (the bf16
    output and alpha's rounding), plus K 2**-22 (|x| @ |W|^T + |bias|) for the fp32 accumulation, which
    a cancelling sum can leave large against a small result (seen once: 3.5% of an element 100x
    smaller than its terms)."""
    bound = 2.0**-7 * ref.abs() + k * 2.0**-22 * mag
    worst = ((y.double() - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


def test_gemm_glue_matches_reference_with_bias(emulated_launch, seed):
    g = torch.Generator().manual_seed(seed)
    for fmt in T.FORMAT_INDEX:
        x, w = torch.randn(37, 96, generator=g).to(torch.bfloat16), torch.randn(50, 96, generator=g)
        bias = torch.randn(50, generator=g).to(torch.bfloat16)
        wq = quantize(w, fmt)
        data, scale, gs = prepare_weight(wq)
        y = T._gemm(x, data, scale, gs, bias, fmt=fmt, n=50, k=96, options={"activations": fmt})
        assert y.dtype == x.dtype and y.shape == (37, 50)
        xd, wd = quantize(x, fmt).dequantize(torch.float64), wq.dequantize(torch.float64)
        ref = xd @ wd.T + bias.double()
        assert_gemm_close(y, ref, xd.abs() @ wd.abs().T + bias.double().abs(), 96)


def test_gemm_refuses_weight_only_calls_and_bad_shapes():
    wq = quantize(torch.randn(16, 64), "nvfp4")
    data, scale, gs = prepare_weight(wq)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="activations only"):
        T._gemm(x, data, scale, gs, None, fmt="nvfp4", n=16, k=64, options={})
    with pytest.raises(ValueError, match="activations only"):
        T._gemm(x, data, scale, gs, None, fmt="nvfp4", n=16, k=64, options={"activations": "mxfp4"})
    with pytest.raises(ValueError, match="do not match K=64"):
        T._gemm(torch.randn(4, 32), data, scale, gs, None, fmt="nvfp4", n=16, k=64, options={"activations": "nvfp4"})
    with pytest.raises(ValueError, match="activations x of shape"):
        T._gemm(torch.full((4, 64), float("nan")), data, scale, gs, None, fmt="nvfp4", n=16, k=64,
                options={"activations": "nvfp4"})


def test_never_available_off_blackwell(monkeypatch):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    assert not T._available(torch.device("cpu"))
    monkeypatch.setattr(T, "compute_capability", lambda device: (9, 0))
    assert not T._available(torch.device("cpu"))
    monkeypatch.setattr(T, "compute_capability", lambda device: (10, 3))  # sm_100a cubins do not run on 10.3
    assert not T._available(torch.device("cpu"))
    assert selftest._VERDICTS == {}  # no self-test was even attempted
