"""sm90 kernels on the GPU against the reference dequantization and a float64 matmul.

Error bounds (per element, against y64 = x64 @ W64^T + bias with W the exact dequantized weight):
  decode / decode_ws / wgmma / wgmma_ws (W4A16, W8A16): the weights enter the MMA exactly (bf16 holds every element times
    its scale), products accumulate in fp32 and y is rounded once to x's dtype, so
    |y - y64| <= 2**-8 |y64| + K 2**-22 (|x| @ |W|^T)    (bf16 output; 2**-11 for fp16 output)
  dequant: W itself is rounded to x's dtype first (as the reference backend does): 2**-8 relative
    per weight, so the bound adds 2**-8 (|x| @ |W|^T).
  fp8 (opt-in): activations rounded to E4M3 per row: ||y - y64|| / ||y64|| <= 0.06 on Gaussian data.
Outputs and workspaces are poisoned with NaN before the launch; shapes are ragged (M, N not multiples
of the tiles, K a multiple of the block but not of the 64/256 tile).
"""

import pytest
import torch
import triton
import triton.language as tl

from microscale.kernels.sm90.layout import padded_shape
from microscale.quant import quantize

pytestmark = pytest.mark.gpu

FORMATS = ["nvfp4", "mxfp4", "mxfp8"]


def _case(fmt, m, n, k, dtype, seed, bias=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.exp(torch.randn(n, 1, device="cuda", generator=g))
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    q = quantize(w, fmt)
    wd = q.dequantize().double()
    y64 = x.double() @ wd.t() + (b.double() if bias else 0)
    scale_mag = x.double().abs() @ wd.abs().t()
    return x, q, b, y64, scale_mag


def _check(y, y64, scale_mag, k, dtype, weight_rounding=False):
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    rel = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = rel * y64.abs() + k * 2.0**-22 * scale_mag
    if weight_rounding:
        bound = bound + rel * scale_mag
    err = (y.double() - y64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 256), (1, 200, 160 + 64), (3, 1000, 96 * 8), (8, 384, 1024),
                                   (16, 130, 2048 + 32), (17, 640, 512), (33, 256, 320), (64, 128, 4096)])
def test_decode_kernel(fmt, m, n, k, seed):
    from microscale.kernels.sm90 import launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    configs = [None, paths.DecodeConfig(reps=1, unroll=1, block_m=16, split=3), paths.DecodeConfig(split=1),
               # 3 tiles in flight with 1..5 tiles per split: the remainder steps after the rotation
               paths.DecodeConfig(unroll=1, depth=3, split=max(1, k // 256)), paths.DecodeConfig(depth=3, split=2),
               paths.DecodeConfig(num_warps=2, reps=4, block_m=16, depth=2),
               paths.DecodeConfig(block_m=8, reps=2, depth=2),  # two row groups per warp, one K part
               paths.DecodeConfig(block_m=16, reps=2, depth=1),  # its tile at M = 9-16 on weights above 4096 x 4096
               # K parts: 2 x 4 and 4 x 2 activation rows per program (several m tiles above), with a split
               paths.DecodeConfig(block_m=8, reps=2, parts=2), paths.DecodeConfig(block_m=8, reps=4, parts=4, split=2),
               paths.DecodeConfig(num_warps=2, block_m=8, reps=4, parts=2, depth=1, unroll=1)]
    kt = padded_shape(n, k)[1] // 64
    for cfg in configs:
        if cfg and kt % (cfg.parts * cfg.unroll):  # K = 2080 pads to 33 steps: no parts
            continue
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws = torch.full((1 << 20,), float("nan"), device="cuda")
        paths.decode_gemm(x, *prep, b, FMT_CODE[fmt], n, k, cfg, out=y, workspace=ws)
        _check(y, y64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 256), (65, 200, 224), (130, 1000, 96 * 8), (300, 384, 2048 + 32)])
