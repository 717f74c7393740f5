"""GEMM for M above decode sizes on Hopper: weights dequantized per K step in registers, wgmma.

    y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  fp32 accumulation

A program owns BN = 16 * NW * R weight rows and BM activation rows and walks K in steps of 64. Each
step its threads decode their 16-byte slice of the pre-shuffled weights (decode.py's routine, the same
registers the decode kernel feeds to mma.sync), and one asynchronous wgmma multiplies them with the
activation tile in shared memory while the threads load and decode the next step. The decoded tile
reaches the wgmma one of two ways:
  - RS (register A): the decoded registers are the wgmma's A fragments as they are, relabelled in K
    (_hardware_k_order); the activation tile is copied in with its columns permuted to match
    (_x_columns, 4-byte cp.async). No weight tile in shared memory: the faster form up to M = 64.
  - otherwise: the tile is put back in true K order and stored to shared memory next to the
    activation tile, and the wgmma reads both from there.
The weights never exist in global memory in bf16, so the kernel reads 4.5 / 4.25 / 8.25 bits per
weight where dequantize-then-cuBLAS writes and reads 16 more.

The activation tiles come in by cp.async X_AHEAD steps ahead, the weight words DEPTH steps ahead in
registers; with K split over several programs (small grids) the partials are summed as in decode.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from . import layout as hopper_layout
from .decode import K_STEP, ROW_GROUP, _dequant_tile, _finish, _load_w, _to_physical_k, _weight_tile_pointers

RS_K_BITS = gl.constexpr(hopper_layout.RS_K_BITS)
X_AHEAD = gl.constexpr(2)  # activation tiles in flight (cp.async) ahead of the step being multiplied
STAGES = gl.constexpr(X_AHEAD + 3)


@gluon.jit
def _copy_x(x_smem, x_ptr, x_row_ok, x_k, step, k_end, K):
    """Start the copy of the activation tile of K step `step` into its stage (zeros past K, M or the
    split's end) and close its commit group: one group per step, so wait_group counts steps."""
    k0 = step * K_STEP
    ok = x_row_ok & (x_k[None, :] + k0 < K) & (step < k_end)
    async_copy.async_copy_global_to_shared(x_smem.index(step % STAGES), x_ptr + k0, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _hardware_k_order(a, BN: gl.constexpr):
    """Decoded tile [BN, 64] in the decode kernel's logical K order -> the wgmma's register A operand,
    relabelled so column j is the hardware's k (only registers renamed): j bits (1, 2, 4, 8, 16, 32)
    are logical k bits (1, 8, 16, 2, 4, 32), that is physical k bits layout.RS_K_BITS."""
    return a.reshape(BN, 2, 2, 2, 2, 2, 2).permute(0, 1, 4, 5, 2, 3, 6).reshape(BN, K_STEP)


@gluon.jit
def _step(acc, tile, step, w_smem, x_smem, x_ptr, x_row_ok, x_k, k_end, K, FMT: gl.constexpr, RG: gl.constexpr,
          RS: gl.constexpr, a_regs: gl.constexpr, a_wgmma: gl.constexpr):
    """acc += W tile @ x tile^T for one K step, the weight tile already loaded into registers."""
    _copy_x(x_smem, x_ptr, x_row_ok, x_k, step + X_AHEAD, k_end, K)
    w, s = tile
    a = gl.convert_layout(_dequant_tile(w, s, FMT, RG, 1), a_regs, assert_trivial=True)
    if RS:
        a = gl.convert_layout(_hardware_k_order(a, RG * ROW_GROUP), a_wgmma, assert_trivial=True)
    else:
        w_smem.index(step % STAGES).store(_to_physical_k(a, RG * ROW_GROUP, 1))
        a = w_smem.index(step % STAGES)
    async_copy.wait_group(X_AHEAD)  # this thread's copies of the step's x tile have landed
    fence_async_shared()
    gl.thread_barrier()  # every warp's part of the x tile (and of the weight tile) is in shared memory
    acc = warpgroup_mma(a, x_smem.index(step % STAGES).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(1, deps=[acc])


@gluon.jit
def _x_columns(RS: gl.constexpr, layout: gl.constexpr):
    """x column (true k within a K step) of each column j of the activation tile in shared memory: j
    itself, or with RS the column that meets the weights at the wgmma's k = j (layout.RS_K_BITS)."""
    j = gl.arange(0, K_STEP, layout=gl.SliceLayout(0, layout))
    if RS:
        k = j & 1  # RS_K_BITS[0] is 1: k pairs stay together (bf16x2 registers, 4-byte copies)
        for b in gl.static_range(1, 6):
            k = k | ((j >> b) & 1) * RS_K_BITS[b]
        j = gl.max_contiguous(gl.multiple_of(k, [2]), [2])  # pairs stay together: 4-byte copies
    return j


@gluon.jit
def wgmma_gemm_kernel(
    X, W, S, ROW_MULT, BIAS, Y, WS, TICKETS, M, N, K, KT, steps_per_split, n_split, stride_xm, stride_ym,
    FMT: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, NW: gl.constexpr, BM: gl.constexpr,
    DEPTH: gl.constexpr, R: gl.constexpr, RS: gl.constexpr,
):
    RG: gl.constexpr = NW * R  # 16-row groups: R per warp
    BN: gl.constexpr = RG * ROW_GROUP
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    v2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_regs: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v2, k_width=8)
    a_wgmma: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    if RS:  # columns permuted in pairs: 4-byte copies
        x_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NW, 1], [1, 0])
    else:
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    pid_m = gl.program_id(0)  # fastest: programs that share a weight tile run together (L2 reuse)
    pid_n = gl.program_id(1)
    pid_s = gl.program_id(2)
    k_begin = pid_s * steps_per_split
    k_end = gl.minimum(k_begin + steps_per_split, KT)
    n_steps = k_end - k_begin
    W_base, w_off, S_base, s_off = _weight_tile_pointers(W, S, pid_n, KT, FMT, NW, RG, 1)

    x_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
    x_k = _x_columns(RS, x_layout)
    x_ptr = X + x_m[:, None].to(gl.int64) * stride_xm + x_k[None, :]
    x_row_ok = (x_m < M)[:, None]

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, K_STEP], tile_smem)
    if RS:
        w_smem = x_smem  # unused: the weights go to the wgmma from registers
    else:
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, K_STEP], tile_smem)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)

    # Stages are indexed by step % STAGES. A stage is rewritten (x copy X_AHEAD steps ahead, weight
    # store of the step) at least three steps after its previous wgmma was issued; by then every
    # warpgroup has waited for that wgmma (warpgroup_mma_wait(1) before the barrier of a later step).
    for j in gl.static_range(X_AHEAD):
        _copy_x(x_smem, x_ptr, x_row_ok, x_k, k_begin + j, k_end, K)
    # weight tiles: DEPTH in registers ahead, rotated through an unrolled trip (as in decode.py)
    tiles = ()
    for j in gl.static_range(DEPTH):
        tiles = tiles + (_load_w(W_base, w_off, S_base, s_off, gl.minimum(k_begin + j, k_end - 1), FMT),)
    for i in range(n_steps // DEPTH):
        step = k_begin + i * DEPTH
        for j in gl.static_range(DEPTH):
            nxt = _load_w(W_base, w_off, S_base, s_off, gl.minimum(step + j + DEPTH, k_end - 1), FMT)
            acc = _step(acc, tiles[0], step + j, w_smem, x_smem, x_ptr, x_row_ok, x_k, k_end, K, FMT, RG, RS,
                        a_regs, a_wgmma)
            tiles = tiles[1:] + (nxt,)
    step = k_begin + (n_steps // DEPTH) * DEPTH
    for j in gl.static_range(DEPTH - 1):
        if j < n_steps % DEPTH:
            acc = _step(acc, tiles[j], step + j, w_smem, x_smem, x_ptr, x_row_ok, x_k, k_end, K, FMT, RG, RS,
                        a_regs, a_wgmma)
    acc = warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)

    _finish(acc, ROW_MULT, BIAS, Y, WS, TICKETS, M, N, stride_ym, pid_m, pid_n, pid_s, n_split, HAS_BIAS, SPLIT)
