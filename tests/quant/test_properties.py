"""Properties: idempotence on canonical quantized tensors, the half-step error bound, SQNR."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import microscale as ms
from microscale.formats import ScaleMode, pack_fp4
from spec_reference import E2M1_POS, E4M3_POS

# The largest |code| a block must hold for re-quantization to pick the same shared exponent:
# FLOOR/EVEN need floor(log2 max) == emax, RCEIL needs ceil(log2(max/elem_max)) == 0,
# CEIL needs ceil(log2 max) == emax (derived from the definitions in ScaleMode).
E2M1_BLOCK_MAX = {"floor": [4.0, 6.0], "even": [4.0, 6.0], "rceil": [4.0, 6.0], "ceil": [3.0, 4.0]}
E4M3_BLOCK_MAX_RANGE = {"floor": (256, 448), "even": (256, 448), "rceil": (224, 448), "ceil": (136, 256)}


def _e2m1_codes_with_block_max(n, nblk, block, maxvals, g):
    codes = torch.randint(0, 16, (n, nblk, block), generator=g, dtype=torch.uint8)
    mag = torch.tensor(E2M1_POS)[(codes & 7).long()]
    allowed = torch.tensor(maxvals)
    cap = allowed[torch.randint(0, len(maxvals), (n, nblk, 1), generator=g)]
    codes = torch.where(mag > cap, torch.zeros_like(codes), codes)  # nothing above the block max
    pos = torch.randint(0, block, (n, nblk, 1), generator=g)
    cap_code = torch.tensor([list(E2M1_POS).index(v) for v in maxvals], dtype=torch.uint8)
    top = cap_code[(cap[..., 0:1] == allowed).float().argmax(-1)]
    sign = torch.randint(0, 2, (n, nblk, 1), generator=g, dtype=torch.uint8) << 3
    return codes.scatter(2, pos, (top | sign[..., 0]).unsqueeze(-1)).reshape(n, -1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), nblk=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       mode=st.sampled_from(list(ScaleMode)))
def test_mxfp4_quantize_of_dequantize_is_identity(n, nblk, seed, mode):
    g = torch.Generator().manual_seed(seed)
    codes = _e2m1_codes_with_block_max(n, nblk, 32, E2M1_BLOCK_MAX[mode.value], g)
    exps = torch.randint(0, 250, (n, nblk), generator=g, dtype=torch.uint8)
    q = ms.QTensor(data=pack_fp4(codes), scale=exps, fmt="mxfp4", shape=(n, nblk * 32))
    q2 = ms.quantize(q.dequantize(), "mxfp4", scale_mode=mode)
    assert torch.equal(q2.scale, q.scale)
    # -0 codes come back as +0: compare values, then signs of nonzero codes
    assert torch.equal(q2.dequantize(), q.dequantize())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), nblk=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       mode=st.sampled_from(list(ScaleMode)))
def test_mxfp8_quantize_of_dequantize_is_identity(n, nblk, seed, mode):
    g = torch.Generator().manual_seed(seed)
    lo, hi = E4M3_BLOCK_MAX_RANGE[mode.value]
    vals = torch.tensor(E4M3_POS, dtype=torch.float32)
    hi_code = int((vals <= hi).nonzero().max())
    top_codes = ((vals > lo) & (vals <= hi)).nonzero().flatten()
    codes = torch.randint(0, 0x7F, (n, nblk, 32), generator=g, dtype=torch.int32)
    codes = torch.minimum(codes, torch.tensor(hi_code))
    pos = torch.randint(0, 32, (n, nblk, 1), generator=g)
    top = top_codes[torch.randint(0, len(top_codes), (n, nblk, 1), generator=g)]
    codes = codes.scatter(2, pos, top.to(torch.int32)) | (torch.randint(0, 2, codes.shape, generator=g) << 7)
    data = codes.to(torch.uint8).reshape(n, -1).view(torch.float8_e4m3fn)
    exps = torch.randint(0, 240, (n, nblk), generator=g, dtype=torch.uint8)
    q = ms.QTensor(data=data, scale=exps, fmt="mxfp8", shape=(n, nblk * 32))
    q2 = ms.quantize(q.dequantize(), "mxfp8", scale_mode=mode)
    assert torch.equal(q2.scale, q.scale)
    assert torch.equal(q2.dequantize(), q.dequantize())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), nblk=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       log_g=st.floats(-3, 4))
def test_nvfp4_quantize_of_dequantize_is_identity(n, nblk, seed, log_g):
    g = torch.Generator().manual_seed(seed)
    codes = _e2m1_codes_with_block_max(n, nblk, 16, [6.0], g)
    scale_codes = torch.randint(1, 0x7F, (n, nblk), generator=g, dtype=torch.uint8)
    gs = torch.tensor(10.0**log_g, dtype=torch.float32)
    q = ms.QTensor(data=pack_fp4(codes), scale=scale_codes.view(torch.float8_e4m3fn), fmt="nvfp4",
                   shape=(n, nblk * 16), global_scale=gs)
    q2 = ms.quantize(q.dequantize(), "nvfp4", global_scale=gs)
    assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(q2.dequantize(), q.dequantize())


def _half_step_bound(x, q):
    """Per element: half the gap between the two grid points around |x| / block_scale."""
    spec = q.fmt
    grid = torch.tensor(E2M1_POS if spec.packed else E4M3_POS, dtype=torch.float64)
    n, k = q.shape
    s = q.block_scale_as_float().double().repeat_interleave(spec.block, dim=1)[:, :k]
    v = x.double().abs() / s
    hi_idx = torch.searchsorted(grid, v.clamp(max=spec.elem_max)).clamp(1, len(grid) - 1)
    gap = grid[hi_idx] - grid[hi_idx - 1]
    return 0.5 * gap * s, v > spec.elem_max


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 130), seed=st.integers(0, 2**31 - 1),
       fmt=st.sampled_from(["nvfp4", "mxfp4", "mxfp8"]), spread=st.floats(0, 30))
def test_error_is_at_most_half_a_step_of_the_block_grid(n, k, seed, fmt, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.exp2(torch.rand(n, 1, generator=g) * spread - spread / 2)
    mode = ScaleMode.RCEIL  # never clips the block maximum
    q = ms.quantize(x, fmt, scale_mode=mode) if fmt != "nvfp4" else ms.quantize(x, fmt)
    err = (q.dequantize().double() - x.double()).abs()
    bound, saturated = _half_step_bound(x, q)
    # NVFP4 elements may exceed 6 after the e4m3 rounding of the block scale: those clip to 6
    ok = (err <= bound * (1 + 1e-6) + 1e-30) | saturated
    assert ok.all(), f"max excess {(err - bound)[~ok].max().item()}"


def sqnr_db(x, y):
    return 10 * torch.log10(x.double().pow(2).sum() / (x.double() - y.double()).pow(2).sum()).item()


# Gaussian weights: the expected SQNR follows from each grid's relative step (about 20 dB for
# 4-bit FP with 16-blocks, 18 for 32-blocks, 31 for E4M3); a broken scale or layout shows here.
SQNR_RANGE_DB = {"nvfp4": (19.0, 22.5), "mxfp4": (16.0, 19.5), "mxfp8": (29.5, 33.5)}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_gaussian_sqnr(fmt, seed, capsys):
    x = torch.randn(1024, 1024)
    y = ms.quantize(x, fmt).dequantize()
    db = sqnr_db(x, y)
    with capsys.disabled():
        print(f"\n  SQNR {fmt} Gaussian 1024x1024: {db:.2f} dB ({ms.get_format(fmt).bits_per_weight} bits/weight)")
    lo, hi = SQNR_RANGE_DB[fmt]
    assert lo <= db <= hi
