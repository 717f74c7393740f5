"""What bounds the M = 1 decode kernel's stream: two probes on the H200.

    PYTHONPATH=. python3 bench/stream_probe.py --out bench/results/stream_probe_h200.json

1. Read-only kernels over the bytes of an NVFP4 weight's words (no scales, no decode, no MMA) in
   the decode kernel's access pattern: a program of 4 warps over 4 row groups (64 rows) and one K
   split; each warp streams its row group's [K/64, 512 B] run, U K steps per load (layout "rows",
   layout.py's order), against the same bytes reordered so that a program's 4 row groups x U K
   steps are contiguous ("program"). NB tiles per loop trip are loaded before they are used.
2. The decode kernel itself (decode_config's tile) at N for which its grid fills 85% to 100% of one
   wave of resident programs, K = 8192: time per byte against wave fill.
Timed as bench/gemm.py times (CUDA-graph replays, weights rotated over copies larger than the L2).
"""

import argparse
import json
import os
import sys

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


def wave_fill(m, n, k=8192):
    _, q = gemm._weights(n, k, "nvfp4", 0)
    prep = sm90.prepare(q)
    nbytes = sum(t.numel() * t.element_size() for t in prep)
    copies = gemm._copies(lambda: tuple(t.clone() for t in prep), nbytes)
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    recs = []
    for n, k in ((28672, 8192), (8192, 28672), (8192, 8192)):
        for split in (2, 4, 8):
            for nb, u in ((1, 2), (2, 2), (4, 2), (1, 8)):
                for program_order in (False, True):
                    recs.append(read_pattern(n, k, split, program_order, nb, u))
                    print(json.dumps(recs[-1]), flush=True)
    for m in (1, 16):
        for n in (28672, 30720, 33792, 8192, 8448, 9216):
            recs.append(wave_fill(m, n))
            print(json.dumps(recs[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": gemm._env(), "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
