"""Benchmark the Hopper (sm90) kernels against cuBLAS on the H200.

    PYTHONPATH=. python3 bench/gemm.py --out bench/results/gemm_h200.json --plot bench/results/gemm_h200.png
    PYTHONPATH=. python3 bench/gemm.py --table bench/results/gemm_h200.json   # only regenerate BENCHMARKS.md

Per format and shape, in one process: our kernel (the one dispatch picks), cuBLAS bf16 (F.linear),
torch._scaled_mm FP8 with row-wise scales, and for M <= 16 the eager "dequantize, then matmul".
Times are per call, from CUDA-graph replays of back-to-back calls, with the weight buffers of every
contender rotated over copies totalling more than the L2, on fresh random data. Up to M = 64 (median of
10 replays) ours and cuBLAS bf16 are timed twice, interleaved, and each keeps its faster run; above it
(compute-bound, clocks moving with the GPU's power) ours, cuBLAS bf16 and FP8 are replayed in turn, 12
times, and each keeps its median (_time_graphs). Our decode kernels are also timed as programmatic dependent
launches (pdl_us), as a decode step under TORCHINDUCTOR_ENABLE_PDL=1 launches them; the plain launch is the
headline figure. The eager dequantize-then-matmul (not capturable) uses triton.testing.do_bench.
Also: the quantize kernel (bytes read + written against the copy ceiling), the kernels' tile sweep (--sweep; per M
the tiles that give the default tile's output are replayed in turn, as the contenders above M = 64) and the large-M
alternatives (dequant+cuBLAS full or chunked, FP8).
"""

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F

COPY_TBPS = 4.25  # h200-baseline.md: device-to-device copy, bytes read + written
BF16_TFLOPS = 701.0  # cuBLAS bf16 8192^3
FP8_TFLOPS = 1225.0  # _scaled_mm row-wise 8192^3
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 4096, 8192]
SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672), (4096, 4096)]
FORMATS = ["nvfp4", "mxfp4", "mxfp8"]
PDL_KERNELS = ("decode", "decode_ws")  # the kernels that can go out as programmatic dependent launches
ROTATE_BYTES = 256 << 20  # rotate weight copies until they exceed this (the H200 L2 is 60 MB)
# issue #3's M = 1 targets: speed-up over cuBLAS bf16 per format and (N, K); M = 16 asks 90% of each
DECODE_TARGETS = {"nvfp4": [((28672, 8192), 3.2), ((8192, 28672), 3.2), ((8192, 8192), 3.0)],
                  "mxfp4": [((28672, 8192), 3.4), ((8192, 28672), 3.4)],
                  "mxfp8": [((28672, 8192), 1.8), ((8192, 28672), 1.8), ((8192, 8192), 1.8)]}


def _bench(fn, rep=100):
    """Median us of fn by triton.testing.do_bench (L2 flushed before every call): for calls that
    cannot be captured in a CUDA graph and are long enough that host overhead does not show."""
    import triton
    return triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode="median") * 1e3


