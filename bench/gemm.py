"""Benchmark the Hopper (sm90) kernels against cuBLAS on the H200.

    PYTHONPATH=. python3 bench/gemm.py --out bench/results/gemm_h200.json --plot bench/results/gemm_h200.png
    PYTHONPATH=. python3 bench/gemm.py --table bench/results/gemm_h200.json   # only regenerate BENCHMARKS.md

Per format and shape, in one process: our kernel (the one dispatch picks), cuBLAS bf16 (F.linear),
torch._scaled_mm FP8 with row-wise scales, and for M <= 16 the eager "dequantize, then matmul".
Times are medians of triton.testing.do_bench (which flushes L2 before every call), with the weight
buffers of every contender rotated over copies totalling more than the L2, on fresh random data.
Also: the quantize kernel (bytes read + written against the copy ceiling), the decode-kernel tile
sweep (--sweep) and the large-M alternatives (dequant+cuBLAS full or chunked, FP8).
"""

import argparse
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
ROTATE_BYTES = 256 << 20  # rotate weight copies until they exceed this (the H200 L2 is 60 MB)


def _bench(fn, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode="median") * 1e3  # us


class Rotating:
    """Call fn(copy) on copies of a weight in turn, so repeated calls do not hit in L2."""

    def __init__(self, make, nbytes):
        self.copies = [make() for _ in range(max(1, -(-ROTATE_BYTES // max(nbytes, 1))))][:8]
        self.i = 0

    def __call__(self, fn):
        def run():
            self.i = (self.i + 1) % len(self.copies)
            return fn(self.copies[self.i])
        return run


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
    rot_q = Rotating(lambda: tuple(t.clone() for t in prep), nbytes_q)
    rot_w = Rotating(lambda: w.clone(), w.numel() * 2) if peers else None
    w8 = rot8 = None
    if peers:
        w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
        ws8 = (w.float().abs().amax(1) / 448).view(1, n)
        rot8 = Rotating(lambda: w8.clone(), w8.numel())
    out = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rec = {"format": fmt, "M": m, "N": n, "K": k}
        opts = {"fp8_activations": True} if kernels == "fp8" else {}
        kernel = kernels or sm90.choose_kernel(fmt, m, opts)
        if kernel == "fp8" and fmt == "nvfp4":
            continue
        rec["backend"] = f"sm90:{kernel}"
        rec["us"] = _bench(rot_q(lambda p: sm90.gemm(x, *p, None, fmt=fmt, n=n, k=k, options={"kernel": kernel})))
        if peers:
            rec["bf16_us"] = _bench(rot_w(lambda wb: F.linear(x, wb)))
            try:
                xs = (x.float().abs().amax(1, keepdim=True) / 448).clamp_min(1e-12)
                x8 = (x.float() / xs).to(torch.float8_e4m3fn)
                mp = max(16, -(-m // 16) * 16)
                if mp != m:
                    x8 = torch.cat([x8, x8.new_zeros(mp - m, k)])
                    xs = torch.cat([xs, xs.new_ones(mp - m, 1)])
                rec["fp8_us"] = _bench(rot8(lambda wq: torch._scaled_mm(x8, wq.t(), scale_a=xs, scale_b=ws8,
                                                                        out_dtype=torch.bfloat16)))
            except RuntimeError as e:  # shapes cuBLASLt FP8 refuses
                rec["fp8_us"] = None
                rec["fp8_error"] = str(e).splitlines()[0][:120]
            if m <= 16:
                rec["eager_us"] = _bench(lambda: F.linear(x, q.dequantize(torch.bfloat16)), rep=20)
            rec["speedup_vs_bf16"] = rec["bf16_us"] / rec["us"]
        moved = nbytes_q + 2 * m * k + 2 * m * n  # the fewest bytes: quantized weights once, x, y
        rec["tbps"] = moved / rec["us"] * 1e-6
        rec["tflops"] = 2 * m * n * k / rec["us"] * 1e-6
        rec["tbps_of_copy"] = rec["tbps"] / COPY_TBPS
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def bench_quantize(m=8192, k=8192):
    from microscale.kernels.quantize import quantize_gpu
    recs = []
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for fmt in FORMATS:
        for given in ([True, False] if fmt == "nvfp4" else [False]):
            g = torch.tensor(448 * 6 / 4.0, device="cuda") if given else None
            us = _bench(lambda: quantize_gpu(x, fmt, global_scale=g))
            q = quantize_gpu(x, fmt, global_scale=g)
            moved = x.numel() * 2 + q.data.numel() * q.data.element_size() + q.scale.numel()
            rec = {"op": "quantize", "format": fmt, "M": m, "K": k, "global_scale": "given" if given else "computed",
                   "us": us, "tbps": moved / us * 1e-6, "of_copy": moved / us * 1e-6 / COPY_TBPS}
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    return recs


def sweep_decode(fmt, n, k, ms, configs, seed=0):
    """Time decode-kernel tile configurations (block_m, reps, unroll, split, num_warps)."""
    from microscale.kernels import sm90
    from microscale.kernels.sm90 import launch as paths
    from microscale.kernels.sm90.decode import FMT_CODE
    _, q = _weights(n, k, fmt, seed)
    prep = sm90.prepare(q)
    rot = Rotating(lambda: tuple(t.clone() for t in prep), sum(t.numel() * t.element_size() for t in prep))
    recs = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for c in configs:
            cfg = paths.DecodeConfig(**c)
            if cfg.block_m < min(m, 32) and m <= 32:
                continue
            try:
                us = _bench(rot(lambda p: paths.decode_gemm(x, *p, None, FMT_CODE[fmt], n, k, cfg)))
            except Exception as e:  # a configuration that does not compile or fit
                us = None
                print("config failed", c, str(e).splitlines()[0][:200], flush=True)
            rec = {"op": "sweep", "format": fmt, "M": m, "N": n, "K": k, **c, "us": us}
            print(json.dumps(rec), flush=True)
            recs.append(rec)
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
        rec = {"op": "large", "format": fmt, "M": m, "N": n, "K": k, "bf16_us": _bench(lambda: F.linear(x, w))}
        for chunk in (0, 2048, 4096):
            rec[f"dequant_chunk{chunk}_us"] = _bench(lambda: paths.dequant_gemm(x, *prep, None, code, n, k, chunk_rows=chunk))
        if fmt != "nvfp4":
            inexact = torch.zeros(1, dtype=torch.int32, device="cuda")
            rec["fp8_us"] = _bench(lambda: paths.fp8_gemm(x, *prep, None, code, n, k, inexact))
            y8 = paths.fp8_gemm(x, *prep, None, code, n, k)
            y16 = paths.dequant_gemm(x, *prep, None, code, n, k)
            rec["fp8_rel_err_vs_w4a16"] = ((y8.float() - y16.float()).norm() / y16.float().norm()).item()
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


def write_table(results: dict, path="BENCHMARKS.md"):
    """Regenerate BENCHMARKS.md from a results JSON."""
    env = results["env"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `bench/gemm.py` from `{results.get('source', 'bench/results/gemm_h200.json')}`: "
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}. "
        "Times are medians of `triton.testing.do_bench` (L2 flushed before every call, weight copies "
        "rotated), random bf16 activations and weights. Speed-up is over cuBLAS bf16 (`F.linear`) in "
        "the same run; TB/s counts quantized weight + activation + output bytes; ceilings: copy "
        f"{COPY_TBPS} TB/s, bf16 {BF16_TFLOPS:.0f} / fp8 {FP8_TFLOPS:.0f} TFLOP/s (docs h200-baseline).",
        "",
        "## GEMM (y = x @ W^T, x bf16 [M, K], W [N, K] quantized)",
        "",
        "| format | M | N | K | kernel | us | cuBLAS bf16 us | fp8 _scaled_mm us | eager dequant us | x bf16 | TB/s | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"

    for r in results["gemm"]:
        lines.append(f"| {r['format']} | {r['M']} | {r['N']} | {r['K']} | {r['backend']} | {f(r['us'])} | "
                     f"{f(r.get('bf16_us'))} | {f(r.get('fp8_us'))} | {f(r.get('eager_us'), 0)} | "
                     f"{f(r.get('speedup_vs_bf16'), 2)} | {f(r['tbps'], 2)} | {f(r['tflops'], 0)} |")
    if results.get("quantize"):
        lines += ["", "## Quantize kernel (8192 x 8192 bf16)", "",
                  "| format | global scale | us | TB/s (read + written) | of copy ceiling |", "|---|---|---|---|---|"]
        for r in results["quantize"]:
            lines.append(f"| {r['format']} | {r['global_scale']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['of_copy']:.0%} |")
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def plot(results: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(FORMATS), figsize=(5 * len(FORMATS), 4), sharey=True)
    for ax, fmt in zip(axes, FORMATS):
        for n, k in SHAPES:
            rs = [r for r in results["gemm"] if r["format"] == fmt and (r["N"], r["K"]) == (n, k)
                  and r.get("speedup_vs_bf16")]
            if rs:
                ax.plot([r["M"] for r in rs], [r["speedup_vs_bf16"] for r in rs], marker="o", label=f"N={n} K={k}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(fmt)
        ax.set_xlabel("M")
    axes[0].set_ylabel("speed-up over cuBLAS bf16")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results JSON to write")
    p.add_argument("--plot", help="PNG to write")
    p.add_argument("--table", help="only regenerate BENCHMARKS.md from this JSON")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default=";".join(f"{n},{k}" for n, k in SHAPES))
    p.add_argument("--fp8", action="store_true", help="also time the opt-in FP8 path for MX formats at M >= 512")
    p.add_argument("--sweep", action="store_true", help="decode-kernel tile sweep instead of the benchmark")
    p.add_argument("--no-quantize", action="store_true")
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
            if r["us"] is not None:
                key = (r["format"], r["M"], r["N"], r["K"])
                best.setdefault(key, []).append(r)
        for key, rs in best.items():
            rs.sort(key=lambda r: r["us"])
            print(key, [(r["block_m"], r["reps"], r["unroll"], r["num_warps"], round(r["us"], 1)) for r in rs[:4]],
                  "worst", round(rs[-1]["us"], 1))
        return
    if args.table:
        with open(args.table) as fh:
            results = json.load(fh)
        results["source"] = args.table
        write_table(results)
        return
    sys.path.insert(0, os.getcwd())
    torch.manual_seed(0)
    formats = args.formats.split(",")
    ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    results = {"env": _env(), "gemm": [], "quantize": [], "sweep": [], "large": [], "notes": []}
    print(json.dumps(results["env"]), flush=True)
    if args.large:
        for fmt in formats:
            for n, k in shapes:
                results["large"] += bench_large(fmt, n, k, ms)
    elif args.sweep:
        configs = [dict(block_m=bm, reps=r, unroll=u, split=s, num_warps=nw)
                   for bm, r, u, s, nw in itertools.product([8, 16], [1, 2], [1, 2, 4], [0], [4])]
        for fmt in formats:
            for n, k in shapes:
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    print(json.dumps({"op": "bf16", "M": m, "N": n, "K": k, "us": _bench(lambda: F.linear(x, wb))}))
                results["sweep"] += sweep_decode(fmt, n, k, ms, configs)
    else:
        if not args.no_quantize:
            results["quantize"] = bench_quantize()
        for fmt in formats:
            for n, k in shapes:
                results["gemm"] += bench_shape(fmt, n, k, ms)
                if args.fp8 and fmt != "nvfp4":
                    results["gemm"] += bench_shape(fmt, n, k, [m for m in ms if m >= 512], kernels="fp8", peers=False)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    if args.plot and results["gemm"]:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
