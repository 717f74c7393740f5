"""Fused quantize kernel (Triton, any CUDA GPU): [M, K] float -> packed codes + block scales.

One pass over x (two for NVFP4 without a given global scale: `amax_kernel` first), loaded 16
bytes at a time; the codes are packed in registers and the scales go straight to the requested
layout (linear, or the 128x4 swizzled tiles of formats.scale_layout). The result is
bit-identical to the reference `microscale.quant.quantize(x, fmt, recipe="compressed-tensors", ...)`.

Two thread layouts (TILE picks one per format; measured on the H200, bench/results/quantize_h200.json):
- whole blocks per thread (NVFP4, MXFP4: bound by arithmetic): the block maximum, the block scale
  and the packing stay in one thread, and per-block work is done once; a warp's 16-byte loads
  stride over whole blocks, so each touches half (NVFP4) or a quarter (MX) of every sector.
- SPREAD, lanes along the 16-byte chunks (MXFP8, bound by memory): every warp access is
  contiguous; the block maximum takes shuffles and the 4 lanes of a block repeat its per-block work.

How the per-element work stays cheap and exact (the FP4 kernels are ALU-bound otherwise):
- NVFP4 with bf16 / fp16 x (PACKED) divides nothing: a block's element codes depend only on where
  |x| lies against 8 breakpoints, the smallest values of x's dtype whose quotient x / d (d = scale /
  global_scale) reaches each E2M1 decision point, and the smallest whose quotient is not zero (the
  sign bit). `nvfp4_table_kernel` finds them exactly per call for all 128 scale codes; the kernel
  reads x as int32 words and codes a 16-byte chunk (8 elements) in one PTX routine: 8 packed
  comparisons per word (set.u32.bf16x2: a 0xFFFF mask per half), the 7 magnitude masks summed
  times -(2**16 + 1), which leaves each half's count in its half, then byte permutes
  (_e2m1_chunk_asm). 506 SASS instructions per thread of the NVFP4 tile instead of 676; the sums
  are multiply-adds because the ALU pipe (comparisons, logic) bounded the kernel with adds
  (ncu: 82% busy), and |x| is an abs.bf16x2 (an HFMA2) for the same reason.
- Otherwise (float32 or rotated x) NVFP4 divides every element by its block's d. A correctly rounded
  division per element (div.rn: a reciprocal on the quarter-rate special-function unit plus a
  range check) is replaced by one reciprocal per block and Markstein's correction step:
  q0 = a * r, q = fma(fma(-q0, d, a), r, q0) with r = RN(1/d) gives RN(a/d) whenever no
  intermediate leaves the normal range. Elements are first scaled by a power of two that brings
  d into [2**-10, 2) and clipped at 6 * d, which keeps every element whose code depends on the
  last bit of the quotient in that range (checked exhaustively for every d in [1, 2) and every
  dividend near an E2M1 decision point). d depends only on the block's E4M3 scale code and the
  global scale, so `nvfp4_table_kernel` prepares the per-block values once per call for all 128
  codes, and a block loads them with one 16-byte load. Comparing float32 elements one at a time
  (FSETP and SEL each) would cost more than this division.
- E2M1 rounding is one float addition of 1.5 * 2**(22 + j), j = the binade above 2, to the
  magnitude; the code is the sum's bits minus the constant's bits. On the GPU this step, the sign
  test below and the shift into the code's nibble are one inline-PTX routine per element
  (_E2M1_NIBBLE_ASM, the same arithmetic as _e2m1_code_biased, which the interpreter runs).
- Which negative elements keep the sign bit (those whose quotient does not round to -0) is one
  unsigned comparison of x's bits against a per-block threshold, exact for underflowing quotients.
- MXFP8 elements use the hardware float32 -> e4m3 conversion (cvt.rn.satfinite.e4m3x2, sm_89+),
  which rounds to nearest even and saturates as the reference's clamp-then-cast does. NVFP4
  block scales are encoded with integer arithmetic instead: with the hardware conversion, the
  H200 tests stored wrong scale bytes on ragged shapes (K not a multiple of 16, whose layout
  differs) while the codes were right (triton 3.6; cause not isolated).
Triton's interpreter (CPU tests) computes tl.fma as a rounded multiply plus a rounded add and
does not round float8 casts to nearest even, so there (NATIVE=False) elements are divided with
div_rn and encoded to E4M3 with integer arithmetic, and the PTX routines run as the same steps in
Triton; everything else is the same code. GPUs before sm_89 (A100), which have no float8
conversion, take the same integer encoding (HW_E4M3); bf16 pairs are compared from sm_90 on (f16
pairs everywhere), before that bf16 x is divided.

Rotation (`rotation=b`: quant/hadamard.py's block-wise Hadamard R, for rotated layers' activations):
x R is computed in registers right after the load, per run of b elements along K
(`_hadamard_rotate`): log2(b) butterfly stages of float32 additions and subtractions in a fixed
order, then one multiply by float32(1 / sqrt(b)) (exact for b = 16). Only additions come before
that multiply, so there is nothing to contract into an fma: the GPU, the interpreter and
`amax_kernel` (whose NVFP4 global scale is then that of the very values quantized) compute the same
float32 values, and the codes are the reference quantizer's of them. Each is within
(log2(b) + 3) * 2**-24 * sum|run| / sqrt(b) (+ 2**-149 below the normal range) of the exact x R:
every term passes through log2(b) rounded additions, and the constant and the multiply round once
each. So codes differ from those of a float64 rotation rounded to float32 only where the two
rotated values differ, at rounding boundaries (tests/kernels/test_quantize_rotation.py). The sums
before the multiply reach b * max|x|: inputs need max|x| <= float32's max / b (1e37 for b = 32);
beyond that the codes are unspecified, as for non-finite input. The butterflies are register
renaming where a thread holds whole runs, so MXFP8 drops SPREAD when rotating (ROTATED_TILE).

Used for weights at load time and for activations at run time. It does not check for NaN/Inf
(the reference rejects them; a check here would synchronize the GPU): non-finite input gives
unspecified codes.
"""

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats.codec import ScaleMode
from ..formats.scale_layout import swizzled_scale_shape
from ..formats.spec import E2M1_MAX, E4M3_MAX, E8M0_BIAS, get_format
from ..formats.tensor import QTensor, padded_k
from ..quant.hadamard import ROTATION_BLOCKS, hadamard_matrix
from ..quant.reference import NVFP4_GLOBAL_NUMERATOR, check_weight
from .dispatch import compute_capability