def test_wgmma_kernel(fmt, m, n, k, seed):
    from microscale.kernels.sm90 import launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    configs = [None, paths.WgmmaConfig(num_warps=8, block_m=64, depth=2, split=1),
               paths.WgmmaConfig(num_warps=4, block_m=128, depth=3, split=3),  # split: 1..5 steps per program
               # A from registers: 16 or 32 activation rows, one or two row groups per warp, one or two warpgroups
               paths.WgmmaConfig(block_m=16, rs=True), paths.WgmmaConfig(block_m=32, reps=2, depth=2, rs=True, split=3),
               paths.WgmmaConfig(num_warps=8, block_m=64, depth=2, rs=True, split=1)]
    for cfg in configs:
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws = torch.full((1 << 20,), float("nan"), device="cuda")
        paths.wgmma_gemm(x, *prep, b, FMT_CODE[fmt], n, k, cfg, out=y, workspace=ws)
        _check(y, y64, mag, k, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 256), (300, 1000, 2048 + 32), (700, 384, 1024), (1030, 200, 224),
                                   (257, 203, 512)])
def test_wgmma_ws_kernel(fmt, m, n, k, seed):
    """The CUDA kernel in every launched form: one CTA per tile, 64-row wgmmas with a 2-stage ring that wraps
    (K = 224: 4 steps) and the tile order in groups of 3 m tiles (M = 1030: 17 tiles, the last group
    partial), split-K over clusters of 2, 3 and 4 CTAs (K = 256: 4 steps, so 1 per part, or 2 + 2 + 0
    in 3; K = 224 in 4 parts of 1; K = 2080: 33 steps, the last part short), and the split chosen by
    split_for (M = 300, N = 1000: 16 tiles of 256 x 128, so 4 parts), A from registers (x permuted per K
    step, K = 2080 padded) alone and over clusters; M ragged against 32-256 rows. Without split-K y is written from
    a tile in shared memory in 16-byte vectors (FP4), or element by element where y's rows are not 16-byte aligned
    (N = 203)."""
    from microscale.kernels.sm90 import prepare, wgmma_ws as W
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    for cfg in (W.WsConfig(), W.WsConfig(split=1), W.WsConfig(split=2), W.WsConfig(block_m=128, split=3),
                W.WsConfig(block_m=128, split=4), W.WsConfig(block_m=64, stages=2, split=1, group_m=3),
                W.WsConfig(block_m=64, stages=2, split=4), W.WsConfig(block_m=64, rs=True, split=1),
                W.WsConfig(block_m=128, rs=True, split=3, stages=6), W.WsConfig(block_m=32, rs=True, split=2)):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        W.wgmma_ws_gemm(x, *prep, b, FMT_CODE[fmt], n, k, cfg, out=y)
        _check(y, y64, mag, k, torch.bfloat16)


# decode_ws tilings: ring_config's (two consumer warps per row group up to M = 8), a 2-stage ring that wraps, ragged
# row tiles (5 groups over 8 or 63 row groups), split-K over clusters of 2 and 3 (K = 256: 4 steps, so 2 + 2 or
# 2 + 2 + 0), 16 groups (17 warps), two and four warps per row group (the latter where K has a multiple of 4 steps),
# two row groups per warp (4 groups, split 2; 6 groups, 4 warps per pair of groups), 2 and 4 accumulators per row
# group, first fills 1, 2 and 3 stages ahead (3: 14 row groups of 2-step stages; 2: 4 row groups taking whole rows)
RING_CONFIGS = [None, dict(steps=2, stages=2, split=1), dict(groups=5, steps=2, stages=4, split=2),
                dict(groups=4, steps=2, stages=3, split=3), dict(groups=16, steps=2, stages=4, split=1),
                dict(groups=5, steps=2, stages=2, split=2, k_warps=2),
                dict(groups=3, steps=4, stages=2, split=2, k_warps=4),
                dict(groups=4, steps=2, stages=3, split=2, k_warps=2, groups_per_warp=2),
                dict(groups=6, steps=4, stages=2, split=1, k_warps=4, groups_per_warp=2),
                dict(groups=4, steps=2, stages=4, split=2, k_warps=2, groups_per_warp=2, chains=2, lead=2),
                dict(groups=5, steps=2, stages=3, split=1, chains=4, lead=1),
                dict(groups=14, steps=2, stages=5, split=1, lead=3),
                dict(groups=4, steps=4, stages=4, split=1, k_warps=2, lead=2)]


