// Block-scaled GEMM for sm_100a with tcgen05: y[M, N] = (A . sA) (B . sB)^T * alpha (+ bias), bf16 out.
//
// A [M, K] (activations) and B [N, K] (weights) are K-major: E2M1 packed two per byte (NVFP4, MXFP4)
// or E4M3 (MXFP8). Their block scales are in the 128x4 swizzled layout of microscale.formats.
// One source, variants by template parameter:
//   FMT       0 NVFP4 (kind::mxf4nvf4, scale_vec::4X), 1 MXFP4 (kind::mxf4, 2X), 2 MXFP8 (kind::mxf8f6f4, 1X)
//   STAGES    depth of the shared-memory ring
//   CTA_GROUP 1: one CTA per 128 x 128 tile; 2: a cluster of two CTAs runs one 256 x 128 MMA
//             (cta_group::2), each CTA holding 128 rows of A, half of B and all of B's scales.
//
// Warps (persistent; every role walks the same tile sequence):
//   0-3  epilogue: tcgen05.ld 32x32b from TMEM, * alpha + bias, bf16 stores (warp w owns lanes 32w..)
//   4    TMA producer: A, B (128B swizzle) and scale atoms into the ring, full/empty mbarriers
//   5    MMA issuer: allocates TMEM; one elected thread copies scales SMEM -> TMEM (tcgen05.cp) and
//        issues 4 tcgen05.mma per stage into one of two accumulators (double buffering)
//
// Everything the host knows better is a kernel argument: the instruction descriptors and the
// shared-memory descriptor templates (descriptors.py), the TMEM column plan (TmemPlan), and the four
// tensor maps (encoded by cuTensorMapEncodeTiled on the host), passed by value as __grid_constant__
// parameters, so a captured CUDA graph holds them in its launch node.
//
// Self-contained for NVRTC: no includes; all tensor-core, TMA and barrier operations are inline PTX
// (the generic ones in ../ptx_common.cuh, which nvrtc.compile_kernels puts in front).

namespace ms {

constexpr int FMT_NVFP4 = 0;
constexpr int FMT_MXFP4 = 1;
constexpr int FMT_MXFP8 = 2;

constexpr int BLOCK_M = 128;          // rows of A per CTA = TMEM lanes
constexpr int BLOCK_N = 128;          // MMA N (one SFB atom row-block; 2 x 128 FP32 accumulators fit TMEM)
constexpr int STAGE_BYTES_K = 128;    // K bytes per stage: one 128B-swizzled row
constexpr int MMA_BYTES_K = 32;       // K bytes per tcgen05.mma (K = 64 FP4 or 32 FP8)
constexpr int MMAS_PER_STAGE = STAGE_BYTES_K / MMA_BYTES_K;
constexpr int SF_ATOM_BYTES = 512;    // 128 rows x 4 scales (formats.scale_layout)
constexpr int EPI_WARPS = 4;
constexpr int TMA_WARP = 4;
constexpr int MMA_WARP = 5;
constexpr int THREADS = 32 * 6;
constexpr int EPI_COLS = 32;          // accumulator columns per tcgen05.ld

// Block scales per row consumed by one MMA (the N of scale_vec::NX); also the 128x4 atoms per stage.
template <int FMT>
constexpr int SCALES_PER_MMA = FMT == FMT_NVFP4 ? 4 : (FMT == FMT_MXFP4 ? 2 : 1);

// Shared memory: STAGES x (A | B | SFA | SFB), then barriers and the TMEM base address.
template <int FMT, int STAGES, int CTA_GROUP>
struct SmemLayout {
  static constexpr int B_ROWS = BLOCK_N / CTA_GROUP;
  static constexpr int A_BYTES = BLOCK_M * STAGE_BYTES_K;
  static constexpr int B_BYTES = B_ROWS * STAGE_BYTES_K;
  static constexpr int SF_ATOMS = SCALES_PER_MMA<FMT>;
  static_assert(FMT == FMT_NVFP4 || FMT == FMT_MXFP4 || FMT == FMT_MXFP8, "unknown format");
  static constexpr int SF_BYTES = SF_ATOMS * SF_ATOM_BYTES;  // per operand: 128 rows of A or all N of B
  static constexpr int A_OFF = 0;
  static constexpr int B_OFF = A_OFF + STAGES * A_BYTES;
  static constexpr int SFA_OFF = B_OFF + STAGES * B_BYTES;
  static constexpr int SFB_OFF = SFA_OFF + STAGES * SF_BYTES;
  static constexpr int FULL_OFF = SFB_OFF + STAGES * SF_BYTES;
  static constexpr int EMPTY_OFF = FULL_OFF + 8 * STAGES;
  static constexpr int TMEM_FULL_OFF = EMPTY_OFF + 8 * STAGES;
  static constexpr int TMEM_EMPTY_OFF = TMEM_FULL_OFF + 8 * 2;
  static constexpr int TMEM_BASE_OFF = TMEM_EMPTY_OFF + 8 * 2;
  static constexpr int BYTES = TMEM_BASE_OFF + 16;
  static constexpr int STAGE_TX_BYTES = A_BYTES + B_BYTES + 2 * SF_BYTES;  // per CTA
  static_assert(B_ROWS % 8 == 0 && A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0,
                "128B-swizzled tiles must stay 1024-byte aligned");
};

// ---- PTX wrappers -------------------------------------------------------------------------------------

__device__ __forceinline__ bool elect_one() {
  u32 elected;
  asm volatile("{\n .reg .pred P;\n elect.sync _|P, 0xffffffff;\n selp.u32 %0, 1, 0, P;\n}" : "=r"(elected));
  return elected != 0;
}

// Arrive and announce `bytes` of TMA traffic; `bar` may be in the peer CTA (shared::cluster address).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive_cluster(u32 bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(bar) : "memory");
}