def _copies(make, nbytes):
    """Copies of a weight totalling more than ROTATE_BYTES (at least two), so calls that rotate
    over them read their weights from HBM, not from the 60 MB L2."""
    return [make() for _ in range(min(8, max(2, -(-ROTATE_BYTES // max(nbytes, 1)))))]


def _time_graph(call, copies, replays=10, calls=8):
    """Median us per call of call(copy), rotating over copies, timed on CUDA-graph replays: the
    kernels run back to back with no host overhead between them (as in a captured decode step)."""
    return _time_graphs([(call, copies)], replays, calls)[0]


# short calls (M <= 64): a replay costs about 3 us more than its calls (the graph's launch), so 32 calls amortize it
# as a decode step's hundreds of kernels do (session 35: 8 calls put 0.3-0.5 us on every contender)
SHORT_CALL_REPS = dict(replays=10, calls=32)
# long, compute-bound calls (M > 64): fewer calls per replay, more replays, every contender's graph in turn
LONG_CALL_REPS = dict(replays=12, calls=2)


def _time_graphs(contenders, replays=10, calls=8):
    """_time_graph of several (call, copies) at once: each captured in a graph of its own, the graphs replayed in
    turn, replay by replay, so that a slow stretch of the GPU (its clocks under power limits move compute-bound
    calls by up to 13% from one second to the next, session 38) falls on every contender alike."""
    graphs, per_call = [], []
    for call, copies in contenders:
        n = max(calls, len(copies))
        for c in copies:
            call(c)  # compile, allocate, warm up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(copies[i % len(copies)])
        graph.replay()
        graphs.append(graph)
        per_call.append(n)
    torch.cuda.synchronize()
    times = [[] for _ in graphs]
    for _ in range(replays):
        for graph, n, t in zip(graphs, per_call, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) * 1e3 / n)
    del graphs
    return [sorted(t)[len(t) // 2] for t in times]


def _time_launches(call, copies, pdl=True, **reps):
    """_time_graph of call as plain launches and, with pdl, as programmatic dependent launches (else None): each
    call's launch and first weight loads then overlap the call before it, as between the GEMMs of bench/e2e.py way
    (e); cuBLAS cannot be launched so."""
    from microscale.kernels.sm90.launch import programmatic_launches
    with programmatic_launches(False):
        plain = _time_graph(call, copies, **reps)
    if not pdl:
        return plain, None
    with programmatic_launches(True):
        return plain, _time_graph(call, copies, **reps)


def _time_against_bf16(ours_call, preps, bf16_call, ws, pdl, **reps):
    """Short calls (M <= 64): ours (plain and, with pdl, programmatic) and cuBLAS bf16 (bf16_call over ws; None:
    not timed) timed twice, interleaved, each keeping its faster run, so that one slow stretch of the GPU inflates
    neither side of the ratio (seen once: cuBLAS 121 us, not 110). Returns (ours, ours_pdl or None, bf16 or None)."""
    ours, ours_pdl, bf16 = [], [], []
    for _ in range(2):
        plain, programmatic = _time_launches(ours_call, preps, pdl, **reps)
        ours.append(plain)
        ours_pdl.append(programmatic)
        if bf16_call is not None:
            bf16.append(_time_graph(bf16_call, ws, **reps))
    return min(ours), min(ours_pdl) if pdl else None, min(bf16) if bf16 else None


def _env():
    import triton
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def _weights(n, k, fmt, seed):
    from microscale.quant import quantize
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    return w, quantize(w, fmt, scale_layout="linear")


def bench_shape(fmt, n, k, ms, *, kernels=None, peers=True, seed=0):
    """Records for one format and (N, K) over the M values."""
    from microscale.kernels import sm90
    w, q = _weights(n, k, fmt, seed)
    prep = sm90.prepare(q)
    nbytes_q = sum(t.numel() * t.element_size() for t in prep)
    preps = _copies(lambda: sm90.clone_prepared(*prep), nbytes_q)
    if peers:
        ws = _copies(lambda: w.clone(), w.numel() * 2)
        w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
        ws8 = (w.float().abs().amax(1) / 448).view(1, n)
        w8s = _copies(lambda: w8.clone(), w8.numel())
    out = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rec = {"format": fmt, "M": m, "N": n, "K": k}
        opts = {"fp8_activations": True} if kernels == "fp8" else {}
        kernel = kernels or sm90.choose_kernel(fmt, m, opts, x.dtype, torch.cuda.get_device_capability(), n, k=k)
        rec["backend"] = f"sm90:{kernel}"
        ours_call = lambda p: sm90.gemm(x, *p, None, fmt=fmt, n=n, k=k, options={"kernel": kernel})
        contenders = [(ours_call, preps)]
        if peers:
            xs = (x.float().abs().amax(1, keepdim=True) / 448).clamp_min(1e-12)
            x8 = (x.float() / xs).to(torch.float8_e4m3fn)
            mp = max(16, -(-m // 16) * 16)  # cuBLASLt FP8 wants M a multiple of 16: pad (counted in the time)
            if mp != m:
                x8 = torch.cat([x8, x8.new_zeros(mp - m, k)])
                xs = torch.cat([xs, xs.new_ones(mp - m, 1)])
            contenders += [(lambda wb: F.linear(x, wb), ws),
                           (lambda wq: torch._scaled_mm(x8, wq.t(), scale_a=xs, scale_b=ws8, out_dtype=torch.bfloat16),
                            w8s)]
        pdl = m <= 64 and kernel in PDL_KERNELS
        if m <= 64:
            bf16_call, bf16_ws = contenders[1] if peers else (None, None)
            rec["us"], pdl_us, bf16_us = _time_against_bf16(ours_call, preps, bf16_call, bf16_ws, pdl,
                                                            **SHORT_CALL_REPS)
            if pdl:
                rec["pdl_us"] = pdl_us
            if peers:
                rec["bf16_us"], rec["fp8_us"] = bf16_us, _time_graph(*contenders[2], **SHORT_CALL_REPS)
        else:
            # long, compute-bound calls: every contender's replays in turn, whose clocks move with the GPU's power
            # (session 38: the same wgmma_ws call 1421 us in one run, 1262 in another; cuBLAS 671-759 us on one
            # shape within a run)
            times = _time_graphs(contenders, **LONG_CALL_REPS)
            rec.update(zip(("us", "bf16_us", "fp8_us"), times))
        if peers:
            if m <= 16:
                rec["eager_us"] = _bench(lambda: F.linear(x, q.dequantize(torch.bfloat16)), rep=20)
            rec["speedup_vs_bf16"] = rec["bf16_us"] / rec["us"]
            if pdl:
                rec["speedup_pdl_vs_bf16"] = rec["bf16_us"] / rec["pdl_us"]
        moved = nbytes_q + 2 * m * k + 2 * m * n  # the fewest bytes: quantized weights once, x, y
        rec["tbps"] = moved / rec["us"] * 1e-6
        rec["tflops"] = 2 * m * n * k / rec["us"] * 1e-6
        rec["tbps_of_copy"] = rec["tbps"] / COPY_TBPS
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def bench_quantize(m=8192, k=8192, formats=FORMATS, tiles=(None,)):
    """quantize_gpu on x [m, k] bf16, timed on CUDA-graph replays over copies of x larger than the L2
    (per call: the kernel launches back to back, no Python in between). TB/s counts the bytes
    actually moved: x read, codes and scales written, and for NVFP4 with a computed global scale x
    read a second time (the amax pass); tbps_one_pass counts x once (the issue #3 target applies
    to the given-scale quantize).

    tiles: quantize_gpu configs (BLOCK_M, BLOCKS, num_warps, SPREAD) to time, None for the default
    (kernels/quantize.py TILE). Every tile must give the default's bytes: one that does not is
    reported with us = None, as is one that fails to compile."""
    from microscale.kernels.quantize import quantize_gpu
    recs = []
    xs = _copies(lambda: torch.randn(m, k, device="cuda", dtype=torch.bfloat16), m * k * 2)
    x = xs[0]
    for fmt in formats:
        for given in ([True, False] if fmt == "nvfp4" else [None]):
            g = torch.tensor(448 * 6 / 4.0, device="cuda") if given else None
            want = quantize_gpu(x, fmt, global_scale=g)
            one_pass = x.numel() * x.element_size() + want.data.numel() * want.data.element_size() + want.scale.numel()
            moved = one_pass + (x.numel() * x.element_size() if given is False else 0)
            for tile in tiles:
                rec = {"op": "quantize", "format": fmt, "M": m, "K": k,
                       "global_scale": {True: "given", False: "computed", None: "none"}[given],
                       **({} if tile is None else {"tile": list(tile)}), "us": None}
                try:
                    q = quantize_gpu(x, fmt, global_scale=g, config=tile)
                    if q.same_codes_and_scales(want):
                        rec["us"] = _time_graph(lambda x: quantize_gpu(x, fmt, global_scale=g, config=tile), xs)
                    else:
                        rec["error"] = "bytes differ from the default tile's"
                except Exception as e:  # a tile that does not compile or fit
                    rec["error"] = str(e).splitlines()[0][:200]
                if rec["us"] is not None:
                    us = rec["us"]
                    rec.update(bytes=moved, tbps=moved / us * 1e-6, of_copy=moved / us * 1e-6 / COPY_TBPS,
                               tbps_one_pass=one_pass / us * 1e-6)
                print(json.dumps(rec), flush=True)
                recs.append(rec)
    return recs


def sweep_kernel(fmt, n, k, ms, configs, kernel="decode", seed=0):
    """Time tile configurations (DecodeConfig, WgmmaConfig, WsConfig, RingConfig or DequantConfig fields) of the
    decode, wgmma, wgmma_ws, decode_ws or dequantize (+ cuBLAS) path. decode_ws: the fields replace those of
    ring_config's choice for each M."""
    from microscale.kernels import sm90
    from microscale.kernels.sm90 import decode_ws, launch as paths
    from microscale.kernels.sm90 import wgmma_ws
    from microscale.kernels.sm90.decode import FMT_CODE
    config_class, run = {"decode": (paths.DecodeConfig, paths.decode_gemm),
                         "decode_ws": (decode_ws.RingConfig, decode_ws.decode_ws_gemm),
                         "wgmma": (paths.WgmmaConfig, paths.wgmma_gemm),
                         "wgmma_ws": (wgmma_ws.WsConfig, wgmma_ws.wgmma_ws_gemm),
                         "dequant": (paths.DequantConfig, lambda *a: paths.dequant_gemm(*a[:-1], cfg=a[-1]))}[kernel]
    _, q = _weights(n, k, fmt, seed)
    prep = sm90.prepare(q)
    preps = _copies(lambda: sm90.clone_prepared(*prep), sum(t.numel() * t.element_size() for t in prep))
    recs = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # every tile must give the default tile's output (up to fp32 summation order): a fast wrong tile
        # is caught here, not after it became the default
        default = decode_ws.ring_config(m, n, k, FMT_CODE[fmt]) if kernel == "decode_ws" else config_class()
        expected = run(x, *prep, None, FMT_CODE[fmt], n, k, default).float()
        m_recs, timed = [], []  # timed: (record, call) of the tiles that give the default's output
        for c in configs:
            cfg = dataclasses.replace(default, **c) if kernel == "decode_ws" else config_class(**c)
            if kernel == "decode" and (cfg.block_m > max(8, 2 * m) or cfg.reps % cfg.parts):  # smaller: several m tiles
                continue
            if kernel == "decode_ws" and cfg.threads > 1024:
                continue
            rec = {"op": "sweep", "kernel": kernel, "format": fmt, "M": m, "N": n, "K": k, **dataclasses.asdict(cfg),
                   "us": None, "rel_diff_vs_default": None}
            try:
                got = run(x, *prep, None, FMT_CODE[fmt], n, k, cfg).float()
                rec["rel_diff_vs_default"] = ((got - expected).norm() / expected.norm()).item()
                if rec["rel_diff_vs_default"] < 1e-3:  # as bench_quantize: a wrong tile is reported, not timed
                    timed.append((rec, lambda p, cfg=cfg: run(x, *p, None, FMT_CODE[fmt], n, k, cfg)))
                else:
                    rec["error"] = "output differs from the default tile's"
            except Exception as e:  # a configuration that does not compile or fit
                print("config failed", c, str(e).splitlines()[0][:200], flush=True)
            m_recs.append(rec)
        # the tiles replayed in turn, as bench_shape's M > 64 contenders: timed one after the other, a long sweep of
        # compute-bound tiles lowered the clocks for the later ones (session 38: the default wgmma_ws tile 1411 us
        # after 24 tiles, 1262 us a minute later)
        times = _time_graphs([(call, preps) for _, call in timed], **(LONG_CALL_REPS if m > 64 else {}))
        for (rec, _), us in zip(timed, times):
            rec["us"] = us
        for rec in m_recs:
            print(json.dumps(rec), flush=True)
        recs += m_recs
    return recs


def bench_large(fmt, n, k, ms, seed=0):
    """Large-M alternatives: dequantize all of W then one cuBLAS GEMM, chunk-wise through L2, FP8."""
    from microscale.kernels import sm90
    from microscale.kernels.sm90 import launch as paths
    from microscale.kernels.sm90.decode import FMT_CODE
    w, q = _weights(n, k, fmt, seed)
    prep = sm90.prepare(q)
    code = FMT_CODE[fmt]
    recs = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rec = {"op": "large", "format": fmt, "M": m, "N": n, "K": k,
               "bf16_us": _time_graph(lambda wb: F.linear(x, wb), [w, w.clone()])}
        for chunk in (0, 4096):
            rec[f"dequant_chunk{chunk}_us"] = _time_graph(
                lambda p: paths.dequant_gemm(x, *p, None, code, n, k, chunk_rows=chunk), [prep])
        if fmt != "nvfp4":
            rec["fp8_us"] = _time_graph(lambda p: paths.fp8_gemm(x, *p, None, code, n, k), [prep])
            y8 = paths.fp8_gemm(x, *prep, None, code, n, k)
            y16 = paths.dequant_gemm(x, *prep, None, code, n, k)
            rec["fp8_rel_err_vs_w4a16"] = ((y8.float() - y16.float()).norm() / y16.float().norm()).item()
            rec["fp8_inexact_weights"] = paths.transcoded(*prep, code, n, k)[2]
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


def _key_results(results: dict) -> list:
    """The issue's targets next to what was measured."""
    from microscale.kernels import sm90
    g = {(r["format"], r["M"], r["N"], r["K"], r["backend"]): r for r in results["gemm"]}

    def sp(fmt, m, n, k, kernel="sm90:decode", field="speedup_vs_bf16"):
        r = g.get((fmt, m, n, k, kernel))
        return None if r is None else r.get(field)

    def fx(v):
        return "-" if v is None else f"{v:.2f}x"

    # cuBLAS bf16 at M <= 16 is memory-bound and the same call for every M, but it runs in two modes
    # about 8% apart (notes): the speed-up is also given against its fastest time for the shape
    fastest_bf16 = {}
    for r in results["gemm"]:
        if r["M"] <= 16 and r.get("bf16_us"):
            nk = r["N"], r["K"]
            fastest_bf16[nk] = min(fastest_bf16.get(nk, r["bf16_us"]), r["bf16_us"])

    def sp_fastest(fmt, m, n, k, kernel):
        r, bf16_us = g.get((fmt, m, n, k, kernel)), fastest_bf16.get((n, k))
        return None if r is None or bf16_us is None else bf16_us / r["us"]

    def chosen(fmt, m, n, k):  # the kernel today's dispatch takes (bf16 x on an H200)
        return "sm90:" + sm90.choose_kernel(fmt, m, {}, n=n, k=k)

    rows = ["## Key results against the targets", "",
            "Decode rows: the kernel the dispatch takes at each M (in brackets after the speed-up), then the Triton "
            "decode kernel alone. Speed-up over cuBLAS bf16 in the same record, and over the fastest cuBLAS bf16 "
            "time of that shape at M <= 16 in these records; PDL: ours launched as programmatic dependent launches "
            "(MICROSCALE_PDL=1, as in bench/e2e.py way (e)) against the same cuBLAS time, in records that have it.",
            "",
            "| target | measured |", "|---|---|"]
    for fmt, items in DECODE_TARGETS.items():
        for (n, k), want in items:
            k1, k16 = chosen(fmt, 1, n, k), chosen(fmt, 16, n, k)
            for label, kernels in ((f"{fmt} M=1 N={n} K={k} >= {want}x bf16; M=16 >= 90% of that", (k1, k16)),
                                   ("same, the Triton decode kernel alone", ("sm90:decode", "sm90:decode"))):
                if label.startswith("same") and kernels == (k1, k16):
                    continue
                m1, m16 = sp(fmt, 1, n, k, kernels[0]), sp(fmt, 16, n, k, kernels[1])
                f1, f16 = sp_fastest(fmt, 1, n, k, kernels[0]), sp_fastest(fmt, 16, n, k, kernels[1])
                ratio = None if not (f1 and f16) else f16 / f1
                p1, p16 = (sp(fmt, m, n, k, kern, "speedup_pdl_vs_bf16") for m, kern in ((1, kernels[0]), (16, kernels[1])))
                pdl = "" if p1 is None or p16 is None else f"; PDL: M=1 {fx(p1)}, M=16 {fx(p16)} ({p16 / p1:.0%})"
                rows.append(f"| {label} | M=1 {fx(m1)} ({fx(f1)}; {kernels[0][5:]}), M=16 {fx(m16)} ({fx(f16)}; "
                            f"{kernels[1][5:]}; {'-' if ratio is None else f'{ratio:.0%}'} of M=1){pdl} |")
    large = [r for r in results["gemm"] if r["M"] >= 1024 and r["backend"] in ("sm90:wgmma_ws", "sm90:dequant")]
    for backend, label in (("sm90:wgmma_ws", "fused wgmma_ws"), ("sm90:dequant", "dequant + cuBLAS")):
        by_m = {}
        for r in large:
            if r["backend"] == backend:
                by_m.setdefault(r["M"], []).append(r["speedup_vs_bf16"])
        if by_m:
            ranges = ", ".join(f"M={m}: {min(v):.2f}-{max(v):.2f}x" for m, v in sorted(by_m.items()))
            rows.append(f"| large M (>= 1024), bf16 activations, any format >= 0.9x bf16 | {label}: {ranges} |")
    def fastest_per_shape(records, floor):
        """Per M: the range of the fastest record's speed-up per format and shape, and how many reach floor."""
        best = {}
        for r in records:
            key = r["format"], r["M"], r["N"], r["K"]
            best[key] = max(best.get(key, 0.0), r["speedup_vs_bf16"])
        parts = []
        for m in sorted({key[1] for key in best}):
            v = [sp for key, sp in best.items() if key[1] == m]
            parts.append(f"M={m}: {min(v):.2f}-{max(v):.2f}x ({sum(x >= floor for x in v)} of {len(v)} >= {floor}x)")
        return ", ".join(parts)

    if large:  # the faster of the two per format and shape, as the issue asks
        rows.append(f"| large M, the faster kernel per format and shape | {fastest_per_shape(large, 0.9)} |")
    medium = [r for r in results["gemm"] if 64 <= r["M"] <= 512 and r["backend"] != "sm90:fp8" and r.get("bf16_us")]
    if medium:
        rows.append(f"| M = 64-512 (no target), bf16 activations, the fastest kernel per format and shape | "
                    f"{fastest_per_shape(medium, 1.0)} |")
    for fmt in ("mxfp4", "mxfp8"):
        fp8 = [f"M={m} {fx(sp(fmt, m, 8192, 8192, 'sm90:fp8'))}" for m in (4096, 8192)]
        rows.append(f"| {fmt} FP8 path >= 1.5x bf16 at M=4096, 8192 (N=K=8192) | {', '.join(fp8)} |")
    for r in results.get("quantize", []):
        if r["global_scale"] != "computed" or r["format"] != "nvfp4":
            rows.append(f"| quantize {r['format']} 8192x8192 bf16 >= 80% of copy bandwidth | "
                        f"{r['tbps']:.2f} TB/s = {r['of_copy']:.0%} |")
    return rows + [""]


def write_table(results: dict, path="BENCHMARKS.md"):
    """Regenerate BENCHMARKS.md from a results JSON."""
    env = results["env"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `bench/gemm.py` from `{results.get('source', 'bench/results/gemm_h200.json')}`: "
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}. "
        "Times are per call from CUDA-graph replays of back-to-back calls (median of the replays; in runs from "
        "session 6 on, at M <= 64 the faster of two interleaved runs of ours and of cuBLAS; in the runs of "
        "M >= 1024 from session 38 on, ours, cuBLAS bf16 and FP8 replayed in turn, replay by replay: the notes say "
        "which runs), every contender's weights rotated over copies larger than the L2, random bf16 activations "
        "and weights. Speed-up is over cuBLAS bf16 (`F.linear`) timed the same way in the same run; TB/s counts "
        "quantized weight + activation + output bytes; ceilings: copy "
        f"{COPY_TBPS} TB/s, bf16 {BF16_TFLOPS:.0f} / fp8 {FP8_TFLOPS:.0f} TFLOP/s (docs h200-baseline).",
        "",
    ]
    lines += _key_results(results)
    if os.path.exists(os.path.join(os.path.dirname(path) or ".", "bench/results/gemm_h200.png")):
        lines += ["![speed-up over cuBLAS bf16 against M](bench/results/gemm_h200.png)", ""]
    lines += [
        "## GEMM (y = x @ W^T, x bf16 [M, K], W [N, K] quantized)",
        "",
        "| format | M | N | K | kernel | us | cuBLAS bf16 us | fp8 _scaled_mm us | eager dequant us | x bf16 | TB/s | "
        "TFLOP/s | PDL us | PDL x bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"

    for r in results["gemm"]:
        lines.append(f"| {r['format']} | {r['M']} | {r['N']} | {r['K']} | {r['backend']} | {f(r['us'])} | "
                     f"{f(r.get('bf16_us'))} | {f(r.get('fp8_us'))} | {f(r.get('eager_us'), 0)} | "
                     f"{f(r.get('speedup_vs_bf16'), 2)} | {f(r['tbps'], 2)} | {f(r['tflops'], 0)} | "
                     f"{f(r.get('pdl_us'))} | {f(r.get('speedup_pdl_vs_bf16'), 2)} |")
    if results.get("quantize"):
        lines += ["", "## Quantize kernel (8192 x 8192 bf16)", "",
                  "| format | global scale | us | TB/s (read + written) | of copy ceiling |", "|---|---|---|---|---|"]
        for r in results["quantize"]:
            lines.append(f"| {r['format']} | {r['global_scale']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['of_copy']:.0%} |")
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    # keep the end-to-end section that bench/e2e.py owns (between its markers)
    kept = ""
    if os.path.exists(path):
        old = open(path).read()
        begin = old.find("<!-- e2e:begin")
        if begin >= 0:
            kept = "\n" + old[begin:]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n" + kept)


def plot(results: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(FORMATS), figsize=(5 * len(FORMATS), 4), sharey=True)
    for ax, fmt in zip(axes, FORMATS):
        for color, (n, k) in zip(("C0", "C1", "C2", "C3"), SHAPES):
            rs = sorted((r for r in results["gemm"] if r["format"] == fmt and (r["N"], r["K"]) == (n, k)
                         and r.get("speedup_vs_bf16")), key=lambda r: r["M"])
            fastest = {}  # per M, the fastest bf16-activation kernel measured (several at some M)
            for r in rs:
                best = fastest.get(r["M"])
                if r["backend"] != "sm90:fp8" and (best is None or r["speedup_vs_bf16"] > best["speedup_vs_bf16"]):
                    fastest[r["M"]] = r
            default = [fastest[m] for m in sorted(fastest)]
            fp8 = [r for r in rs if r["backend"] == "sm90:fp8"]
            if default:
                ax.plot([r["M"] for r in default], [r["speedup_vs_bf16"] for r in default], marker="o",
                        color=color, label=f"N={n} K={k}")
            if fp8:
                ax.plot([r["M"] for r in fp8], [r["speedup_vs_bf16"] for r in fp8], marker="x", ls="--",
                        color=color, label=f"N={n} K={k}, FP8 path (opt-in)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(fmt)
        ax.set_xlabel("M")
    axes[0].set_ylabel("speed-up over cuBLAS bf16 (fastest kernel per M)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge_results(old, new):
    """The results `old` with every GEMM record that `new` measured again (same format, M, N, K and
    backend) replaced by the new one; the other sections are the new run's where it has them."""
    new = dict(new)

    def key(r):
        return r["format"], r["M"], r["N"], r["K"], r["backend"]
    fresh = {key(r) for r in new["gemm"]}
    merged = [r for r in old["gemm"] if key(r) not in fresh] + new["gemm"]
    formats = list(dict.fromkeys(r["format"] for r in merged))
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in merged))
    new["gemm"] = sorted(merged, key=lambda r: (formats.index(r["format"]), shapes.index((r["N"], r["K"])),
                                                r["M"], r["backend"]))
    for kind in ("quantize", "sweep", "large"):
        new[kind] = new[kind] or old.get(kind, [])
    new["notes"] = old.get("notes", []) + new.get("notes", []) + [
        f"Merged run {new['env']['date']} into results of {old['env']['date']}."]
    return new


def main():
    # "us" and the sweeps time our kernels as plain launches, as cuBLAS's: back to back, a programmatic
    # dependent launch overlaps each call with the one before it; bench_shape times that apart ("pdl_us")
    os.environ["MICROSCALE_PDL"] = "0"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results JSON to write")
    p.add_argument("--plot", help="PNG to write")
    p.add_argument("--table", help="only regenerate BENCHMARKS.md from this JSON")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default=";".join(f"{n},{k}" for n, k in SHAPES))
    p.add_argument("--fp8", action="store_true", help="also time the opt-in FP8 path for MX formats at M >= 512")
    p.add_argument("--kernel", help="time this sm90 kernel instead of the dispatch rule's choice")
    p.add_argument("--sweep", action="store_true",
                   help="tile sweep of the decode kernel (or --kernel wgmma|wgmma_ws|dequant, or --kernel quantize "
                   "with grid keys block_m, blocks, num_warps, spread) instead of the benchmark")
    p.add_argument("--sweep-grid", default='{"block_m": [8, 16], "reps": [1, 2], "unroll": [2, 4], '
                   '"depth": [1, 2, 3], "ctas_per_sm": [2, 4, 8]}',
                   help="JSON {DecodeConfig field: [values]}: the sweep times every combination")
    p.add_argument("--merge", action="store_true",
                   help="keep the records of the existing --out file that this run does not measure again")
    p.add_argument("--no-quantize", action="store_true")
    p.add_argument("--quantize-only", action="store_true", help="only the quantize-kernel benchmark")
    p.add_argument("--large", action="store_true", help="large-M alternatives instead of the benchmark")
    p.add_argument("--summary", help="print a compact summary of a results JSON")
    args = p.parse_args()
    if args.summary:
        with open(args.summary) as fh:
            results = json.load(fh)
        for key in ("quantize", "large", "gemm"):
            for r in results.get(key, []):
                print(" ".join(f"{a}={v:.3g}" if isinstance(v, float) else f"{a}={v}" for a, v in r.items()))
        best = {}
        for r in results.get("sweep", []):
            if r.get("op") == "quantize":
                print("quantize", r["format"], r["global_scale"], r.get("tile", "default"),
                      r["us"] and round(r["us"], 1))
            elif r["us"] is not None:
                key = (r["format"], r["M"], r["N"], r["K"])
                best.setdefault(key, []).append(r)
        for key, rs in best.items():
            rs.sort(key=lambda r: r["us"])
            tile = ("block_m", "reps", "unroll", "ctas_per_sm") if rs[0]["kernel"] == "decode" else \
                ("groups", "split", "k_warps", "stages")
            print(key, rs[0]["kernel"], tile, [(*(r.get(f) for f in tile), round(r["us"], 1)) for r in rs[:4]],
                  "worst", round(rs[-1]["us"], 1))
        return
    if args.table:
        with open(args.table) as fh:
            results = json.load(fh)
        results["source"] = args.table
        write_table(results)
        if args.plot:
            plot(results, args.plot)
        return
    sys.path.append(os.getcwd())  # after PYTHONPATH, so that a tree named there is the microscale imported
    torch.manual_seed(0)
    formats = args.formats.split(",")
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    results = {"env": _env(), "gemm": [], "quantize": [], "sweep": [], "large": [], "notes": []}
    merged_into = None
    if args.merge and args.out and os.path.exists(args.out):
        with open(args.out) as fh:
            merged_into = json.load(fh)

    def current():
        return merge_results(merged_into, results) if merged_into else results

    def save():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(current(), fh, indent=1)
    print(json.dumps(results["env"]), flush=True)
    if args.large:
        for fmt in formats:
            for n, k in shapes:
                results["large"] += bench_large(fmt, n, k, ms)
    elif args.sweep and args.kernel == "quantize":  # grid keys: block_m, blocks, num_warps, spread
        grid = json.loads(args.sweep_grid)
        tiles = [tuple(t) for t in itertools.product(*(grid[f] for f in ("block_m", "blocks", "num_warps", "spread")))]
        results["sweep"] = bench_quantize(formats=formats, tiles=[None] + tiles)
    elif args.sweep:
        grid = json.loads(args.sweep_grid)
        configs = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
        for fmt in formats:
            for n, k in shapes:
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    wbs = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                    print(json.dumps({"op": "bf16", "M": m, "N": n, "K": k,
                                      "us": _time_graph(lambda wb: F.linear(x, wb), wbs)}))
                results["sweep"] += sweep_kernel(fmt, n, k, ms, configs, args.kernel or "decode")
    else:
        if not args.no_quantize:
            results["quantize"] = bench_quantize()
        for fmt in (formats if not args.quantize_only else []):
            for n, k in shapes:
                results["gemm"] += bench_shape(fmt, n, k, ms, kernels=args.kernel)
                if args.fp8 and fmt != "nvfp4" and (n, k) == (8192, 8192):
                    results["gemm"] += bench_shape(fmt, n, k, [m for m in ms if m >= 512], kernels="fp8")
                save()  # partial results survive a time limit
    save()
    if args.plot and results["gemm"]:
        plot(current(), args.plot)


if __name__ == "__main__":
    main()