def _ring_configs(m, k):
    """RING_CONFIGS as RingConfigs (None: ring_config's) for M rows and K, those whose stage divides K's steps."""
    from dataclasses import replace
    from microscale.kernels.sm90 import decode_ws as D
    configs = [None if f is None else replace(D.RingConfig(**f), block_m=8 if m <= 8 else 16) for f in RING_CONFIGS]
    return [c for c in configs if c is None or (padded_shape(1, k)[1] // 64) % c.steps == 0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 256), (1, 200, 160 + 64), (5, 1000, 96 * 8), (8, 384, 1024),
                                   (9, 130, 2048 + 32), (16, 640, 512)])
def test_decode_ws_kernel(fmt, m, n, k, seed):
    """The TMA-ring decode kernel in the tilings above, 8 activation rows up to M = 8 and 16 above; K = 224
    (padded to 256) and 2080 (padded to 2176: 34 steps, so 2 per stage) end partway into a stage's x box."""
    from microscale.kernels.sm90 import decode_ws as D, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    for cfg in _ring_configs(m, k):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        D.decode_ws_gemm(x, *prep, b, FMT_CODE[fmt], n, k, cfg, out=y)
        _check(y, y64, mag, k, torch.bfloat16)


def test_decode_ws_weight_maps_take_its_l2_promotion(monkeypatch, seed):
    """decode_ws encodes its weight maps (not x's) with WEIGHT_L2_PROMOTION; the promotion changes only how the L2
    fetches, so the output is bit-equal to the maps' default (256B)."""
    from microscale.kernels import nvrtc
    from microscale.kernels.sm90 import decode_ws as D, prepare
    x, q, b, y64, mag = _case("nvfp4", 1, 640, 1024, torch.bfloat16, seed)
    prep = prepare(q)
    encoded, encode = [], nvrtc.encode_tensor_map
    monkeypatch.setattr(nvrtc, "encode_tensor_map", lambda spec: encoded.append(spec) or encode(spec))
    ys, kept = {}, D.WEIGHT_L2_PROMOTION
    for promotion in (kept, "256B"):
        monkeypatch.setattr(D, "WEIGHT_L2_PROMOTION", promotion)
        encoded.clear()
        ys[promotion] = torch.full((1, 640), float("nan"), device="cuda", dtype=torch.bfloat16)
        D.decode_ws_gemm(x, *prep, b, 0, 640, 1024, out=ys[promotion])
        assert [s.l2_promotion for s in encoded] == ["256B", promotion, promotion]  # x, words, scales
    assert kept != "256B" and torch.equal(ys["256B"], ys[kept])
    _check(ys["256B"], y64, mag, 1024, torch.bfloat16)


def _gated_case(fmt, m, n, k, seed):
    """Gate and up weights [n, K] under one NVFP4 global scale, the fused weight of their row pairs
    (kernels/gated.py) and its bias; float64 silu(gate) * up and its error bound: the two products' fp32
    accumulation (K 2**-22 of |x| @ |W|^T each) through silu's slope (at most 1.1), plus the output rounding."""
    from microscale.kernels.gated import interleave_index
    x, q, b, pre, mag = _case(fmt, m, 2 * n, k, torch.bfloat16, seed)
    index = interleave_index(n, "cuda")
    want, err = _silu_mul(pre, k * 2.0**-22 * mag)
    return x, q.take_rows(index), b[index], want, 2.0**-8 * want.abs() + err


