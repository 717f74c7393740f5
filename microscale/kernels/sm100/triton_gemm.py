"""Blackwell (sm100) block-scaled GEMM in Triton: tcgen05.mma with the scale tables in Tensor Memory.

    y[M, N] = dequant(A)[M, K] @ dequant(W)[N, K]^T * alpha (+ bias),   fp32 accumulation

A holds the activations (quantized on the fly), W the weights (a QTensor prepared once). Both are
K-major: E2M1 packed two per byte (low nibble = even K) or E4M3 one per byte. Scales are one E4M3
(NVFP4, 16 elements) or E8M0 (MX, 32 elements) per block along K. alpha = 1 / (g_A * g_W) folds
the two NVFP4 encode global scales in; the MX formats have none.

The kernel names its MMA operands lhs (the MMA's M side, 128 rows per instruction) and rhs (its N
side). Normally lhs = A and rhs = W. For small M (decode) the roles swap (SWAP_AB): the kernel
computes y^T = W A^T, so the weight rows fill the 128-row M side and the few activation rows sit on
the N side, whose tile can be 32 or 64 wide; the epilogue stores the tile transposed.

Scales: the lhs scales, and the rhs scales unless SWAP_AB, are read by TMA in the 5-D packed view
(rows/128, cols/4, 2, 256) of our 128x4 swizzled bytes (microscale.formats.scale_layout), reshaped
to the (rows/128, cols/4, 32, 4, 4) atoms and permuted to the [rows, cols] tensor tl.dot_scaled
takes. Triton recognises that pattern and copies the tile SMEM -> TMEM with tcgen05.cp; the MMA
then reads its scales from TMEM. In SWAP_AB mode the activation scales ([M, cols], linear layout)
are a [BLOCK_N, cols] pointer load (tcgen05.st through registers): at most 64 rows per tile.

EMULATE_MMA (constexpr) replaces only tl.dot_scaled by an in-register dequantization plus tl.dot
(bf16 operands, fp32 accumulation, exact: every E2M1/E4M3 value times its scale fits bf16). The
same tiling, TMA descriptors, scale views, persistent schedule, masking and epilogue then run on a
Hopper GPU or under TRITON_INTERPRET=1, where tcgen05 does not exist.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...formats.scale_layout import ROW_TILE, swizzled_scale_shape
from ...formats.spec import FormatSpec, get_format
from ...formats.tensor import QTensor

K_ALIGN = 32  # elements: K is zero-padded to this so every TMA row stride is a multiple of 16 bytes
SMALL_M = 64  # M at or below this runs with swapped operands (tcgen05 needs 128 rows on the M side)


# ---- emulated MMA: dequantize in registers ----------------------------------------------------------
@triton.jit
def _e2m1_to_float(codes):
    """E2M1 codes (uint8, low 4 bits) -> float32 through the float32 bit pattern."""
    codes = codes.to(tl.int32)
    exp = (codes >> 1) & 3
    mant = codes & 1
    normal = (((exp + 126) << 23) | (mant << 22)).to(tl.float32, bitcast=True)  # (1 + m/2) 2^(exp-1)
    magnitude = tl.where(exp == 0, mant.to(tl.float32) * 0.5, normal)
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _scale_to_float(scale):
    """Block scales -> float32: E8M0 (uint8) exactly as formats.codec.e8m0_decode, or E4M3."""
    if scale.dtype == tl.uint8:
        bits = scale.to(tl.int32)
        value = tl.where(bits == 0, 0x00400000, bits << 23)  # 2^-127 is a float32 subnormal
        value = tl.where(bits == 0xFF, 0x7FC00000, value)  # E8M0 NaN
        return value.to(tl.float32, bitcast=True)
    else:
        return scale.to(tl.float32)


@triton.jit
def _dequantize_tile(data, scale, FMT: tl.constexpr, VEC: tl.constexpr):
    """[rows, K bytes] codes + [rows, K/VEC] scales -> [rows, K] bfloat16 (exact)."""
    ROWS: tl.constexpr = data.shape[0]
    if FMT == "e2m1":
        codes = tl.join(data & 0xF, data >> 4).reshape(ROWS, data.shape[1] * 2)  # low nibble = even K
        values = _e2m1_to_float(codes)
    else:
        values = data.to(tl.float32)
    COLS: tl.constexpr = values.shape[1]
    factor = tl.broadcast_to(_scale_to_float(scale)[:, :, None], (ROWS, COLS // VEC, VEC)).reshape(ROWS, COLS)
    return (values * factor).to(tl.bfloat16)


@triton.jit
def _mma(acc, lhs, lhs_scale, rhs, rhs_scale, LHS_FMT: tl.constexpr, RHS_FMT: tl.constexpr, VEC: tl.constexpr,
         EMULATE_MMA: tl.constexpr):
    """acc += (lhs * lhs_scale) @ (rhs * rhs_scale)^T; lhs and rhs are K-major tiles."""
    if EMULATE_MMA:
        a = _dequantize_tile(lhs, lhs_scale, LHS_FMT, VEC)
        b = _dequantize_tile(rhs, rhs_scale, RHS_FMT, VEC)
        return tl.dot(a, b.T, acc)
    else:
        return tl.dot_scaled(lhs, lhs_scale, LHS_FMT, rhs.T, rhs_scale, RHS_FMT, acc)


# ---- scale tiles --------------------------------------------------------------------------------
@triton.jit
def _load_swizzled_scales(desc, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] scales starting at (row0, col0) from the 5-D view of the 128x4 swizzled table."""
    packed = desc.load([0, row0 // 128, col0 // 4, 0, 0])  # [1, ROWS/128, COLS/4, 2, 256]
    atoms = packed.reshape(ROWS // 128, COLS // 4, 32, 4, 4)  # (row/128, col/4, row%32, row/32%4, col%4)
    return atoms.trans(0, 3, 2, 1, 4).reshape(ROWS, COLS)


@triton.jit
def _load_linear_scales(ptr, row0, col0, n_rows, n_cols, row_stride, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    raw = tl.load(ptr.to(tl.pointer_type(tl.uint8)) + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0)
    return raw.to(ptr.dtype.element_ty, bitcast=True)  # masked-off scales are 0 (never NaN)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M lhs tiles share each rhs tile while it is in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


# ---- the kernel ---------------------------------------------------------------------------------
@triton.jit
def block_scaled_gemm_kernel(
        lhs_desc, lhs_scale_desc,  # lhs data [rows_lhs, K bytes]; its scales, 5-D swizzled view
        rhs_desc, rhs_scale,  # rhs data; scales: 5-D swizzled view, or pointer to linear [rows_rhs, cols] if SWAP_AB
        out_desc, bias_ptr, lhs_global_ptr, rhs_global_ptr,  # out_desc: y [M, N], block [BLOCK_M, BLOCK_N] or transposed
        rows_lhs, rows_rhs, k, scale_cols,
        LHS_FMT: tl.constexpr, RHS_FMT: tl.constexpr, VEC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, NUM_STAGES: tl.constexpr,
        SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GLOBAL_SCALE: tl.constexpr,
        EMULATE_MMA: tl.constexpr):
    LHS_K_BYTES: tl.constexpr = BLOCK_K // 2 if LHS_FMT == "e2m1" else BLOCK_K
    RHS_K_BYTES: tl.constexpr = BLOCK_K // 2 if RHS_FMT == "e2m1" else BLOCK_K
    SCALE_COLS: tl.constexpr = BLOCK_K // VEC
    tl.static_assert(BLOCK_M == 128, "one tcgen05 instruction covers 128 lhs rows")
    tl.static_assert(SWAP_AB or BLOCK_N % 128 == 0, "swizzled rhs scales come in 128-row atoms")
    tl.static_assert(SCALE_COLS % 4 == 0, "swizzled scales come in 4-column atoms")

    num_pid_m = tl.cdiv(rows_lhs, BLOCK_M)
    num_pid_n = tl.cdiv(rows_rhs, BLOCK_N)
    k_tiles = tl.cdiv(k, BLOCK_K)
    alpha = 1.0
    if HAS_GLOBAL_SCALE:
        alpha = 1.0 / (tl.load(lhs_global_ptr) * tl.load(rhs_global_ptr))

    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row_lhs = pid_m * BLOCK_M
        row_rhs = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, num_stages=NUM_STAGES, warp_specialize=True):
            lhs = lhs_desc.load([row_lhs, ki * LHS_K_BYTES])
            rhs = rhs_desc.load([row_rhs, ki * RHS_K_BYTES])
            lhs_scale = _load_swizzled_scales(lhs_scale_desc, row_lhs, ki * SCALE_COLS, BLOCK_M, SCALE_COLS)
            if SWAP_AB:
                rhs_scale_tile = _load_linear_scales(rhs_scale, row_rhs, ki * SCALE_COLS, rows_rhs, scale_cols,
                                                     scale_cols, BLOCK_N, SCALE_COLS)
            else:
                rhs_scale_tile = _load_swizzled_scales(rhs_scale, row_rhs, ki * SCALE_COLS, BLOCK_N, SCALE_COLS)
            acc = _mma(acc, lhs, lhs_scale, rhs, rhs_scale_tile, LHS_FMT, RHS_FMT, VEC, EMULATE_MMA)

        # epilogue: global scales, bias, cast; TMA store (transposed when SWAP_AB) clips ragged edges
        acc = acc * alpha
        if HAS_BIAS:
            if SWAP_AB:
                offs = row_lhs + tl.arange(0, BLOCK_M)
                acc += tl.load(bias_ptr + offs, mask=offs < rows_lhs, other=0.0).to(tl.float32)[:, None]
            else:
                offs = row_rhs + tl.arange(0, BLOCK_N)
                acc += tl.load(bias_ptr + offs, mask=offs < rows_rhs, other=0.0).to(tl.float32)[None, :]
        tile = acc.to(out_desc.dtype)
        if SWAP_AB:
            out_desc.store([row_rhs, row_lhs], tile.T)
        else:
            out_desc.store([row_lhs, row_rhs], tile)
