"""Fused quantize kernel (Triton, any CUDA GPU): [M, K] float -> packed codes + block scales.

One pass over x: each program loads a [BLOCK_M, BLOCK_K] tile, takes the absolute maximum of every
block of 16 (NVFP4) or 32 (MX) along K, encodes the block scale and the elements, packs E2M1 two
per byte (low nibble = even K) and writes the scales directly in the requested layout (linear, or
the 128x4 swizzled tile layout of formats.scale_layout). The result is bit-identical to the
reference `microscale.quant.quantize(x, fmt, recipe="compressed-tensors", ...)`: the same float32
operations in the same order, IEEE division (`div_rn`, never flushed to zero), RNE casts.

Used for weights at load time and for activations at run time. It does not check for NaN/Inf
(the reference rejects them; a check here would synchronize the GPU): non-finite input gives
unspecified codes.
"""

import os

import torch
import triton
import triton.language as tl

from ..formats.codec import E2M1_VALUES, ScaleMode
from ..formats.scale_layout import swizzled_scale_shape
from ..formats.spec import E2M1_MAX, E4M3_MAX, E8M0_BIAS, get_format
from ..formats.tensor import QTensor, padded_k
from ..quant.reference import check_weight, nvfp4_global_scale

_SCALE_MODE_CODE = {ScaleMode.FLOOR: 0, ScaleMode.RCEIL: 1, ScaleMode.CEIL: 2, ScaleMode.EVEN: 3}

# E2M1 grid: step 0.5 below 2, 1 below 4, 2 up to 6 (the values of codec.E2M1_VALUES). Adding
# 1.5 * 2**(22 + j) to a float rounds it to a multiple of 2**(j - 1), to nearest even, in one IEEE
# addition; the sum's bits minus the constant's bits count the steps.
GRID_LOW, GRID_MID = tl.constexpr(E2M1_VALUES[4]), tl.constexpr(E2M1_VALUES[6])  # 2.0, 4.0
ROUND_HALF, ROUND_ONE, ROUND_TWO = tl.constexpr(1.5 * 2**22), tl.constexpr(1.5 * 2**23), tl.constexpr(1.5 * 2**24)
NVFP4_ZERO_SCALE = tl.constexpr(0.125)  # compressed-tensors replaces a zero block scale by this
NVFP4_ZERO_SCALE_BITS = tl.constexpr(0x20)  # its E4M3 code
ELEM_MAX_FP4 = tl.constexpr(E2M1_MAX)
ELEM_MAX_FP8 = tl.constexpr(E4M3_MAX)
BIAS = tl.constexpr(E8M0_BIAS)


@triton.jit
def _e2m1_codes(y):
    """float32 with |y| <= 6 -> E2M1 code (int32), round to nearest even, sign bit for y < 0
    (codec.e2m1_encode: also for values that round to zero)."""
    a = tl.abs(y)
    low = a < GRID_LOW
    mid = a < GRID_MID
    c = tl.where(low, ROUND_HALF, tl.where(mid, ROUND_ONE, ROUND_TWO))
    steps = (a + c).to(tl.int32, bitcast=True) - c.to(tl.int32, bitcast=True)
    mag = steps + tl.where(low, 0, tl.where(mid, 2, 4))  # codes of 2.0 and 4.0 are 4 and 6
    return mag | ((y < 0).to(tl.int32) << 3)


