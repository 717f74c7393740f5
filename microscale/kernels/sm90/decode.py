"""Decode GEMM (small M) for Hopper: weights dequantized in registers straight into mma.sync.

    y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  fp32 accumulation, M <= 64

Written in Gluon (Triton's explicit-layout dialect) because the whole point is register layout:
the weight tile is loaded in the pre-shuffled layout of layout.py (one 16-byte load per thread and
K step), turned into bf16 by one inline-PTX routine per 32-bit word (masks and shifts into bf16x2,
then one packed multiply by the block scale), and handed to the MMA as its A operand without any
data movement: every `convert_layout(..., assert_trivial=True)` below is checked by the compiler to
be a renaming. The MMA computes y^T = W x^T (weights on the 16-row side, the few activation rows on
the 8/16-wide side), so M = 1 costs as little tensor-core work as M = 8.

The grid is (M tiles, N tiles, K splits). With K split in SPLIT parts, each program writes its fp32
partial tile to a workspace and takes a ticket; the last program of a tile sums the partials in
split order (deterministic), applies the per-row factor and bias, writes y, and resets the ticket.
With GATED the weight holds gate/up row pairs (kernels/gated.py) and the epilogue stores
silu(gate) * up, N / 2 outputs.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import layout as hopper_layout

ROW_GROUP = gl.constexpr(hopper_layout.ROW_GROUP)
K_STEP = gl.constexpr(hopper_layout.K_STEP)

FMT_CODE = {"nvfp4": 0, "mxfp4": 1, "mxfp8": 2}
FMT_NAME = {code: name for name, code in FMT_CODE.items()}
# bytes of one row group and K step in the prepared buffer, words and scales (layout.step_bytes), by format code
_STEP_BYTES = gl.constexpr(tuple(sum(hopper_layout.step_bytes(FMT_NAME[code])) for code in sorted(FMT_NAME)))

# E2M1 word -> 4 bf16x2 registers (layout.FP4_BITS), each times the block scale s' (exact products; an
# fma with -0 rather than mul.bf16x2, which needs sm_90, so the kernel also runs on sm_80).
# s' (bf16x2) = code * MUL + ADD: NVFP4 0x00100010 / 0x75807580 (layout.NVFP4_SCALE_BASE), MX 0x00800080 / 0.
_FP4_DECODE = """{{
.reg .b32 s, t, z;
mov.b32 z, 0x80008000;
mad.lo.u32 s, {s}, {mul}, {add};
and.b32 {o0}, {w}, 0x81C081C0;
shf.l.wrap.b32 t, {w}, {w}, 10;
and.b32 {o1}, t, 0x81C081C0;
shf.l.wrap.b32 t, {w}, {w}, 13;
and.b32 {o2}, t, 0x81C081C0;
and.b32 t, {w}, 0x001B001B;
mul.lo.u32 t, t, 0x1084;
and.b32 {o3}, t, 0x81C081C0;
fma.rn.bf16x2 {o0}, {o0}, s, z;
fma.rn.bf16x2 {o1}, {o1}, s, z;
fma.rn.bf16x2 {o2}, {o2}, s, z;
fma.rn.bf16x2 {o3}, {o3}, s, z;
}}"""
# E4M3 word (layout.FP8_BITS) -> 2 bf16x2 registers holding value * 2**-120, times s' = 2**(code - 127).
# Register 1 first: in this order ptxas schedules the decode kernel's MXFP8 loop 1-12% faster at M <= 8
# (H200, sweep_h200.json run 16c) than with register 0 first, for the same instructions.
_FP8_DECODE = """{{
.reg .b32 s, t, u, z;
mov.b32 z, 0x80008000;
mul.lo.u32 s, {s}, 8388736;
shl.b32 t, {w}, 4;
shr.u32 u, {w}, 4;
and.b32 t, t, 0x80F080F0;
and.b32 u, u, 0x07000700;
or.b32 {o1}, t, u;
and.b32 {o0}, {w}, 0x87F087F0;
fma.rn.bf16x2 {o1}, {o1}, s, z;
fma.rn.bf16x2 {o0}, {o0}, s, z;
}}"""


def decode_ptx(fmt_code: int, operands: dict) -> str:
    """The decode routine of a format as PTX, its operands named by `operands`: o0..o3 (FP4) or o0, o1
    (MXFP8) the bf16x2 outputs, w the word, s the block's scale code. The Triton kernels here and the
    CUDA kernel of wgmma_ws.py use the same routine."""
    if fmt_code == FMT_CODE["mxfp8"]:
        return _FP8_DECODE.format(**operands)
    mul, add = (0x00100010, hopper_layout.NVFP4_SCALE_BASE * 0x00010001) if fmt_code == FMT_CODE["nvfp4"] else (0x00800080, 0)
    return _FP4_DECODE.format(mul=mul, add=add, **operands)


# inline_asm_elementwise operands: pack 8 (FP4) or 4 (FP8) copies of the word, then of the scale
_NVFP4_ASM = gl.constexpr(decode_ptx(0, dict(o0="$0", o1="$1", o2="$2", o3="$3", w="$4", s="$12")))
_MXFP4_ASM = gl.constexpr(decode_ptx(1, dict(o0="$0", o1="$1", o2="$2", o3="$3", w="$4", s="$12")))
_MXFP8_ASM = gl.constexpr(decode_ptx(2, dict(o0="$0", o1="$1", w="$2", s="$6")))


@gluon.constexpr_function
def _x_load_layout(NW, U, BMX):
    """Activation tile [BMX, U*64] in physical K order: 16 consecutive k per thread (two 16-byte loads),
    lanes 4 along K and 8 along M, the same tile in every warp; the register bits are the MMA B
    operand's (layout.py: physical k = 16t + 8 i2 + 4 i1 + 2 khi + i0), only in another order."""
    reg = [[0, 1], [0, 2], [0, 4], [0, 8]]
    reg += [[0, 64 << j] for j in range(U.bit_length() - 1)]
    reg += [[8 << j, 0] for j in range((BMX // 8).bit_length() - 1)]
    lanes = [[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]]
    warps = [[0, 0] for _ in range(NW.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lanes, warps, [], [BMX, U * 64])


@gluon.jit
def _x_to_operand(x, U: gl.constexpr, BMX: gl.constexpr, b_layout: gl.constexpr):
    """[BMX, U*64] activations in physical K order -> the MMA B operand [U*64, BMX] in logical order."""
    x = x.reshape(BMX, U, 4, 2, 2, 2, 2).permute(0, 1, 5, 2, 3, 4, 6).reshape(BMX, U * 64)
    return gl.convert_layout(x.permute(1, 0), b_layout, assert_trivial=True)


@gluon.jit
def _tile_index(layout: gl.constexpr, RG: gl.constexpr, U: gl.constexpr, LAST: gl.constexpr):
    """Index vectors over the 4 dims of a [RG, U, 32, LAST] per-lane tile in `layout`."""
    i0 = gl.arange(0, RG, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    i1 = gl.arange(0, U, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
    i2 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
    i3 = gl.arange(0, LAST, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    return i0[:, None, None, None], i1[None, :, None, None], i2[None, None, :, None], i3[None, None, None, :]


@gluon.jit
def _to_rows(t, RG: gl.constexpr, U: gl.constexpr, WORDS: gl.constexpr):
    """Word tile [RG, U, 32 lanes, WORDS] -> [RG*16, U*8 (FP4) | U*16 (FP8)] in the MMA's row/k order.

    row = 16 rg + 8 rsel + g; column = 8u + 4 khi + t (FP4) or 16u + 8 khi + 2t + k4 (FP8).
    """
    if WORDS == 4:
        t = t.reshape(RG, U, 8, 4, 2, 2).permute(0, 5, 2, 1, 4, 3)  # rg, rsel, g, u, khi, t
        return t.reshape(RG * ROW_GROUP, U * 8)
    else:
        t = t.reshape(RG, U, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6)  # rg, rsel, g, u, khi, t, k4
        return t.reshape(RG * ROW_GROUP, U * 16)


@gluon.jit
def _scales_to_rows(s, RG: gl.constexpr, U: gl.constexpr):
    """Scale tile [RG, U, 32 lanes, 2 rsel] -> int32 [RG*16, U*8], column 8u + 4 khi + t (same for both khi)."""
    s = s.reshape(RG, U, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(RG * ROW_GROUP, U, 4).to(gl.int32)
    s = gl.join(s, s).permute(0, 1, 3, 2)  # rows, u, khi, t
    return s.reshape(RG * ROW_GROUP, U * 8)


@gluon.jit
def _repeat_minor(t, TIMES: gl.constexpr):
    """[R, C] -> [R, C * TIMES], each element repeated in TIMES adjacent registers (no data movement)."""
    t = gl.join(t, t)
    if TIMES >= 4:
        t = gl.join(t, t)
    if TIMES == 8:
        t = gl.join(t, t)
    return t.reshape(t.shape[0], t.shape[1] * TIMES)


@gluon.jit
def _dequant_tile(w, s, FMT: gl.constexpr, RG: gl.constexpr, U: gl.constexpr):
    """Loaded word and scale tiles -> the weight tile [RG*16, U*64] in bf16, times s' per block."""
    s = _scales_to_rows(s, RG, U)
    if FMT == 2:
        w = _repeat_minor(_to_rows(w, RG, U, 8), 4)
        s = gl.convert_layout(_repeat_minor(_repeat_minor(s, 2), 4), w.type.layout, assert_trivial=True)
        return gl.inline_asm_elementwise(_MXFP8_ASM, "=r,=r,r,r,r,r,r,r,r,r", [w, s], dtype=gl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        w = _repeat_minor(_to_rows(w, RG, U, 4), 8)
        s = gl.convert_layout(_repeat_minor(s, 8), w.type.layout, assert_trivial=True)
        asm: gl.constexpr = _NVFP4_ASM if FMT == 0 else _MXFP4_ASM
        return gl.inline_asm_elementwise(asm, "=r,=r,=r,=r," + "r," * 15 + "r", [w, s], dtype=gl.bfloat16,
                                         is_pure=True, pack=8)


@gluon.jit
def _weight_tile_pointers(W, S, pid_n, KT, FMT: gl.constexpr, NW: gl.constexpr, RG: gl.constexpr, U: gl.constexpr,
                          KP: gl.constexpr = 1, part_steps=0):
    """Base pointers of row tile pid_n and per-lane offsets of its word tile [RG, U, 32, WORDS] (int32)
    and scale tile [RG, U, 32, 2] (bytes) within one K step; _load_w adds the K step.

    With KP K parts, tile row group rg = r NW + w (rep r of warp w) is row group (r // KP) NW + w of
    the RG // KP the program covers, at K step offset (r % KP) * part_steps."""
    WORDS: gl.constexpr = 8 if FMT == 2 else 4  # int32 words per lane and K step
    STEP: gl.constexpr = _STEP_BYTES[FMT]  # words and scales of a row group and K step (layout.prepared_views)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, WORDS], [1, 1, 32, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 1, 32, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    w_rg, w_u, w_lane, w_q = _tile_index(w_layout, RG, U, WORDS)
    w_off = (_part_row_group(w_rg, NW, KP) * KT + _part_of(w_rg, NW, KP) * part_steps + w_u) * (STEP // 4) \
        + w_lane * WORDS + w_q
    s_rg, s_u, s_lane, s_rsel = _tile_index(s_layout, RG, U, 2)
    if FMT != 0:
        s_lane = (s_lane >> 2) * 2 + ((s_lane & 3) >> 1)  # lanes 2j, 2j+1 share a block of 32
    s_off = (_part_row_group(s_rg, NW, KP) * KT + _part_of(s_rg, NW, KP) * part_steps + s_u) * STEP \
        + s_lane * 2 + s_rsel
    W_base = W.to(gl.pointer_type(gl.int32)) + (pid_n * (RG // KP)).to(gl.int64) * KT * (STEP // 4)
    S_base = S + (pid_n * (RG // KP)).to(gl.int64) * KT * STEP
    return W_base, w_off, S_base, s_off


@gluon.jit
def _part_of(rg, NW: gl.constexpr, KP: gl.constexpr):
    """K part of tile row group rg = r NW + w: r % KP."""
    return (rg // NW) % KP


@gluon.jit
def _part_row_group(rg, NW: gl.constexpr, KP: gl.constexpr):
    """Row group (of the program's RG // KP) of tile row group rg = r NW + w: (r // KP) NW + w."""
    return (rg // (NW * KP)) * NW + rg % NW


@gluon.jit
def _sum_parts(acc, NW: gl.constexpr, KP: gl.constexpr):
    """acc [RG*16, KP*MP] of a program with K parts: rows (r, w, i) of part r % KP times activation
    columns (p, m) of part p -> y^T tile [RG/KP*16, MP], the sum over p of the rows of part p times the
    columns of part p. Registers and lanes only: a thread holds every rep of its rows."""
    ROWS: gl.constexpr = acc.shape[0]
    MP: gl.constexpr = acc.shape[1] // KP
    layout: gl.constexpr = acc.type.layout
    row = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    col = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    own = _part_of(row // ROW_GROUP, NW, KP)[:, None] == (col // MP)[None, :]
    acc = gl.where(own, acc, 0.0).reshape(ROWS // (KP * NW * ROW_GROUP), KP, NW * ROW_GROUP, KP, MP)
    return gl.sum(gl.sum(acc, axis=3), axis=1).reshape(ROWS // KP, MP)


@gluon.jit
def _load_w(W_base, w_off, S_base, s_off, kt, FMT: gl.constexpr):
    """The word and scale tiles of K steps kt .. kt+U-1, marked evict-first: weights are read once, and
    keeping them from pushing the activations and other lines out of L2 measured 3-15% faster."""
    STEP: gl.constexpr = _STEP_BYTES[FMT]
    return (gl.load(W_base + w_off + kt * (STEP // 4), eviction_policy="evict_first"),
            gl.load(S_base + s_off + kt * STEP, eviction_policy="evict_first"))


@gluon.jit
def _wait_prior_grid():
    """griddepcontrol.wait (ptx_common.cuh's wait_prior_grid; sm_90+): under a programmatic dependent launch
    (PDL), the kernel before this one has completed and its writes are visible after it."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_dependents():
    """griddepcontrol.launch_dependents: the next kernel may launch before this one ends."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _mma_step(acc, w, s, x_ptr, x_k, kt, K, FMT: gl.constexpr, RG: gl.constexpr, U: gl.constexpr,
              a_layout: gl.constexpr, b_layout: gl.constexpr, FULL_K: gl.constexpr):
    """acc += dequant(W tile) @ x tile^T for K steps kt .. kt+U-1.

    x comes from L2 and is loaded here rather than prefetched: its latency hides behind the decode,
    and a prefetched activation tile would hold BMX rows of registers even for M = 1. Rows past M
    read row M - 1 again (x_ptr), so no load is masked by row; columns past K (only when K is not
    the padded K, FULL_K false) must be zeros, as they meet zero weights: x_k [BMX, BK] is each
    element's true k at step 0.
    """
    k0 = kt * K_STEP
    if FULL_K:
        x = gl.load(x_ptr + k0)
    else:
        x = gl.load(x_ptr + k0, mask=(x_k + k0 < K), other=0.0)
    a = gl.convert_layout(_dequant_tile(w, s, FMT, RG, U), a_layout, assert_trivial=True)
    x_hi = x.to(gl.bfloat16)
    acc = gl.nvidia.ampere.mma_v2(a, _x_to_operand(x_hi, U, x.shape[0], b_layout), acc)
    if x.dtype != gl.bfloat16:
        # fp16 (or fp32) activations: add the bf16 rounding residual, exact for fp16
        x_lo = (x.to(gl.float32) - x_hi.to(gl.float32)).to(gl.bfloat16)
        acc = gl.nvidia.ampere.mma_v2(a, _x_to_operand(x_lo, U, x.shape[0], b_layout), acc)
    return acc


@gluon.jit
def decode_gemm_kernel(
    X, W, S, ROW_MULT, BIAS, Y, WS, TICKETS,
    M, N, K, KT, steps_per_split, n_split, stride_xm, stride_ym,
    FMT: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
    NW: gl.constexpr, R: gl.constexpr, U: gl.constexpr, BMX: gl.constexpr, DEPTH: gl.constexpr,
    FULL_K: gl.constexpr, KP: gl.constexpr, PDL: gl.constexpr = False, GATED: gl.constexpr = False,
):
    RG: gl.constexpr = NW * R  # 16-row groups of the MMA tile: RG // KP of the weight, KP K parts each
    BN: gl.constexpr = RG * ROW_GROUP
    BK: gl.constexpr = U * K_STEP
    MP: gl.constexpr = BMX // KP  # activation rows per program

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    x_layout: gl.constexpr = _x_load_layout(NW, U, BMX)

    pid_m = gl.program_id(0)  # fastest: the m tiles of a weight tile run together and share its L2 lines
    pid_n = gl.program_id(1)
    pid_s = gl.program_id(2)
    # K steps are counted within a part: part p adds p * part_steps in the pointers
    part_steps = KT // KP
    k_begin = pid_s * steps_per_split
    k_end = gl.minimum(k_begin + steps_per_split, part_steps)
    n_iter = gl.maximum(k_end - k_begin, 0) // U
    k_last = gl.maximum(k_end - U, 0)

    W_base, w_off, S_base, s_off = _weight_tile_pointers(W, S, pid_n, KT, FMT, NW, RG, U, KP, part_steps)

    # activation column c of the MMA is row m = pid_m * MP + c % MP of x, in K part c // MP
    x_c = gl.arange(0, BMX, layout=gl.SliceLayout(1, x_layout))
    x_m = pid_m * MP + x_c % MP
    x_k = (x_c // MP * (part_steps * K_STEP))[:, None] + gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))[None, :]
    # rows past M repeat row M - 1: their columns of acc are never stored, and unmasked loads need
    # neither predicates nor zeroed registers
    x_ptr = X + gl.minimum(x_m, M - 1)[:, None].to(gl.int64) * stride_xm + x_k

    # K loop with DEPTH weight tiles in flight: each step issues the load DEPTH tiles ahead and consumes
    # the oldest. The trip is unrolled DEPTH times; as DEPTH + 1 tiles are live while a load is issued,
    # the SASS copies the loaded tiles into place at the back edge, each copy waiting for its load in
    # the trip that issued it (docs/hopper.md; unrolled DEPTH + 1 times, without the copies, it measured
    # no faster: branch decode-unroll-rotation).
    # Loads past the split end re-read its last tile (clamped) and are never used.
    tiles = ()
    for j in gl.static_range(DEPTH):
        tiles = tiles + (_load_w(W_base, w_off, S_base, s_off, gl.minimum(k_begin + j * U, k_last), FMT),)
    if PDL:  # no kernel writes the weights: their first tiles load while the kernel before this one finishes
        _wait_prior_grid()
    acc = gl.zeros([BN, BMX], gl.float32, layout=mma)
    for i in range(n_iter // DEPTH):
        kt = k_begin + i * (DEPTH * U)
        for j in gl.static_range(DEPTH):
            nxt = _load_w(W_base, w_off, S_base, s_off, gl.minimum(kt + (j + DEPTH) * U, k_last), FMT)
            w, s = tiles[0]
            acc = _mma_step(acc, w, s, x_ptr, x_k, kt + j * U, K, FMT, RG, U, a_layout, b_layout,
                            FULL_K)
            tiles = tiles[1:] + (nxt,)
    kt = k_begin + (n_iter // DEPTH) * (DEPTH * U)
    for j in gl.static_range(DEPTH - 1):
        if j < n_iter % DEPTH:
            w, s = tiles[j]
            acc = _mma_step(acc, w, s, x_ptr, x_k, kt + j * U, K, FMT, RG, U, a_layout, b_layout,
                            FULL_K)

    if PDL:
        _release_dependents()  # the fix-up and the stores overlap the next kernel's launch
    if KP > 1:
        acc = _sum_parts(acc, NW, KP)
    _finish(acc, ROW_MULT, BIAS, Y, WS, TICKETS, M, N, stride_ym, pid_m, pid_n, pid_s, n_split, HAS_BIAS, SPLIT,
            GATED)


@gluon.constexpr_function
def _fixup_layout(BN, BM, NW):
    """Layout of the output tile [BN, BM] for the split-K fix-up and the epilogue: 4 consecutive rows n
    per thread, lanes along n first. The workspace holds each partial tile m-major, so every access
    is a 16-byte vector and a warp's accesses are contiguous (y's rows too, in 8-byte pieces)."""
    lanes_n = min(32, BN // 4)
    return gl.BlockedLayout([4, 1], [lanes_n, 32 // lanes_n], [1, NW], [0, 1])


@gluon.jit
def _finish(acc, ROW_MULT, BIAS, Y, WS, TICKETS, M, N, stride_ym, pid_m, pid_n, pid_s, n_split,
            HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, GATED: gl.constexpr = False):
    """y^T tile (pid_n, pid_m) = acc (times row_mult, plus bias). With SPLIT, acc is this program's
    partial over its K range: it goes to the workspace WS, and the last program of the tile (ticket
    n_split - 1) sums the partials in split order (deterministic), writes y and resets the ticket.

    WS holds per tile and split one [BM, BN] partial, m-major (launch.split_workspace_elems). Tiles
    wider than 8 columns go through _fixup_layout first: read in the MMA's layout, one scattered 4-byte
    access per element, the fix-up took up to 6 us per call (M = 16, 4096 x 14336, 17 splits: 20.1 us
    against 13.9 us with none, session 12). The 8-column tile of M <= 8 stays in the MMA's layout: the
    shared memory of the conversion made MXFP8 at M = 1-4 (8 programs per SM) 3-15% slower."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    if BM > 8:
        acc = gl.convert_layout(acc, _fixup_layout(BN, BM, gl.num_warps()))
    layout: gl.constexpr = acc.type.layout
    if SPLIT:
        n_loc = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        m_loc = gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
        tile = pid_n * gl.num_programs(0) + pid_m
        part = WS + (tile * n_split).to(gl.int64) * (BN * BM) + (m_loc * BN)[None, :] + n_loc[:, None]
        m_ok = (pid_m * BM + m_loc < M)[None, :]  # rows n are padded to the tile: only columns past M are masked
        gl.store(part + pid_s * (BN * BM), acc, mask=m_ok)
        gl.thread_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = gl.atomic_add(TICKETS + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == n_split - 1:
            acc = _sum_partials(part, m_ok, n_split, acc)
            _epilogue(acc, ROW_MULT, BIAS, Y, pid_n, pid_m, M, N, stride_ym, HAS_BIAS, GATED)
            gl.store(TICKETS + tile, 0)
    else:
        _epilogue(acc, ROW_MULT, BIAS, Y, pid_n, pid_m, M, N, stride_ym, HAS_BIAS, GATED)


@gluon.jit
def _sum_partials(part, m_ok, n_split, acc):
    """The sum of the n_split partial tiles at part, in split order. Several are read at once (one read
    per split is a chain of L2 round trips); reads past the last split repeat it and are not added."""
    # at most 64 registers of partials per thread
    LOADS: gl.constexpr = max(1, min(8, 64 * 32 * gl.num_warps() // (acc.shape[0] * acc.shape[1])))
    total = gl.zeros_like(acc)
    for s0 in range(0, n_split, LOADS):
        parts = ()
        for j in gl.static_range(LOADS):
            s = gl.minimum(s0 + j, n_split - 1)
            parts = parts + (gl.load(part + s * (acc.shape[0] * acc.shape[1]), mask=m_ok, other=0.0,
                                     cache_modifier=".cg"),)
        for j in gl.static_range(LOADS):
            if s0 + j < n_split:
                total += parts[j]
    return total


@gluon.jit
def _epilogue(acc, ROW_MULT, BIAS, Y, pid_n, pid_m, M, N, stride_ym, HAS_BIAS: gl.constexpr, GATED: gl.constexpr):
    """y^T tile (pid_n, pid_m) = acc times row_mult, plus bias; with GATED, silu(gate) * up of the tile's
    gate/up row pairs (rows 16 a + i and 16 a + 8 + i: register pairs of the MMA layout, which acc keeps
    up to 8 columns), N / 2 outputs."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    n_idx = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc.type.layout))
    n_ok = n_idx < N
    acc = acc * gl.load(ROW_MULT + n_idx, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += gl.load(BIAS + n_idx, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    if GATED:
        gate, up = gl.split(acc.reshape(BN // 16, 2, 8, BM).permute(0, 2, 3, 1))
        _store_tile((gate / (1.0 + gl.exp(-gate)) * up).reshape(BN // 2, BM), Y, pid_n, pid_m, M, N // 2, stride_ym)
    else:
        _store_tile(acc, Y, pid_n, pid_m, M, N, stride_ym)


@gluon.jit
def _store_tile(acc, Y, pid_n, pid_m, M, N, stride_ym):
    """Y[m, n] = acc[n - pid_n BN, m - pid_m BM] for the tile's n < N, m < M."""
    layout: gl.constexpr = acc.type.layout
    n_idx = pid_n * acc.shape[0] + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    m_idx = pid_m * acc.shape[1] + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(Y + m_idx[None, :].to(gl.int64) * stride_ym + n_idx[:, None], acc.to(Y.dtype.element_ty),
             mask=(n_idx < N)[:, None] & (m_idx < M)[None, :])


# ---- dequantize in registers, write the full tile: bf16 weights for cuBLAS, or E4M3 for the FP8 path ----
@gluon.constexpr_function
def _contiguous_first(ll):
    """The same linear layout with the register bases of the 16 contiguous K positions first
    (a renaming of registers, so stores of a thread's K run vectorize)."""
    first = [[0, 1], [0, 2], [0, 4], [0, 8]]
    rest = [b for b in ll.reg_bases if b not in first]
    return gl.DistributedLinearLayout(first + rest, ll.lane_bases, ll.warp_bases, ll.block_bases, ll.shape)


@gluon.jit
def _to_physical_k(v, BN: gl.constexpr, U: gl.constexpr):
    """A weight tile [BN, U*64] in the MMA's logical K order -> true K order (layout.py), with the
    registers renamed so each thread's 16 consecutive K come first (their stores vectorize)."""
    v = v.reshape(BN, U, 2, 4, 2, 2, 2).permute(0, 1, 3, 4, 5, 2, 6).reshape(BN, U * K_STEP)
    return gl.convert_layout(v, _contiguous_first(v.type.layout), assert_trivial=True)


@gluon.jit
def dequant_kernel(
    W, S, ROW_MULT, OUT, INEXACT, KT, ld_out, factor,
    FMT: gl.constexpr, TO_FP8: gl.constexpr, NW: gl.constexpr, R: gl.constexpr, U: gl.constexpr,
):
    """OUT[n, k] = W[n, k] for a [RG*16, U*64] tile per program: the true value (times row_mult) in
    OUT's dtype, or with TO_FP8 the decoded value times `factor` rounded to E4M3, counting in
    INEXACT the elements that E4M3 does not hold exactly."""
    RG: gl.constexpr = NW * R
    BN: gl.constexpr = RG * ROW_GROUP
    BK: gl.constexpr = U * K_STEP
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)

    pid_n = gl.program_id(0)
    kt = gl.program_id(1) * U
    W_base, w_off, S_base, s_off = _weight_tile_pointers(W, S, pid_n, KT, FMT, NW, RG, U)
    w, s = _load_w(W_base, w_off, S_base, s_off, kt, FMT)
    v = gl.convert_layout(_dequant_tile(w, s, FMT, RG, U), a_layout, assert_trivial=True).to(gl.float32)

    rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, a_layout))
    if TO_FP8:
        v = v * factor
        q = v.to(gl.float8e4nv)
        inexact = gl.sum(gl.sum((q.to(gl.float32) != v).to(gl.int32), axis=1), axis=0)
        gl.atomic_add(INEXACT, inexact)
        v = q
    else:
        v = (v * gl.load(ROW_MULT + rows)[:, None]).to(OUT.dtype.element_ty)
    v = _to_physical_k(v, BN, U)
    r = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, v.type.layout))
    c = kt * K_STEP + gl.arange(0, BK, layout=gl.SliceLayout(0, v.type.layout))
    gl.store(OUT + r[:, None].to(gl.int64) * ld_out + c[None, :], v)