def _silu_mul(pre, err):
    """silu(gate) * up of float64 pre-activations [M, 2n] (gate columns first) whose errors are at most err, and the
    product's error from them (through silu's slope, at most 1.1), before the output's rounding."""
    n = pre.shape[1] // 2
    gate, up, err_g, err_u = pre[:, :n], pre[:, n:], err[:, :n], err[:, n:]
    silu = gate / (1 + torch.exp(-gate))
    return silu * up, 1.1 * err_g * up.abs() + silu.abs() * err_u + err_g * err_u


def _check_gated(y, want, bound):
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
    worst = ((y.double() - want).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 104, 160 + 64), (3, 504, 96 * 8), (8, 200, 1024)])
def test_decode_kernel_gated_epilogue(fmt, m, n, k, seed):
    """The decode kernel over gate/up row pairs stores silu(gate) * up, [M, N / 2]: the tiles with up to 8
    activation rows per program (launch.decode_takes_gated), with and without K splits and K parts."""
    from microscale.kernels.sm90 import launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, want, bound = _gated_case(fmt, m, n, k, seed)
    prep = prepare(q)
    configs = [None, paths.DecodeConfig(block_m=8, split=1), paths.DecodeConfig(block_m=8, depth=3, split=2),
               paths.DecodeConfig(block_m=8, reps=2, parts=2), paths.DecodeConfig(block_m=16, reps=2, parts=2, split=3)]
    for cfg in configs:
        if cfg and (padded_shape(2 * n, k)[1] // 64) % (cfg.parts * cfg.unroll):
            continue
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws = torch.full((1 << 20,), float("nan"), device="cuda")
        paths.decode_gemm(x, *prep, b, FMT_CODE[fmt], 2 * n, k, cfg, out=y, workspace=ws, gated=True)
        _check_gated(y, want, bound)
    with pytest.raises(ValueError, match="at most 8 activation rows per program, not 16"):
        paths.decode_gemm(x, *prep, b, FMT_CODE[fmt], 2 * n, k, paths.DecodeConfig(block_m=16), gated=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 104, 160 + 64), (5, 504, 96 * 8), (16, 320, 2048 + 32)])
def test_decode_ws_kernel_gated_epilogue(fmt, m, n, k, seed):
    from microscale.kernels.sm90 import decode_ws as D, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, want, bound = _gated_case(fmt, m, n, k, seed)
    prep = prepare(q)
    for cfg in _ring_configs(m, k):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        D.decode_ws_gemm(x, *prep, b, FMT_CODE[fmt], 2 * n, k, cfg, out=y, gated=True)
        _check_gated(y, want, bound)


