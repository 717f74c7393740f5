// Decode GEMM for small M on sm_90a, fed by a TMA ring (warp-specialized):
//
//     y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias),  M <= BM (8 or 16), x and y bf16, fp32 accumulation
//
// The Triton decode kernel (decode.py) holds every weight byte in flight in registers; this one lets a
// producer warp bring STEPS K steps of RGS row groups (and x's BM rows) per stage into a STAGES-deep
// shared-memory ring by TMA, so the bytes in flight do not cost registers. Each consumer warp owns one
// row group (16 weight rows): per K step it reads its 16 bytes of words and 2 of scales from the ring,
// decodes them (decode.py's PTX, generated into wgmma_ws.cuh's helpers) and issues mma.sync m16n8k16 with
// the weights as A and x as B, as the Triton kernel does. With KW > 1, KW consumer warps share a row group,
// warp p taking the K steps s = p mod KW of each stage, and their partials are summed through shared memory
// in warp order: small weights give an SM few row groups, and one warp per scheduler leaves the decode's
// latency exposed. Split-K over the CTAs of a cluster, the partials summed through distributed shared
// memory in rank order. With GATED the weight holds gate/up row pairs (kernels/gated.py: rows g and g + 8
// of a row group, one thread's two accumulator halves) and y gets silu(gate) * up, N / 2 columns.
//
// The dispatch takes it where decode_ws.ring_wins. Compiled after wgmma_ws.cuh's source, whose helpers it uses.