_SCALE_MODE_CODE = {ScaleMode.FLOOR: 0, ScaleMode.RCEIL: 1, ScaleMode.CEIL: 2, ScaleMode.EVEN: 3}

# _e2m1_code_biased's constants (ints here; tl.constexpr below): c = (e << 23) + ROUND_OFFSET is
# 1.5 * 2**(22 + e - 127) (0x4AC00000 = bits of 1.5 * 2**22 at e = 127), and bits(q + c) +
# e * STEP_FACTOR is the E2M1 code plus CODE_BIAS
ROUND_OFFSET = 0x4AC00000 - (127 << 23)
STEP_FACTOR = 2 - (1 << 23)
CODE_BIAS = ROUND_OFFSET + 2 * 127


def _int32(v: int) -> int:
    """v mod 2**32 as a signed int32 value."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


# CODE_BIAS in every nibble of a word of 8 (int32) or 4 (int16) codes
WORD_BIAS_8, WORD_BIAS_4 = tl.constexpr(_int32(CODE_BIAS * 0x11111111)), tl.constexpr(_int32(CODE_BIAS * 0x1111))
ROUND_OFFSET, STEP_FACTOR = tl.constexpr(ROUND_OFFSET), tl.constexpr(STEP_FACTOR)
NVFP4_ZERO_SCALE = tl.constexpr(0.125)  # compressed-tensors replaces a zero block scale by this
NVFP4_ZERO_SCALE_BITS = tl.constexpr(0x20)  # its E4M3 code
GLOBAL_NUMERATOR = tl.constexpr(NVFP4_GLOBAL_NUMERATOR)
ELEM_MAX_FP4 = tl.constexpr(E2M1_MAX)
ELEM_MAX_FP8 = tl.constexpr(E4M3_MAX)
BIAS = tl.constexpr(E8M0_BIAS)
# the entries' magnitude of the normalized Hadamard matrices, float32 (0.25 and RN(2**-2.5))
HADAMARD_NORM_16, HADAMARD_NORM_32 = (tl.constexpr(float(hadamard_matrix(b)[0, 0])) for b in (16, 32))


@triton.jit
def _e2m1_code_biased(q, neg):
    """float32 q in [0, 6 + a few ulp] and a sign flag -> the E2M1 code of q (round to nearest
    even), sign bit 8 where neg, plus CODE_BIAS (int32): callers subtract the bias once per word.

    The grid steps by 2**(j - 1) in binade j = max(exponent, 0) (j = 0 below 2, 1 below 4, 2
    above): adding c = 1.5 * 2**(22 + j) rounds q to that step in one IEEE addition, the sum's
    bits minus c's bits count the steps, and binade j starts at code 2 * j. With e = j + 127,
    code = bits(q + c) - c + 2 * j = bits(q + c) + e * (2 - 2**23) - CODE_BIAS.
    """
    e = tl.maximum(q.to(tl.int32, bitcast=True) >> 23, 127)
    c = (e << 23) + ROUND_OFFSET
    return (q + c.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) + e * STEP_FACTOR + tl.where(neg, 8, 0)


# _e2m1_nibble on the GPU: _e2m1_code_biased's arithmetic, the sign test and the shift as PTX
# ($1 = q, $2 = x's bits, $3 = the sign threshold, $4 = the shift). Written in Triton, the compiler
# splits e * (2 - 2**23) in two and carries each sign through a predicate saved to a register and back;
# this way the sm_90 hot path of the NVFP4 tile has 676 instructions instead of 745, MXFP4's 498
# instead of 551 (32 elements per thread).
_E2M1_NIBBLE_ASM = tl.constexpr(f"""{{
.reg .b32 e, c;
.reg .pred p;
shr.u32 e, $1, 23;
max.u32 e, e, 127;
mad.lo.u32 c, e, {1 << 23}, {ROUND_OFFSET.value};
add.rn.f32 $0, $1, c;
mad.lo.u32 $0, e, {STEP_FACTOR.value & 0xFFFFFFFF}, $0;
setp.gt.u32 p, $2, $3;
@p add.u32 $0, $0, 8;
shl.b32 $0, $0, $4;
}}""")


@triton.jit
def _e2m1_nibble(q, x_bits, threshold, shift, NATIVE: tl.constexpr):
    """(_e2m1_code_biased(q, x_bits > threshold) << shift) as int32, for q, x_bits (uint32) and the
    broadcastable threshold (uint32) and shift; through _E2M1_NIBBLE_ASM when NATIVE."""
    if NATIVE:
        return tl.inline_asm_elementwise(_E2M1_NIBBLE_ASM, "=r,r,r,r,r", [q, x_bits, tl.broadcast_to(threshold, q.shape),
                                         tl.broadcast_to(shift, q.shape)], dtype=tl.int32, is_pure=True, pack=1)
    return _e2m1_code_biased(q, x_bits > threshold) << shift


@triton.jit
def _e4m3_bits(v):
    """float32 with |v| <= 448 -> E4M3 bits (int32), round to nearest even, as codec.e4m3_encode.

    Integer arithmetic rather than a cast, so the interpreter (whose float8 casts do not round to
    nearest even) computes the same bits as the GPU.
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
def _hadamard_rotate(x, R: tl.constexpr):
    """x [A, B, C, V] float32 -> x R: every R consecutive elements of a row of (C, V) (R divides
    C * V) times hadamard_matrix(R), in float32 and in a fixed order (module docstring).

    log2(R) butterfly stages of constant geometry: each adds and subtracts the pairs of adjacent
    elements and puts the sums before the differences (split, join, permute: register renaming
    where a thread holds the whole run), which applies [[1, 1], [1, -1]] to the lowest index bit
    and rotates the bits down by one; after log2(R) stages every bit had its turn and is back in
    place, and Sylvester's H_R = [[1, 1], [1, -1]] tensored log2(R) times has been applied. Then
    one multiply by float32(1 / sqrt(R)), exact for R = 16.
    """
    A: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    N: tl.constexpr = x.shape[2] * x.shape[3] // R
    y = tl.reshape(x, (A, B, N, R))
    for _ in tl.static_range(4 if R == 16 else 5):
        lo, hi = tl.split(tl.reshape(y, (A, B, N, R // 2, 2)))
        y = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 2, 4, 3)), (A, B, N, R))
    return tl.reshape(y * (HADAMARD_NORM_16 if R == 16 else HADAMARD_NORM_32), x.shape)


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
def _zero_quotient_bound(d):
    """Divisor d > 0 (up to inf) -> the bits (int32) of F, the largest float32 <= d * 2**-150: a
    quotient x / d rounds to zero exactly when |x| <= F (at most 2**-150, which rounds to 0)."""
    exact = d >= 16777216.0  # d * 2**-150 is then a normal float32 (two exact scalings)
    return tl.where(exact, ((d * 7.888609052210118e-31) * 8.881784197001252e-16).to(tl.int32, bitcast=True),
                    (tl.minimum(d, 16777216.0) * 0.5).to(tl.int32))  # else F = floor(d / 2) * 2**-149: bits floor(d / 2)