def _glue_case(fmt, m, n, k, seed, eps=1e-5):
    """_case's x (as h), weight and bias, a norm weight (negative and small values too), a residual, and float64 of
    what decode_ws computes with the norm (kernels/rmsnorm.py): rstd(h) (W @ bf16(norm weight * h)) + bias, rstd in
    float64, with its |.| for the bound. h's row 0 is zeros at M > 1 (rstd = eps**-0.5, only the bias is left)."""
    x, q, b, pre, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    if m > 1:
        x[0] = 0
        pre[0], mag[0] = b.double(), 0
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    weight = (torch.rand(k, device="cuda", generator=g) * 2 - 0.5).to(torch.bfloat16)
    residual = (torch.randn(m, n, device="cuda", generator=g) * 4).to(torch.bfloat16)
    scaled = (weight * x).double()  # the bf16 product, correctly rounded as the kernel's HMUL2
    wd = q.dequantize().double()
    rstd = 1 / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    normed = (rstd * (scaled @ wd.t()) + b.double(), rstd * (scaled.abs() @ wd.abs().t()))
    return x, q, b, (weight, eps), residual, (pre, mag), normed


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 200, 160 + 64), (5, 504, 96 * 8), (8, 384, 1024), (16, 320, 2048 + 32)])
def test_decode_ws_kernel_norm_and_residual(fmt, m, n, k, seed):
    """The norm warp and the residual add (kernels/rmsnorm.py) in ring_config's tiling, split-K over 2 CTAs (one and
    two warps per row group, a 2-stage ring that wraps) and over 3 (one with no K steps at K = 224), plain and over
    gate/up pairs (n of them): outputs NaN-poisoned, against float64 of the kernel's definition. The bound adds to
    _check's the error of rstd: a float32 sum of K squares in lanes of K / 8 (at most K 2**-27 relative) and the
    approximate rsqrt (2**-21), times |rstd W x'|."""
    from microscale.kernels.gated import interleave_index
    from microscale.kernels.sm90 import decode_ws as D, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    for gated in (False, True):
        rows = 2 * n if gated else n
        x, q, b, norm, residual, plain, normed = _glue_case(fmt, m, rows, k, seed)
        residual = residual[:, :n] if gated else residual
        if gated:
            index = interleave_index(n, "cuda")
            q, b = q.take_rows(index), b[index]
        prep = prepare(q)
        for use_norm, use_residual in ((True, False), (False, True), (True, True)):
            pre, mag = normed if use_norm else plain
            err = (k * 2.0**-22 + (k * 2.0**-27 + 2.0**-21) * use_norm) * mag
            want, err = _silu_mul(pre, err) if gated else (pre, err)
            if use_residual:
                want = want + residual.double()
            for cfg in [c for c in _ring_configs(m, k) if c is None or c.split > 1 and c.k_warps < 4]:
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                D.decode_ws_gemm(x, *prep, b, FMT_CODE[fmt], rows, k, cfg, out=y, gated=gated,
                                 norm=norm if use_norm else None, residual=residual if use_residual else None)
                assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) outputs"
                worst = ((y.double() - want).abs() / (2.0**-8 * want.abs() + err + 1e-30)).max().item()
                assert worst <= 1.0, f"{cfg} gated={gated} norm={use_norm} residual={use_residual}: {worst:.3f} x bound"


@pytest.mark.parametrize("fmt,m,n,k,fused", [("nvfp4", 1, 4096, 4096, ("rms_norm", "residual")),
                                             ("nvfp4", 4, 4096, 4096, ("rms_norm", "residual")),
                                             ("nvfp4", 16, 4096, 4096, ("residual",)), ("nvfp4", 32, 512, 1024, ()),
                                             ("mxfp8", 1, 28672, 4096, ("rms_norm", "residual"))])
