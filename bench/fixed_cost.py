"""Time against bytes at M = 1: the fixed cost per call of the decode kernel and of cuBLAS bf16.

    PYTHONPATH=. python3 bench/fixed_cost.py --out bench/results/fixed_cost_h200.json

NVFP4 weights N=28672 with K from 512 to 16384 (plus 8192x8192 and 8192x28672), timed as in
bench/gemm.py (CUDA-graph replays, weights rotated over copies larger than the L2); at K=8192 also
with the K split fixed at 1, 2, 4 and 8 (0 = decode_config's choice). A line through time against
bytes gives the fixed cost (intercept) and the streaming rate (slope) of each side; an empty kernel
in the same graph timing gives the launch gap.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import gemm  # noqa: E402

from microscale.kernels import sm90  # noqa: E402
from microscale.kernels.sm90 import launch  # noqa: E402

SHAPES = [(28672, 512), (28672, 1024), (28672, 2048), (28672, 4096), (28672, 8192), (28672, 16384),
          (8192, 8192), (8192, 28672)]


@triton.jit
def _empty(p):
    pass


def measure():
    buf = torch.zeros(1, device="cuda")
    recs = [{"op": "empty kernel", "us": gemm._time_graph(lambda c: _empty[(132,)](c), [buf, buf], calls=64)}]
    for n, k in SHAPES:
        w, q = gemm._weights(n, k, "nvfp4", 0)
        prep = sm90.prepare(q)
        nbytes = sum(t.numel() * t.element_size() for t in prep)
        preps = gemm._copies(lambda: sm90.clone_prepared(*prep), nbytes)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for split in [0, 1, 2, 4, 8] if k == 8192 else [0]:
            cfg = dataclasses.replace(launch.decode_config(1, n, k, 0), split=split)
            us = gemm._time_graph(lambda p: launch.decode_gemm(x, *p, None, 0, n, k, cfg), preps)
            recs.append({"op": "nvfp4", "N": n, "K": k, "split": split, "MB": nbytes / 1e6, "us": us,
                         "TBps": nbytes / us / 1e6})
        weights = gemm._copies(lambda: w.clone(), w.numel() * 2)
        us = gemm._time_graph(lambda b: x @ b.t(), weights)
        recs.append({"op": "bf16", "N": n, "K": k, "MB": w.numel() * 2 / 1e6, "us": us,
                     "TBps": w.numel() * 2 / us / 1e6})
        for r in recs[-2:]:
            print(json.dumps(r), flush=True)
        del preps, weights
    return recs


def fit(recs, op):
    """Least-squares line us = a + MB / rate over the N=28672 records of op (auto split)."""
    pts = [(r["MB"], r["us"]) for r in recs if r["op"] == op and r["N"] == 28672 and r.get("split", 0) == 0]
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"op": op, "fixed_us": my - slope * mx, "TBps": 1 / slope}  # MB/us = TB/s


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/fixed_cost_h200.json")
    args = p.parse_args()
    recs = measure()
    out = {"env": gemm._env(), "records": recs, "fits": [fit(recs, "nvfp4"), fit(recs, "bf16")]}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out["fits"]))