@triton.jit
def _sign_threshold(d):
    """Per block divisor d > 0 (up to inf) -> T (uint32) such that x / d rounds to a float32 < 0
    exactly when x's bits, read as uint32, exceed T: x < 0 and |x| > F (_zero_quotient_bound; a
    quotient that rounds to -0 is coded as 0 by e2m1_encode)."""
    return _zero_quotient_bound(d).to(tl.uint32, bitcast=True) | 0x80000000


@triton.jit
def _scale_offsets(rows, cols, n_cols, SWIZZLED: tl.constexpr):
    """Byte offsets of scale (row, col): linear [rows, n_cols], or formats.scale_layout's 128x4 tiles."""
    if SWIZZLED:
        cp = (n_cols + 3) // 4 * 4
        return ((rows // 128) * (cp // 4) * 512 + (cols // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + cols % 4)
    return rows * n_cols + cols


@triton.jit
def _divisor(d):
    """What dividing exactly by a block divisor d > 0 (up to inf) takes, see quantize_kernel:
    (p, -d * p, RN(1 / (d * p)), sign threshold), p a power of two that brings d into [2**-10, 2).
    d = inf gets p = 0 and d * p = 1: every x / inf is 0."""
    finite = d < float("inf")
    p = tl.where(finite, _pow2(tl.minimum(tl.maximum(-_floor_ceil_log2(d)[0], -127), 127)), 0.0)
    dd = tl.where(finite, d * p, 1.0)
    return p, -dd, tl.div_rn(tl.full(dd.shape, 1.0, tl.float32), dd), _sign_threshold(d)


# a 16-bit x's dtype as a constexpr code, and its +inf bits (the breakpoint no finite element reaches)
X_KIND = {torch.bfloat16: 0, torch.float16: 1}
INF_BITS = tl.constexpr((0x7F80, 0x7C00))


@triton.jit
def _x_value(bits, XK: tl.constexpr):
    """Bits of a non-negative value of x's dtype (XK = X_KIND) -> float32, exact."""
    if XK == 0:
        return (bits << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x_bits_near(v, XK: tl.constexpr):
    """float32 v >= 0 -> the bits of a value of x's dtype within one ulp of it (inf where v overflows)."""
    if XK == 0:
        return v.to(tl.int32, bitcast=True) >> 16
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)


TABLE_PROGRAMS = tl.constexpr(8)  # nvfp4_table_kernel's grid: 16 scale codes each (one wave is latency)
TABLE_ROW = tl.constexpr(8)  # int32 per scale code: 8 breakpoint pairs, or 4 for the division


@triton.jit
def nvfp4_table_kernel(G, AMAX, TABLE, G_FROM_AMAX: tl.constexpr, BREAKPOINTS: tl.constexpr, XK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """TABLE[c] (TABLE_ROW int32) = what coding the elements of a block with E4M3 scale code c takes
    (code 0 stands for the 0.125 that replaces a zero scale), d = RN(scale / g) its divisor:
    - BREAKPOINTS, for 16-bit x of dtype XK (quantize_kernel's PACKED): b_0 .. b_7, each in both
      halves of a word, b_0 negated. b_i (i = 1..7) is the smallest value of that dtype whose
      code, the reference's rounding of RN(b_i / d), is at least i; b_0 the smallest whose float32
      quotient is not zero (where a negative element keeps its sign bit); +inf where no finite
      value gets there;
    - else entries 0-3: _divisor(d) (float32 bits), for float32 elements (quantize_kernel divides).
    g: given in G, or 2688 / amax from AMAX (float32 bits, from amax_kernel), 1.0 when that is not
    finite (as reference.nvfp4_global_scale), then written to G.

    Each b_i is found exactly from an estimate: mid_i * d for i >= 1, for i = 0 the largest
    float32 F <= d * 2**-150 (a quotient rounds to zero exactly when it is at most 2**-150), taken
    to x's dtype within one ulp; the quotient moves b_i at most one more ulp from mid_i * d, so
    b_i is the first of the five values around the estimate whose quotient passes the test.
    PDL: quantize_kernel, launched next as a programmatic dependent launch, may start at once (it loads x, then
    waits for this grid before it reads G and TABLE).
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if G_FROM_AMAX:
        amax = tl.load(AMAX).to(tl.float32, bitcast=True)
        g = tl.div_rn(tl.full([], GLOBAL_NUMERATOR, tl.float32), amax)
        g = tl.where(g < float("inf"), g, 1.0)
        if tl.program_id(0) == 0:
            tl.store(G, g)
    else:
        g = tl.load(G)
    CODES: tl.constexpr = 128 // TABLE_PROGRAMS
    code = tl.program_id(0) * CODES + tl.arange(0, CODES)[:, None]
    s = tl.where(code == 0, NVFP4_ZERO_SCALE, _e4m3_value(code))
    d = tl.div_rn(s, g)  # [CODES, 1]
    row = TABLE + code * TABLE_ROW
    if not BREAKPOINTS:
        p, neg_dd, rcp, threshold = _divisor(d)
        tl.store(row, p.to(tl.int32, bitcast=True))
        tl.store(row + 1, neg_dd.to(tl.int32, bitcast=True))
        tl.store(row + 2, rcp.to(tl.int32, bitcast=True))
        tl.store(row + 3, threshold.to(tl.int32, bitcast=True))
    else:
        i = tl.arange(0, 8)[None, :]
        # breakpoint i >= 1: the quotient q reaches the midpoint below E2M1 value i (0.25, 0.75, 1.25,
        # 1.75, 2.5, 3.5, 5), strictly where a tie there rounds down to the even code; i = 0: q > 0
        mid = tl.where(i < 5, tl.where(i == 0, 0.0, 0.5 * i - 0.25), tl.where(i == 5, 2.5, tl.where(i == 6, 3.5, 5.0)))
        strict = (i % 2 == 1) | (i == 0)
        f = _zero_quotient_bound(d).to(tl.float32, bitcast=True)  # estimate of b_0
        estimate = tl.where(i == 0, _x_bits_near(f, XK), _x_bits_near(mid * d, XK))
        INF: tl.constexpr = INF_BITS[XK]
        b = tl.full(estimate.shape, INF, tl.int32)
        for j in tl.static_range(5):
            c = tl.minimum(tl.maximum(estimate + (j - 2), 0), INF)
            q = tl.div_rn(_x_value(c, XK), d)
            b = tl.minimum(b, tl.where(tl.where(strict, q > mid, q >= mid), c, INF))
        tl.store(row + i, (b | (b << 16)) | tl.where(i == 0, -0x7FFF8000, 0))  # 0x80008000: -b_0 in both halves


def _e2m1_chunk_asm(pair: str) -> str:
    """PTX: four words of x (16-bit elements of type `pair`, bf16x2 or f16x2; $1..$4), the block's
    breakpoint pairs ($5 = -b_0, $6..$12 = b_1..b_7) and $13 = -(2**16 + 1), $14 = 8 * $13 (from
    MASK_WEIGHT) -> the word of their 8 E2M1 codes.

    Per word: set.ge gives 0xFFFF in each half whose |x| reaches b_i; the sum s of the 7 masks is
    (c_0 - c_1) * 2**16 - c_0 modulo 2**32 for the halves' counts c_0 (low) and c_1, so
    s * -(2**16 + 1) = c_1 * 2**16 + c_0 (the codes' magnitudes); the sign's mask (x <= -b_0)
    times 8 * -(2**16 + 1) adds 8 in its halves. Then byte permutes put the even elements' codes in
    the low nibbles.
    """
    lines = ["{", ".reg .b32 a, m, s, n, v0, v1, v2, v3, lo, hi;"]
    for k in range(4):
        # each mask times -(2**16 + 1) as it is added: multiply-adds, which leave the ALU pipe (the
        # comparisons' and masks') to the rest
        lines += [f"abs.{pair} a, ${k + 1};", f"set.ge.u32.{pair} m, a, $6;", "mul.lo.u32 s, m, $13;"]
        for i in range(2, 8):
            lines += [f"set.ge.u32.{pair} m, a, ${i + 5};", "mad.lo.u32 s, m, $13, s;"]
        lines += [f"set.le.u32.{pair} n, ${k + 1}, $5;", f"mad.lo.u32 v{k}, n, $14, s;"]
    # v_k holds element 2k's code at bit 0 and element 2k + 1's at bit 16
    lines += ["mad.lo.u32 lo, v1, 256, v0;", "mad.lo.u32 hi, v3, 256, v2;",  # bytes: e0 e2 e1 e3 | e4 e6 e5 e7
              "prmt.b32 v0, lo, hi, 0x5410;", "prmt.b32 v1, lo, hi, 0x7632;",  # e0 e2 e4 e6 | e1 e3 e5 e7
              "mad.lo.u32 $0, v1, 16, v0;", "}"]
    return "\n".join(lines)


_E2M1_CHUNK_ASM = tl.constexpr((_e2m1_chunk_asm("bf16x2"), _e2m1_chunk_asm("f16x2")))


_MAX_ASM = tl.constexpr(("max.bf16x2 $0, $1, $2;", "max.f16x2 $0, $1, $2;"))


@triton.jit
def _max16x2(a, b, XK: tl.constexpr, NATIVE: tl.constexpr):
    """Halfwise maximum of two words of non-negative 16-bit values (x's |elements|)."""
    if NATIVE:
        return tl.inline_asm_elementwise(_MAX_ASM[XK], "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    return tl.maximum(a & 0xFFFF, b & 0xFFFF) | tl.maximum(a & -65536, b & -65536)


@triton.jit
def _take(t, k: tl.constexpr):
    """t[..., k] of a 4-D tensor whose last axis a thread holds whole: a register, no data movement."""
    return tl.sum(tl.where(tl.arange(0, t.shape[3])[None, None, None, :] == k, t, 0), axis=3)


@triton.jit
def _amax_words(w0, w1, w2, w3, XK: tl.constexpr, NATIVE: tl.constexpr):
    """The 4 words [A, B, C] of each chunk of a block (16-bit elements) -> max |element| of the
    block, float32 [A, B]."""
    a = _max16x2(_max16x2(w0 & 0x7FFF7FFF, w1 & 0x7FFF7FFF, XK, NATIVE),
                 _max16x2(w2 & 0x7FFF7FFF, w3 & 0x7FFF7FFF, XK, NATIVE), XK, NATIVE)
    tl.static_assert(a.shape[2] == 2, "an NVFP4 block of 16-bit elements is 2 chunks of 4 words")
    c = tl.arange(0, 2)[None, None, :]
    a = _max16x2(tl.sum(tl.where(c == 0, a, 0), axis=2), tl.sum(tl.where(c == 1, a, 0), axis=2), XK, NATIVE)
    return tl.maximum(_x_value(a & 0xFFFF, XK), _x_value((a >> 16) & 0xFFFF, XK))


@triton.jit
def _count_reached(v, b1, b2, b3, b4, b5, b6, b7):
    """How many of the breakpoints b1..b7 (16-bit, in the low half) v (16-bit magnitude) reaches."""
    return ((v >= (b1 & 0xFFFF)).to(tl.int32) + (v >= (b2 & 0xFFFF)).to(tl.int32) + (v >= (b3 & 0xFFFF)).to(tl.int32)
            + (v >= (b4 & 0xFFFF)).to(tl.int32) + (v >= (b5 & 0xFFFF)).to(tl.int32) + (v >= (b6 & 0xFFFF)).to(tl.int32)
            + (v >= (b7 & 0xFFFF)).to(tl.int32))


@triton.jit
def _pair_codes(w, nb0, b1, b2, b3, b4, b5, b6, b7):
    """_e2m1_chunk_asm's v_k in integer arithmetic: the codes of a word's two elements at bits 0 and 16."""
    a = w & 0x7FFF7FFF
    lo, hi = a & 0xFFFF, a >> 16
    b0 = nb0 & 0x7FFF
    code_lo = _count_reached(lo, b1, b2, b3, b4, b5, b6, b7) + tl.where(((w & 0x8000) != 0) & (lo >= b0), 8, 0)
    code_hi = _count_reached(hi, b1, b2, b3, b4, b5, b6, b7) + tl.where((w < 0) & (hi >= b0), 8, 0)
    return code_lo | (code_hi << 16)


@triton.jit
def _e2m1_chunk(w0, w1, w2, w3, nb0, b1, b2, b3, b4, b5, b6, b7, weight, XK: tl.constexpr, NATIVE: tl.constexpr):
    """Four words of x's 16-bit elements and the block's breakpoint pairs -> the word of their 8
    E2M1 codes: _E2M1_CHUNK_ASM on the GPU (weight: quantize_kernel's MASK_WEIGHT), the same steps
    in Triton under the interpreter (which needs no weight)."""
    nb0, b1, b2, b3 = [tl.broadcast_to(b, w0.shape) for b in (nb0, b1, b2, b3)]
    b4, b5, b6, b7 = [tl.broadcast_to(b, w0.shape) for b in (b4, b5, b6, b7)]
    if NATIVE:
        return tl.inline_asm_elementwise(_E2M1_CHUNK_ASM[XK], "=r" + ",r" * 14,
                                         [w0, w1, w2, w3, nb0, b1, b2, b3, b4, b5, b6, b7,
                                          tl.broadcast_to(weight, w0.shape), tl.broadcast_to(weight * 8, w0.shape)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    lo = _pair_codes(w0, nb0, b1, b2, b3, b4, b5, b6, b7) + (_pair_codes(w1, nb0, b1, b2, b3, b4, b5, b6, b7) << 8)
    hi = _pair_codes(w2, nb0, b1, b2, b3, b4, b5, b6, b7) + (_pair_codes(w3, nb0, b1, b2, b3, b4, b5, b6, b7) << 8)
    even = (lo & 0xFFFF) | (hi << 16)
    odd = ((lo >> 16) & 0xFFFF) | (hi & -65536)
    return even + (odd << 4)


@triton.jit
def amax_kernel(X, AMAX, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROTATION: tl.constexpr = 0):
    """AMAX (int32, zeroed) = float32 bits of max |x| (of max |x R| with a ROTATION, R computed as
    quantize_kernel does): an atomic integer max, which orders non-negative floats as their values."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROTATION:  # tiled as quantize_kernel's whole blocks per thread (runs of R along K for blocks), so
        # that each thread holds whole runs and the butterflies stay in registers
        VEC: tl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth
        runs = tl.program_id(1) * (BLOCK_K // ROTATION) + tl.arange(0, BLOCK_K // ROTATION)
        ks = (runs * ROTATION)[:, None, None, None] + (tl.arange(0, ROTATION // VEC) * VEC)[None, None, :, None] \
            + tl.arange(0, VEC)[None, None, None, :]
        r4 = rows[None, :, None, None]
        x = tl.load(X + r4.to(tl.int64) * stride_xm + ks, mask=(r4 < M) & (ks < K), other=0.0).to(tl.float32)
        amax = tl.max(tl.reshape(tl.abs(_hadamard_rotate(x, ROTATION)), (BLOCK_M * BLOCK_K,)), axis=0)
    else:
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        amax = tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)
    tl.atomic_max(AMAX, amax.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["M", "n_cols"])  # masks and scale offsets only: fewer variants to compile
def quantize_kernel(
    X, DATA, SCALE, G, TABLE, M, K, n_cols, stride_xm, MASK_WEIGHT,
    FMT: tl.constexpr, MODE: tl.constexpr, SWIZZLED: tl.constexpr, NATIVE: tl.constexpr, HW_E4M3: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, SPREAD: tl.constexpr,
    ROTATION: tl.constexpr = 0, XK: tl.constexpr = 0, PACKED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """FMT 0 = NVFP4 (compressed-tensors recipe), 1 = MXFP4, 2 = MXFP8; MODE = _SCALE_MODE_CODE.

    A program quantizes BLOCK_M rows x BLOCKS blocks. Tile element (j, m, c, e) is
    x[row m, (block j) * BLOCK + c * VEC + e]: e runs over one 16-byte load. Triton gives lanes to
    the first dimensions that are not contiguous in memory, so with j first lanes run along K
    blocks (warps along rows) and the chunks c of a block stay in one thread; SPREAD loads and
    stores in (c, j, m, e) order, so lanes run along c first. Stores whose natural vectorization
    differs from the computed layout get contiguity 1 (tl.max_contiguous), which avoids a layout
    conversion through shared memory.
    DATA is int32 (VEC = 8: eight E2M1 codes per word), int16 (VEC = 4) or uint8 (MXFP8).
    NATIVE (False under the interpreter): PTX routines (_e2m1_nibble, _e2m1_chunk, _max16x2), else
    the same steps in Triton. HW_E4M3 (sm_89 and later, not under the interpreter): MXFP8 elements
    through the hardware float8 conversion, else integer arithmetic.
    NVFP4 (TABLE from nvfp4_table_kernel): with PACKED, X is read as int32 words of two 16-bit
    elements of dtype XK and a chunk's 4 words are coded together by comparisons against the
    block's breakpoints (_e2m1_chunk); otherwise float32 elements are divided by the block's
    divisor (below) and coded by _e2m1_nibble. Per element the comparisons take 8 instructions
    for two elements, the division about 12 for one: comparing float32 elements one at a time
    (FSETP and SEL each) would cost more than dividing them.
    MASK_WEIGHT: -(2**16 + 1), _e2m1_chunk's multiplier, passed as an argument so that ptxas does
    not factor the constant out of its sum of multiply-adds.
    ROTATION (16 or 32, 0 for none): quantize x R instead of x (_hadamard_rotate, right after the
    load; without data movement where a thread holds whole blocks, i.e. not SPREAD).
    PDL (NVFP4, launched as a programmatic dependent launch right after nvfp4_table_kernel): x's loads are issued
    while that kernel still runs; G and TABLE are read after griddepcontrol.wait.
    """
    C: tl.constexpr = BLOCK // VEC
    cols = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    chunk = tl.arange(0, C)
    e = tl.arange(0, VEC)
    if PACKED:  # words of two elements: word u of a chunk holds its elements 2u (low half) and 2u + 1
        ks = ((cols * BLOCK)[:, None, None, None] + (chunk * VEC)[None, None, :, None]) // 2 \
            + tl.arange(0, VEC // 2)[None, None, None, :]
        r4 = rows[None, :, None, None]
        w = tl.load(X + r4.to(tl.int64) * stride_xm + ks, mask=(r4 < M) & (ks < K // 2), other=0)
        w0, w1, w2, w3 = _take(w, 0), _take(w, 1), _take(w, 2), _take(w, 3)  # [BLOCKS, BLOCK_M, C]
        amax = _amax_words(w0, w1, w2, w3, XK, NATIVE)
    else:
        if SPREAD:  # load as (c, j, m, e): lanes run along the 16-byte chunks of a row
            ks = (cols * BLOCK)[None, :, None, None] + (chunk * VEC)[:, None, None, None] + e[None, None, None, :]
            r4 = rows[None, None, :, None]
            x = tl.load(X + r4.to(tl.int64) * stride_xm + ks, mask=(r4 < M) & (ks < K), other=0.0)
            x = tl.permute(x, (1, 2, 0, 3)).to(tl.float32)
        else:
            ks = (cols * BLOCK)[:, None, None, None] + (chunk * VEC)[None, None, :, None] + e[None, None, None, :]
            r4 = rows[None, :, None, None]
            x = tl.load(X + r4.to(tl.int64) * stride_xm + ks, mask=(r4 < M) & (ks < K), other=0.0).to(tl.float32)
        if ROTATION:
            x = _hadamard_rotate(x, ROTATION)
        amax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)  # [BLOCKS, BLOCK_M]

    if PDL:
        tl.extra.cuda.gdc_wait()
    # Per block: the scale code, and what coding the elements takes: NVFP4 with PACKED the 8
    # breakpoint pairs, as [BLOCKS, BLOCK_M, 1, 4] twice (shaped as a chunk of words, so that a
    # thread holds them); otherwise dividing by the block's divisor d (x / d is the element before
    # rounding): a power of two p, -d * p, RN(1 / (d * p)) and the sign threshold.
    if FMT == 0:
        s = tl.minimum(tl.div_rn(amax, ELEM_MAX_FP4) * tl.load(G), ELEM_MAX_FP8)
        code = _e4m3_bits(s)
        scale_bits = tl.where(code == 0, NVFP4_ZERO_SCALE_BITS, code)
        if PACKED:
            entry = TABLE + code[:, :, None, None] * TABLE_ROW + tl.arange(0, 4)[None, None, None, :]
            bp_lo, bp_hi = tl.load(entry), tl.load(entry + 4)
        else:
            entry = TABLE + code[:, :, None] * TABLE_ROW + tl.arange(0, 4)[None, None, :]
            even, odd = tl.split(tl.reshape(tl.load(entry).to(tl.float32, bitcast=True), (BLOCKS, BLOCK_M, 2, 2)))
            p, rcp = tl.split(even)
            neg_dd, threshold = tl.split(odd)
            threshold = threshold.to(tl.uint32, bitcast=True)
            clip = (neg_dd * -ELEM_MAX_FP4)[:, :, None, None]  # x / d clipped at 6
    else:
        EMAX: tl.constexpr = 2 if FMT == 1 else 8
        MBITS: tl.constexpr = 1 if FMT == 1 else 3
        ELEM_MAX: tl.constexpr = ELEM_MAX_FP4 if FMT == 1 else ELEM_MAX_FP8
        scale_bits = _e8m0_from_amax(amax, MODE, ELEM_MAX, EMAX, MBITS)
        p = _pow2(-(scale_bits - BIAS))
        threshold = _sign_threshold(_pow2(scale_bits - BIAS))
        clip = ELEM_MAX_FP4

    kp = n_cols * BLOCK  # K padded to whole blocks: padded columns get zero codes
    store_ok = (cols < n_cols)[:, None, None] & (rows < M)[None, :, None]
    if FMT == 2:
        y = x * p[:, :, None, None]
        if HW_E4M3:
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = _e4m3_bits(tl.minimum(tl.maximum(y, -ELEM_MAX_FP8), ELEM_MAX_FP8)).to(tl.uint8)
        offs = (rows[None, :, None, None].to(tl.int64) * kp + (cols * BLOCK)[:, None, None, None]
                + (chunk * VEC)[None, None, :, None] + e[None, None, None, :])
        if SPREAD:
            offs, q, ok = tl.permute(offs, (2, 0, 1, 3)), tl.permute(q, (2, 0, 1, 3)), tl.permute(store_ok, (2, 0, 1))
            tl.store(DATA + offs, q, mask=ok[:, :, :, None])
        else:
            tl.store(DATA + offs, q, mask=store_ok[:, :, :, None])
    else:
        shift = (4 * e)[None, None, None, :]  # code of element e -> nibble e (low nibble = even K)
        if PACKED:
            words = _e2m1_chunk(w0, w1, w2, w3, _take(bp_lo, 0), _take(bp_lo, 1), _take(bp_lo, 2), _take(bp_lo, 3),
                                _take(bp_hi, 0), _take(bp_hi, 1), _take(bp_hi, 2), _take(bp_hi, 3), MASK_WEIGHT, XK,
                                NATIVE)
        else:
            a = tl.abs(x) * p[:, :, None, None]
            # RCEIL and CEIL scales bring every MX |x| * p to at most 6 (RCEIL: times 1 + 2**-23,
            # which still rounds to 6), FLOOR and EVEN not; NVFP4's block scale is rounded to E4M3
            if (FMT == 0) | (MODE == 0) | (MODE == 3):
                a = tl.minimum(a, clip)
            if FMT == 0:  # a = RN(a / (d * p))
                neg_dd = neg_dd[:, :, None, None]
                if NATIVE:
                    rcp = rcp[:, :, None, None]
                    q0 = a * rcp
                    a = tl.fma(tl.fma(q0, neg_dd, a), rcp, q0)
                else:
                    a = tl.div_rn(a, -neg_dd)
            codes = _e2m1_nibble(a, x.to(tl.uint32, bitcast=True), threshold[:, :, None, None], shift, NATIVE)
            words = tl.sum(codes, axis=3) - (WORD_BIAS_8 if VEC == 8 else WORD_BIAS_4)  # [BLOCKS, BLOCK_M, C]
        if VEC == 4:
            words = words.to(tl.int16)
        offs = rows[None, :, None].to(tl.int64) * (kp // VEC) + (cols * C)[:, None, None] + chunk[None, None, :]
        if SPREAD:  # one word per lane, as computed (not the C words of a block in one thread)
            ptrs = tl.max_contiguous(DATA + tl.permute(offs, (2, 0, 1)), [1, 1, 1])
            tl.store(ptrs, tl.permute(words, (2, 0, 1)), mask=tl.permute(store_ok, (2, 0, 1)))
        else:
            tl.store(DATA + offs, words, mask=store_ok)

    # one byte per thread, as computed: contiguity the store would otherwise vectorize over (two
    # blocks of one thread) costs a layout conversion through shared memory
    ptrs = tl.max_contiguous(SCALE + _scale_offsets(rows[None, :], cols[:, None], n_cols, SWIZZLED), [1, 1])
    tl.store(ptrs, scale_bits.to(tl.uint8), mask=(cols < n_cols)[:, None] & (rows < M)[None, :])


def _check_input(x: torch.Tensor):
    check_weight(x, "quantize_gpu: x", finite=False)
    if not (x.is_cuda or _interpreted()):
        raise ValueError(f"quantize_gpu: x must be on a CUDA device, got {x.device}")


def _check_rotation(rotation, spec, k: int):
    if rotation is None:
        return
    if not isinstance(rotation, int) or rotation not in ROTATION_BLOCKS or spec.block % rotation:
        got = rotation if isinstance(rotation, int) else f"a {type(rotation).__name__}"
        raise ValueError(f"quantize_gpu: rotation must be the block size b of the Hadamard rotation, one of "
                         f"{ROTATION_BLOCKS} dividing {spec.name}'s block of {spec.block}; got {got}")
    if k % rotation:
        raise ValueError(f"quantize_gpu: K={k} of x is not a multiple of the rotation block {rotation}")


def _gpu_at_least(device, cc: tuple) -> bool:
    """Whether the kernels run compiled (not under the interpreter) on a GPU of compute capability cc or later."""
    have = None if _interpreted() else compute_capability(device)
    return have is not None and have >= cc


def _hardware_e4m3(device) -> bool:
    """Whether the GPU converts float32 to E4M3 in hardware (sm_89 and later; A100 and older do not,
    and Triton refuses float8e4nv casts there)."""
    return _gpu_at_least(device, (8, 9))


def _packed_words(x: torch.Tensor, spec, rotation) -> bool:
    """Whether NVFP4 reads x as int32 words of two elements (quantize_kernel's PACKED): 16-bit x
    with whole words per row, unrotated, and a GPU that compares bf16 pairs (sm_90; f16 pairs
    everywhere). The interpreter runs the same path with the PTX steps in Triton."""
    if not (spec.global_scale and rotation is None and x.element_size() == 2):
        return False
    if x.shape[1] % 2 or x.stride(0) % 2 or x.data_ptr() % 4:
        return False
    return _interpreted() or x.dtype == torch.float16 or _gpu_at_least(x.device, (9, 0))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _programmatic(device) -> bool:
    """Whether NVFP4's quantize kernel runs as a programmatic dependent launch after the table kernel, its x loads
    overlapping it (griddepcontrol: sm_90 and later, not under the interpreter)."""
    return _gpu_at_least(device, (9, 0))


def _given_global_scale(x: torch.Tensor, global_scale) -> torch.Tensor:
    """A given NVFP4 encode global scale as a float32 1-element tensor on x's device."""
    if not isinstance(global_scale, torch.Tensor):
        g = float(global_scale)
        if not (g > 0 and g != float("inf")):
            raise ValueError(f"quantize_gpu: global_scale must be finite and > 0, got {g}")
    return torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(1)


AMAX_BLOCK_M, AMAX_BLOCK_K = 16, 1024
# (BLOCK_M, BLOCKS, num_warps, SPREAD) per format: lanes run along K blocks (SPREAD: along the 16-byte
# chunks of the blocks), warps and registers along rows
TILE = {"nvfp4": (8, 32, 4, False), "mxfp4": (4, 32, 4, False), "mxfp8": (8, 32, 8, True)}
# with a rotation, whole blocks per thread for MXFP8 too (the butterflies then stay in registers);
# MXFP4's tile, not tuned
ROTATED_TILE = {**TILE, "mxfp8": TILE["mxfp4"]}


def quantize_gpu(x: torch.Tensor, fmt, *, global_scale=None, scale_mode=ScaleMode.RCEIL,
                 scale_layout: str = "swizzled", config=None, rotation: Optional[int] = None) -> QTensor:
    """Quantize x [M, K] (bf16/fp16/fp32, CUDA) along K; bit-identical to the reference quantizer.

    Same result as `quant.quantize(x, fmt, recipe="compressed-tensors", scale_mode=..., global_scale=...,
    scale_layout=...)`. NVFP4's global scale (encode, 448*6/amax) is computed on the GPU when not
    given (one more pass over x); a given tensor is used as is (not checked, to avoid a host
    synchronization). config: (BLOCK_M, BLOCKS, num_warps, SPREAD), for tuning; TILE's (ROTATED_TILE's
    with a rotation) by default.

    rotation: b (16 or 32, dividing the format's block and K) quantizes x R instead, R the block-wise
    Hadamard rotation of quant/hadamard.py, computed in registers (x R never goes to memory); the
    NVFP4 global scale, when computed, is that of x R. The result is the reference's quantization of
    float32 values that the module docstring bounds against exact x R.
    """
    spec = get_format(fmt)
    _check_input(x)
    _check_rotation(rotation, spec, x.shape[1])
    if x.stride(1) != 1:
        x = x.contiguous()
    if scale_layout not in ("linear", "swizzled"):
        raise ValueError(f"quantize_gpu: scale_layout {scale_layout!r} not in ('linear', 'swizzled')")
    if not spec.global_scale and global_scale is not None:
        raise ValueError(f"quantize_gpu: {spec.name} has no global scale; got global_scale={global_scale!r}")
    m, k = x.shape
    kp = padded_k(k, spec.block)
    n_cols = kp // spec.block
    vec = 16 // x.element_size()
    data = torch.empty(m, kp // 2 if spec.packed else kp, dtype=spec.data_dtype, device=x.device)
    if scale_layout == "swizzled":
        shape = swizzled_scale_shape(m, n_cols)
        padded = shape != (m, n_cols)
        scale = (torch.zeros if padded else torch.empty)(shape, dtype=torch.uint8, device=x.device)
    else:
        scale = torch.empty(m, n_cols, dtype=torch.uint8, device=x.device)

    g = table = None
    packed = _packed_words(x, spec, rotation)
    pdl = bool(spec.global_scale) and _programmatic(x.device)
    xk = X_KIND.get(x.dtype, 0)  # read only where packed
    if spec.global_scale:
        table = torch.empty(128, TABLE_ROW.value, dtype=torch.int32, device=x.device)
        if global_scale is None:
            g = torch.empty(1, dtype=torch.float32, device=x.device)
            amax = torch.zeros(1, dtype=torch.int32, device=x.device)
            amax_kernel[(triton.cdiv(m, AMAX_BLOCK_M), triton.cdiv(k, AMAX_BLOCK_K))](
                x, amax, m, k, x.stride(0), BLOCK_M=AMAX_BLOCK_M, BLOCK_K=AMAX_BLOCK_K, ROTATION=rotation or 0,
                num_warps=8)
        else:
            g, amax = _given_global_scale(x, global_scale), None
        nvfp4_table_kernel[(TABLE_PROGRAMS.value,)](g, amax if amax is not None else g, table,
                                                    G_FROM_AMAX=amax is not None, BREAKPOINTS=packed, XK=xk,
                                                    PDL=pdl, num_warps=4)

    block_m, blocks, warps, spread = config or (ROTATED_TILE if rotation else TILE)[spec.name]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n_cols, blocks))
    fmt_code = 0 if spec.global_scale else (1 if spec.packed else 2)
    word = data.view(torch.uint8) if not spec.packed else data.view(torch.int32 if vec == 8 else torch.int16)
    quantize_kernel[grid](
        x.view(torch.int32) if packed else x, word, scale, g if g is not None else scale,
        table if table is not None else scale,
        m, k, n_cols, x.stride(0) // 2 if packed else x.stride(0), -(1 << 16) - 1,
        FMT=fmt_code, MODE=_SCALE_MODE_CODE[ScaleMode(scale_mode)], SWIZZLED=scale_layout == "swizzled",
        NATIVE=not _interpreted(), HW_E4M3=fmt_code == 2 and _hardware_e4m3(x.device),
        BLOCK=spec.block, VEC=vec, BLOCK_M=block_m, BLOCKS=blocks, SPREAD=spread, ROTATION=rotation or 0,
        XK=xk, PACKED=packed, PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )
    return QTensor(data=data, scale=scale.view(spec.scale_dtype), fmt=spec, shape=(m, k),
                   global_scale=None if g is None else g.reshape(()), scale_layout=scale_layout,
                   orig_dtype=x.dtype)