def test_linear_glue_through_the_dispatch(fmt, m, n, k, fused, seed):
    """QuantizedLinear.forward with an RMSNorm module and a residual, where fusions(m) says the kernel takes both
    (MXFP8 28672x4096 too, a split-1 tiling), only the residual (M = 16: the norm as torch ops in front of
    decode_ws) or neither (M = 32): against float64 of residual + W norm(h), which each path rounds differently
    (the fused kernel bf16(w h) into the MMA and rstd after it, the torch ops rstd h and w times it each to
    bf16)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from microscale import FP4Linear, FP8Linear
    from microscale.kernels import rmsnorm
    g = torch.Generator(device="cuda").manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda")
    layer = (FP8Linear if fmt == "mxfp8" else FP4Linear).from_linear(linear, fmt)
    norm = LlamaRMSNorm(k, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(k, device="cuda", generator=g) + 0.5)
    h = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    assert layer.fusions(m) == frozenset(fused)
    y = layer(h, norm=norm, residual=residual)
    h64 = h.double()
    normed = norm.weight.double() * h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
    wd = layer.qweight.dequantize().double()
    want = residual.double() + normed @ wd.t()
    bound = 2.0**-8 * want.abs() + 2.0**-7 * (normed.abs() @ wd.abs().t())  # x rounded to bf16 (twice unfused)
    assert ((y.double() - want).abs() <= bound).all()
    unfused = rmsnorm.add_residual(layer(norm(h)), residual)
    assert ((unfused.double() - want).abs() <= bound).all()


def test_decode_ws_is_deterministic(seed):
    """Split-K over a cluster sums the parts in rank order: the same call twice gives the same bits."""
    from microscale.kernels.sm90 import decode_ws as D, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    m, n, k = 3, 8192, 4096
    x, q, _, y64, mag = _case("nvfp4", m, n, k, torch.bfloat16, seed, bias=False)
    prep = prepare(q)
    cfg = D.ring_config(m, n, k, FMT_CODE["nvfp4"])
    assert cfg.split == 2
    y = D.decode_ws_gemm(x, *prep, None, FMT_CODE["nvfp4"], n, k)
    _check(y, y64, mag, k, torch.bfloat16)
    assert torch.equal(y, D.decode_ws_gemm(x, *prep, None, FMT_CODE["nvfp4"], n, k))


def test_wgmma_ws_split_parts_sum_in_rank_order(seed):
    """Split-K is deterministic: the same call twice gives the same bits, and a part with no K steps
    (K = 128: 2 steps over 4 parts) adds zeros."""
    from microscale.kernels.sm90 import prepare, wgmma_ws as W
    from microscale.kernels.sm90.decode import FMT_CODE
    m, n, k = 200, 256, 128
    x, q, b, y64, mag = _case("nvfp4", m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    cfg = W.WsConfig(block_m=128, split=4)
    y = W.wgmma_ws_gemm(x, *prep, b, FMT_CODE["nvfp4"], n, k, cfg)
    _check(y, y64, mag, k, torch.bfloat16)
    assert torch.equal(y, W.wgmma_ws_gemm(x, *prep, b, FMT_CODE["nvfp4"], n, k, cfg))


@triton.jit
def _write_late(src, dst, n, SLEEPS: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src, written about SLEEPS microseconds after this kernel has released the next one: a
    programmatic dependent launch after it starts at once, and finds the old dst until griddepcontrol.wait."""
    tl.extra.cuda.gdc_launch_dependents()
    for _ in range(SLEEPS):
        tl.inline_asm_elementwise("nanosleep.u32 1000; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize("kernel,fmt,m,n", [("decode", "nvfp4", 1, 1000), ("decode", "nvfp4", 8, 4096),
                                            ("decode", "mxfp8", 1, 8192), ("decode_ws", "nvfp4", 4, 8192),
                                            ("decode_ws", "nvfp4", 1, 4096)])
def test_programmatic_launch_reads_x_only_after_the_kernel_that_writes_it(kernel, fmt, m, n, seed, monkeypatch):
    """As programmatic dependent launches (MICROSCALE_PDL=1) the decode kernels start beside the kernel before
    them; here that kernel releases them at once and writes x about 20 us later over NaNs. A kernel that read
    x (or wrote y, or the split-K workspace) before griddepcontrol.wait would give NaNs or wrong sums."""
    from microscale.kernels.sm90 import decode_ws as D, launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    monkeypatch.setenv("MICROSCALE_PDL", "1")
    k = 2048
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    staged = torch.empty_like(x)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(1 << 22, device="cuda")
    for _ in range(3):
        staged.fill_(float("nan"))
        y.fill_(float("nan"))
        ws.fill_(float("nan"))
        _write_late[(triton.cdiv(x.numel(), 1024),)](x, staged, x.numel(), SLEEPS=20, BLOCK=1024)
        if kernel == "decode":
            paths.decode_gemm(staged, *prep, b, FMT_CODE[fmt], n, k, out=y, workspace=ws)
        else:
            D.decode_ws_gemm(staged, *prep, b, FMT_CODE[fmt], n, k, out=y)
        _check(y, y64, mag, k, torch.bfloat16)