@triton.jit
def _e4m3_bits(v):
    """float32 with |v| <= 448 -> E4M3 bits (int32), round to nearest even, as codec.e4m3_encode.

    Integer arithmetic rather than a cast, so the interpreter (whose float8 casts do not round to
    nearest even) and the GPU compute the same bits.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)  # 3 mantissa bits, rebias
    q = tl.abs(v) * 512.0  # subnormal: multiples of 2**-9; RNE to an integer with the 2**23 trick
    sub = ((q + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(a >= 0x3C800000, normal, sub)  # 0x3C800000 = 2**-6, the smallest normal


@triton.jit
def _e4m3_value(b):
    """E4M3 bits (int32, not NaN) -> float32, exact."""
    mag = b & 0x7F
    normal = ((mag << 20) + ((127 - 7) << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag >= 8, normal, mag.to(tl.float32) * 0.001953125)  # subnormal: m * 2**-9
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit
def _floor_ceil_log2(v):
    """floor(log2 v), ceil(log2 v) for v >= 0 float32 (subnormals too), from the bits.

    v = 0 and v = inf give (-1, 0), as torch.frexp's (0 or inf, 0) does in codec._floor_ceil_log2.
    """
    tiny = v < 1.1754943508222875e-38  # below the smallest normal: scale up by 2**64 exactly first
    vs = tl.where(tiny, v * 18446744073709551616.0, v)
    bits = vs.to(tl.int32, bitcast=True)
    floor = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 64, 0)
    ceil = floor + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    special = (v == 0) | (v == float("inf"))
    return tl.where(special, -1, floor), tl.where(special, 0, ceil)


@triton.jit
def _e8m0_from_amax(amax, MODE: tl.constexpr, ELEM_MAX: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr):
    """Biased E8M0 exponent (int32) of a block, as codec.e8m0_from_amax (finite amax)."""
    v = amax
    if MODE == 3:  # EVEN: round amax to the element's mantissa width, keep the exponent
        v = ((amax.to(tl.int32, bitcast=True) + (1 << (22 - MBITS))) & 0x7F800000).to(tl.float32, bitcast=True)
    if MODE == 1:  # RCEIL
        _, e = _floor_ceil_log2(tl.div_rn(v, ELEM_MAX))
    else:
        floor, ceil = _floor_ceil_log2(v)
        e = (ceil if MODE == 2 else floor) - EMAX
    b = tl.minimum(tl.maximum(e + BIAS, 0), 254)
    return tl.where(v == 0, 0, b)


@triton.jit
def _pow2(e):
    """Exact float32 2**e for integer e in [-127, 127] (2**-127 is subnormal), as codec.pow2."""
    normal = ((e + BIAS) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == -127, 5.877471754111438e-39, normal)


@triton.jit
def _scale_offsets(rows, cols, n_cols, SWIZZLED: tl.constexpr):
    """Byte offsets of scale (row, col): linear [rows, n_cols], or formats.scale_layout's 128x4 tiles."""
    if SWIZZLED:
        cp = (n_cols + 3) // 4 * 4
        return ((rows // 128) * (cp // 4) * 512 + (cols // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + cols % 4)
    return rows * n_cols + cols


@triton.jit
def quantize_kernel(
    X, DATA, SCALE, G, M, K, n_cols, stride_xm,
    FMT: tl.constexpr, MODE: tl.constexpr, SWIZZLED: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """FMT 0 = NVFP4 (compressed-tensors recipe), 1 = MXFP4, 2 = MXFP8; MODE = _SCALE_MODE_CODE."""
    NB: tl.constexpr = BLOCK_K // BLOCK
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
    x = tl.reshape(x, (BLOCK_M, NB, BLOCK))
    amax = tl.max(tl.abs(x), axis=2)

    if FMT == 0:
        g = tl.load(G)
        s = tl.div_rn(amax, ELEM_MAX_FP4) * g
        s_bits = _e4m3_bits(tl.minimum(tl.maximum(s, -ELEM_MAX_FP8), ELEM_MAX_FP8))
        s = _e4m3_value(s_bits)
        s_bits = tl.where(s == 0, NVFP4_ZERO_SCALE_BITS, s_bits)
        s = tl.where(s == 0, NVFP4_ZERO_SCALE, s)
        scale_bits = s_bits.to(tl.uint8)
        y = tl.div_rn(x, tl.div_rn(s, g)[:, :, None])
    else:
        EMAX: tl.constexpr = 2 if FMT == 1 else 8
        MBITS: tl.constexpr = 1 if FMT == 1 else 3
        ELEM_MAX: tl.constexpr = ELEM_MAX_FP4 if FMT == 1 else ELEM_MAX_FP8
        b = _e8m0_from_amax(amax, MODE, ELEM_MAX, EMAX, MBITS)
        scale_bits = b.to(tl.uint8)
        y = x * _pow2(-(b - BIAS))[:, :, None]
    y = tl.reshape(y, (BLOCK_M, BLOCK_K))

    kp = n_cols * BLOCK  # K padded to whole blocks: padded columns get zero codes
    if FMT == 2:
        q = _e4m3_bits(tl.minimum(tl.maximum(y, -ELEM_MAX_FP8), ELEM_MAX_FP8)).to(tl.uint8)
        tl.store(DATA + rows[:, None].to(tl.int64) * kp + ks[None, :], q,
                 mask=row_ok[:, None] & (ks < kp)[None, :])
    else:
        codes = _e2m1_codes(tl.minimum(tl.maximum(y, -ELEM_MAX_FP4), ELEM_MAX_FP4))
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(DATA + rows[:, None].to(tl.int64) * (kp // 2) + kb[None, :], packed,
                 mask=row_ok[:, None] & (kb < kp // 2)[None, :])

    cols = pid_k * NB + tl.arange(0, NB)
    offs = _scale_offsets(rows[:, None], cols[None, :], n_cols, SWIZZLED)
    tl.store(SCALE + offs, scale_bits, mask=row_ok[:, None] & (cols < n_cols)[None, :])


def _check_input(x: torch.Tensor):
    check_weight(x, "quantize_gpu: x", finite=False)
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(f"quantize_gpu: x must be on a CUDA device, got {x.device}")


def _global_scale(x: torch.Tensor, global_scale) -> torch.Tensor:
    """The NVFP4 encode global scale as a float32 1-element tensor on x's device."""
    if global_scale is None:
        return nvfp4_global_scale(x).reshape(1)
    if not isinstance(global_scale, torch.Tensor):
        g = float(global_scale)
        if not (g > 0 and g != float("inf")):
            raise ValueError(f"quantize_gpu: global_scale must be finite and > 0, got {g}")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(1)
    return g


def quantize_gpu(x: torch.Tensor, fmt, *, global_scale=None, scale_mode=ScaleMode.RCEIL,
                 scale_layout: str = "swizzled") -> QTensor:
    """Quantize x [M, K] (bf16/fp16/fp32, CUDA) along K; bit-identical to the reference quantizer.

    Same result as `quant.quantize(x, fmt, recipe="compressed-tensors", scale_mode=..., global_scale=...,
    scale_layout=...)`. NVFP4's global scale (encode, 448*6/amax) is computed on the GPU when not
    given; a given tensor is used as is (not checked, to avoid a host synchronization).
    """
    spec = get_format(fmt)
    _check_input(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"quantize_gpu: scale_layout {scale_layout!r} not in ('linear', 'swizzled')")
    if not spec.global_scale and global_scale is not None:
        raise ValueError(f"quantize_gpu: {spec.name} has no global scale; got global_scale={global_scale!r}")
    m, k = x.shape
    kp = padded_k(k, spec.block)
    n_cols = kp // spec.block
    data = torch.empty(m, kp // 2 if spec.packed else kp, dtype=spec.data_dtype, device=x.device)
    if scale_layout == "swizzled":
        shape = swizzled_scale_shape(m, n_cols)
        padded = shape != (m, n_cols)
        scale = (torch.zeros if padded else torch.empty)(shape, dtype=torch.uint8, device=x.device)
    else:
        scale = torch.empty(m, n_cols, dtype=torch.uint8, device=x.device)
    g = _global_scale(x, global_scale) if spec.global_scale else None

    block_k = 128 if spec.block == 32 else 64
    block_m = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(kp, block_k))
    fmt_code = 0 if spec.global_scale else (1 if spec.packed else 2)
    quantize_kernel[grid](
        x, data.view(torch.uint8), scale, g if g is not None else scale,
        m, k, n_cols, x.stride(0),
        FMT=fmt_code, MODE=_SCALE_MODE_CODE[ScaleMode(scale_mode)], SWIZZLED=scale_layout == "swizzled",
        BLOCK=spec.block, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4,
    )
    return QTensor(data=data, scale=scale.view(spec.scale_dtype), fmt=spec, shape=(m, k),
                   global_scale=None if g is None else g.reshape(()), scale_layout=scale_layout,
                   orig_dtype=x.dtype)