namespace ms90 {

// A stage: x's STEPS boxes of BM rows, then the words [RGS][STEPS][DATA_BYTES], then the scales
// [RGS][STEPS][SCALE_BYTES] (the TMA boxes' order), padded to 1024 bytes; the full/empty barriers after the ring.
template <int FMT, int BM, int RGS, int STEPS, int STAGES>
struct RingSmem {
  static constexpr int X_STEP = BM * X_ROW_BYTES;  // one K step of x, 128B-swizzled rows
  static constexpr int X_BYTES = STEPS * X_STEP;
  static constexpr int W_BYTES = RGS * STEPS * DATA_BYTES<FMT>;
  static constexpr int S_BYTES = RGS * STEPS * SCALE_BYTES<FMT>;
  static constexpr u32 STAGE_TX = X_BYTES + W_BYTES + S_BYTES;
  static constexpr int STAGE = (STAGE_TX + 1023) / 1024 * 1024;
  static constexpr int FULL_OFF = STAGES * STAGE;
  static constexpr int EMPTY_OFF = FULL_OFF + 8 * STAGES;
  static constexpr int BYTES = EMPTY_OFF + 8 * STAGES + 1024;
  static constexpr int ACC = BM / 2;  // fp32 accumulators per thread
  static_assert(X_STEP % 1024 == 0, "swizzled x boxes must stay 1024-byte aligned");
  static_assert(RGS * 32 * ACC * 4 <= FULL_OFF, "the split-K partial must fit in the ring");
};

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One K step of a consumer warp: acc[8 j .. 8 j + 3] += W tile (16 rows) x^T (x rows 8 j .. 8 j + 7).
// The thread's pair P (physical k 16t + 2P, +1; decode_step) is the MMA's k slice P / 2, half P % 2, for
// the weights (A) and the activations (B) alike.
template <int FMT, int BM>
__device__ __forceinline__ void ring_step(float (&acc)[BM / 2], u32 w_addr, u32 s_addr, u32 x_step) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  u32 pair[2][2][4];
  decode_step<FMT>(w_addr, s_addr, pair);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const int row = 8 * j + g;  // x row; with 128B swizzle its 16-byte chunk c sits at c ^ (row % 8)
    u32 xw[8];
    ld_shared_v4(x_step + row * X_ROW_BYTES + (((2 * t) ^ g) << 4), xw);
    ld_shared_v4(x_step + row * X_ROW_BYTES + (((2 * t + 1) ^ g) << 4), xw + 4);
    float d[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int p0 = 2 * c, p1 = 2 * c + 1;
      const u32 a[4] = {pair[0][p0 / 4][p0 % 4], pair[1][p0 / 4][p0 % 4], pair[0][p1 / 4][p1 % 4],
                        pair[1][p1 / 4][p1 % 4]};
      mma_bf16_16816(d, a, xw[p0], xw[p1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[4 * j + i] = d[i];
  }
}

template <int FMT, int BM, int RGS, int KW, int STEPS, int STAGES, int SPLIT, int GATED>
__global__ void __launch_bounds__((RGS * KW + 1) * 32)
decode_ws_gemm(const __grid_constant__ TensorMap x_tmap, const __grid_constant__ TensorMap data_tmap,
               const __grid_constant__ TensorMap scale_tmap, const float* __restrict__ row_mult,
               const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int KT, int ldy, int steps) {
  using L = RingSmem<FMT, BM, RGS, STEPS, STAGES>;
  static_assert(STEPS % KW == 0, "a stage's K steps are shared out among the KW warps of a row group");
  static_assert(RGS * KW * 32 * L::ACC * 4 <= L::FULL_OFF, "the partials must fit in the ring");
  constexpr int CONSUMERS = RGS * KW;
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  const u32 full = smem + L::FULL_OFF, empty = smem + L::EMPTY_OFF;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_tile = blockIdx.x / SPLIT;
  const int part = SPLIT == 1 ? 0 : static_cast<int>(cluster_rank());
  const int kt0 = part * steps;
  const int stages_mine = max(0, min(KT - kt0, steps)) / STEPS;  // steps and KT are multiples of STEPS

  init_ring_barriers(full, empty, STAGES, CONSUMERS);

  float acc[L::ACC];
#pragma unroll
  for (int i = 0; i < L::ACC; ++i) acc[i] = 0.0f;
  if (warp == CONSUMERS) {
    if (lane == 0) {
      prefetch_tensormap(&x_tmap);
      prefetch_tensormap(&data_tmap);
      prefetch_tensormap(&scale_tmap);
      const u64 policy = evict_first_policy();
      auto load_weights = [&](int i) {
        const int stage = i % STAGES, kt = kt0 + i * STEPS;
        const u32 f = full + 8 * stage, base = smem + stage * L::STAGE;
        mbar_arrive_expect_tx(f, L::STAGE_TX);
        tma_load_4d_hint(base + L::X_BYTES, &data_tmap, 0, 0, kt, n_tile * RGS, f, policy);
        tma_load_3d_hint(base + L::X_BYTES + L::W_BYTES, &scale_tmap, 0, kt, n_tile * RGS, f, policy);
      };
      auto load_x = [&](int i) {
        const int stage = i % STAGES, kt = kt0 + i * STEPS;
#pragma unroll
        for (int s = 0; s < STEPS; ++s)
          tma_load_2d_cta(smem + stage * L::STAGE + s * L::X_STEP, &x_tmap, (kt + s) * X_ROW_BYTES, 0, full + 8 * stage);
      };
      // The weights are never written by a kernel: under a programmatic dependent launch the first stages'
      // weights stream in while the kernel before this one finishes; x is its output.
      const int first = min(stages_mine, STAGES);
      for (int i = 0; i < first; ++i) load_weights(i);
      wait_prior_grid();
      for (int i = 0; i < first; ++i) load_x(i);
      for (int i = first; i < stages_mine; ++i) {
        mbar_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);
        load_weights(i);
        load_x(i);
      }
    } else {
      wait_prior_grid();  // every thread waits before it reaches release_dependents below
    }
  } else {
    wait_prior_grid();  // and the consumers store y, which the kernel before this one may still read
    const int scale_lane = FMT == 0 ? lane : (lane / 4) * 2 + (lane % 4) / 2;
    const int group = warp % RGS, kw = warp / RGS;
    for (int i = 0; i < stages_mine; ++i) {
      const int stage = i % STAGES;
      const u32 base = smem + stage * L::STAGE;
      mbar_wait(full + 8 * stage, (i / STAGES) & 1);
#pragma unroll
      for (int j = 0; j < STEPS / KW; ++j) {
        const int s = kw + j * KW;
        const u32 words = base + L::X_BYTES + (group * STEPS + s) * DATA_BYTES<FMT> + lane * (DATA_BYTES<FMT> / 32);
        const u32 scales = base + L::X_BYTES + L::W_BYTES + (group * STEPS + s) * SCALE_BYTES<FMT> + scale_lane * 2;
        ring_step<FMT, BM>(acc, words, scales, base + s * L::X_STEP);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * stage);
    }
  }

  release_dependents();  // what is left (the split-K sum, the stores) overlaps the next kernel's launch

  // acc[4 j + 2 h + c]: weight row 16 warp + g + 8 h of the tile, activation row 8 j + 2 t + c
  bool mine = warp < RGS;
  const u32 partial = smem + (warp * 32 + lane) * (4 * L::ACC);
  auto store_partial = [&]() {
#pragma unroll
    for (int i = 0; i < L::ACC; i += 4)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(partial + 4 * i), "f"(acc[i]), "f"(acc[i + 1]),
                   "f"(acc[i + 2]), "f"(acc[i + 3]) : "memory");
  };
  if constexpr (KW > 1) {
    __syncthreads();  // every consumer is done with the ring: it takes the partials
    if (warp < CONSUMERS && warp >= RGS) store_partial();
    __syncthreads();
    if (mine) {  // the row group's first warp adds the others' partials in warp order
#pragma unroll
      for (int p = 1; p < KW; ++p) {
#pragma unroll
        for (int i = 0; i < L::ACC; i += 4) {
          float v[4];
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                       : "r"(partial + p * RGS * 32 * 4 * L::ACC + 4 * i) : "memory");
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i + j] += v[j];
        }
      }
    }
  }
  if constexpr (SPLIT > 1) {
    if constexpr (KW == 1) __syncthreads();  // every consumer is done with the ring: it takes the partials
    if (mine) store_partial();
    cluster_sync();
    mine = warp < RGS && warp % SPLIT == part;  // each CTA sums and stores the rows of RGS / SPLIT warps
    if (mine) {
#pragma unroll
      for (int i = 0; i < L::ACC; i += 4) {
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) {
          float v[4];
          asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                       : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                       : "r"(map_to_rank(partial + 4 * i, r))
                       : "memory");
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i + j] = r == 0 ? v[j] : acc[i + j] + v[j];
        }
      }
    }
  }
  if (mine) {
    const int g = lane / 4, t = lane % 4;
    const int n0 = (n_tile * RGS + warp) * 16 + g;
    float mult[2], add[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min(n0 + 8 * h, N - 1);  // rows past N are computed and never stored
      mult[h] = row_mult[n];
      add[h] = bias != nullptr ? __uint_as_float(static_cast<u32>(bias[n]) << 16) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = 8 * j + 2 * t + c;
        if (m >= M) continue;
        const float v0 = acc[4 * j + c] * mult[0] + add[0], v1 = acc[4 * j + 2 + c] * mult[1] + add[1];
        if constexpr (GATED) {  // the pair (gate, up) -> output column 8 (row group) + g
          if (n0 < N) y[static_cast<long>(m) * ldy + n0 / 16 * 8 + g] = bf16_bits(v0 / (1.0f + __expf(-v0)) * v1);
        } else {
          if (n0 < N) y[static_cast<long>(m) * ldy + n0] = bf16_bits(v0);
          if (n0 + 8 < N) y[static_cast<long>(m) * ldy + n0 + 8] = bf16_bits(v1);
        }
      }
    }
  }
  if constexpr (SPLIT > 1) cluster_sync();  // no CTA leaves while a peer may still read its partial
}

}  // namespace ms90
