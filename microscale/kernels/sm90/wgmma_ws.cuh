// Fused dequantize + wgmma GEMM for large M on sm_90a, warp-specialized:
//
//     y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  x and y bf16, fp32 accumulation
//
// W is in the Hopper layout of layout.py (pre-shuffled words, rebased block scales, per-row factor).
// A CTA owns 128 weight rows and BM activation rows and walks K in steps of 64. The CLUSTER CTAs of a
// cluster share their activation rows: each loads BM / CLUSTER of them and multicasts them to all, so
// x crosses from L2 once per cluster (at CLUSTER 1 the x traffic, not the tensor cores, set the pace).
//   warp 8     producer: per step its share of the x box (128 bytes of K, 128B swizzle) and the step's
//              weight words and scale bytes of the 8 row groups (one TMA box each), into a STAGES-deep ring
//              with full/empty mbarriers; a stage is refilled once the consumers of every CTA of the
//              cluster have released it
//   warps 0-7  two consumer warpgroups of 64 weight rows each: every thread turns its 16-byte word
//              load into bf16 (the decode routines of decode.py, shared as PTX), writes them into the
//              warpgroup's A tile in the wgmma's 128B-swizzled K-major layout (two tiles, alternating),
//              and issues 4 wgmma m64nBMk16 (A = decoded weights, B = x from the ring). The decode of
//              step k runs while the wgmmas of step k - 1 are in flight.
// The MMA computes y^T = W x^T: weight rows on the wgmma's M side, activation rows on its N side.
// Epilogue: accumulators times row_mult (plus bias) rounded to bf16, stored straight to y.
//
// Self-contained for NVRTC (no includes). The decode routines and the wgmma wrappers are generated
// by wgmma_ws.py into the @GENERATED@ line below.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

namespace ms90 {

constexpr int ROWS = 128;            // weight rows per CTA: two warpgroups of 64
constexpr int THREADS = 288;         // 8 consumer warps + 1 producer warp
constexpr int PRODUCER_WARP = 8;
constexpr int X_ROW_BYTES = 128;     // one K step (64) of bf16 activations: one 128B-swizzled row
constexpr int A_TILE_BYTES = 64 * X_ROW_BYTES;  // a warpgroup's decoded 64 x 64 bf16 weight tile

template <int FMT> constexpr int DATA_BYTES = FMT == 2 ? 1024 : 512;  // per row group and K step
template <int FMT> constexpr int SCALE_BYTES = FMT == 0 ? 64 : 32;

// Shared memory: the x ring, four A tiles ([warpgroup][step parity]), the weight ring, barriers.
template <int FMT, int BM, int STAGES>
struct Smem {
  static constexpr int X_BYTES = BM * X_ROW_BYTES;
  static constexpr int W_BYTES = 8 * DATA_BYTES<FMT>;
  static constexpr int S_BYTES = 8 * SCALE_BYTES<FMT>;
  static constexpr int X_OFF = 0;
  static constexpr int A_OFF = X_OFF + STAGES * X_BYTES;
  static constexpr int W_OFF = A_OFF + 4 * A_TILE_BYTES;
  static constexpr int S_OFF = W_OFF + STAGES * W_BYTES;
  static constexpr int FULL_OFF = S_OFF + STAGES * S_BYTES;
  static constexpr int EMPTY_OFF = FULL_OFF + 8 * STAGES;
  static constexpr int BYTES = EMPTY_OFF + 8 * STAGES + 1024;  // + slack to align the base to 1024
  static constexpr u32 STAGE_TX = X_BYTES + W_BYTES + S_BYTES;
  static_assert(X_BYTES % 1024 == 0, "swizzled tiles must stay 1024-byte aligned");
};

__device__ __forceinline__ u32 shared_address(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred P;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      " @!P bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Arrive on the barrier at shared::cta address `bar` of CTA `rank` of the cluster (default .cta-scope
// release: what it orders is the wgmma's completed reads of the stage, not memory another CTA reads).
__device__ __forceinline__ void mbar_arrive_in(u32 bar, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void tensormap_acquire(const void* tmap) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(tmap) : "memory");
}

// A TMA box into the same shared-memory offset of every CTA in `cta_mask`, completing on each one's `bar`.
template <int CLUSTER>
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* tmap, int x, int y, u32 bar) {
  if constexpr (CLUSTER == 1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar), "h"(static_cast<u16>((1u << CLUSTER) - 1)) : "memory");
  }
}

// Weight boxes, with an L2 policy: weights are read by few CTAs, x by every row tile. One box per step
// for each of the words and the scales of 8 row groups: as 16 separate bulk copies of 64-512 bytes the
// copies, not the tensor cores, set the pace (measured on the H200).
__device__ __forceinline__ void tma_load_3d_hint(u32 dst, const void* tmap, int x, int y, int z, u32 bar, u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;"
      :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(z), "r"(bar), "l"(policy) : "memory");
}