// TMA tile loads. With CTA_GROUP == 2 the completion may be signalled on the peer CTA's barrier.
template <int CTA_GROUP>
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* tmap, int x, int y, u32 bar) {
  if constexpr (CTA_GROUP == 1) {
    tma_load_2d_cta(dst, tmap, x, y, bar);
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.cta_group::2"
        " [%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar) : "memory");
  }
}

template <int CTA_GROUP>
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* tmap, int x, int y, int z, u32 bar) {
  if constexpr (CTA_GROUP == 1) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];"
        :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.cta_group::2"
        " [%0], [%1, {%2, %3, %4}], [%5];"
        :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
  }
}

template <int CTA_GROUP>
__device__ __forceinline__ void tmem_alloc(u32 dst_slot, u32 columns) {
  asm volatile("tcgen05.alloc.cta_group::%2.sync.aligned.shared::cta.b32 [%0], %1;"
               :: "r"(dst_slot), "r"(columns), "n"(CTA_GROUP) : "memory");
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::%0.sync.aligned;" :: "n"(CTA_GROUP));
}

template <int CTA_GROUP>
__device__ __forceinline__ void tmem_dealloc(u32 taddr, u32 columns) {
  asm volatile("tcgen05.dealloc.cta_group::%2.sync.aligned.b32 %0, %1;"
               :: "r"(taddr), "r"(columns), "n"(CTA_GROUP) : "memory");
}

__device__ __forceinline__ void tcgen05_before_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tcgen05_after_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// One 128x4 scale atom (32 rows x 16 B in SMEM) -> 32 lanes x 4 columns, copied to all four lane quarters.
template <int CTA_GROUP>
__device__ __forceinline__ void tmem_copy_scale_atom(u32 taddr, u64 sdesc) {
  asm volatile("tcgen05.cp.cta_group::%2.32x128b.warpx4 [%0], %1;"
               :: "r"(taddr), "l"(sdesc), "n"(CTA_GROUP) : "memory");
}

template <int FMT, int CTA_GROUP>
__device__ __forceinline__ void mma_block_scaled(u32 d, u64 adesc, u64 bdesc, u32 idesc, u32 sfa, u32 sfb,
                                                 u32 accumulate) {
  if constexpr (FMT == FMT_NVFP4) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
        " tcgen05.mma.cta_group::%7.kind::mxf4nvf4.block_scale.scale_vec::4X [%0], %1, %2, %3, [%4], [%5], p;\n}"
        :: "r"(d), "l"(adesc), "l"(bdesc), "r"(idesc), "r"(sfa), "r"(sfb), "r"(accumulate), "n"(CTA_GROUP) : "memory");
  } else if constexpr (FMT == FMT_MXFP4) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
        " tcgen05.mma.cta_group::%7.kind::mxf4.block_scale.scale_vec::2X [%0], %1, %2, %3, [%4], [%5], p;\n}"
        :: "r"(d), "l"(adesc), "l"(bdesc), "r"(idesc), "r"(sfa), "r"(sfb), "r"(accumulate), "n"(CTA_GROUP) : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
        " tcgen05.mma.cta_group::%7.kind::mxf8f6f4.block_scale.scale_vec::1X [%0], %1, %2, %3, [%4], [%5], p;\n}"
        :: "r"(d), "l"(adesc), "l"(bdesc), "r"(idesc), "r"(sfa), "r"(sfb), "r"(accumulate), "n"(CTA_GROUP) : "memory");
  }
}

