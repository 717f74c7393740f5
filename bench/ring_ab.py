"""A/B of decode_ws tilings on the H200: ring_config's RingConfig against variants of it, one process.

    PYTHONPATH=. python3 bench/ring_ab.py --cases '[["nvfp4", 8192, 8192, [1, 16]]]' --alts '[{"lead": 2}]'
    PYTHONPATH=. python3 bench/ring_ab.py --cases ... --alts ... --compile-only   # any machine: fill the NVRTC cache

A case is [format, N, K, [M, ...]] with an optional fifth element, alts of its own. An alt is a dict of RingConfig
fields that replace ring_config's ("base"). Per case and M every variant and cuBLAS bf16 (F.linear) are timed in
--rounds interleaved rounds, as bench/gemm.py times (CUDA-graph replays, weights rotated over copies larger than the
L2), plain and as programmatic dependent launches; each variant's output is compared with float64 (the exact
dequantized weight: rel_err_vs_f64 is the bf16 output's rounding) and with the base's (equal_base). One JSON line per
variant (sweep_h200.json's "ab" records, runs 36a-37c, come from these lines). --triton adds the Triton decode kernel
(variant "triton decode", cfg null), the kernel ring_wins weighs decode_ws against, to the same rounds.
--compile-only builds every variant into the NVRTC cache ($MICROSCALE_CACHE_DIR) with no GPU: a CPU machine can
prepare it and the GPU machine then only times.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s modules, also when loaded by path
from gemm import _copies, _time_graph, _time_launches, _weights  # noqa: E402


def variants(fmt: str, n: int, k: int, m: int, alts: list) -> dict:
    """{"base": ring_config's RingConfig, json.dumps(alt): the base with alt's fields} for one case and M."""
    from microscale.kernels.sm90 import decode_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    base = decode_ws.ring_config(m, n, k, FMT_CODE[fmt])
    return {"base": base, **{json.dumps(a): dataclasses.replace(base, **a) for a in alts}}


def compile_variants(cases: list, alts: list) -> int:
    """Builds every variant of the cases (no GPU needed); returns how many."""
    from microscale.kernels.sm90 import decode_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    built = set()
    for fmt, n, k, ms, *own in cases:
        for m in ms:
            for cfg in variants(fmt, n, k, m, alts + (own[0] if own else [])).values():
                built.add(decode_ws.variant(FMT_CODE[fmt], cfg))
    for v in built:
        decode_ws._compiled((v,))
    return len(built)


TRITON = "triton decode"  # the contender ring_wins weighs decode_ws against: the Triton decode kernel's own tiling


def ab_case(fmt: str, n: int, k: int, ms: list, alts: list, rounds: int = 3, calls: int = 32, triton: bool = False):
    """Yields a record per variant and M of one weight; with triton also one of the Triton decode kernel (cfg None)
    timed in the same rounds."""
    from microscale.kernels import sm90
    from microscale.kernels.sm90 import decode_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    code = FMT_CODE[fmt]
    w, q = _weights(n, k, fmt, 0)
    prep = sm90.prepare(q)
    preps = _copies(lambda: sm90.clone_prepared(*prep), sum(t.numel() * t.element_size() for t in prep))
    ws = _copies(lambda: w.clone(), w.numel() * 2)
    exact = q.dequantize().double()  # the weight the kernel multiplies by, exactly
    for m in ms:
        torch.manual_seed(m)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfgs = variants(fmt, n, k, m, alts) | ({TRITON: None} if triton else {})
        plain, pdl, bf16, ys = {name: [] for name in cfgs}, {name: [] for name in cfgs}, [], {}
        for _ in range(rounds):
            bf16.append(_time_graph(lambda wb: F.linear(x, wb), ws, calls=calls))
            for name, cfg in cfgs.items():
                if cfg is None:
                    call = lambda p: sm90.gemm(x, *p, None, fmt=fmt, n=n, k=k,  # noqa: E731
                                               options={"kernel": "decode"})
                else:
                    call = lambda p, cfg=cfg: decode_ws.decode_ws_gemm(x, *p, None, code, n, k, cfg)  # noqa: E731
                ys[name] = call(prep).double()
                t, tp = _time_launches(call, preps, calls=calls)
                plain[name].append(t)
                pdl[name].append(tp)
        ref = x.double() @ exact.T
        for name, cfg in cfgs.items():
            best, best_pdl = min(plain[name]), min(pdl[name])
            yield {"format": fmt, "N": n, "K": k, "M": m, "variant": name,
                   "cfg": None if cfg is None else dataclasses.asdict(cfg),
                   "bf16": round(min(bf16), 3), "us": [round(v, 3) for v in plain[name]], "best": round(best, 3),
                   "pdl": round(best_pdl, 3), "change": round(best / min(plain["base"]) - 1, 4),
                   "change_pdl": round(best_pdl / min(pdl["base"]) - 1, 4),
                   "x_bf16": round(min(bf16) / best, 3), "x_bf16_pdl": round(min(bf16) / best_pdl, 3),
                   "rel_err_vs_f64": ((ys[name] - ref).norm() / ref.norm()).item(),
                   "equal_base": bool(torch.equal(ys[name], ys["base"]))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", required=True, help='JSON: [[format, N, K, [M, ...](, [alt, ...])], ...]')
    p.add_argument("--alts", default="[]", help="JSON: [{RingConfig field: value, ...}, ...] for every case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=32, help="calls per graph replay")
    p.add_argument("--triton", action="store_true", help="also time the Triton decode kernel in the same rounds")
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args(argv)
    cases, alts = json.loads(args.cases), json.loads(args.alts)
    if args.compile_only:
        print(f"built {compile_variants(cases, alts)} variants")
        return
    for fmt, n, k, ms, *own in cases:
        for record in ab_case(fmt, n, k, ms, alts + (own[0] if own else []), args.rounds, args.calls,
                              args.triton):
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
