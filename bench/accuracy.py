"""SmolLM2-135M perplexity per format x weight-quantization method: the table in ACCURACY.md.

Weights only (activations stay float32): every decoder Linear is quantized (lm_head is tied to the
embedding and stays float32), fused q/k/v and gate/up share one NVFP4 global scale. The quantized
model is evaluated with each layer's effective weight (dequantized, rotated back when rotated), the
same arithmetic as FP4Linear's reference backend. Perplexity: the first --tokens tokens of wiki-200,
window 1024, stride 512 (eval.perplexity). GPTQ calibrates on Wikipedia articles that are not
evaluation text (quant/calibration.py).

    PYTHONPATH=. .venv/bin/python bench/accuracy.py               # all rows, CPU: slow (an hour+)
    PYTHONPATH=. .venv/bin/python bench/accuracy.py --table       # the markdown table of the JSON

Each finished row is appended to the JSON at once, so a run cut short keeps what it measured, and a
rerun skips rows already there.
"""

import argparse
import json
import math
import os
import platform
import time

import torch
from torch import nn

from microscale.formats.spec import get_format
from microscale.models.eval import load_smollm2, perplexity, wiki_text
from microscale.models.quantize_model import FUSED_PROJECTIONS
from microscale.quant.calibration import CALIBRATION_ARTICLES, calibration_ids
from microscale.quant.methods import effective_weight, quantize_weights

# (label, method, rotation): rotation = the format's block when True
METHODS = {
    "rtn": ("rtn", False),
    "search": ("search", False),
    "gptq": ("gptq", False),
    "gptq+rot": ("gptq", True),
}
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "accuracy_smollm2.json")


def decoder_linears(model) -> dict:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("model.layers.")}


def fused_groups(names) -> list:
    groups = []
    for members in FUSED_PROJECTIONS:
        parents = sorted({n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in members})
        for parent in parents:
            group = tuple(f"{parent}.{m}" for m in members if f"{parent}.{m}" in names)
            if len(group) > 1:
                groups.append(group)
    return groups


def weight_sqnr_db(originals: dict, effective: dict) -> float:
    signal = sum(w.double().square().sum().item() for w in originals.values())
    noise = sum((effective[n].double() - w.double()).square().sum().item() for n, w in originals.items())
    return 10 * math.log10(signal / noise)


def load_rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["rows"]


def save_rows(path, rows, meta):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def markdown_table(rows) -> str:
    base = next(r["ppl"] for r in rows if r["format"] == "float32")
    lines = ["| format | method | perplexity | vs float32 | weight SQNR dB | quantization s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["format"] == "float32":
            lines.append(f"| float32 | - | {r['ppl']:.3f} | - | - | - |")
            continue
        lines.append(f"| {r['format']} | {r['method']} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.1f}% | "
                     f"{r['sqnr_db']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "mxfp8"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--tokens", type=int, default=8192, help="first tokens of wiki-200 scored")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = p.parse_args()
    if args.table:
        print(markdown_table(load_rows(args.out)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model, tokenizer = load_smollm2()
    model.to(device)
    ids = tokenizer(wiki_text(200), return_tensors="pt").input_ids[0][: args.tokens]
    calib = calibration_ids(tokenizer, args.calib_samples, args.calib_len)
    meta = {"model": "SmolLM2-135M-Instruct", "text": f"first {ids.numel()} tokens of wiki-200",
            "window": 1024, "stride": 512, "device": device, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "calibration": f"{args.calib_samples} x {args.calib_len} tokens of wiki articles "
                           f"{CALIBRATION_ARTICLES[0]}-{CALIBRATION_ARTICLES[1] - 1} (sorted by title)"}
    rows = load_rows(args.out)
    done = {(r["format"], r["method"]) for r in rows}
    selected = decoder_linears(model)
    originals = {n: m.weight.detach().clone() for n, m in selected.items()}
    groups = fused_groups(selected)

    if ("float32", "-") not in done:
        t0 = time.perf_counter()
        ppl, scored = perplexity(model, ids)
        rows.append({"format": "float32", "method": "-", "ppl": ppl, "tokens": scored,
                     "eval_seconds": time.perf_counter() - t0})
        save_rows(args.out, rows, meta)
        print(f"float32: perplexity {ppl:.3f} over {scored} tokens", flush=True)

    for fmt in args.formats:
        spec = get_format(fmt)
        for label in args.methods:
            if (spec.name, label) in done:
                continue
            method, rotated = METHODS[label]
            rotation_block = spec.block if rotated else None
            t0 = time.perf_counter()
            qtensors = quantize_weights(model, selected, spec, method=method, fused_groups=groups,
                                        calibration=calib if method == "gptq" else None,
                                        rotation_block=rotation_block)
            seconds = time.perf_counter() - t0
            effective = {n: effective_weight(q, rotation_block).to(device) for n, q in qtensors.items()}
            for n, m in selected.items():
                m.weight.data = effective[n]
            t1 = time.perf_counter()
            ppl, scored = perplexity(model, ids)
            for n, m in selected.items():
                m.weight.data = originals[n]
            rows.append({"format": spec.name, "method": label, "ppl": ppl, "tokens": scored,
                         "sqnr_db": weight_sqnr_db(originals, effective), "seconds": seconds,
                         "eval_seconds": time.perf_counter() - t1})
            save_rows(args.out, rows, meta)
            print(f"{spec.name} {label}: perplexity {ppl:.3f}, weight SQNR {rows[-1]['sqnr_db']:.2f} dB, "
                  f"quantized in {seconds:.0f} s", flush=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
