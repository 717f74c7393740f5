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
// latency exposed. Split-K over the CTAs of a cluster: a CTA sends its partials of the rows a peer stores
// into the peer's shared memory (st.async, completing a barrier there), where they are summed in rank order;
// only the receiver waits for them, no cluster barrier for the slower CTA of the pair. With GATED the weight
// holds gate/up row pairs (kernels/gated.py: rows g and g + 8 of a row group, one thread's two accumulator
// halves) and y gets silu(gate) * up, N / 2 columns.
// With NORM (kernels/rmsnorm.py) x is h and the kernel computes y = W rmsnorm(h) * norm_weight: a norm warp
// takes each stage as it lands, sums the squares of h's rows and multiplies h by norm_weight in place (bf16,
// as the module rounds it) before the consumers' ready barrier; the epilogue scales the rows by
// rsqrt(sum / K + eps), the sums of a cluster's K parts added in rank order. With RESID y = residual + ...,
// added in float32 before the rounding.
//
// The dispatch takes it where decode_ws.ring_wins. Compiled after wgmma_ws.cuh's source, whose helpers it uses.

namespace ms90 {

// A stage: x's STEPS boxes of BM rows, then the words [RGS][STEPS][DATA_BYTES], then the scales
// [RGS][STEPS][SCALE_BYTES] (the TMA boxes' order), padded to 1024 bytes; the full/empty barriers after the ring.
// SPLIT > 1: the peers' partials of the row groups this CTA stores and (NORM) their x row sums land in RECV,
// [SPLIT ranks][OWNED warps][32 lanes][ACC] floats then [SPLIT][BM] floats, completing the RECV_BAR barrier.
template <int FMT, int BM, int RGS, int STEPS, int STAGES, int NORM, int SPLIT>
struct RingSmem {
  static constexpr int X_STEP = BM * X_ROW_BYTES;  // one K step of x, 128B-swizzled rows
  static constexpr int X_BYTES = STEPS * X_STEP;
  static constexpr int W_BYTES = RGS * STEPS * DATA_BYTES<FMT>;
  static constexpr int S_BYTES = RGS * STEPS * SCALE_BYTES<FMT>;
  static constexpr u32 STAGE_TX = X_BYTES + W_BYTES + S_BYTES;
  static constexpr int STAGE = (STAGE_TX + 1023) / 1024 * 1024;
  static constexpr int FULL_OFF = STAGES * STAGE;
  static constexpr int EMPTY_OFF = FULL_OFF + 8 * STAGES;
  static constexpr int READY_OFF = EMPTY_OFF + 8 * STAGES;  // NORM: x normalized, per stage
  static constexpr int SUMSQ_OFF = READY_OFF + (NORM ? 8 * STAGES : 0);  // NORM: x's sums of squares, BM floats
  static constexpr int ACC = BM / 2;  // fp32 accumulators per thread
  static constexpr int OWNED = (RGS + SPLIT - 1) / SPLIT;  // row groups a CTA of the cluster stores, at most
  static constexpr int RECV_BAR_OFF = SUMSQ_OFF + (NORM ? 4 * BM : 0);
  static constexpr int RECV_OFF = (RECV_BAR_OFF + (SPLIT > 1 ? 8 : 0) + 15) / 16 * 16;
  static constexpr int RECV_SUMSQ_OFF = RECV_OFF + SPLIT * OWNED * 32 * ACC * 4;
  static constexpr int RECV_BYTES = SPLIT > 1 ? SPLIT * (OWNED * 32 * ACC * 4 + (NORM ? 4 * BM : 0)) : 0;
  // NORM: the K part's slice of the norm weight, `steps` x 128 bytes (a launch-time size) after BYTES' share
  static constexpr int WEIGHT_OFF = (RECV_OFF + RECV_BYTES + 15) / 16 * 16;
  static constexpr int BYTES = WEIGHT_OFF + 1024;
  static_assert(X_STEP % 1024 == 0, "swizzled x boxes must stay 1024-byte aligned");
};

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One K step of a consumer warp: acc[r][c % CH][4 j .. 4 j + 3] += W tile (16 rows of row group r, k slice c of
// the step) x^T (x rows 8 j .. 8 j + 7). CH accumulators per row group shorten the chain of dependent MMAs.
// The thread's pair P (physical k 16t + 2P, +1; decode_step) is the MMA's k slice P / 2, half P % 2, for
// the weights (A) and the activations (B) alike. x_addr: the K step's x box plus x_lane_offset().
// GPW row groups (words and scales W_STRIDE and S_STRIDE bytes apart) share the x registers: at M = 16 the x loads
// take 4 times the shared-memory bytes of the words.
template <int FMT, int BM, int GPW, int CH, int W_STRIDE, int S_STRIDE>
__device__ __forceinline__ void ring_step(float (&acc)[GPW][CH][BM / 2], u32 w_addr, u32 s_addr, u32 x_addr) {
  u32 pair[GPW][2][2][4];
#pragma unroll
  for (int r = 0; r < GPW; ++r) decode_step<FMT>(w_addr + r * W_STRIDE, s_addr + r * S_STRIDE, pair[r]);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    u32 xw[8];  // rows 8 j + g, chunks 2t and 2t + 1 (the swizzle flips bit 4 of the offset between them)
    ld_shared_v4(x_addr + j * 8 * X_ROW_BYTES, xw);
    ld_shared_v4((x_addr + j * 8 * X_ROW_BYTES) ^ 16u, xw + 4);
#pragma unroll
    for (int r = 0; r < GPW; ++r) {
      float d[CH][4];
#pragma unroll
      for (int h = 0; h < CH; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) d[h][i] = acc[r][h][4 * j + i];
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int p0 = 2 * c, p1 = 2 * c + 1;
        const u32 a[4] = {pair[r][0][p0 / 4][p0 % 4], pair[r][1][p0 / 4][p0 % 4], pair[r][0][p1 / 4][p1 % 4],
                          pair[r][1][p1 / 4][p1 % 4]};
        mma_bf16_16816(d[c % CH], a, xw[p0], xw[p1]);
      }
#pragma unroll
      for (int h = 0; h < CH; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][h][4 * j + i] = d[h][i];
      }
    }
  }
}