// Arrive on `bar` once every tcgen05 operation this thread issued so far has completed; with
// CTA_GROUP == 2 the arrival goes to the barrier at the same offset in both CTAs of the pair.
template <int CTA_GROUP>
__device__ __forceinline__ void mma_commit(u32 bar) {
  if constexpr (CTA_GROUP == 1) {
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" :: "r"(bar) : "memory");
  } else {
    asm volatile("tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64 [%0], %1;"
                 :: "r"(bar), "h"((u16)0x3) : "memory");
  }
}

// 32 lanes x 32 columns of FP32: thread t gets row (lane quarter base + t), columns c..c+31.
__device__ __forceinline__ void tmem_load_32cols(u32 taddr, float (&v)[EPI_COLS]) {
  u32 r[EPI_COLS];
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15]),
        "=r"(r[16]), "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]), "=r"(r[22]), "=r"(r[23]),
        "=r"(r[24]), "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]), "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
      : "r"(taddr));
  asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory");
#pragma unroll
  for (int i = 0; i < EPI_COLS; ++i) v[i] = __uint_as_float(r[i]);
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

// ---- the kernel -----------------------------------------------------------------------------------------

struct TileCoords {
  int m_block, n_block;  // in units of BLOCK_M * CTA_GROUP and BLOCK_N
};

// Tiles run M-fastest so CTAs working at the same time share the weight (B) tile in L2.
__device__ __forceinline__ TileCoords tile_coords(int tile, int m_blocks) {
  return {tile % m_blocks, tile / m_blocks};
}

