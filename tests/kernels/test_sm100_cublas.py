"""The sm100-cublas route (torch._scaled_mm) on the CPU: its arguments against torch's own rules.

No GPU can run it here (cuBLAS block-scaled GEMMs need sm100). Under FakeTensorMode with tensors
on a "cuda" device, torch._scaled_mm runs its shape/dtype/layout checks (the meta function that
mirrors Blas.cpp: row-major A, column-major B, K and N multiples of 16, blocked scale counts) on
the exact tensors the backend builds, so a wrong padding, view or scale count fails here.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from microscale.formats import (QTensor, e2m1_decode, e8m0_decode, get_format, swizzled_scale_shape,
                                unpack_fp4, unswizzle_scales_128x4)
from microscale.formats.tensor import padded_k
from microscale.kernels.sm100 import cublas_gemm as cb
from microscale.quant import quantize


def fake_qtensor(fmt, rows, k, layout="swizzled"):
    spec = get_format(fmt)
    kp = padded_k(k, spec.block)
    data = torch.empty(rows, kp // 2 if spec.packed else kp, dtype=spec.data_dtype, device="cuda")
    cols = kp // spec.block
    shape = swizzled_scale_shape(rows, cols) if layout == "swizzled" else (rows, cols)
    scale = torch.empty(shape, dtype=spec.scale_dtype, device="cuda")
    g = torch.empty((), dtype=torch.float32, device="cuda") if spec.global_scale else None
    return QTensor(data=data, scale=scale, fmt=spec, shape=(rows, k), global_scale=g, scale_layout=layout)


def test_installed_torch_has_the_block_scaled_dtypes():
    assert cb.scaled_mm_supported()


SHAPES = [(1, 4096, 4096), (5, 264, 320), (127, 100, 96), (150, 264, 336), (4096, 4104, 8208)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_scaled_mm_operands_pass_torch_checks(fmt, m, n, k):
    with FakeTensorMode():
        data, scale, _ = cb.prepare_weight(fake_qtensor(fmt, n, k))
        operands = cb.scaled_mm_operands(fake_qtensor(fmt, m, k), data, scale, w_fmt=fmt)
        y = torch._scaled_mm(*operands, out_dtype=torch.bfloat16)
        assert y.shape == (max(m, 128), -(-n // 16) * 16) and y.dtype == torch.bfloat16


def test_scaled_mm_check_is_not_vacuous():
    """The same fake call with one scale block missing is rejected by torch."""
    with FakeTensorMode():
        data, scale, _ = cb.prepare_weight(fake_qtensor("nvfp4", 264, 320))
        a, b, scale_a, scale_b = cb.scaled_mm_operands(fake_qtensor("nvfp4", 150, 320), data, scale, w_fmt="nvfp4")
        short = torch.empty(scale_a.numel() - 1, dtype=scale_a.dtype, device="cuda")
        with pytest.raises(RuntimeError, match="blockwise scaling"):
            torch._scaled_mm(a, b, short, scale_b, out_dtype=torch.bfloat16)


def blocked_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's block-scaled product as cuBLAS documents it, in float64 on the CPU:
    scales in the 128x4 blocked layout (one per 16 E2M1 with E4M3 scales, else one per 32)."""
    fp4 = a.dtype == torch.float4_e2m1fn_x2
    block = 16 if scale_a.dtype == torch.float8_e4m3fn else 32

    def values(t, scale):  # t: [rows, K] (K-major)
        codes = e2m1_decode(unpack_fp4(t.view(torch.uint8))) if fp4 else t.float()
        rows, k = codes.shape
        padded_rows = swizzled_scale_shape(rows, k // block)[0]
        s = unswizzle_scales_128x4(scale.view(padded_rows, -1), rows, k // block)
        s = s.float() if s.dtype == torch.float8_e4m3fn else e8m0_decode(s.view(torch.uint8))
        return codes.double() * s.double().repeat_interleave(block, 1)

    return (values(a, scale_a) @ values(b.t(), scale_b).T).to(out_dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("m, n, k", [(5, 264, 320), (150, 100, 96)])
def test_scaled_mm_glue_matches_the_reference(monkeypatch, fmt, m, n, k, seed):
    """Padding, scale views, global scales and bias around a _scaled_mm computed as documented."""
    monkeypatch.setattr(torch, "_scaled_mm", blocked_scaled_mm)
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g), fmt)
    a = quantize(torch.randn(m, k, generator=g) * 10, fmt, scale_layout="swizzled")
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y = cb.scaled_mm(a, *cb.prepare_weight(w), bias, w_fmt=fmt, n=n)
    ref = a.dequantize().double() @ w.dequantize().double().T + bias.double()
    # bf16 _scaled_mm output, then the global scales and bias: two bf16 roundings
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-12 * ref.abs().max().item())


@pytest.mark.parametrize("act, wt", [("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"), ("nvfp4", "mxfp4")])
def test_pairs_cublas_lacks_are_refused(act, wt):
    w, a = quantize(torch.randn(128, 256), wt), quantize(torch.randn(8, 256), act)
    with pytest.raises(ValueError, match="cuBLAS|cannot pair"):
        cb.scaled_mm(a, *cb.prepare_weight(w), None, w_fmt=wt, n=128)


def test_offered_only_on_sm100(monkeypatch):
    monkeypatch.setattr(cb, "compute_capability", lambda device: (9, 0))
    assert not cb.BACKEND.available(torch.device("cpu"))
