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
(bf16 operands, fp32 accumulation, exact: every E2M1/E4M3 value times its scale fits bf16; fp32
operands under TRITON_INTERPRET, whose dot cannot take bf16). The same tiling, TMA descriptors,
scale views, persistent schedule, masking and epilogue then run on a Hopper GPU or on the CPU,
where tcgen05 does not exist. The compiler's sm100-only warp specialization is off there.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...formats.scale_layout import ROW_TILE
from ...formats.spec import FormatSpec, get_format
from ...formats.tensor import QTensor
from ..dispatch import Backend, compute_capability, register
from ..selftest import backend_run_fn, selftest_passed
from .operands import K_ALIGN, ceil_to, check_format_pair, pad_codes, padded_k_bytes, prepare_weight

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
def _dequantize_tile(data, scale, FMT: tl.constexpr, VEC: tl.constexpr, DTYPE: tl.constexpr):
    """[rows, K bytes] codes + [rows, K/VEC] scales -> [rows, K] in DTYPE (exact in bfloat16 and float32)."""
    ROWS: tl.constexpr = data.shape[0]
    if FMT == "e2m1":
        codes = tl.join(data & 0xF, data >> 4).reshape(ROWS, data.shape[1] * 2)  # low nibble = even K
        values = _e2m1_to_float(codes)
    else:
        values = data.to(tl.float32)
    COLS: tl.constexpr = values.shape[1]
    factor = tl.broadcast_to(_scale_to_float(scale)[:, :, None], (ROWS, COLS // VEC, VEC)).reshape(ROWS, COLS)
    return (values * factor).to(DTYPE)


@triton.jit
def _mma(acc, lhs, lhs_scale, rhs, rhs_scale, LHS_FMT: tl.constexpr, RHS_FMT: tl.constexpr, VEC: tl.constexpr,
         EMULATE_MMA: tl.constexpr, EMULATED_DTYPE: tl.constexpr):
    """acc += (lhs * lhs_scale) @ (rhs * rhs_scale)^T; lhs and rhs are K-major tiles."""
    if EMULATE_MMA:
        a = _dequantize_tile(lhs, lhs_scale, LHS_FMT, VEC, EMULATED_DTYPE)
        b = _dequantize_tile(rhs, rhs_scale, RHS_FMT, VEC, EMULATED_DTYPE)
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
# Sizes are not specialized (on value 1 or divisibility by 16): one binary per variant serves every M.
@triton.jit(do_not_specialize=["rows_lhs", "rows_rhs", "k", "scale_cols"])
def block_scaled_gemm_kernel(
        lhs_desc, lhs_scale_desc,  # lhs codes [rows_lhs, K bytes]; its scales in the 5-D swizzled view
        rhs_desc, rhs_scale,  # rhs codes; scales: 5-D swizzled view, or (SWAP_AB) pointer to linear [rows_rhs, cols]
        out_desc,  # y [M, N]; block [BLOCK_M, BLOCK_N // 2], or [BLOCK_N, BLOCK_M] when SWAP_AB
        bias_ptr, lhs_global_ptr, rhs_global_ptr,  # None when absent (bias [N]; fp32 NVFP4 encode scales)
        rows_lhs, rows_rhs, k, scale_cols,  # k: padded K in elements; scale_cols: columns of linear rhs scales
        LHS_FMT: tl.constexpr, RHS_FMT: tl.constexpr, VEC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
        SWAP_AB: tl.constexpr, EMULATE_MMA: tl.constexpr,
        EMULATED_DTYPE: tl.constexpr):  # bfloat16 on a GPU; float32 under TRITON_INTERPRET (no bf16 dot there)
    LHS_K_BYTES: tl.constexpr = BLOCK_K // 2 if LHS_FMT == "e2m1" else BLOCK_K
    RHS_K_BYTES: tl.constexpr = BLOCK_K // 2 if RHS_FMT == "e2m1" else BLOCK_K
    SCALE_COLS: tl.constexpr = BLOCK_K // VEC
    # Two fp32 accumulators (so the epilogue of one tile overlaps the MMAs of the next) need
    # 2 * BLOCK_N of the 512 TMEM columns, and the scale tables need some too.
    SINGLE_ACC: tl.constexpr = 2 * BLOCK_N >= 512
    tl.static_assert(BLOCK_M == 128, "one tcgen05 block-scaled MMA covers 128 lhs rows")
    tl.static_assert(SWAP_AB or BLOCK_N % 128 == 0, "swizzled rhs scales come in 128-row atoms")
    tl.static_assert(SCALE_COLS % 4 == 0, "swizzled scales come in 4-column atoms")

    num_pid_m = tl.cdiv(rows_lhs, BLOCK_M)
    num_pid_n = tl.cdiv(rows_rhs, BLOCK_N)
    k_tiles = tl.cdiv(k, BLOCK_K)
    alpha = 1.0
    if lhs_global_ptr is not None:
        alpha = (1.0 / tl.load(lhs_global_ptr)) * (1.0 / tl.load(rhs_global_ptr))  # g_A * g_W can overflow

    # Persistent over output tiles, NUM_SMS apart. As in Triton's Blackwell persistent matmul, the
    # tile loop is flattened with the K loop into one software pipeline (num_stages TMA buffers)
    # and warp-specialized (TMA-load, MMA and epilogue warps). The epilogue recomputes its tile
    # from its own counter: Blackwell pipelining cannot share a value between prologue and epilogue.
    tile_id_out = tl.program_id(0) - NUM_SMS
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                            warp_specialize=not EMULATE_MMA, disallow_acc_multi_buffer=SINGLE_ACC):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        row_lhs = pid_m * BLOCK_M
        row_rhs = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            lhs = lhs_desc.load([row_lhs, ki * LHS_K_BYTES])
            rhs = rhs_desc.load([row_rhs, ki * RHS_K_BYTES])
            lhs_scale = _load_swizzled_scales(lhs_scale_desc, row_lhs, ki * SCALE_COLS, BLOCK_M, SCALE_COLS)
            if SWAP_AB:
                rhs_scale_tile = _load_linear_scales(rhs_scale, row_rhs, ki * SCALE_COLS, rows_rhs, scale_cols,
                                                     scale_cols, BLOCK_N, SCALE_COLS)
            else:
                rhs_scale_tile = _load_swizzled_scales(rhs_scale, row_rhs, ki * SCALE_COLS, BLOCK_N, SCALE_COLS)
            acc = _mma(acc, lhs, lhs_scale, rhs, rhs_scale_tile, LHS_FMT, RHS_FMT, VEC, EMULATE_MMA, EMULATED_DTYPE)

        # epilogue: global scales, bias, cast; the TMA store clips ragged rows (and columns to 16 bytes)
        tile_id_out += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_out, num_pid_m, num_pid_n, GROUP_M)
        row_lhs = pid_m * BLOCK_M
        row_rhs = pid_n * BLOCK_N
        acc = acc * alpha
        if SWAP_AB:
            if bias_ptr is not None:
                offs = row_lhs + tl.arange(0, BLOCK_M)
                acc += tl.load(bias_ptr + offs, mask=offs < rows_lhs, other=0.0).to(tl.float32)[:, None]
            out_desc.store([row_rhs, row_lhs], acc.to(out_desc.dtype).T)
        else:
            if bias_ptr is not None:
                offs = row_rhs + tl.arange(0, BLOCK_N)
                acc += tl.load(bias_ptr + offs, mask=offs < rows_rhs, other=0.0).to(tl.float32)[None, :]
            # two half-width stores: half the shared-memory staging buffer (the operand stages need it)
            left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
            out_desc.store([row_lhs, row_rhs], left.to(out_desc.dtype))
            out_desc.store([row_lhs, row_rhs + BLOCK_N // 2], right.to(out_desc.dtype))


# ---- tile configurations --------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """One compiled variant. block_m is the lhs (MMA M) tile, block_n the rhs tile."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    swap_ab: bool
    group_m: int = 8


def _k_tile(act: FormatSpec, wt: FormatSpec) -> int:
    """128-byte operand rows (the 128B TMA/MMA swizzle): 256 K for fp4 x fp4, else 128.

    The tcgen05 instruction consumes K=64 (fp4 x fp4) or K=32 (fp8 operand) per issue; fp4 next to
    fp8 (kind::mxf8f6f4) is padded to a byte per element in shared memory, so it counts as 8-bit.
    """
    return 256 if act.packed and wt.packed else 128


def tile_config(act: FormatSpec, wt: FormatSpec, m: int, emulate: bool = False) -> TileConfig:
    """The variant for an [m, K] x [N, K] problem.

    m > SMALL_M: 128 x 256 output tiles, 3 stages: 3 x 54 KB of operand buffers (NVFP4) plus a
    32 KB epilogue buffer fit the 227 KB of shared memory; the single fp32 accumulator takes 256
    of the 512 TMEM columns (two would leave none for the scales).
    m <= SMALL_M: swapped operands; 128 weight rows x 32 or 64 activation rows, 6 stages to keep
    weight bytes in flight (the problem is memory-bound), double-buffered accumulator.
    Emulated (Hopper, interpreter): the same tile with 2 stages, because the dequantized operands
    need shared memory there too.
    """
    swap = m <= SMALL_M
    block_n = (32 if m <= 32 else 64) if swap else 256
    if emulate:
        return TileConfig(128, block_n, _k_tile(act, wt), num_stages=2, num_warps=8, swap_ab=swap)
    return TileConfig(128, block_n, _k_tile(act, wt), num_stages=6 if swap else 3, num_warps=4 if swap else 8,
                      swap_ab=swap)


def all_tile_configs(act: FormatSpec, wt: FormatSpec, emulate: bool = False) -> dict:
    """Every variant the launcher can pick for this format pair, by a representative M."""
    return {name: tile_config(act, wt, m, emulate) for name, m in (("large", SMALL_M + 1), ("swap64", SMALL_M),
                                                                     ("swap32", 32))}


# ---- host side ----------------------------------------------------------------------------------
FORMAT_PAIRS = (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("mxfp8", "mxfp4"))  # (act, weight)
_SUPPORTED_OUT = (torch.bfloat16, torch.float16)


def _codes_desc(data: torch.Tensor, fmt: FormatSpec, rows: int, block_k: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(data, [rows, block_k // 2 if fmt.packed else block_k])


def _swizzled_scale_desc(scale: torch.Tensor, rows: int, block_k: int, fmt: FormatSpec) -> TensorDescriptor:
    """5-D view (1, Rp/128, Cp/4, 2, 256) of the 128x4 swizzled table: one 512-byte atom = 2 x 256."""
    rp, cp = scale.shape
    view = scale.view(1, rp // ROW_TILE, cp // 4, 2, 256)
    return TensorDescriptor.from_tensor(view, [1, rows // ROW_TILE, block_k // fmt.block // 4, 2, 256])


def constexprs(act: FormatSpec, wt: FormatSpec, cfg: TileConfig, num_sms: int, emulate: bool) -> dict:
    """Compile-time arguments of block_scaled_gemm_kernel (shared by the launcher and AOT compiles)."""
    lhs, rhs = (wt, act) if cfg.swap_ab else (act, wt)
    return dict(LHS_FMT=lhs.elem, RHS_FMT=rhs.elem, VEC=act.block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=num_sms,
                SWAP_AB=cfg.swap_ab, EMULATE_MMA=emulate,
                EMULATED_DTYPE=tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16)


def _out_block(cfg: TileConfig) -> tuple:
    """Output TMA box: the transposed tile when swapped, else half a tile (two stores per tile)."""
    return (cfg.block_n, cfg.block_m) if cfg.swap_ab else (cfg.block_m, cfg.block_n // 2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so the persistent loop visits several tiles each


def _output(out: Optional[torch.Tensor], m: int, n: int, dtype, device) -> torch.Tensor:
    """The [M, N] destination of the TMA store: the caller's `out`, or a view of a padded buffer.

    TMA stores write whole 16-byte chunks (triton-lang/triton#11583): when a row of N elements is
    not a multiple of 16 bytes, the columns up to the next 16-byte boundary are written too. So rows
    must own that much room; those extra columns are scratch.
    """
    room = ceil_to(n, 16 // dtype.itemsize)
    if out is None:
        return torch.empty(m, room, dtype=dtype, device=device)[:, :n]
    if (tuple(out.shape) != (m, n) or out.dtype != dtype or out.stride(1) != 1 or out.stride(0) < room
            or (out.stride(0) * dtype.itemsize) % 16 or out.data_ptr() % 16):
        raise ValueError(f"sm100 GEMM: out must be {dtype} [{m}, {n}], unit column stride, 16-byte aligned rows "
                         f"of at least {room} elements (TMA stores write whole 16-byte chunks), got {out.dtype} "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    return out


def block_scaled_gemm(a: QTensor, w_data: torch.Tensor, w_scale: torch.Tensor, w_global: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], *, w_fmt, n: int, out_dtype=torch.bfloat16,
                      out: Optional[torch.Tensor] = None, emulate: bool = False,
                      config: Optional[TileConfig] = None) -> torch.Tensor:
    """y [M, N] = dequant(a) @ dequant(W)^T (+ bias), from quantized activations and a prepared weight.

    a: activations [M, K] as a QTensor in either scale layout (converted if the tile wants the other).
    w_data, w_scale, w_global: from prepare_weight. out: optional [M, N] destination, a view of rows
    at least ceil(N, 16 bytes) long (the columns past N up to that boundary are scratch).
    emulate: the EMULATE_MMA kernel (any sm90+ GPU, or TRITON_INTERPRET=1 on CPU tensors).
    Returns out_dtype (bf16 or fp16) [M, N], contiguous unless `out` was given.
    """
    act, wt = check_format_pair(a.fmt, w_fmt)
    m, k = a.shape
    if out_dtype not in _SUPPORTED_OUT:
        raise ValueError(f"sm100 GEMM: out_dtype {out_dtype} not in {_SUPPORTED_OUT}")
    if tuple(w_data.shape) != (n, padded_k_bytes(k, wt)):
        raise ValueError(f"sm100 GEMM: prepared weight codes of shape {tuple(w_data.shape)} do not match "
                         f"N={n}, K={k} ({wt.name}); expected {(n, padded_k_bytes(k, wt))} from prepare_weight")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"sm100 GEMM: bias of shape {tuple(bias.shape)}, expected ({n},)")
    cfg = config or tile_config(act, wt, m, emulate)
    a = a.with_scale_layout("linear" if cfg.swap_ab else "swizzled")
    y = _output(out, m, n, out_dtype, a.data.device)
    out_desc = TensorDescriptor(y, [m, n], [y.stride(0), 1], list(_out_block(cfg)))
    a_data = pad_codes(a.data, act)
    weight_rows, act_rows = (cfg.block_m, cfg.block_n) if cfg.swap_ab else (cfg.block_n, cfg.block_m)
    weight = (_codes_desc(w_data, wt, weight_rows, cfg.block_k),
              _swizzled_scale_desc(w_scale, weight_rows, cfg.block_k, wt))
    if cfg.swap_ab:
        activation = (_codes_desc(a_data, act, act_rows, cfg.block_k), a.scale.contiguous())
        operands, rows = (*weight, *activation), (n, m)
    else:
        activation = (_codes_desc(a_data, act, act_rows, cfg.block_k),
                      _swizzled_scale_desc(a.scale, act_rows, cfg.block_k, act))
        operands, rows = (*activation, *weight), (m, n)
    num_sms = _num_sms(a.data.device)
    tiles = triton.cdiv(rows[0], cfg.block_m) * triton.cdiv(rows[1], cfg.block_n)
    block_scaled_gemm_kernel[(min(tiles, num_sms),)](
        *operands, out_desc, bias, a.global_scale, w_global, *rows, ceil_to(k, K_ALIGN), a.scale_cols,
        **constexprs(act, wt, cfg, num_sms, emulate), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y if out is not None else y.contiguous()


# ---- the sm100-triton backend ---------------------------------------------------------------------
BACKEND_NAME = "sm100-triton"
EMULATE_ENV = "MICROSCALE_SM100_EMULATE"  # "1": emulated MMA, and the backend is offered on any sm90+ GPU


def _emulate_forced() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def _gemm(x2d, data, scale, global_scale, bias, *, fmt, n, k, options):
    """W4A4 / W8A8: the activations are quantized per call to options["activations"] (required);
    NVFP4 with the static encode scale options["input_global_scale"] when given."""
    from ..quantize import quantize_gpu  # the activation quantizer lives with the Hopper kernels

    act = (options or {}).get("activations")
    pairs = [f"{a} x {w}" for a, w in FORMAT_PAIRS]
    if act is None or (get_format(act).name, get_format(fmt).name) not in FORMAT_PAIRS:
        raise ValueError(f"{BACKEND_NAME} runs quantized activations only: pass options={{'activations': ...}} "
                         f"with one of (activations x weights) {pairs}; got {act!r} x {fmt}")
    if x2d.dim() != 2 or x2d.shape[1] != k:
        raise ValueError(f"{BACKEND_NAME}: activations of shape {tuple(x2d.shape)} do not match K={k}")
    act, wt = check_format_pair(act, fmt)
    m = x2d.shape[0]
    if m == 0:
        return x2d.new_empty(0, n)
    emulate = _emulate_forced()
    cfg = tile_config(act, wt, m, emulate)
    a = quantize_gpu(x2d, act, global_scale=options.get("input_global_scale"),
                     scale_layout="linear" if cfg.swap_ab else "swizzled")
    out_dtype = x2d.dtype if x2d.dtype in _SUPPORTED_OUT else torch.bfloat16
    y = block_scaled_gemm(a, data, scale, global_scale, bias, w_fmt=wt, n=n, out_dtype=out_dtype,
                          emulate=emulate, config=cfg)
    return y.to(x2d.dtype)


def _available(device) -> bool:
    """sm100 (or any sm90+ GPU with the emulated MMA forced), and the first-use self-test passed."""
    cc = compute_capability(device)
    emulate = _emulate_forced()
    if cc is None or not (cc[0] == 10 or (emulate and cc[0] >= 9)):
        return False
    name = BACKEND_NAME + (" (emulated MMA)" if emulate else "")
    return selftest_passed(name, backend_run_fn(BACKEND), device, FORMAT_PAIRS)


BACKEND = register(Backend(
    name=BACKEND_NAME,
    formats=frozenset({"nvfp4", "mxfp4", "mxfp8"}),
    available=_available,
    prepare=prepare_weight,
    gemm=_gemm,
    options=frozenset({"activations", "input_global_scale"}),
    requires=frozenset({"activations"}),
))


# ---- ahead-of-time compilation (no GPU needed): CI checks and the resource table --------------------
_TRITON_TYPE = {torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float32: "fp32"}
B200_SMS = 148


def aot_compile(act, wt, cfg: TileConfig, *, emulate: bool = False, capability: int = 100,
                out_dtype=torch.bfloat16, num_sms: int = B200_SMS):
    """triton.compile the variant the launcher would run, for GPUTarget("cuda", capability, 32).

    The signature mirrors block_scaled_gemm's arguments (with a bias); returns the CompiledKernel
    (asm["ptx"], asm["cubin"], metadata.shared, metadata.tmem_size).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    act, wt = check_format_pair(act, wt)
    lhs, rhs = (wt, act) if cfg.swap_ab else (act, wt)
    scale = _TRITON_TYPE[act.scale_dtype]
    k_scale_atoms = cfg.block_k // act.block // 4

    def codes(fmt, rows):
        return f"tensordesc<{_TRITON_TYPE[fmt.data_dtype]}[{rows},{cfg.block_k // 2 if fmt.packed else cfg.block_k}]>"

    def swizzled(rows):
        return f"tensordesc<{scale}[1,{rows // ROW_TILE},{k_scale_atoms},2,256]>"

    out_block = _out_block(cfg)
    signature = {
        "lhs_desc": codes(lhs, cfg.block_m), "lhs_scale_desc": swizzled(cfg.block_m),
        "rhs_desc": codes(rhs, cfg.block_n), "rhs_scale": f"*{scale}" if cfg.swap_ab else swizzled(cfg.block_n),
        "out_desc": f"tensordesc<{_TRITON_TYPE[out_dtype]}[{out_block[0]},{out_block[1]}]>",
        "bias_ptr": f"*{_TRITON_TYPE[out_dtype]}",
        "lhs_global_ptr": "*fp32" if act.global_scale else "constexpr",
        "rhs_global_ptr": "*fp32" if act.global_scale else "constexpr",
        "rows_lhs": "i32", "rows_rhs": "i32", "k": "i32", "scale_cols": "i32",
    }
    consts = constexprs(act, wt, cfg, num_sms, emulate)
    if not act.global_scale:
        consts.update(lhs_global_ptr=None, rhs_global_ptr=None)
    signature.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(block_scaled_gemm_kernel, signature=signature, constexprs=consts),
                          target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
