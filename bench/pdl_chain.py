"""Decoder GEMMs back to back, with and without programmatic dependent launches (PDL): the decode kernels at M <= 8.

    PYTHONPATH=. python3 bench/pdl_chain.py --out bench/results/pdl_chain_h200.json

In a model the decode GEMMs run one after another, each starting while the one before it ends (PDL, bench/e2e.py
way (e)), so a kernel's fixed cost per call counts more than its streaming rate. Here 32 distinct weights of one
shape (larger than the L2 together) run back to back in one CUDA graph, and the time per call is the replay
time / 32 (gemm._time_graph): the Triton decode kernel (launch.decode_config), the TMA-ring kernel with one
consumer warp per row group and with ring_config's choice (two up to M = 8), and the dispatch's choice. The
Llama-3-8B decoder's weights at M = 1, 2, 4, 8, NVFP4 and MXFP4. Then the layer (q/k/v, o, gate/up with the
gated epilogue, down) 32 times in one graph at M = 1: the dispatch's choices against the Triton kernel on the
three small weights and one warp per row group on gate/up (the rule of session 22).
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gemm  # noqa: E402

from microscale.kernels import sm90  # noqa: E402
from microscale.kernels.sm90 import decode_ws, launch  # noqa: E402
from microscale.kernels.sm90.decode import FMT_CODE  # noqa: E402

LAYERS = 32
# (N, K, gated): q/k/v, o, gate/up (row pairs, silu(gate) * up stored), down
SHAPES = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]
MS = (1, 2, 4, 8)
SESSION22_SMALL_WEIGHT = 4096 * 14336  # session 22's dispatch: the Triton kernel on weights up to this size


def _pdl(on: bool):
    os.environ[launch.PDL_ENV] = "1" if on else "0"


def _kernels(fmt, m, n, k, gated):
    """name -> f(x, prepared weight): the kernels compared on one shape."""
    code = FMT_CODE[fmt]
    ring = decode_ws.ring_config(m, n, k, code)
    one_warp = dataclasses.replace(ring, k_warps=1)
    return {
        "decode": lambda x, p: launch.decode_gemm(x, *p, None, code, n, k, gated=gated),
        "ring_k_warps_1": lambda x, p: decode_ws.decode_ws_gemm(x, *p, None, code, n, k, one_warp, gated=gated),
        f"ring_k_warps_{ring.k_warps}": lambda x, p: decode_ws.decode_ws_gemm(x, *p, None, code, n, k, ring,
                                                                              gated=gated),
        "dispatch": lambda x, p: sm90.gemm(x, *p, None, fmt=fmt, n=n, k=k,
                                           options={"epilogue": "silu_mul"} if gated else {}),
    }


def shape_records(fmt, n, k, gated):
    preps = [sm90.prepare(gemm._weights(n, k, fmt, seed)[1]) for seed in range(LAYERS)]
    recs = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for pdl in (True, False):
            _pdl(pdl)
            kernels = _kernels(fmt, m, n, k, gated)
            expected = kernels["decode"](x, preps[0]).float()
            rec = {"format": fmt, "M": m, "N": n, "K": k, "gated": gated, "pdl": pdl,
                   "dispatch_kernel": sm90.choose_kernel(fmt, m, {}, n=n, k=k)}
            for name, run in kernels.items():
                diff = ((run(x, preps[0]).float() - expected).norm() / expected.norm()).item()
                if diff > 1e-3:  # a wrong kernel is reported, not timed
                    rec[f"{name}_error"] = f"output differs from the decode kernel's by {diff:.2e}"
                    continue
                rec[f"{name}_us"] = gemm._time_graph(lambda p: run(x, p), preps, replays=20, calls=LAYERS)
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    return recs


def layer_records(fmt="nvfp4"):
    """The decoder's GEMMs at M = 1 for LAYERS layers in one graph, each output the next one's input."""
    layers = [[(sm90.prepare(gemm._weights(n, k, fmt, 100 * i + j)[1]), n, k, gated)
               for j, (n, k, gated) in enumerate(SHAPES)] for i in range(LAYERS)]
    code = FMT_CODE[fmt]

    def session22(x, p, n, k, gated):  # the Triton kernel on the small weights, one warp per row group on gate/up
        if n * k <= SESSION22_SMALL_WEIGHT:
            return launch.decode_gemm(x, *p, None, code, n, k, gated=gated)
        cfg = dataclasses.replace(decode_ws.ring_config(1, n, k, code), k_warps=1)
        return decode_ws.decode_ws_gemm(x, *p, None, code, n, k, cfg, gated=gated)

    def dispatch(x, p, n, k, gated):
        return sm90.gemm(x, *p, None, fmt=fmt, n=n, k=k, options={"epilogue": "silu_mul"} if gated else {})

    x0 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    recs = []
    for pdl in (True, False):
        _pdl(pdl)
        for name, run in (("session22", session22), ("dispatch", dispatch)):
            def step():
                x = x0
                for layer in layers:
                    for p, n, k, gated in layer:
                        x = run(x[:, :k], p, n, k, gated)
            rec = {"op": "layer chain", "format": fmt, "M": 1, "pdl": pdl, "rule": name,
                   "us_per_layer": gemm._time_graph(lambda _: step(), [None], replays=20, calls=1) / LAYERS}
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    return recs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results JSON to write")
    p.add_argument("--formats", default="nvfp4,mxfp4")
    args = p.parse_args()
    results = {"env": gemm._env(), "shapes": [], "layers": []}
    for fmt in args.formats.split(","):
        for n, k, gated in SHAPES:
            results["shapes"] += shape_records(fmt, n, k, gated)
    results["layers"] = layer_records()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
