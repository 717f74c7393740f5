"""Time against bytes at M = 1: the fixed cost per call of the dispatch's decode kernel and of cuBLAS bf16.

    PYTHONPATH=. python3 bench/fixed_cost.py --out bench/results/fixed_cost_h200.json

NVFP4 weights of N = 28672 and of N = 8192 rows over a range of K, timed as bench/gemm.py times M = 1 (CUDA-graph
replays of 32 plain launches, weights rotated over copies larger than the L2; ours and cuBLAS interleaved, each
keeping the faster of two runs: gemm._time_against_bf16). Per row count and side, a least-squares line through time
against bytes gives the fixed cost (intercept) and the streaming rate (slope). Launch floors in the same timing:
kernels of 132 CTAs of 288 threads (decode_ws's block at NVFP4 8192x8192, M = 1), plain or in 2-CTA clusters with
100 KB of shared memory (that call's launch), empty or with each CTA reading one 16-byte line that the calls before
left in the L2 (the least a kernel that waits for one load pays per call). The question it answers: how much of a
call's time does not shrink with its bytes, and how does that compare with cuBLAS (the M = 1 targets of 3.0-3.4x
leave 11.3 us at NVFP4 8192x8192).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import gemm  # noqa: E402

from microscale.kernels import nvrtc, sm90  # noqa: E402

SERIES = {28672: (1024, 2048, 4096, 8192, 16384), 8192: (2048, 4096, 8192, 14336, 28672)}

FLOOR_SOURCE = r"""
namespace floor_probe {
// READ: each CTA loads one 16-byte line (always the same ones, so from the L2 after the first call) and waits for it
template <int READ>
__global__ void kernel(const uint4* __restrict__ lines, uint4* __restrict__ sink) {
  if (READ) {
    const uint4 v = lines[blockIdx.x];
    if (v.x == 0x9e3779b9u && threadIdx.x == 0) sink[blockIdx.x] = v;  // never true for the zeros read
  }
}
}
"""
FLOOR_KERNELS = ("floor_probe::kernel<0>", "floor_probe::kernel<1>")
FLOOR_CTAS, FLOOR_THREADS = 132, 288
FLOOR_LAUNCHES = ((1, 0), (2, 100 * 1024))  # (cluster, shared-memory bytes)


def compile_floor_kernels():
    return nvrtc.compile_kernels(FLOOR_KERNELS, source=FLOOR_SOURCE, label="fixed_cost floor probe", arch="sm_90a")


def launch_floors():
    """Records of us per call for the FLOOR_KERNELS launched as each of FLOOR_LAUNCHES."""
    compiled, device = compile_floor_kernels(), torch.cuda.current_device()
    lines = torch.zeros(FLOOR_CTAS, 4, dtype=torch.int32, device="cuda")
    sink = torch.empty_like(lines)
    recs = []
    for read, name in enumerate(FLOOR_KERNELS):
        kernel = nvrtc.load_kernel(compiled, name, device)
        for cluster, smem in FLOOR_LAUNCHES:
            def call(_):
                nvrtc.launch(kernel, clusters=FLOOR_CTAS // cluster, cluster=cluster, block=FLOOR_THREADS,
                             smem_bytes=smem, device_index=device,
                             stream_handle=torch.cuda.current_stream().cuda_stream,  # the capturing stream
                             args=(lines.data_ptr(), sink.data_ptr()))
            us = min(gemm._time_graph(call, [None], **gemm.SHORT_CALL_REPS) for _ in range(3))
            recs.append({"op": "launch floor", "read": bool(read), "cluster": cluster, "smem": smem, "us": us})
            print(json.dumps(recs[-1]), flush=True)
    return recs


def measure():
    recs = launch_floors()
    for n, ks in SERIES.items():
        for k in ks:
            w, q = gemm._weights(n, k, "nvfp4", 0)
            prep = sm90.prepare(q)
            nbytes = sum(t.numel() * t.element_size() for t in prep)
            preps = gemm._copies(lambda: sm90.clone_prepared(*prep), nbytes)
            weights = gemm._copies(lambda: w.clone(), w.numel() * 2)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            kernel = sm90.choose_kernel("nvfp4", 1, {}, x.dtype, torch.cuda.get_device_capability(), n, k=k)
            ours = lambda p: sm90.gemm(x, *p, None, fmt="nvfp4", n=n, k=k, options={"kernel": kernel})  # noqa: E731
            ours_us, _, bf16_us = gemm._time_against_bf16(ours, preps, lambda b: F.linear(x, b), weights, False,
                                                          **gemm.SHORT_CALL_REPS)
            for rec in ({"op": "nvfp4", "MB": nbytes / 1e6, "us": ours_us, "backend": f"sm90:{kernel}"},
                        {"op": "bf16", "MB": w.numel() * 2 / 1e6, "us": bf16_us}):
                rec.update(N=n, K=k, TBps=rec["MB"] / rec["us"])
                print(json.dumps(rec), flush=True)
                recs.append(rec)
            del preps, weights
    return recs


def fit(recs, op, n):
    """Least-squares line us = fixed + MB / rate over the records of op on N = n."""
    pts = [(r["MB"], r["us"]) for r in recs if r["op"] == op and r["N"] == n]
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"op": op, "N": n, "fixed_us": my - slope * mx, "TBps": 1 / slope}  # MB/us = TB/s


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/fixed_cost_h200.json")
    args = p.parse_args()
    recs = measure()
    out = {"env": gemm._env(), "records": recs, "fits": [fit(recs, op, n) for n in SERIES for op in ("nvfp4", "bf16")]}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out["fits"]))