// The lane's offset in a K step's x box: row g (= lane / 4), 16-byte chunk 2t (t = lane % 4), which the 128B swizzle
// puts at chunk 2t ^ g. A 1024-byte-aligned box keeps bit 4 of the address the chunk's parity.
__device__ __forceinline__ u32 x_lane_offset() {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  return g * X_ROW_BYTES + (((2 * t) ^ g) << 4);
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The norm warp (NORM): first its K part's slice of norm_weight into shared memory at `weight` (cp.async, zeros
// past K; a constant, so before griddepcontrol.wait); then for each stage, as it lands, every bf16 of x's rows
// m < M gets its square added to the row's sum and is multiplied by the norm weight in place, and the stage is
// ready for the consumers. Lane (8 q + c) takes 16-byte chunk c of rows q, q + 4, ... of every K step. The row
// sums end in shared memory at sumsq (in lanes' order, then a butterfly over the 8 lanes of a row: the same
// order in every CTA and run).
template <int BM, int STEPS, int STAGES, int X_STEP, int STAGE>
__device__ __forceinline__ void normalize_stages(u32 smem, u32 full, u32 ready, u32 sumsq, u32 weight,
                                                 const u16* __restrict__ norm_weight, int kt0, int stages_mine,
                                                 int M, int K) {
  const int lane = threadIdx.x % 32, c = lane % 8, q = lane / 8;
  for (int j = lane; j < stages_mine * STEPS * 8; j += 32) {  // K % 8 == 0: a chunk is all in or all out
    const int k = kt0 * 64 + 8 * j;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(weight + 16 * j), "l"(norm_weight + (k < K ? k : 0)), "r"(k < K ? 16 : 0) : "memory");
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncwarp();
  wait_prior_grid();
  float ss[BM / 4];
#pragma unroll
  for (int r = 0; r < BM / 4; ++r) ss[r] = 0.0f;
  for (int i = 0; i < stages_mine; ++i) {
    const int stage = i % STAGES;
    const u32 base = smem + stage * STAGE;
    mbar_wait(full + 8 * stage, (i / STAGES) & 1);
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      u32 w[4];
      ld_shared_v4(weight + ((i * STEPS + s) * 8 + c) * 16, w);
#pragma unroll
      for (int r = 0; r < BM / 4; ++r) {
        const int row = q + 4 * r;
        if (row >= M) continue;  // rows past M are TMA's zeros, never stored
        const u32 addr = base + s * X_STEP + row * X_ROW_BYTES + ((c ^ (row % 8)) << 4);
        u32 v[4];
        ld_shared_v4(addr, v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lo = __uint_as_float(v[e] << 16), hi = __uint_as_float(v[e] & 0xffff0000u);
          ss[r] = fmaf(hi, hi, fmaf(lo, lo, ss[r]));
          v[e] = mul_bf16x2(v[e], w[e]);
        }
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                     "r"(v[3]) : "memory");
      }
    }
    // the stage's next bytes come by TMA (the async proxy): order these generic-proxy writes before them
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) mbar_arrive(ready + 8 * stage);
  }
