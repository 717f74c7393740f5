"""Large-M GEMM for Hopper with warp specialization: decoder warps feed wgmma through shared memory.

    y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  fp32 accumulation, bf16 activations

wgmma.py decodes and multiplies in the same warps with a barrier per K step, and reaches about half
of cuBLAS bf16 at large M. Here the work is split over three partitions that meet only at mbarriers
on a ring of STAGES shared-memory stages:
- loader (1 warp): the activation tile [BM, 64] of each K step by TMA;
- decoders (DECODERS warps): each K step's weight words and scales by register loads (DEPTH steps
  ahead), decoded in registers (decode.py's routine) and stored as a bf16 [BN, 64] tile in true K
  order, the wgmma A operand;
- MMA (the default partition, BN / 64 warpgroups): one asynchronous wgmma per K step with the next
  one issued before the previous is waited for; a stage goes back to the loader and the decoders
  once the wgmma that read it has completed.
Each program owns a full [BN, BM] output tile (no split-K: this kernel is for M >= 1024).

Not yet run (written when no device time was left): compiled for sm_90 and its SASS checked in CI;
the GPU test (test_sm90_gemm.py) and the benchmark decide whether it replaces dequant + cuBLAS.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from .decode import K_STEP, ROW_GROUP, _dequant_tile, _epilogue, _load_w, _to_physical_k, _weight_tile_pointers


@gluon.jit
def _stage(i, STAGES: gl.constexpr):
    """Stage of K step i in the ring, and the parity of its use (mbarrier phase)."""
    return i % STAGES, (i // STAGES) & 1


@gluon.jit
def _loader(x_desc, W, S, x_smem, w_smem, bars, pid_n, pid_m, KT,
            FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
            DECODERS: gl.constexpr, DEPTH: gl.constexpr):
    """Activation tiles by TMA, each stage once the wgmma that last read it has completed."""
    x_ready, x_empty, w_ready, w_empty = bars
    for i in range(KT):
        s, phase = _stage(i, STAGES)
        mbarrier.wait(x_empty.index(s), phase ^ 1)  # fresh barriers count as released
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [pid_m * BM, i * K_STEP], x_ready.index(s), x_smem.index(s))


@gluon.jit
def _decoders(x_desc, W, S, x_smem, w_smem, bars, pid_n, pid_m, KT,
              FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
              DECODERS: gl.constexpr, DEPTH: gl.constexpr):
    """Weight tiles: loaded DEPTH steps ahead in registers, decoded, stored as bf16 in true K order."""
    x_ready, x_empty, w_ready, w_empty = bars
    RG: gl.constexpr = BN // ROW_GROUP
    v2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[DECODERS, 1], instr_shape=[16, 8])
    a_regs: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=v2, k_width=8)
    W_base, w_off, S_base, s_off = _weight_tile_pointers(W, S, pid_n, KT, FMT, DECODERS, RG, 1)
    tiles = ()
    for j in gl.static_range(DEPTH):
        tiles = tiles + (_load_w(W_base, w_off, S_base, s_off, gl.minimum(j, KT - 1), FMT),)
    for t in range(gl.cdiv(KT, DEPTH)):
        for j in gl.static_range(DEPTH):
            i = t * DEPTH + j
            if i < KT:
                nxt = _load_w(W_base, w_off, S_base, s_off, gl.minimum(i + DEPTH, KT - 1), FMT)
                w, sc = tiles[0]
                a = gl.convert_layout(_dequant_tile(w, sc, FMT, RG, 1), a_regs, assert_trivial=True)
                s, phase = _stage(i, STAGES)
                mbarrier.wait(w_empty.index(s), phase ^ 1)
                w_smem.index(s).store(_to_physical_k(a, BN, 1))
                fence_async_shared()  # the generic-proxy stores before the wgmma (async proxy) reads them
                mbarrier.arrive(w_ready.index(s), count=1)
                tiles = tiles[1:] + (nxt,)


@gluon.jit
def _mma(x_smem, w_smem, bars, KT, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
         mma: gl.constexpr):
    """acc [BN, BM] = W tile @ x tile^T over all K steps, two wgmmas in flight."""
    x_ready, x_empty, w_ready, w_empty = bars
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for i in range(KT):
        s, phase = _stage(i, STAGES)
        mbarrier.wait(x_ready.index(s), phase)
        mbarrier.wait(w_ready.index(s), phase)
        acc = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])  # the wgmma of step i - 1 has completed: free its stage
        prev = (i + STAGES - 1) % STAGES
        mbarrier.arrive(x_empty.index(prev), count=1, pred=i > 0)
        mbarrier.arrive(w_empty.index(prev), count=1, pred=i > 0)
    return (warpgroup_mma_wait(0, deps=[acc]),)  # the default partition returns a tuple of tensors


@gluon.jit
def wgmma_ws_gemm_kernel(
    x_desc, W, S, ROW_MULT, BIAS, Y, M, N, KT, stride_ym,
    FMT: gl.constexpr, HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr,
    DECODERS: gl.constexpr, DEPTH: gl.constexpr, DECODER_REGS: gl.constexpr,
):
    MMA_WARPS: gl.constexpr = BN // 16  # one warpgroup per 64 weight rows
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                  instr_shape=[16, BM, 16])
    w_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    pid_m = gl.program_id(0)  # fastest: the programs that share a weight tile run together (L2)
    pid_n = gl.program_id(1)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, K_STEP], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, K_STEP], w_layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(j), count=1)
        mbarrier.init(x_empty.index(j), count=1)
        mbarrier.init(w_ready.index(j), count=1)
        mbarrier.init(w_empty.index(j), count=1)
    fence_async_shared()  # the inits (generic proxy) before the TMA unit and the other partitions use them
    bars = (x_ready, x_empty, w_ready, w_empty)

    # (the worker arguments are written out at the call: a tuple kept in a variable would turn the
    # constexprs in it into run-time integers)
    acc, = gl.warp_specialize([
        (_mma, (x_smem, w_smem, bars, KT, BN, BM, STAGES, mma)),
        (_loader, (x_desc, W, S, x_smem, w_smem, bars, pid_n, pid_m, KT, FMT, BN, BM, STAGES, DECODERS, DEPTH)),
        (_decoders, (x_desc, W, S, x_smem, w_smem, bars, pid_n, pid_m, KT, FMT, BN, BM, STAGES, DECODERS, DEPTH)),
    ], [1, DECODERS], [24, DECODER_REGS])

    # epilogue in a layout whose threads run along N, so y's rows are written in contiguous pieces
    out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, MMA_WARPS], [0, 1])
    acc = gl.convert_layout(acc, out_layout)
    n_idx = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
    m_idx = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
    out_mask = (n_idx < N)[:, None] & (m_idx < M)[None, :]
    _epilogue(acc, ROW_MULT, BIAS, Y, n_idx, m_idx, out_mask, stride_ym, N, HAS_BIAS)
