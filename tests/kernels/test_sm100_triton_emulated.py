"""The sm100-triton kernel with EMULATE_MMA: everything but the tcgen05 instruction, run for real.

EMULATE_MMA swaps only tl.dot_scaled for an in-register dequantize + tl.dot, so these tests exercise
the kernel's TMA descriptors, 5-D scale views, swapped operands, persistent tile walk, K tails,
masking, global scales, bias and transposed/clipped TMA stores against float64 math on the
dequantized operands. Outputs are NaN-poisoned first, in a wider buffer whose columns past the
16-byte boundary after N must stay NaN (TMA stores write whole 16-byte chunks: triton#11583).

CPU: TRITON_INTERPRET=1 in a subprocess (set before triton is imported). The interpreter computes
the emulated dot in float32 and truncates float32 -> bfloat16 on the store, hence its looser bound.
GPU (`-m gpu`, the H200): the compiled sm_90 emulation, bf16 operands (exact), RNE output.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from microscale.formats import get_format
from microscale.kernels.sm100 import triton_gemm as tg
from microscale.quant import quantize

# |y - ref| <= REL |ref| + ACC (|a| @ |w|^T): output rounding plus float32 accumulation.
GPU_REL = 2.0**-7  # bf16 RNE is 2^-8
INTERPRETER_REL = 2.0**-6  # truncation to bf16 is up to 2^-7
ACC = 2.0**-14

# (M, N, K): swap32 with N % 8 != 0; swap64 at its edge; the smallest unswapped M; K % 32 == 16
# (an NVFP4 K that needs padding for 16-byte rows) with ragged M and N; a K tail inside a 256 tile.
INTERPRETER_SHAPES = [(5, 100, 96), (64, 136, 320), (65, 200, 176), (300, 264, 600)]
GPU_SHAPES = [(1, 264, 320), (33, 100, 96), (64, 520, 1040), (65, 300, 512), (300, 1000, 4112)]
PERSISTENT_SHAPE = (1100, 4000, 512)  # 9 x 16 = 144 output tiles > 132 SMs: programs take several tiles


def make_problem(act, wt, m, n, k, seed, device, *, bias=True, huge_row=True):
    """Quantized activations (reference quantizer, in the layout the tile wants) and weights, with edge rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0] = 0.0  # an all-zero row: zero scales (E8M0 2^-127 or the NVFP4 0.125 rule)
    if m > 2 and huge_row:
        x[1] *= 1e4  # a row far above the others (the NVFP4 global scale follows it)
        x[2, : k // 2] *= 1e-6  # tiny blocks next to normal ones in one row
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    b = (torch.randn(n, generator=g) * 8).to(torch.bfloat16).to(device) if bias else None
    cfg = tg.tile_config(get_format(act), get_format(wt), m)
    a = quantize(x, act, scale_layout="linear" if cfg.swap_ab else "swizzled").to(device)
    return a, quantize(w, wt).to(device), b


def float64_reference(a, w, bias):
    a64, w64 = a.dequantize().double(), w.dequantize().double()
    y = a64 @ w64.T
    if bias is not None:
        y = y + bias.double()
    return y, a64.abs() @ w64.abs().T


def scratch_end(n):
    """TMA stores write whole 16-byte chunks: columns [n, scratch_end) may be written, later ones not."""
    return (n + 7) // 8 * 8


def run_poisoned(a, w, bias, out_dtype=torch.bfloat16):
    """The emulated kernel into a NaN-filled buffer with spare columns; returns (y view, buffer)."""
    m, n = a.shape[0], w.shape[0]
    width = scratch_end(n) + 8  # 16-byte rows, 8 columns that must stay NaN
    buffer = torch.full((m, width), float("nan"), dtype=out_dtype, device=a.data.device)
    y = tg.block_scaled_gemm(a, *tg.prepare_weight(w), bias, w_fmt=w.fmt, n=n, out_dtype=out_dtype,
                             out=buffer[:, :n], emulate=True)
    return y, buffer


def error_report(y, buffer, ref, magnitude, rel):
    n = y.shape[1]
    err = (y.double() - ref).abs()
    bound = rel * ref.abs() + ACC * magnitude
    return dict(nan=int(y.isnan().sum()), bad=int((~(err <= bound)).sum()),
                max_err_over_bound=float((err / bound.clamp_min(1e-300)).nan_to_num(float("inf")).max()),
                padding_written=int((~buffer[:, scratch_end(n):].isnan()).sum()))


# ---- CPU: the interpreter ------------------------------------------------------------------------
def patch_interpreter_index():
    """triton 3.6's interpreter turns 1-element arrays into Python ints with int(), which numpy >= 2.4
    refuses (triton-lang/triton#9171, fixed upstream by #9172 after 3.6); the same fix, applied here."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor


def _interpreter_child(pair, seed):
    """Runs in the TRITON_INTERPRET=1 subprocess; prints one JSON line per shape."""
    patch_interpreter_index()
    act, wt = pair
    for i, (m, n, k) in enumerate(INTERPRETER_SHAPES):
        a, w, bias = make_problem(act, wt, m, n, k, seed + i, "cpu", bias=i % 2 == 0)
        y, buffer = run_poisoned(a, w, bias)
        ref, magnitude = float64_reference(a, w, bias)
        print(json.dumps(dict(shape=[m, n, k], **error_report(y, buffer, ref, magnitude, INTERPRETER_REL))))


@pytest.mark.parametrize("act, wt", tg.FORMAT_PAIRS)
def test_emulated_kernel_under_the_interpreter(act, wt, seed):
    code = (f"import runpy; runpy.run_path({__file__!r})['_interpreter_child']"
            f"(({act!r}, {wt!r}), {seed})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == len(INTERPRETER_SHAPES), proc.stdout
    for r in reports:
        assert r["nan"] == 0 and r["bad"] == 0 and r["padding_written"] == 0, f"{act} x {wt}: {r}"


# ---- GPU: the compiled emulation on the H200 -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES + [PERSISTENT_SHAPE])
@pytest.mark.parametrize("act, wt", tg.FORMAT_PAIRS)
def test_emulated_kernel_on_gpu(act, wt, shape, seed):
    m, n, k = shape
    a, w, bias = make_problem(act, wt, m, n, k, seed, "cuda")
    y, buffer = run_poisoned(a, w, bias)
    ref, magnitude = float64_reference(a, w, bias)
    report = error_report(y, buffer, ref, magnitude, GPU_REL)
    assert report["nan"] == 0 and report["bad"] == 0 and report["padding_written"] == 0, report


@pytest.mark.gpu
def test_emulated_kernel_fp16_out_without_bias(seed):
    a, w, _ = make_problem("nvfp4", "nvfp4", 200, 136, 512, seed, "cuda", bias=False, huge_row=False)
    y, buffer = run_poisoned(a, w, None, out_dtype=torch.float16)
    ref, magnitude = float64_reference(a, w, None)
    report = error_report(y, buffer, ref, magnitude, 2.0**-10)  # fp16 RNE is 2^-11
    assert report["nan"] == 0 and report["bad"] == 0 and report["padding_written"] == 0, report


@pytest.mark.gpu
def test_backend_gate_and_end_to_end_emulated(monkeypatch, seed):
    """The self-test gate on this GPU (emulated MMA forced), then dispatch -> sm100-triton ->
    quantize_gpu -> emulated kernel for every pair and operand order."""
    from microscale.kernels import dispatch, selftest

    monkeypatch.setenv(tg.EMULATE_ENV, "1")
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    assert tg.BACKEND.available(torch.device("cuda"))
    g = torch.Generator().manual_seed(seed)
    for act, wt in tg.FORMAT_PAIRS:
        for m in (3, 48, 130):
            x = (torch.randn(m, 384, generator=g) * 3).to(torch.bfloat16).cuda()
            w = quantize(torch.randn(200, 384, generator=g), wt).to("cuda")
            bias = torch.randn(200, generator=g).to(torch.bfloat16).cuda()
            y = dispatch.linear(x, w, bias, backend=tg.BACKEND_NAME, options={"activations": act})
            assert y.dtype == torch.bfloat16 and y.shape == (m, 200)
            ref, magnitude = float64_reference(quantize(x, act), w, bias)  # quantize_gpu is bit-identical
            err = (y.double() - ref).abs()
            ok = err <= GPU_REL * ref.abs() + ACC * magnitude
            assert not y.isnan().any() and bool(ok.all()), (act, wt, m, int((~ok).sum()))


def test_out_must_leave_room_for_whole_16_byte_stores():
    a = quantize(torch.randn(4, 64), "mxfp8", scale_layout="linear")
    w = quantize(torch.randn(100, 64), "mxfp8")
    exact = torch.empty(4, 100, dtype=torch.bfloat16)  # 200-byte rows: the last 16-byte chunk overhangs N
    with pytest.raises(ValueError, match="16-byte chunks"):
        tg.block_scaled_gemm(a, *tg.prepare_weight(w), None, w_fmt="mxfp8", n=100, out=exact, emulate=True)
