"""Time against bytes at M = 1: the fixed cost per call of the dispatch's decode kernel and of cuBLAS bf16.

    PYTHONPATH=. python3 bench/fixed_cost.py --out bench/results/fixed_cost_h200.json

NVFP4 weights of N = 28672 and of N = 8192 rows over a range of K, timed as bench/gemm.py times M = 1 (CUDA-graph
replays of 32 plain launches, weights rotated over copies larger than the L2; ours and cuBLAS interleaved, each
keeping the faster of two runs: gemm._time_against_bf16). Per row count and side, a least-squares line through time
against bytes gives the fixed cost (intercept) and the streaming rate (slope); an empty kernel in the same timing
gives the launch gap. The question it answers: how much of a call's time does not shrink with its bytes, and how
does that compare with cuBLAS (the M = 1 targets of 3.0-3.4x leave 11.3 us at NVFP4 8192x8192).
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
import gemm  # noqa: E402

from microscale.kernels import sm90  # noqa: E402

SERIES = {28672: (1024, 2048, 4096, 8192, 16384), 8192: (2048, 4096, 8192, 14336, 28672)}


@triton.jit
def _empty(p):
    pass


def measure():
    buf = torch.zeros(1, device="cuda")
    empty_us = gemm._time_graph(lambda c: _empty[(132,)](c), [buf, buf], **gemm.SHORT_CALL_REPS)
    recs = [{"op": "empty kernel", "us": empty_us}]
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
