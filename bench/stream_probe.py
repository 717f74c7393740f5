"""What bounds the M = 1 decode kernels' stream: probes on the H200.

    PYTHONPATH=. python3 bench/stream_probe.py --out bench/results/stream_probe_h200.json
    PYTHONPATH=. python3 bench/stream_probe.py --probe ring --out bench/results/stream_ring_h200.json
    PYTHONPATH=. python3 bench/stream_probe.py --probe ws-waits|ws-timeline|ws-fill --out ...
    PYTHONPATH=. python3 bench/stream_probe.py --probe ws-promotion --out ...
    PYTHONPATH=. python3 bench/stream_probe.py --probe queue --out bench/results/stream_queue_h200.json
    PYTHONPATH=. python3 bench/stream_probe.py --probe ws-floor --out bench/results/ws_floor_h200.json

1. (--probe read, the default) Read-only kernels over the bytes of an NVFP4 weight's words (no scales, no decode, no MMA) in
   the decode kernel's access pattern: a program of 4 warps over 4 row groups (64 rows) and one K
   split; each warp streams its row group's [K/64, 512 B] run, U K steps per load (layout "rows",
   layout.py's order), against the same bytes reordered so that a program's 4 row groups x U K
   steps are contiguous ("program"). NB tiles per loop trip are loaded before they are used.
2. The decode kernel itself (decode_config's tile) at N for which its grid fills 85% to 100% of one
   wave of resident programs, K = 8192: time per byte against wave fill.
3. (--probe ring) Read-only TMA rings as decode_ws runs them (one CTA per SM, a producer warp issuing
   1-D bulk copies into a ring of 2-4 stages (128 KB), a consumer warp releasing each stage as it lands, nothing
   decoded), over the bytes of an NVFP4 weight (words and scales) in four orders: "split", words and
   scales in two arrays, each CTA's row groups as separate runs (layout.py's order, decode_ws's boxes);
   "interleaved", a row group's words and scales of a K step side by side; "contiguous", each CTA's
   stages one run of bytes; "sweep", stage i of CTA c at (i x CTAs + c) stages, so that the CTAs read one moving
   window of memory together. Beside them, in the same process, the dispatch's kernel at M = 1 and cuBLAS
   bf16 on the same weight shape.
4. (--probe ws-bounds) decode_ws on one weight: as it is ("full"), with the consumers skipping the decode and
   the MMAs ("stream"), and with the producer loading only the first STAGES stages and then merely arriving on
   the full barriers ("consume": the consumers re-read the ring, no HBM traffic after it is filled). Beside
   "stream", what of decode_ws's stream the read-only ring (probe 3) does not have: "stream-no-x" loads no x,
   "stream-evict-normal" loads the weights without the evict-first hint, "stream-one-arrival" frees a stage when
   one consumer warp is done with it instead of all. The kernel source is patched as text for the probes; their
   outputs are garbage.
5. (--probe ws-waits) decode_ws with clock64 sums around its ring waits (waits_source): per CTA, the share
   of the producer's time spent waiting for the consumers to free a stage and of the consumers' time spent
   waiting for a stage to land, medians over the CTAs of one call after warm-ups. Both shares large at once
   would say the ring, not either side, loses the time. Also each CTA's first-stage wait alone (the ramp) and the
   spread of the CTAs' starts and loop ends (%globaltimer).
6. (--probe ws-timeline) decode_ws with %globaltimer stamps per CTA (timeline_source) under bench/gemm.py's timing:
   per call, when the first stage lands, the loops and the CTAs end, and the gap to the next call; under
   programmatic launches (the calls overlap) only the time per call.
7. (--probe ws-fill) decode_ws with the first ring fill `lead` stages ahead (RingConfig.lead) on several ring shapes.
8. (--probe ws-promotion) decode_ws, as it is and as "stream" (probe 4), with its weight maps' L2 promotion (the size
   the L2 rounds a TMA copy's misses up to) at 256B (TensorMapSpec's default), 128B (decode_ws's since session 42),
   64B and none. A row group's K step is 576 bytes (NVFP4), so the words' 256-byte box rows and the scales' 64-byte
   ones start off the 256-byte grid; at 256B the stream was about 3 us slower than the read-only ring of probe 3 (1-D
   bulk copies, no promotion) over the same bytes, at 128B it is as fast (ws_probes_h200.json run 42a).
9. (--probe queue) Read-only rings over an NVFP4 weight's bytes shared out differently: 128 CTAs of whole stages
   (decode_ws's count), 130 or 132 CTAs of equal byte shares, chunks claimed from a global counter (so that CTAs whose
   bytes come sooner take more), two CTAs per SM, a CTA per chunk (many more than the SMs hold at once, balanced by
   the block scheduler as cuBLAS's small CTAs are). Asks whether the 4 SMs decode_ws leaves idle, or balancing the
   CTAs as they run, would shorten the stream.
10. (--probe ws-floor) At M = 1 on issue #3's key weights, every format: decode_ws "full" (plain and programmatic),
   "stream" and "consume" (probe 4) beside cuBLAS bf16 in one process, and the time each target asks for: how far
   the target lies from the kernel's own stream.
Timed as bench/gemm.py times (CUDA-graph replays, weights rotated over copies larger than the L2).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import struct
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import gemm  # noqa: E402

from microscale.kernels import sm90  # noqa: E402
from microscale.kernels.sm90 import launch  # noqa: E402


@triton.jit
def _read_kernel(W, OUT, KT, tiles_per_split, PROGRAM_ORDER: tl.constexpr, NB: tl.constexpr, U: tl.constexpr):
    n = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.arange(0, 4)[:, None, None]
    j = tl.arange(0, NB)[None, :, None]
    e = tl.arange(0, 128 * U)[None, None, :]  # int32 words of U K steps of one row group
    acc = tl.zeros([4, NB, 128 * U], tl.int32)
    c0 = s * tiles_per_split
    c1 = tl.minimum(c0 + tiles_per_split, KT // U)
    for c in range(c0, c1, NB):
        cc = tl.minimum(c + j, c1 - 1)
        if PROGRAM_ORDER:
            off = ((n.to(tl.int64) * (KT // U) + cc) * 4 + r) * (128 * U) + e
        else:
            off = ((n * 4 + r).to(tl.int64) * (KT // U) + cc) * (128 * U) + e
        acc ^= tl.load(W + off, eviction_policy="evict_first")
    tl.store(OUT + n * tl.num_programs(1) + s, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0))


def read_pattern(n, k, split, program_order, nb, u):
    kt = k // 64
    words = n // 16 * kt * 128
    copies = gemm._copies(lambda: torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda"),
                          words * 4)
    tiles = n // 64
    out = torch.empty(tiles * split, dtype=torch.int32, device="cuda")
    per_split = -(-(kt // u) // split)
    us = gemm._time_graph(lambda w: _read_kernel[(tiles, split)](w, out, kt, per_split, PROGRAM_ORDER=program_order,
                                                                 NB=nb, U=u, num_warps=4), copies)
    return {"op": "read", "N": n, "K": k, "split": split, "layout": "program" if program_order else "rows",
            "nb": nb, "u": u, "us": us, "tbps": words * 4 / us / 1e6}


def _prepared_copies(fmt, n, k):
    """A fresh weight: (the bf16 original, copies of its prepared tensors larger than the L2 in all, their bytes)."""
    w, q = gemm._weights(n, k, fmt, 0)
    prep = sm90.prepare(q)
    nbytes = sum(t.numel() * t.element_size() for t in prep)
    return w, gemm._copies(lambda: sm90.clone_prepared(*prep), nbytes), nbytes


def wave_fill(m, n, k=8192):
    _, copies, nbytes = _prepared_copies("nvfp4", n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    us = gemm._time_graph(lambda p: launch.decode_gemm(x, *p, None, 0, n, k), copies)
    # the grid decode_gemm launched: its split rule, with the residency it cached for this tile
    cfg = launch.decode_config(m, n, k, 0)
    resident = next(v for key, v in launch._RESIDENT.items()
                    if dict(key[1])["BMX"] == cfg.block_m and dict(key[1])["R"] == cfg.reps)
    sms = launch.sm_count(0)
    tiles = n // cfg.block_n
    split = launch._split_for(cfg, tiles, k // 64 // cfg.unroll // 4, sms, resident)
    return {"op": "wave fill", "M": m, "N": n, "K": k, "us": us, "tbps": nbytes / us / 1e6, "programs": tiles * split,
            "wave_fill": tiles * split / (resident * sms)}


RING_SOURCE = r"""
namespace ms90 {
// CTA c streams n_stages stages; stage i is `segs` bulk copies of seg_bytes from
// base(c) + j * seg_stride + i * stage_step, base(c) = (c / split) * tile_stride + (c % split) * part_stride,
// then segs2 copies of seg_bytes2 from src2 the same way (scales; segs2 = 0 for none).
struct Stream { const char* src; long tile_stride, part_stride, seg_stride, stage_step; int seg_bytes, segs; };

__device__ __forceinline__ void bulk_copy(u32 dst, const char* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

template <int STAGES>
__global__ void __launch_bounds__(64) ring_read(Stream a, Stream b, int split, int n_stages, int stage_bytes) {
  extern __shared__ unsigned char smem_raw[];
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  const u32 full = smem + STAGES * stage_bytes, empty = full + 8 * STAGES;
  init_ring_barriers(full, empty, STAGES, 1);
  const int c = blockIdx.x;
  const char* base_a = a.src + (c / split) * a.tile_stride + (c % split) * a.part_stride;
  const char* base_b = b.src + (c / split) * b.tile_stride + (c % split) * b.part_stride;
  const u32 tx = a.segs * a.seg_bytes + b.segs * b.seg_bytes;
  if (threadIdx.x == 0) {
    for (int i = 0; i < n_stages; ++i) {
      const int stage = i % STAGES;
      if (i >= STAGES) mbar_wait(empty + 8 * stage, ((i / STAGES) & 1) ^ 1);
      const u32 f = full + 8 * stage, dst = smem + stage * stage_bytes;
      mbar_arrive_expect_tx(f, tx);
      for (int j = 0; j < a.segs; ++j)
        bulk_copy(dst + j * a.seg_bytes, base_a + j * a.seg_stride + i * a.stage_step, a.seg_bytes, f);
      for (int j = 0; j < b.segs; ++j)
        bulk_copy(dst + a.segs * a.seg_bytes + j * b.seg_bytes, base_b + j * b.seg_stride + i * b.stage_step,
                  b.seg_bytes, f);
    }
  } else if (threadIdx.x == 32) {
    for (int i = 0; i < n_stages; ++i) {
      mbar_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);
      mbar_arrive(empty + 8 * (i % STAGES));
    }
  }
}
}  // namespace ms90
"""
RING_IN_FLIGHT = 128 * 1024  # as decode_ws.IN_FLIGHT_BYTES


def _stream(src, tile_stride=0, part_stride=0, seg_stride=0, stage_step=0, seg_bytes=0, segs=0):
    return struct.pack("<Qqqqqii", src, tile_stride, part_stride, seg_stride, stage_step, seg_bytes, segs)


def ring_read(n, k, groups, split, steps, order):
    """The read-only ring over an NVFP4 weight's bytes in `order` (module docstring, probe 3): us per call."""
    from microscale.kernels import nvrtc
    from microscale.kernels.sm90 import wgmma_ws
    rgs, kt = n // 16, k // 64
    tiles = -(-rgs // groups)
    kt_part = kt // split
    n_stages = kt_part // steps
    wb, sb = 512, 64  # words and scales of one row group and K step
    total = rgs * kt * (wb + sb)
    copies = gemm._copies(lambda: torch.randint(0, 255, (tiles * groups * kt * (wb + sb),), dtype=torch.uint8,
                                                device="cuda"), total)
    stage_bytes = -(-groups * steps * (wb + sb) // 1024) * 1024
    stages = max(2, min(4, RING_IN_FLIGHT // stage_bytes))
    name = f"ms90::ring_read<{stages}>"
    kernel = nvrtc.load_kernel(nvrtc.compile_kernels((name,), source=wgmma_ws.source() + RING_SOURCE,
                                                     label="ring_read", arch="sm_90a"), name, 0)

    def streams(buf):
        p = buf.data_ptr()
        if order == "split":
            words = _stream(p, groups * kt * wb, kt_part * wb, kt * wb, steps * wb, steps * wb, groups)
            q = p + tiles * groups * kt * wb
            return words, _stream(q, groups * kt * sb, kt_part * sb, kt * sb, steps * sb, steps * sb, groups)
        if order == "interleaved":
            u = wb + sb
            return _stream(p, groups * kt * u, kt_part * u, kt * u, steps * u, steps * u, groups), _stream(0)
        seg = groups * steps * (wb + sb)
        if order == "sweep":
            return _stream(p, split * seg, seg, 0, tiles * split * seg, seg, 1), _stream(0)
        return _stream(p, groups * kt * (wb + sb), groups * kt_part * (wb + sb), 0, seg, seg, 1), _stream(0)

    smem = max(stages * stage_bytes + 1024 + 16 * stages, 116 * 1024)

    def call(buf):
        a, b = streams(buf)
        nvrtc.launch(kernel, clusters=tiles * split, cluster=1, block=64, smem_bytes=smem, device_index=0,
                     stream_handle=torch.cuda.current_stream().cuda_stream,
                     args=(a, b, np.int32(split), np.int32(n_stages), np.int32(stage_bytes)))
    us = gemm._time_graph(call, copies)
    return {"op": "ring read", "N": n, "K": k, "groups": groups, "split": split, "steps": steps, "stages": stages,
            "order": order, "ctas": tiles * split, "us": us, "tbps": total / us / 1e6}


QUEUE_SOURCE = r"""
namespace ms90 {
// The bytes [0, total) as chunks of at most `chunk` bytes through a ring of STAGES stages. dynamic 0: CTA c reads
// the bytes [total c / P, total (c + 1) / P) of the P CTAs (256-byte aligned). dynamic 1: the CTAs claim chunk after
// chunk from counter[0] (the next claim in flight while a chunk is issued); the last CTA done (counter[1]) resets
// both for the next call.
template <int STAGES>
__global__ void __launch_bounds__(64) ring_queue(const char* src, long total, int chunk, int dynamic, int* counter) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ volatile int stop;
  const u32 smem = (shared_address(smem_raw) + 1023u) & ~1023u;
  const u32 full = smem + STAGES * chunk, empty = full + 8 * STAGES;
  if (threadIdx.x == 0) stop = 0;
  init_ring_barriers(full, empty, STAGES, 1);
  const long P = gridDim.x, c = blockIdx.x;
  const long n_chunks = (total + chunk - 1) / chunk;
  if (threadIdx.x == 0) {
    long lo = total * c / P / 256 * 256;
    const long hi = c + 1 == P ? total : total * (c + 1) / P / 256 * 256;
    long g = dynamic ? atomicAdd(counter, 1) : 0;
    for (int i = 0;; ++i) {
      const bool more = dynamic ? g < n_chunks : lo < hi;
      long next = 0;
      if (dynamic && more) next = atomicAdd(counter, 1);
      const int stage = i % STAGES;
      if (i >= STAGES) mbar_wait(empty + 8 * stage, ((i / STAGES) & 1) ^ 1);
      const u32 f = full + 8 * stage;
      if (!more) {
        stop = 1;
        mbar_arrive(f);
        break;
      }
      const long at = dynamic ? g * chunk : lo;
      const u32 bytes = (u32)min((long)chunk, (dynamic ? total : hi) - at);
      mbar_arrive_expect_tx(f, bytes);
      bulk_copy(smem + stage * chunk, src + at, bytes, f);
      g = next;
      lo += chunk;
    }
    if (dynamic && atomicAdd(counter + 1, 1) == P - 1) {
      atomicExch(counter, 0);
      atomicExch(counter + 1, 0);
    }
  } else if (threadIdx.x == 32) {
    for (int i = 0;; ++i) {
      mbar_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);
      if (stop) break;
      mbar_arrive(empty + 8 * (i % STAGES));
    }
  }
}
}  // namespace ms90
"""


def queue_source() -> str:
    """ring_queue's source: after RING_SOURCE, whose bulk_copy it takes."""
    from microscale.kernels.sm90 import wgmma_ws
    return wgmma_ws.source() + RING_SOURCE + QUEUE_SOURCE


def _nvfp4_bytes(n, k):
    """Words and scales of an NVFP4 weight [n, k] in the prepared layout: 576 bytes per row group and K step."""
    return n // 16 * (k // 64) * 576


def ring_queue(n, k, ctas, chunk, dynamic, stages=4):
    """Probe 9: the NVFP4 weight's bytes (words and scales, as the prepared layout holds them) through read-only rings
    of `stages` chunks, by `ctas` CTAs: each a contiguous share of the bytes, or (dynamic) chunks claimed from a
    global counter, so that CTAs whose bytes come sooner take more of them."""
    from microscale.kernels import nvrtc
    total = _nvfp4_bytes(n, k)
    copies = gemm._copies(lambda: torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda"), total)
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    name = f"ms90::ring_queue<{stages}>"
    kernel = nvrtc.load_kernel(nvrtc.compile_kernels((name,), source=queue_source(), label="ring_queue", arch="sm_90a"),
                               name, 0)
    smem = stages * chunk + 1024 + 16 * stages
    if ctas <= launch.sm_count(0):  # one CTA per SM, as decode_ws
        smem = max(smem, 116 * 1024)

    def call(buf):
        nvrtc.launch(kernel, clusters=ctas, cluster=1, block=64, smem_bytes=smem, device_index=0,
                     stream_handle=torch.cuda.current_stream().cuda_stream,
                     args=(buf.data_ptr(), np.int64(total), np.int32(chunk), np.int32(dynamic), counter.data_ptr()))
    us = gemm._time_graph(call, copies)
    torch.cuda.synchronize()
    assert counter.sum().item() == 0, "the queue's counters were not reset"
    return {"op": "ring queue", "N": n, "K": k, "ctas": ctas, "chunk": chunk, "stages": stages,
            "dynamic": bool(dynamic), "us": us, "tbps": total / us / 1e6}


def peers(n, k):
    """The dispatch's kernel (NVFP4, M = 1) and cuBLAS bf16 on the same shape, as bench/gemm.py times them."""
    import torch.nn.functional as F
    w, preps, nbytes = _prepared_copies("nvfp4", n, k)
    ws = gemm._copies(lambda: w.clone(), w.numel() * 2)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ours = gemm._time_graph(lambda p: sm90.gemm(x, *p, None, fmt="nvfp4", n=n, k=k, options={}), preps)
    bf16 = gemm._time_graph(lambda wb: F.linear(x, wb), ws)
    return {"op": "peers", "N": n, "K": k, "nvfp4_us": ours, "nvfp4_tbps": nbytes / ours / 1e6, "bf16_us": bf16,
            "bf16_tbps": w.numel() * 2 / bf16 / 1e6}


def _splice(src: str, anchor: str, text: str) -> str:
    """src with its one occurrence of anchor replaced by text."""
    if src.count(anchor) != 1:
        raise RuntimeError(f"decode_ws.cuh changed: the probe's patch point {anchor!r} is not there once")
    return src.replace(anchor, text)


def _ws_sources():
    """decode_ws.source() as is and patched for the two probes (module docstring, probe 4)."""
    from microscale.kernels.sm90 import decode_ws
    src = decode_ws.source()
    step = "        ring_step<FMT, BM, GPW, "
    weights = "        const u32 f = full + 8 * stage, base = smem + stage * L::STAGE;\n"
    x = "      auto load_x = [&](int i) {\n        const int stage = i % STAGES, kt = kt0 + i * STEPS;\n"
    never = "__device__ int ms_never = 0;\n"
    stream = never + _splice(src, step, "        if (ms_never) ring_step<FMT, BM, GPW, ")
    tx = weights + "        mbar_arrive_expect_tx(f, L::STAGE_TX);\n"
    no_x = _splice(_splice(stream, tx, tx.replace("L::STAGE_TX", "L::STAGE_TX - L::X_BYTES")),
                   x, x + "        return;\n")
    hint = "      const u64 policy = evict_first_policy();\n"
    normal = ('      u64 policy;\n'
              '      asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));\n')
    arrive = "      if (lane == 0) mbar_arrive(empty + 8 * stage);\n      if (++stage"
    one_arrival = _splice(_splice(stream, "init_ring_barriers(full, empty, STAGES, CONSUMERS);",
                                  "init_ring_barriers(full, empty, STAGES, 1);"),
                          arrive, arrive.replace("lane == 0", "lane == 0 && warp == 0"))
    return {"full": src,
            "stream": stream,
            "stream-no-x": no_x,
            "stream-evict-normal": _splice(stream, hint, normal),
            "stream-one-arrival": one_arrival,
            "consume": _splice(_splice(src, weights, weights + "        if (i >= STAGES) { mbar_arrive(f); return; }\n"),
                               x, x + "        if (i >= STAGES) return;\n")}


# a PTX statement storing %globaltimer (ns) in the named unsigned long long, for the patched sources below
STAMP = 'asm volatile("mov.u64 %0, %globaltimer;" : "=l"({}));\n'.format


WAIT_FIELDS = ("producer_wait", "producer_span", "consumer_wait", "consumer_span", "consumer_warps", "consumer_first",
               "start_ns", "end_ns")


def waits_source(buffer_address: int) -> str:
    """decode_ws's source with clock64 sums of its ring waits (module docstring, probe 5): per CTA, in int64
    [CTAs, 8] at buffer_address, WAIT_FIELDS: the producer's cycles waiting for an empty stage and its span from
    the barriers' init to the end of its loop, the consumer warps' cycles waiting for a full stage and their spans
    (sums over the warps, lane 0 of each), the number of consumer warps, their cycles waiting for the first stage
    (the ramp, inside consumer_wait), and the producer's %globaltimer at the init and at the end of its loop."""
    from microscale.kernels.sm90 import decode_ws, wgmma_ws
    src = decode_ws.SOURCE_PATH.read_text()
    after = "const long long ms_d = clock64() - ms_a;\nms_wait += ms_d;\nif (i == 0) ms_first = ms_d; }\n"
    timed = lambda line: "{ const long long ms_a = clock64();\n" + line + after  # noqa: E731
    init = "  init_ring_barriers(full, empty, STAGES, CONSUMERS);\n"
    src = _splice(src, init, init + "  const long long ms_t0 = clock64();\n  long long ms_wait = 0, ms_first = 0;\n"
                  "  unsigned long long ms_g0;\n  " + STAMP("ms_g0"))
    for line in ("        mbar_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);\n",
                 "      mbar_wait((NORM ? ready : full) + 8 * stage, phase);\n"):
        src = _splice(src, line, timed(line))
    release = "  release_dependents();  // what is left"
    record = f"""  if (lane == 0 && warp <= CONSUMERS) {{
    unsigned long long* ms_slot = (unsigned long long*){buffer_address}ull + 8ull * blockIdx.x;
    const unsigned long long ms_span = clock64() - ms_t0;
    if (warp == CONSUMERS) {{
      unsigned long long ms_g1;
      {STAMP("ms_g1")}      ms_slot[0] = ms_wait;
      ms_slot[1] = ms_span;
      ms_slot[6] = ms_g0;
      ms_slot[7] = ms_g1;
    }} else {{
      atomicAdd(ms_slot + 2, (unsigned long long)ms_wait);
      atomicAdd(ms_slot + 3, ms_span);
      atomicAdd(ms_slot + 4, 1ull);
      atomicAdd(ms_slot + 5, (unsigned long long)ms_first);
    }}
  }}
"""
    return wgmma_ws.source() + "\n" + _splice(src, release, record + release)


TIMELINE_FIELDS = ("start_ns", "land_ns", "loop_end_ns", "end_ns", "cta", "sm")


def timeline_source(buffer_address: int) -> str:
    """decode_ws's source with %globaltimer stamps (module docstring, probe 6): thread 0 of every CTA appends
    TIMELINE_FIELDS to int64 records [1 + n, 8] at buffer_address (record 0 holds the count): the CTA's first
    instruction, its first stage landing, the end of its K loop, its last instruction, its index and its SM."""
    from microscale.kernels.sm90 import decode_ws, wgmma_ws
    src = decode_ws.SOURCE_PATH.read_text()
    head = "  using L = RingSmem<FMT, BM, RGS, STEPS, STAGES, NORM, SPLIT>;\n"
    src = _splice(src, head, head + "  unsigned long long ms_s, ms_land = 0, ms_loop = 0, ms_e;\n  " + STAMP("ms_s"))
    wait = "      mbar_wait((NORM ? ready : full) + 8 * stage, phase);\n"
    src = _splice(src, wait, wait + "      if (i == 0 && threadIdx.x == 0) " + STAMP("ms_land"))
    release = "  release_dependents();  // what is left"
    src = _splice(src, release, "  if (threadIdx.x == 0) " + STAMP("ms_loop") + release)
    tail = "}\n\n}  // namespace ms90"  # the kernel's end
    record = f"""  if (threadIdx.x == 0) {{
    {STAMP("ms_e")}    unsigned long long* ms_buf = (unsigned long long*){buffer_address}ull;
    unsigned long long* ms_rec = ms_buf + 8ull * (1ull + atomicAdd(ms_buf, 1ull));
    unsigned ms_sm;
    asm volatile("mov.u32 %0, %smid;" : "=r"(ms_sm));
    ms_rec[0] = ms_s; ms_rec[1] = ms_land; ms_rec[2] = ms_loop; ms_rec[3] = ms_e; ms_rec[4] = blockIdx.x;
    ms_rec[5] = ms_sm;
  }}
"""
    return wgmma_ws.source() + "\n" + _splice(src, tail, record + tail)


@contextlib.contextmanager
def _decode_ws_source(src: str):
    """decode_ws builds its kernels from src inside the block (the caches cleared on the way in and out)."""
    from microscale.kernels.sm90 import decode_ws
    original = decode_ws.source
    decode_ws.source = lambda: src
    decode_ws._compiled.cache_clear()
    decode_ws._kernel.cache_clear()
    try:
        yield
    finally:
        decode_ws.source = original
        decode_ws._compiled.cache_clear()
        decode_ws._kernel.cache_clear()


def _ws_case(fmt, m, n, k):
    """(call, copies of the prepared weight, ring_config, record head) for decode_ws on a fresh weight."""
    from microscale.kernels.sm90 import decode_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    code = FMT_CODE[fmt]
    _, copies, nbytes = _prepared_copies(fmt, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = decode_ws.ring_config(m, n, k, code)
    head = {"format": fmt, "M": m, "N": n, "K": k, "groups": cfg.groups, "split": cfg.split, "k_warps": cfg.k_warps,
            "steps": cfg.steps, "stages": cfg.stages, "bytes": nbytes}
    return (lambda p: decode_ws.decode_ws_gemm(x, *p, None, code, n, k, cfg=cfg)), copies, cfg, head


def ws_bounds(fmt, m, n, k, rounds=2):
    call, copies, _, head = _ws_case(fmt, m, n, k)
    rec = {"op": "ws bounds", **head}
    sources = _ws_sources()
    for _ in range(rounds):
        for mode, src in sources.items():
            with _decode_ws_source(src):
                rec.setdefault(mode, []).append(gemm._time_graph(call, copies))
    return rec


def ws_floor(fmt, n, k, want, rounds=3):
    """Probe 10: at M = 1, decode_ws as it is ("full", plain and programmatic launches), with the consumers' decode and
    MMAs left out ("stream") and re-reading a filled ring ("consume"), against cuBLAS bf16 on the same shape, rounds
    interleaved; each keeps its fastest round. target_us is cuBLAS's time over issue #3's speed-up `want`: the time
    the kernel must reach with plain launches, to set beside its own stream's."""
    import torch.nn.functional as F
    call, copies, _, head = _ws_case(fmt, 1, n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ws = gemm._copies(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), n * k * 2)
    sources = _ws_sources()
    times = {}
    for _ in range(rounds):
        times.setdefault("bf16", []).append(gemm._time_graph(lambda wb: F.linear(x, wb), ws))
        for mode in ("full", "stream", "consume"):
            with _decode_ws_source(sources[mode]):
                plain, programmatic = gemm._time_launches(call, copies, pdl=mode == "full")
            times.setdefault(mode, []).append(plain)
            if programmatic is not None:
                times.setdefault("full_pdl", []).append(programmatic)
    best = {mode: min(ts) for mode, ts in times.items()}
    return {"op": "ws floor", **head, "target_speedup": want, "target_us": best["bf16"] / want,
            **{f"{mode}_us": t for mode, t in best.items()}, "rounds": times,
            "stream_tbps": head["bytes"] / best["stream"] / 1e6,
            **{f"{mode}_speedup": best["bf16"] / best[mode] for mode in ("full", "full_pdl", "stream")}}


def ws_waits(fmt, m, n, k):
    """Probe 5: the medians over CTAs of the fractions of their spans that the producer waits for an empty stage
    (consumers behind) and the consumer warps wait for a full one (the stream behind), one call after warm-ups."""
    from microscale.kernels.sm90.layout import ROW_GROUP, padded_shape
    call, copies, cfg, head = _ws_case(fmt, m, n, k)
    ctas = -(-padded_shape(n, k)[0] // (ROW_GROUP * cfg.groups)) * cfg.split
    slots = torch.zeros(ctas, 8, dtype=torch.int64, device="cuda")
    with _decode_ws_source(waits_source(slots.data_ptr())):
        for p in copies:
            call(p)
        slots.zero_()
        call(copies[0])
        torch.cuda.synchronize()
    r = slots.cpu().double()
    waits = dict(zip(WAIT_FIELDS, r.T))
    start, end = waits["start_ns"], waits["end_ns"]
    return {"op": "ws waits", **head, "ctas": ctas,
            "producer_waits_empty": (waits["producer_wait"] / waits["producer_span"]).median().item(),
            "consumers_wait_full": (waits["consumer_wait"] / waits["consumer_span"]).median().item(),
            "consumers_wait_first": (waits["consumer_first"] / waits["consumer_span"]).median().item(),
            "consumer_warps": waits["consumer_warps"].median().item(),
            "span_cycles_median": waits["producer_span"].median().item(),
            # %globaltimer, ns from the first CTA's start: the spread of the CTAs' starts and of their loops' ends
            "start_spread_ns": (start.max() - start.min()).item(),
            "end_first_ns": (end.min() - start.min()).item(), "end_median_ns": (end.median() - start.min()).item(),
            "end_last_ns": (end.max() - start.min()).item()}


def timeline_summary(records: torch.Tensor, calls: int) -> dict:
    """The last `calls` calls of timeline_source's records [n, 6] (float64, TIMELINE_FIELDS), us from each call's
    first CTA start: the CTAs' first stages landing (median), their loops' ends (median, last), their ends (last)
    and the gap to the next call's first CTA, medians over the calls; loop_end_by_sm: per SM (by %smid) the median
    over the calls of its CTA's loop end and its spread (std) between calls, to tell slow SMs (the same in every
    call: placement, e.g. crowded GPCs) from slow moments. Calls are told apart by start time (plain launches do
    not overlap)."""
    ctas = len(set(records[:, 4].tolist()))
    r = records[records[:, 0].argsort()][-calls * ctas:]
    per = r.reshape(calls, ctas, len(TIMELINE_FIELDS))
    t0 = per[:, :, 0].min(1).values[:, None]
    rel = lambda c: (per[:, :, c] - t0) / 1e3  # noqa: E731
    gaps = (per[1:, :, 0].min(1).values - per[:-1, :, 3].max(1).values) / 1e3
    med = lambda v: v.median().item()  # noqa: E731
    by_sm = {}
    for sm, end in zip(per[:, :, 5].flatten().tolist(), rel(2).flatten().tolist()):
        by_sm.setdefault(int(sm), []).append(end)
    spread = lambda v: torch.tensor(v).std().item() if len(v) > 1 else 0.0  # noqa: E731
    by_sm = [[sm, round(torch.tensor(v).median().item(), 3), round(spread(v), 3)] for sm, v in sorted(by_sm.items())]
    return {"ctas": ctas, "start_last": med(rel(0).max(1).values), "land_median": med(rel(1).median(1).values),
            "loop_end_median": med(rel(2).median(1).values), "loop_end_last": med(rel(2).max(1).values),
            "end_last": med(rel(3).max(1).values), "gap_to_next": med(gaps), "loop_end_by_sm": by_sm}


def ws_timeline(fmt, m, n, k, programmatic=False):
    """Probe 6: timeline_summary of decode_ws's calls in a CUDA-graph replay (bench/gemm.py's timing)."""
    call, copies, cfg, head = _ws_case(fmt, m, n, k)
    buf = torch.zeros(1 + (1 << 17), 8, dtype=torch.int64, device="cuda")
    os.environ[launch.PDL_ENV] = "1" if programmatic else "0"
    try:
        with _decode_ws_source(timeline_source(buf.data_ptr())):
            us = gemm._time_graph(call, copies)
    finally:
        del os.environ[launch.PDL_ENV]
    rec = {"op": "ws timeline", **head, "programmatic": programmatic, "us_per_call": us}
    if programmatic:  # the calls overlap: start times no longer tell them apart (timeline_summary)
        return rec
    count = int(buf[0, 0])
    records = buf[1:1 + count, :len(TIMELINE_FIELDS)].cpu().double()
    return {**rec, **timeline_summary(records, max(8, len(copies)))}


def ws_fill(fmt, m, n, k, rings=((4, None), (2, 4), (2, 5), (2, 6), (2, 8)), leads=(1, 2, 99), rounds=2):
    """Probe 7: decode_ws with ring_config's groups and split and the given (steps, stages) rings (None: ring_config's),
    each filled `lead` stages ahead (RingConfig.lead; 99: the whole ring at once)."""
    from dataclasses import replace
    from microscale.kernels.sm90 import decode_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    _, copies, cfg0, head = _ws_case(fmt, m, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    recs = []
    for steps, stages in rings:
        for lead in leads:
            cfg = replace(cfg0, steps=steps, stages=stages or cfg0.stages, lead=0 if lead == 99 else lead)
            if cfg.lead >= cfg.stages:
                continue
            call = lambda p, cfg=cfg: decode_ws.decode_ws_gemm(x, *p, None, FMT_CODE[fmt], n, k, cfg=cfg)  # noqa: E731
            rec = {"op": "ws fill", **head, "steps": cfg.steps, "stages": cfg.stages, "lead": lead, "us": []}
            recs.append((rec, call))
    for _ in range(rounds):
        for rec, call in recs:
            rec["us"].append(gemm._time_graph(call, copies))
    return [rec for rec, _ in recs]


WS_CASES = (("nvfp4", 1, 28672, 8192), ("nvfp4", 1, 8192, 28672), ("nvfp4", 1, 8192, 8192), ("mxfp4", 1, 28672, 8192),
            ("nvfp4", 1, 4096, 14336))


def ws_timeline_probes():
    for case in WS_CASES:
        yield ws_timeline(*case)
        yield ws_timeline(*case, programmatic=True)


@contextlib.contextmanager
def _weight_map_promotion(promotion: str):
    """wgmma_ws.weight_map_specs (the weight maps decode_ws launches with) at L2 promotion `promotion`."""
    from microscale.kernels.sm90 import wgmma_ws
    original = wgmma_ws.weight_map_specs
    wgmma_ws.weight_map_specs = lambda *a, **kw: tuple(dataclasses.replace(spec, l2_promotion=promotion)
                                                       for spec in original(*a, **kw))
    try:
        yield
    finally:
        wgmma_ws.weight_map_specs = original


def ws_promotion(fmt, m, n, k, promotions=("256B", "128B", "64B", "none"), rounds=2):
    call, copies, _, head = _ws_case(fmt, m, n, k)
    rec = {"op": "ws promotion", **head}
    sources = _ws_sources()
    for _ in range(rounds):
        for mode in ("full", "stream"):
            with _decode_ws_source(sources[mode]):
                for promotion in promotions:
                    with _weight_map_promotion(promotion):
                        rec.setdefault(f"{mode}_{promotion}", []).append(gemm._time_graph(call, copies))
    return rec


def ws_promotion_probes():
    for fmt, m, n, k in (("nvfp4", 1, 28672, 8192), ("nvfp4", 1, 8192, 28672), ("nvfp4", 1, 8192, 8192),
                         ("mxfp4", 1, 28672, 8192), ("mxfp8", 1, 8192, 8192), ("nvfp4", 1, 28672, 4096)):
        yield ws_promotion(fmt, m, n, k)


def ws_fill_probes():
    for case in WS_CASES:
        yield from ws_fill(*case)


def read_probes():
    for n, k in ((28672, 8192), (8192, 28672), (8192, 8192)):
        for split in (2, 4, 8):
            for nb, u in ((1, 2), (2, 2), (4, 2), (1, 8)):
                for program_order in (False, True):
                    yield read_pattern(n, k, split, program_order, nb, u)
    for m in (1, 16):
        for n in (28672, 30720, 33792, 8192, 8448, 9216):
            yield wave_fill(m, n)


def ring_probes():
    for n, k, groups, split in ((28672, 8192, 14, 1), (8192, 28672, 8, 2), (8192, 8192, 8, 2)):
        yield peers(n, k)
        for rnd in range(2):
            for steps in (4, 8):
                for order in ("split", "interleaved", "contiguous", "sweep"):
                    yield dict(ring_read(n, k, groups, split, steps, order), round=rnd)


def queue_probes():
    for n, k, groups, split in ((8192, 8192, 8, 2), (28672, 8192, 14, 1), (8192, 28672, 8, 2)):
        yield peers(n, k)
        for rnd in range(2):
            yield dict(ring_read(n, k, groups, split, 4, "contiguous"), round=rnd)
            stage = groups * 4 * 576
            for ctas, chunk, dynamic in ((128, stage, 0), (130, stage, 0), (132, stage, 0), (132, stage, 1),
                                         (132, stage // 2, 1), (132, stage // 4, 1), (264, stage // 2, 0),
                                         (264, stage // 2, 1)):
                yield dict(ring_queue(n, k, ctas, chunk, dynamic, stages=4 if chunk >= stage else 8), round=rnd)
            # a CTA per chunk, many more than the SMs hold: the block scheduler balances them
            for chunk in (9216, 18432, 36864, 73728):
                yield dict(ring_queue(n, k, _nvfp4_bytes(n, k) // chunk, chunk, 0, stages=1), round=rnd)


def ws_waits_probes():
    for fmt, m, n, k in (("nvfp4", 1, 28672, 8192), ("nvfp4", 1, 8192, 28672), ("nvfp4", 1, 8192, 8192),
                         ("mxfp4", 1, 28672, 8192), ("nvfp4", 16, 28672, 8192), ("nvfp4", 1, 28672, 4096),
                         ("nvfp4", 1, 4096, 14336), ("nvfp4", 1, 6144, 4096)):
        yield ws_waits(fmt, m, n, k)


def ws_floor_probes():
    for fmt, items in gemm.DECODE_TARGETS.items():
        for (n, k), want in items:
            yield ws_floor(fmt, n, k, want)


def ws_bounds_probes():
    for fmt, m, n, k in (("nvfp4", 1, 28672, 8192), ("nvfp4", 1, 8192, 28672), ("nvfp4", 1, 8192, 8192),
                         ("mxfp8", 1, 8192, 8192), ("nvfp4", 16, 28672, 8192), ("nvfp4", 1, 28672, 4096),
                         ("nvfp4", 1, 4096, 14336)):
        yield ws_bounds(fmt, m, n, k)


PROBES = {"read": read_probes, "ring": ring_probes, "queue": queue_probes, "ws-bounds": ws_bounds_probes,
          "ws-waits": ws_waits_probes, "ws-timeline": ws_timeline_probes, "ws-fill": ws_fill_probes,
          "ws-promotion": ws_promotion_probes, "ws-floor": ws_floor_probes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--probe", choices=tuple(PROBES), default="read")
    args = p.parse_args()
    recs = []
    for rec in PROBES[args.probe]():
        recs.append(rec)
        print(json.dumps(rec), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": gemm._env(), "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