template <int FMT, int STAGES, int CTA_GROUP>
__global__ void __launch_bounds__(THREADS, 1) tcgen05_block_scaled_gemm(
    const __grid_constant__ TensorMap tmap_a, const __grid_constant__ TensorMap tmap_b,
    const __grid_constant__ TensorMap tmap_sfa, const __grid_constant__ TensorMap tmap_sfb,
    u16* __restrict__ out,              // bf16 [M, ldo]
    const u16* __restrict__ bias,       // bf16 [N] or null
    const float* __restrict__ alpha,    // one float (NVFP4: 1 / (gA * gB)) or null for 1
    int M, int N, int k_stages, int ldo,
    u32 idesc0, u32 idesc1, u32 idesc2, u32 idesc3,  // one per MMA of a stage (scale factor IDs differ)
    u64 ab_desc,                        // A/B smem descriptor with start address 0
    u64 sf_desc,                        // scale-atom smem descriptor with start address 0
    u32 tmem_columns, u32 acc_columns,  // TmemPlan: allocation, columns per accumulator,
    u32 sf_column0, u32 sf_slot_columns, u32 sfb_offset) {  // first scale slot, slot width, B after A
  using L = SmemLayout<FMT, STAGES, CTA_GROUP>;
  constexpr int SF_ATOMS = L::SF_ATOMS;

  extern __shared__ unsigned char smem_raw[];
  // 128B swizzle wants 1024-byte aligned tiles; the host asks for BYTES + 1024.
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  {
    u32 dynamic_bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (dynamic_bytes < L::BYTES + 1024u) __trap();  // host and kernel disagree on the layout
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const u32 rank = CTA_GROUP == 2 ? cluster_rank() : 0;
  const bool leader = rank == 0;

  auto full_bar = [&](int s) { return smem + L::FULL_OFF + 8 * s; };
  auto empty_bar = [&](int s) { return smem + L::EMPTY_OFF + 8 * s; };
  auto tmem_full_bar = [&](int b) { return smem + L::TMEM_FULL_OFF + 8 * b; };
  auto tmem_empty_bar = [&](int b) { return smem + L::TMEM_EMPTY_OFF + 8 * b; };

  if (warp == TMA_WARP && elect_one()) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar(s), CTA_GROUP);  // one arrive.expect_tx per CTA (only the leader's is used)
      mbar_init(empty_bar(s), 1);         // one tcgen05.commit
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(tmem_full_bar(b), 1);
      mbar_init(tmem_empty_bar(b), EPI_WARPS * CTA_GROUP);  // one arrive per epilogue warp of the pair
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (warp == MMA_WARP) tmem_alloc<CTA_GROUP>(smem + L::TMEM_BASE_OFF, tmem_columns);
  tcgen05_before_sync();
  __syncthreads();
  if constexpr (CTA_GROUP == 2) cluster_sync();
  tcgen05_after_sync();
  u32 tmem_base;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(tmem_base) : "r"(smem + L::TMEM_BASE_OFF));

  const int m_blocks = (M + BLOCK_M * CTA_GROUP - 1) / (BLOCK_M * CTA_GROUP);
  const int n_blocks = (N + BLOCK_N - 1) / BLOCK_N;
  const int tiles = m_blocks * n_blocks;
  const int cluster_id = blockIdx.x / CTA_GROUP;
  const int clusters = gridDim.x / CTA_GROUP;

  if (warp == TMA_WARP) {
    if (elect_one()) {
      prefetch_tensormap(&tmap_a);
      prefetch_tensormap(&tmap_b);
      prefetch_tensormap(&tmap_sfa);
      prefetch_tensormap(&tmap_sfb);
      int stage = 0;
      u32 phase = 0;
      for (int tile = cluster_id; tile < tiles; tile += clusters) {
        const TileCoords t = tile_coords(tile, m_blocks);
        const int a_row = (t.m_block * CTA_GROUP + rank) * BLOCK_M;
        const int b_row = t.n_block * BLOCK_N + rank * L::B_ROWS;
        for (int k = 0; k < k_stages; ++k) {
          mbar_wait(empty_bar(stage), phase ^ 1);  // the first pass through the ring does not wait
          const u32 full = CTA_GROUP == 2 ? map_to_rank(full_bar(stage), 0) : full_bar(stage);
          mbar_arrive_expect_tx(full, L::STAGE_TX_BYTES);
          tma_load_2d<CTA_GROUP>(smem + L::A_OFF + stage * L::A_BYTES, &tmap_a, k * STAGE_BYTES_K, a_row, full);
          tma_load_2d<CTA_GROUP>(smem + L::B_OFF + stage * L::B_BYTES, &tmap_b, k * STAGE_BYTES_K, b_row, full);
          // Scale maps are (256-byte half atoms, half atoms along K, 128-row blocks).
          tma_load_3d<CTA_GROUP>(smem + L::SFA_OFF + stage * L::SF_BYTES, &tmap_sfa, 0, k * 2 * SF_ATOMS,
                                 t.m_block * CTA_GROUP + rank, full);
          tma_load_3d<CTA_GROUP>(smem + L::SFB_OFF + stage * L::SF_BYTES, &tmap_sfb, 0, k * 2 * SF_ATOMS,
                                 t.n_block, full);
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
      }
      // Drain: every stage's last release must have landed before this CTA may exit.
      for (int i = 0; i < STAGES; ++i) {
        mbar_wait(empty_bar(stage), phase ^ 1);
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
    }
    __syncwarp();
  } else if (warp == MMA_WARP) {
    if (leader && elect_one()) {
      const u32 idesc[MMAS_PER_STAGE] = {idesc0, idesc1, idesc2, idesc3};
      int stage = 0;
      u32 phase = 0;
      int acc = 0;
      u32 acc_phase = 0;
      for (int tile = cluster_id; tile < tiles; tile += clusters) {
        mbar_wait(tmem_empty_bar(acc), acc_phase ^ 1);  // epilogue has drained this accumulator
        tcgen05_after_sync();
        const u32 d_tmem = tmem_base + acc * acc_columns;
        for (int k = 0; k < k_stages; ++k) {
          mbar_wait(full_bar(stage), phase);
          tcgen05_after_sync();
          const u32 sfa_tmem = tmem_base + sf_column0 + stage * sf_slot_columns;
          const u32 sfb_tmem = sfa_tmem + sfb_offset;
          const u32 sfa_smem = smem + L::SFA_OFF + stage * L::SF_BYTES;
          const u32 sfb_smem = smem + L::SFB_OFF + stage * L::SF_BYTES;
#pragma unroll
          for (int a = 0; a < SF_ATOMS; ++a) {
            tmem_copy_scale_atom<CTA_GROUP>(sfa_tmem + 4 * a, sf_desc | ((sfa_smem + a * SF_ATOM_BYTES) >> 4));
            tmem_copy_scale_atom<CTA_GROUP>(sfb_tmem + 4 * a, sf_desc | ((sfb_smem + a * SF_ATOM_BYTES) >> 4));
          }
          const u32 a_smem = smem + L::A_OFF + stage * L::A_BYTES;
          const u32 b_smem = smem + L::B_OFF + stage * L::B_BYTES;
#pragma unroll
          for (int i = 0; i < MMAS_PER_STAGE; ++i) {
            const u32 atom = i * SCALES_PER_MMA<FMT> / 4;  // 128x4 atom holding this MMA's scales
            mma_block_scaled<FMT, CTA_GROUP>(d_tmem, ab_desc | ((a_smem + i * MMA_BYTES_K) >> 4),
                                             ab_desc | ((b_smem + i * MMA_BYTES_K) >> 4), idesc[i],
                                             sfa_tmem + 4 * atom, sfb_tmem + 4 * atom, (k | i) != 0);
          }
          mma_commit<CTA_GROUP>(empty_bar(stage));  // frees the stage (and its scale slot) once read
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
        mma_commit<CTA_GROUP>(tmem_full_bar(acc));  // accumulator complete
        if (++acc == 2) { acc = 0; acc_phase ^= 1; }
      }
    }
    __syncwarp();
  } else {
    // Epilogue: warp w reads TMEM lanes 32w..32w+31 (the lane quarter a warp may access).
    const float scale = alpha ? *alpha : 1.0f;
    const bool vector_ok = (ldo % 8) == 0;
    int acc = 0;
    u32 acc_phase = 0;
    for (int tile = cluster_id; tile < tiles; tile += clusters) {
      const TileCoords t = tile_coords(tile, m_blocks);
      const int row = (t.m_block * CTA_GROUP + rank) * BLOCK_M + warp * 32 + lane;
      mbar_wait(tmem_full_bar(acc), acc_phase);
      tcgen05_after_sync();
#pragma unroll 1
      for (int c = 0; c < BLOCK_N; c += EPI_COLS) {
        float v[EPI_COLS];
        tmem_load_32cols(tmem_base + (static_cast<u32>(warp * 32) << 16) + acc * acc_columns + c, v);
        const int col0 = t.n_block * BLOCK_N + c;
        if (row < M) {
          u16* dst = out + static_cast<long long>(row) * ldo + col0;
#pragma unroll
          for (int j = 0; j < EPI_COLS; j += 8) {
            float y[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const int col = col0 + j + e;
              y[e] = v[j + e] * scale + ((bias && col < N) ? bf16_to_float(bias[col]) : 0.0f);
            }
            if (vector_ok && col0 + j + 8 <= N) {
              asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(dst + j),
                           "r"(pack_bf16x2(y[0], y[1])), "r"(pack_bf16x2(y[2], y[3])),
                           "r"(pack_bf16x2(y[4], y[5])), "r"(pack_bf16x2(y[6], y[7])) : "memory");
            } else {
#pragma unroll
              for (int e = 0; e < 8; ++e)
                if (col0 + j + e < N) dst[j + e] = static_cast<u16>(pack_bf16x2(y[e], 0.0f) & 0xFFFF);
            }
          }
        }
      }
      tcgen05_before_sync();
      __syncwarp();
      if (lane == 0) {
        const u32 bar = tmem_empty_bar(acc);
        mbar_arrive_cluster(CTA_GROUP == 2 ? map_to_rank(bar, 0) : bar);
      }
      if (++acc == 2) { acc = 0; acc_phase ^= 1; }
    }
  }

  tcgen05_before_sync();
  __syncthreads();
  if constexpr (CTA_GROUP == 2) cluster_sync();  // no CTA leaves while its peer may still signal it
  if (warp == MMA_WARP) {
    tcgen05_after_sync();
    tmem_dealloc<CTA_GROUP>(tmem_base, tmem_columns);
  }
}

// Copies one TMA box into shared memory and back out to `dst` byte for byte, so a test can check a
// tensor map's box, strides, swizzle and out-of-bounds fill on any GPU with TMA (sm_90 and up).
// Each CTA also records (gridDim.x, CTAs in its cluster) in `launch_info` to check cluster launches.
template <int RANK>
__global__ void __launch_bounds__(128, 1) tma_box_probe(const __grid_constant__ TensorMap tmap,
                                                       unsigned char* __restrict__ dst, u32* __restrict__ launch_info,
                                                       u32 box_bytes, int x, int y, int z) {
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;  // box at a 1024-byte boundary
  const u32 bar = smem + ((box_bytes + 15u) & ~15u);
  if (threadIdx.x == 0) {
    u32 cluster_ctas;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(cluster_ctas));
    launch_info[2 * blockIdx.x] = gridDim.x;
    launch_info[2 * blockIdx.x + 1] = cluster_ctas;
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    prefetch_tensormap(&tmap);
    mbar_arrive_expect_tx(bar, box_bytes);
    if constexpr (RANK == 2) tma_load_2d<1>(smem, &tmap, x, y, bar);
    else tma_load_3d<1>(smem, &tmap, x, y, z, bar);
    mbar_wait(bar, 0);
  }
  __syncthreads();
  if (blockIdx.x != 0) return;
  const unsigned char* src = smem_raw + (smem - shared_address(smem_raw));
  for (u32 i = threadIdx.x; i < box_bytes; i += blockDim.x) dst[i] = src[i];
}

}  // namespace ms