__device__ __forceinline__ void tma_load_4d_hint(u32 dst, const void* tmap, int x, int y, int z, int w, u32 bar,
                                                 u64 policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
      :: "r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar), "l"(policy) : "memory");
}

__device__ __forceinline__ u64 evict_first_policy() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// wgmma shared-memory descriptor of a K-major tile with 128B swizzle: rows of 128 bytes, 8-row groups
// 1024 bytes apart (SBO), leading offset unused (1), base 1024-byte aligned.
__device__ __forceinline__ u64 smem_desc_128b(u32 addr) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ u32 bf16_bits(float v) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// @GENERATED@

// Keeps the compiler from touching the accumulators before the wgmmas that write them have completed.
template <int BM>
__device__ __forceinline__ void fence_accumulators(float (&acc)[BM / 2]) {
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) asm volatile("" : "+f"(acc[i]) :: "memory");
}

// One thread's 16 dequantized weights of rows g and g + 8 (rsel) at a K step, as bf16x2 pairs in true K
// order: pair[rsel][i2][p] holds k = 16t + 8 i2 + 2p, +1 (layout.py: k = 16t + 8 i2 + 4 i1 + 2 khi + i0,
// p = 2 i1 + khi). Word q of a lane is (khi, rsel) for FP4 and (khi, rsel, k4 = i2) for FP8.
template <int FMT>
__device__ __forceinline__ void decode_step(u32 w_addr, u32 s_addr, u32 (&pair)[2][2][4]) {
  u16 sc;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(sc) : "r"(s_addr));
  const u32 s[2] = {static_cast<u32>(sc & 0xFF), static_cast<u32>(sc >> 8)};
  if constexpr (FMT == 2) {
    u32 w[8];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(w_addr));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[4]), "=r"(w[5]), "=r"(w[6]), "=r"(w[7]) : "r"(w_addr + 16));
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int khi = q >> 2, rsel = (q >> 1) & 1, k4 = q & 1;
      u32 r[2];
      decode_fp8(w[q], s[rsel], r);
      pair[rsel][k4][khi] = r[0];
      pair[rsel][k4][2 + khi] = r[1];
    }
  } else {
    u32 w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(w_addr));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int khi = q >> 1, rsel = q & 1;
      u32 r[4];
      if constexpr (FMT == 0) decode_nvfp4(w[q], s[rsel], r);
      else decode_mxfp4(w[q], s[rsel], r);
#pragma unroll
      for (int j = 0; j < 4; ++j) pair[rsel][j >> 1][2 * (j & 1) + khi] = r[j];
    }
  }
}

template <int FMT, int BM, int STAGES, int CLUSTER>
__device__ __forceinline__ void consume(u32 smem, u32 full, u32 empty, const float* __restrict__ row_mult, const u16* __restrict__ bias,
                                        u16* __restrict__ y, int M, int N, int KT, int ldy, int m_tile,
                                        int n_tile, bool has_weights) {
  using L = Smem<FMT, BM, STAGES>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4, wq = warp % 4, rg = warp;  // row group rg = 16 weight rows
  const int g = lane / 4, t = lane % 4;
  const int scale_lane = FMT == 0 ? lane : (lane / 4) * 2 + (t / 2);  // MX: lanes 2j, 2j+1 share a block of 32
  const u32 a_tiles = smem + L::A_OFF + wg * 2 * A_TILE_BYTES;
  float acc[BM / 2];  // not zeroed: the first wgmma ignores it (scale-d 0), and an instruction writing
                     // the accumulators between wgmmas would make ptxas serialize them

  for (int kt = 0; kt < KT; ++kt) {
    const int stage = kt % STAGES;
    mbar_wait(full + 8 * stage, (kt / STAGES) & 1);
    u32 pair[2][2][4];
    decode_step<FMT>(smem + L::W_OFF + stage * L::W_BYTES + rg * DATA_BYTES<FMT> + lane * (DATA_BYTES<FMT> / 32),
                     smem + L::S_OFF + stage * L::S_BYTES + rg * SCALE_BYTES<FMT> + scale_lane * 2, pair);
    const u32 a = a_tiles + (kt & 1) * A_TILE_BYTES;
#pragma unroll
    for (int rsel = 0; rsel < 2; ++rsel) {
      const u32 row = a + (16 * wq + 8 * rsel + g) * X_ROW_BYTES;
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "r"(row + (((2 * t + i2) ^ g) << 4)), "r"(pair[rsel][i2][0]), "r"(pair[rsel][i2][1]),
                        "r"(pair[rsel][i2][2]), "r"(pair[rsel][i2][3]) : "memory");
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy stores -> wgmma reads
    named_barrier_sync(1 + wg, 128);
    const u32 x_stage = smem + L::X_OFF + stage * L::X_BYTES;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      wgmma_bf16<BM>(acc, smem_desc_128b(a + 32 * c), smem_desc_128b(x_stage + 32 * c), kt > 0 || c > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    if (kt > 0 && lane < CLUSTER) {  // step kt - 1's stage is read: release it in every CTA of the cluster
      const u32 bar = empty + 8 * ((kt - 1) % STAGES);
      if constexpr (CLUSTER == 1) mbar_arrive(bar);
      else mbar_arrive_in(bar, lane);
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  fence_accumulators<BM>(acc);
  if (!has_weights) return;

  // acc[4i + 2h + c]: weight row 16 wq + g + 8h of the warpgroup, activation row 8i + 2t + c
  const int n0 = n_tile * ROWS + 64 * wg + 16 * wq + g;
  float mult[2], add[2] = {0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mult[h] = row_mult[n0 + 8 * h];
    if (bias != nullptr && n0 + 8 * h < N) add[h] = __uint_as_float(static_cast<u32>(bias[n0 + 8 * h]) << 16);
  }
  const int m0 = m_tile * BM + 2 * t;
#pragma unroll
  for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = m0 + 8 * i + c, n = n0 + 8 * h;
        if (m < M && n < N) y[static_cast<long>(m) * ldy + n] = bf16_bits(acc[4 * i + 2 * h + c] * mult[h] + add[h]);
      }
    }
  }
}