#pragma unroll
  for (int r = 0; r < BM / 4; ++r) {
#pragma unroll
    for (int o = 1; o < 8; o *= 2) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
    if (c == 0) asm volatile("st.shared.f32 [%0], %1;" :: "r"(sumsq + 4 * (q + 4 * r)), "f"(ss[r]) : "memory");
  }
}

// One CTA per SM (the launch asks for most of its shared memory): min blocks 1 lets ptxas give each thread the
// registers the CTA's warps leave, where its occupancy heuristic spilled MXFP8 tilings into a stack frame
template <int FMT, int BM, int RGS, int KW, int GPW, int CH, int LEAD, int STEPS, int STAGES, int SPLIT, int GATED,
          int NORM, int RESID>
__global__ void __launch_bounds__((RGS * KW / GPW + 1 + NORM) * 32, 1)
decode_ws_gemm(const __grid_constant__ TensorMap x_tmap, const __grid_constant__ TensorMap data_tmap,
               const __grid_constant__ TensorMap scale_tmap, const float* __restrict__ row_mult,
               const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int KT, int ldy, int steps,
               const u16* __restrict__ norm_weight, float norm_eps, int K, const u16* __restrict__ residual,
               int ldr) {
  using L = RingSmem<FMT, BM, RGS, STEPS, STAGES, NORM, SPLIT>;
  static_assert(STEPS % KW == 0, "a stage's K steps are shared out among the KW warps of a row group");
  static_assert(RGS * KW * 32 * L::ACC * 4 <= L::FULL_OFF, "the partials must fit in the ring");
  static_assert(GPW == 1 || (RGS % GPW == 0 && KW >= GPW), "a warp per row group must be left for the epilogue");
  constexpr int CONSUMERS = RGS * KW / GPW;
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  const u32 full = smem + L::FULL_OFF, empty = smem + L::EMPTY_OFF, ready = smem + L::READY_OFF;
  const u32 sumsq = smem + L::SUMSQ_OFF, recv = smem + L::RECV_OFF, recv_bar = smem + L::RECV_BAR_OFF;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_tile = blockIdx.x / SPLIT;
  const int part = SPLIT == 1 ? 0 : static_cast<int>(cluster_rank());
  const int kt0 = part * steps;
  const int stages_mine = max(0, min(KT - kt0, steps)) / STEPS;  // steps and KT are multiples of STEPS

  if (NORM && threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(ready + 8 * s, 1);  // fenced with the others'
  }
  if (SPLIT > 1 && threadIdx.x == 0) mbar_init(recv_bar, 1);
  init_ring_barriers(full, empty, STAGES, CONSUMERS);
  if constexpr (SPLIT > 1) {
    // The peers' partials for the row groups this CTA stores (and their row sums) complete recv_bar, and no
    // peer may send before the barrier is initialized: the cluster barrier's wait comes after the K loop.
    if (threadIdx.x == 0) {
      const int owned = (RGS - part + SPLIT - 1) / SPLIT;
      mbar_arrive_expect_tx(recv_bar, (SPLIT - 1) * (owned * 32 * L::ACC * 4 + (NORM ? 4 * BM : 0)));
    }
    cluster_arrive_relaxed();
  }

  float accs[GPW][CH][L::ACC];  // the warp's row groups; after the K loop acc is the sum for the row group it stores
#pragma unroll
  for (int r = 0; r < GPW; ++r) {
#pragma unroll
    for (int h = 0; h < CH; ++h) {
#pragma unroll
      for (int i = 0; i < L::ACC; ++i) accs[r][h][i] = 0.0f;
    }
  }
  float (&acc)[L::ACC] = accs[0][0];

  // The epilogue's operands are loaded before the K loop, so that they add no memory round trip to the kernel's
  // tail: the rows' factors and bias (constants, before griddepcontrol.wait) and the residual (after it). After
  // the split-K sum, warp w < RGS of the CTA with rank w % SPLIT stores weight rows n0 and n0 + 8 of its tile.
  const int g = lane / 4, t = lane % 4;
  const int n0 = (n_tile * RGS + warp) * 16 + g;
  const bool stores = warp < RGS && warp % SPLIT == part;
  float mult[2] = {0.0f, 0.0f}, add[2] = {0.0f, 0.0f};
  // [j][c][h]: activation row 8 j + 2 t + c, weight row n0 + 8 h (GATED: h = 0); -0 adds nothing, to -0 too
  float res[BM / 8][2][2];
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) res[j][0][0] = res[j][0][1] = res[j][1][0] = res[j][1][1] = -0.0f;
  if (stores) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min(n0 + 8 * h, N - 1);  // rows past N are computed and never stored
      mult[h] = row_mult[n];
      add[h] = bias != nullptr ? bf16_value(bias[n]) : 0.0f;
    }
  }
  auto load_residual = [&]() {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = 8 * j + 2 * t + c;
        if (m >= M || n0 >= N) continue;
        const u16* row = residual + static_cast<long>(m) * ldr;
        if constexpr (GATED) {
          res[j][c][0] = bf16_value(row[n0 / 16 * 8 + g]);
        } else {
          res[j][c][0] = bf16_value(row[n0]);
          if (n0 + 8 < N) res[j][c][1] = bf16_value(row[n0 + 8]);
        }
      }
    }
  };

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
      // weights stream in while the kernel before this one finishes; x is its output. The memory serves a
      // ring's requests together, so a whole ring issued at once lands its first stage only when the whole
      // ring has landed. So the first fill keeps LEAD stages in flight: each further stage goes out once the one
      // LEAD before it has landed (ring_config picks LEAD: 2 for the norm-fused calls and rings of large stages,
      // else the whole ring).
      const int first = min(stages_mine, STAGES), lead = min(first, LEAD);
      for (int i = 0; i < lead; ++i) load_weights(i);
      wait_prior_grid();
      for (int i = 0; i < lead; ++i) load_x(i);
      for (int i = lead; i < first; ++i) {
        mbar_wait(full + 8 * i - 8 * lead, 0);
        load_weights(i);
        load_x(i);
      }
      for (int i = first; i < stages_mine; ++i) {
        mbar_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);
        load_weights(i);
        load_x(i);
      }
    } else {
      wait_prior_grid();  // every thread waits before it reaches release_dependents below
    }
  } else if (NORM && warp > CONSUMERS) {  // the norm warp (it waits for the prior grid after its weight loads)
    normalize_stages<BM, STEPS, STAGES, L::X_STEP, L::STAGE>(smem, full, ready, sumsq, smem + L::WEIGHT_OFF,
                                                             norm_weight, kt0, stages_mine, M, K);
  } else {
    wait_prior_grid();  // and the consumers store y, which the kernel before this one may still read
    if (RESID && stores) load_residual();
    const int scale_lane = FMT == 0 ? lane : (lane / 4) * 2 + (lane % 4) / 2;
    const int group = warp % (RGS / GPW) * GPW, kw = warp / (RGS / GPW);
    // The warp's addresses in stage 0, made opaque to ptxas, which otherwise recomputes them in every trip from the
    // CTA id and the lane; the stage and its phase advance by counting. The NVFP4 M <= 8 loop takes 145 SASS
    // instructions per stage instead of 164-168, its consumers alone 8% less time (sweep_h200.json run 27e).
    u32 words = smem + L::X_BYTES + (group * STEPS + kw) * DATA_BYTES<FMT> + lane * (DATA_BYTES<FMT> / 32);
    u32 scales = smem + L::X_BYTES + L::W_BYTES + (group * STEPS + kw) * SCALE_BYTES<FMT> + scale_lane * 2;
    u32 x = smem + kw * L::X_STEP + x_lane_offset();
    asm volatile("" : "+r"(words), "+r"(scales), "+r"(x));
    u32 stage = 0, phase = 0;
    for (int i = 0; i < stages_mine; ++i) {
      const u32 offset = stage * L::STAGE;
      mbar_wait((NORM ? ready : full) + 8 * stage, phase);
#pragma unroll
      for (int j = 0; j < STEPS / KW; ++j) {
        ring_step<FMT, BM, GPW, CH, STEPS * DATA_BYTES<FMT>, STEPS * SCALE_BYTES<FMT>>(
            accs, words + offset + j * KW * DATA_BYTES<FMT>, scales + offset + j * KW * SCALE_BYTES<FMT>,
            x + offset + j * KW * L::X_STEP);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * stage);
      if (++stage == STAGES) stage = 0, phase ^= 1;
    }
#pragma unroll
    for (int r = 0; r < GPW; ++r) {
#pragma unroll
      for (int h = 1; h < CH; ++h) {
#pragma unroll
        for (int i = 0; i < L::ACC; ++i) accs[r][0][i] += accs[r][h][i];
      }
    }
  }

  release_dependents();  // what is left (the split-K sum, the stores) overlaps the next kernel's launch

  // acc[4 j + 2 h + c]: weight row 16 warp + g + 8 h of the tile, activation row 8 j + 2 t + c
  bool mine = warp < RGS;
  // the partials of row group rg from the warps taking K steps kw (mod KW), [KW][RGS][32 lanes][ACC] floats
  auto partial = [&](int kw_, int rg) { return smem + ((kw_ * RGS + rg) * 32 + lane) * (4 * L::ACC); };
  if constexpr (KW > 1 || NORM) {
    __syncthreads();  // every consumer is done with the ring (it takes the partials); the norm warp's sums are in
  }
  if constexpr (KW > 1) {
    // warp w < RGS sums row group w's partials in kw order, starting from its own with GPW = 1
    if (warp < CONSUMERS && (GPW > 1 || warp >= RGS)) {
      const int kw = warp / (RGS / GPW), group = warp % (RGS / GPW) * GPW;
#pragma unroll
      for (int r = 0; r < GPW; ++r) {
#pragma unroll
        for (int i = 0; i < L::ACC; i += 4)
          asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(partial(kw, group + r) + 4 * i),
                       "f"(accs[r][0][i]), "f"(accs[r][0][i + 1]), "f"(accs[r][0][i + 2]), "f"(accs[r][0][i + 3])
                       : "memory");
      }
    }
    __syncthreads();
    if (mine) {
#pragma unroll
      for (int p = GPW > 1 ? 0 : 1; p < KW; ++p) {
#pragma unroll
        for (int i = 0; i < L::ACC; i += 4) {
          float v[4];
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                       : "r"(partial(p, warp) + 4 * i) : "memory");
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i + j] = p == 0 ? v[j] : acc[i + j] + v[j];
        }
      }
    }
  }
  if constexpr (SPLIT > 1) {
    // Each CTA stores the rows of warps w = rank (mod SPLIT); the others send it their K parts' sums of those
    // rows, which it adds in rank order (the same sum whatever CTA finishes first).
    cluster_wait();
    if (mine && warp % SPLIT != part) {
      const u32 owner = warp % SPLIT, bar = map_to_rank(recv_bar, owner);
      const u32 slot = recv + ((part * L::OWNED + warp / SPLIT) * 32 + lane) * (4 * L::ACC);
#pragma unroll
      for (int i = 0; i < L::ACC; i += 4)
        st_async_v4(map_to_rank(slot + 4 * i, owner), acc[i], acc[i + 1], acc[i + 2], acc[i + 3], bar);
    }
    if (NORM && threadIdx.x < BM) {  // x's row sums, complete since the __syncthreads above, to every peer
      float v;
      asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(sumsq + 4 * threadIdx.x) : "memory");
#pragma unroll
      for (int r = 0; r < SPLIT; ++r) {
        if (r != part) {
          st_async_f32(map_to_rank(smem + L::RECV_SUMSQ_OFF + 4 * (part * BM + threadIdx.x), r), v,
                       map_to_rank(recv_bar, r));
        }
      }
    }
    mine = stores;
    if (mine) {
      mbar_wait_cluster(recv_bar, 0);
      const u32 slots = recv + ((warp / SPLIT) * 32 + lane) * (4 * L::ACC);
#pragma unroll
      for (int i = 0; i < L::ACC; i += 4) {
        const float own[4] = {acc[i], acc[i + 1], acc[i + 2], acc[i + 3]};
#pragma unroll
        for (int r = 0; r < SPLIT; ++r) {
          float v[4] = {own[0], own[1], own[2], own[3]};
          if (r != part) {
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                         : "r"(slots + r * L::OWNED * 32 * 4 * L::ACC + 4 * i) : "memory");
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i + j] = r == 0 ? v[j] : acc[i + j] + v[j];
        }
      }
    }
  }
  if (stores) {
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = 8 * j + 2 * t + c;
        if (m >= M) continue;
        float rstd = 1.0f;
        if constexpr (NORM) {  // the K parts' sums in rank order: the same total in every CTA of the cluster
          float total = 0.0f;
#pragma unroll
          for (int r = 0; r < SPLIT; ++r) {
            float v;
            const u32 sums = r == part ? sumsq : smem + L::RECV_SUMSQ_OFF + 4 * BM * r;
            asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(sums + 4 * m) : "memory");
            total += v;
          }
          rstd = rsqrtf(total / static_cast<float>(K) + norm_eps);
        }
        const float v0 = acc[4 * j + c] * rstd * mult[0] + add[0], v1 = acc[4 * j + 2 + c] * rstd * mult[1] + add[1];
        u16* row = y + static_cast<long>(m) * ldy;
        if constexpr (GATED) {  // the pair (gate, up) -> output column 8 (row group) + g
          if (n0 < N) row[n0 / 16 * 8 + g] = bf16_bits(v0 / (1.0f + __expf(-v0)) * v1 + res[j][c][0]);
        } else {
          if (n0 < N) row[n0] = bf16_bits(v0 + res[j][c][0]);
          if (n0 + 8 < N) row[n0 + 8] = bf16_bits(v1 + res[j][c][1]);
        }
      }
    }
  }
}

}  // namespace ms90