def _graph_node_types(graph) -> list:
    from cuda.bindings import driver
    handle = driver.CUgraph(graph.raw_cuda_graph())
    err, _, count = driver.cuGraphGetNodes(handle, 0)
    err, nodes, count = driver.cuGraphGetNodes(handle, count)
    assert int(err) == 0, err
    return [driver.cuGraphNodeGetType(node)[1] for node in nodes[:count]]


@pytest.mark.parametrize("kernel,m", [("wgmma_ws", 600), ("decode_ws", 4)])
def test_tma_kernels_captured_in_a_cuda_graph(kernel, m, seed):
    """A call captured on an activation buffer allocated inside the capture replays on new values as the
    eager call computes them. The graph holds kernel nodes only: the tensor maps travel in the launch's
    parameters (a map copied to the device per call would add a copy node, a PCIe round trip per replay)."""
    from cuda.bindings import driver
    from microscale.kernels import sm90
    n, k = 1000, 1024 + 64
    x, q, b, y64, mag = _case("nvfp4", m, n, k, torch.bfloat16, seed)
    prep = sm90.prepare(q)
    ws = {"kernel": kernel}
    _check(sm90.gemm(x, *prep, b, fmt="nvfp4", n=n, k=k, options=ws), y64, mag, k, torch.bfloat16)
    src = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        inner_x = src * 1  # a buffer of the graph's pool, at an address no eager call has used
        y = sm90.gemm(inner_x, *prep, b, fmt="nvfp4", n=n, k=k, options=ws)
    types = _graph_node_types(graph)
    assert len(types) >= 2 and all(t == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL for t in types), types
    graph.instantiate()
    for i in range(2):
        fresh = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + i))
        src.copy_(x if i == 0 else fresh.to(torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if i == 0:
            _check(y, y64, mag, k, torch.bfloat16)
        assert torch.equal(y, sm90.gemm(src.clone(), *prep, b, fmt="nvfp4", n=n, k=k, options=ws))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_fp16_activations(fmt, seed):
    from microscale.kernels import sm90
    x, q, b, y64, mag = _case(fmt, 5, 300, 512, torch.float16, seed)
    y = sm90.gemm(x, *sm90.prepare(q), b, fmt=fmt, n=300, k=512, options={"kernel": "decode"})
    _check(y, y64, mag, 512, torch.float16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(65, 200, 224), (300, 1000, 1024), (1024, 384, 2048 + 160)])
def test_dequant_cublas(fmt, m, n, k, seed):
    from microscale.kernels.sm90 import launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    for cfg in (paths.DequantConfig(), paths.DequantConfig(reps=2, unroll=4), paths.DequantConfig(num_warps=8, unroll=1)):
        for chunk in (0, 128):
            ws = torch.full(padded_shape(n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = paths.dequant_gemm(x, *prep, b, FMT_CODE[fmt], n, k, chunk_rows=chunk,
                                   workspace=ws if not chunk else None, cfg=cfg)
            _check(y, y64, mag, k, torch.bfloat16, weight_rounding=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_chunks_on_two_streams_in_a_cuda_graph(fmt, seed):
    """Four chunks through two workspaces, the next chunk dequantized on the side stream: captured
    in a CUDA graph and replayed, y equals the eager call's bit for bit and meets the bound."""
    from microscale.kernels.sm90 import launch as paths, prepare
    from microscale.kernels.sm90.decode import FMT_CODE
    m, n, k = 300, 1000, 1024 + 64
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    prep = prepare(q)
    eager = paths.dequant_gemm(x, *prep, b, FMT_CODE[fmt], n, k, chunk_rows=256)
    _check(eager, y64, mag, k, torch.bfloat16, weight_rounding=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture asks
        paths.dequant_gemm(x, *prep, b, FMT_CODE[fmt], n, k, chunk_rows=256)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = paths.dequant_gemm(x, *prep, b, FMT_CODE[fmt], n, k, chunk_rows=256)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_fp8_path(fmt, seed):
    from microscale.kernels import sm90
    m, n, k = 1024, 384, 1024 + 64
    x, q, b, y64, _ = _case(fmt, m, n, k, torch.bfloat16, seed)
    y = sm90.gemm(x, *sm90.prepare(q), b, fmt=fmt, n=n, k=k, options={"fp8_activations": True})
    assert not torch.isnan(y).any()
    rel = ((y.double() - y64).norm() / y64.norm()).item()
    assert rel <= 0.06, rel


def test_fp8_transcode_exact_and_counted(seed):
    """MXFP4 rows whose block exponents span <= 14 binades transcode exactly; wider spans are counted."""
    from microscale.kernels.sm90 import launch as paths, prepare
    n, k = 128, 512
    w = torch.randn(n, k, device="cuda")
    w[:64] *= torch.exp2(torch.randint(-6, 7, (64, k // 32), device="cuda").float()).repeat_interleave(32, 1)
    w[64:] *= torch.exp2(torch.randint(-40, 40, (64, k // 32), device="cuda").float()).repeat_interleave(32, 1)
    q = quantize(w, "mxfp4")
    data, scale, row_mult = prepare(q)
    inexact = torch.zeros(1, dtype=torch.int32, device="cuda")
    w8, w_scale = paths.transcode_e4m3(data, scale, row_mult, 1, n, k, inexact)
    exact = (w8.float() * w_scale[:, None])[:n, :k]
    ref = q.dequantize()
    assert torch.equal(exact[:64], ref[:64])
    wrong = (exact[64:] != ref[64:]).sum().item()
    assert wrong > 0 and inexact.item() == wrong


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_wgmma_ws_kernel_at_m_8192(fmt, seed):
    """M = 8192, up to which the dispatch gives FP4 to wgmma_ws (WS_MAX_M): 32 m tiles of 256 rows taken in groups
    of 8 (default_group_m at K = 4096), 4 n tiles, the last ragged, y through shared memory; against float64,
    outputs poisoned with NaN first."""
    from microscale.kernels import sm90
    from microscale.kernels.sm90 import prepare, wgmma_ws as W
    from microscale.kernels.sm90.decode import FMT_CODE
    m, n, k = 8192, 392, 4096
    assert sm90.choose_kernel(fmt, m, {}, n=n, k=k) == "wgmma_ws" and W.default_group_m(256, k) == 8
    x, q, b, y64, mag = _case(fmt, m, n, k, torch.bfloat16, seed)
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    W.wgmma_ws_gemm(x, *prepare(q), b, FMT_CODE[fmt], n, k, out=y)
    _check(y, y64, mag, k, torch.bfloat16)


def test_dispatch_picks_sm90():
    from microscale.kernels import dispatch
    assert dispatch.select_backend("nvfp4", "cuda").name == "sm90"  # the kernel rule: test_sm90_dispatch.py


def test_first_use_selftest_passes_where_the_kernels_are_tested():
    """The self-test that gates this backend on sm_80-sm_89 and sm_120 must pass on the H200, where the
    kernels are tested: it covers the decode kernel (M=5) and the larger-M kernels (M=40, 150)."""
    from microscale.kernels import selftest, sm90
    assert selftest.run_selftest(selftest.backend_run_fn(sm90.BACKEND), "cuda", sm90.SELFTEST_PAIRS) == []


def test_linear_end_to_end(seed):
    from microscale.kernels import dispatch
    x, q, b, y64, mag = _case("nvfp4", 7, 256, 512, torch.bfloat16, seed)
    y = dispatch.linear(x.view(7, 1, 512), q, b)
    _check(y.view(7, 256), y64, mag, 512, torch.bfloat16)