template <int FMT, int BM, int STAGES, int CLUSTER>
__global__ void __launch_bounds__(THREADS, 1)
wgmma_ws_gemm(const u64* __restrict__ x_tmap, const u64* __restrict__ w_tmaps, const float* __restrict__ row_mult,
              const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int KT, int ldy, int m_tiles,
              int n_tiles, int group_m) {
  using L = Smem<FMT, BM, STAGES>;
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  const u32 full = smem + L::FULL_OFF, empty = smem + L::EMPTY_OFF;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // a cluster: one m tile, CLUSTER consecutive n tiles (past n_tiles when they do not divide: such a CTA
  // still loads and multicasts its share of x, but reads no weights and writes nothing). Clusters run
  // through groups of group_m m tiles, m fastest within a group, so the CTAs resident at once share
  // an L2-sized slice of x rather than streaming all of a large x from memory for every n tile.
  const int cluster_id = blockIdx.x / CLUSTER;
  const u32 rank = CLUSTER == 1 ? 0 : cluster_rank();
  const int per_group = group_m * ((n_tiles + CLUSTER - 1) / CLUSTER);
  const int first_m = cluster_id / per_group * group_m;
  const int group_rows = min(m_tiles - first_m, group_m);
  const int m_tile = first_m + cluster_id % per_group % group_rows;
  const int n_tile = cluster_id % per_group / group_rows * CLUSTER + rank;
  const bool has_weights = n_tile < n_tiles;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 8 * CLUSTER);  // one arrival per consumer warp of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CLUSTER > 1) cluster_sync();  // peers' barriers exist before anything arrives on them
  else __syncthreads();

  if (warp == PRODUCER_WARP) {
    const u64* data_tmap = w_tmaps;  // words (256 bytes, DATA / 256, K steps, row groups)
    const u64* scale_tmap = w_tmaps + 16;  // scales (SCALE bytes, K steps, row groups)
    if (lane == 0) {
      tensormap_acquire(x_tmap);
      tensormap_acquire(data_tmap);
      tensormap_acquire(scale_tmap);
    }
    __syncwarp();
    const u64 policy = evict_first_policy();
    for (int kt = 0; kt < KT; ++kt) {
      const int stage = kt % STAGES;
      const u32 f = full + 8 * stage;
      mbar_wait(empty + 8 * stage, ((kt / STAGES) & 1) ^ 1);
      if (lane == 0) {
        mbar_arrive_expect_tx(f, has_weights ? L::STAGE_TX : L::X_BYTES);  // x bytes from every CTA
        constexpr int SHARE = BM / CLUSTER;
        tma_load_2d<CLUSTER>(smem + L::X_OFF + stage * L::X_BYTES + rank * SHARE * X_ROW_BYTES, x_tmap,
                             kt * X_ROW_BYTES, m_tile * BM + rank * SHARE, f);
        if (has_weights) {
          tma_load_4d_hint(smem + L::W_OFF + stage * L::W_BYTES, data_tmap, 0, 0, kt, n_tile * 8, f, policy);
          tma_load_3d_hint(smem + L::S_OFF + stage * L::S_BYTES, scale_tmap, 0, kt, n_tile * 8, f, policy);
        }
      }
    }
  } else {
    consume<FMT, BM, STAGES, CLUSTER>(smem, full, empty, row_mult, bias, y, M, N, KT, ldy, m_tile, n_tile,
                                      has_weights);
  }
  if constexpr (CLUSTER > 1) cluster_sync();  // no CTA leaves while a peer may still signal its barriers
}

}  // namespace ms90
