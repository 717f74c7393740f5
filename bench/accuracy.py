"""Model quality per format x weight-quantization method: the tables in ACCURACY.md.

SmolLM2-135M: perplexity. all-MiniLM-L6-v2 (--model minilm): sentence-embedding agreement with float32.

Weights only (activations stay float32): every decoder Linear is quantized (lm_head is tied to the
embedding and stays float32), fused q/k/v and gate/up share one NVFP4 global scale. The quantized
model is evaluated with each layer's effective weight (dequantized, rotated back when rotated), the
same arithmetic as FP4Linear's reference backend. Perplexity: the first --tokens tokens of wiki-200,
window 1024, stride 512 (eval.perplexity). GPTQ calibrates on Wikipedia articles that are not
evaluation text (quant/calibration.py).

    PYTHONPATH=. .venv/bin/python bench/accuracy.py               # all rows, CPU: slow (an hour+)
    PYTHONPATH=. .venv/bin/python bench/accuracy.py --table       # the markdown table of the JSON
    PYTHONPATH=. .venv/bin/python bench/accuracy.py --model minilm [--table]

MiniLM: the 36 encoder Linears are quantized (the pooler is unused by mean pooling); the inputs are
the first 128 wiki summaries (eval.run_encoder's), GPTQ calibrates on 64 x 128 tokens of other ones.

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
from microscale.models.eval import (
    CALIBRATION_SIZE,
    embedding_agreement,
    load_minilm,
    load_smollm2,
    perplexity,
    sentence_embeddings,
    wiki_articles,
    wiki_text,
)
from microscale.models.quantize_model import fused_groups
from microscale.quant.calibration import CALIBRATION_ARTICLES, calibration_ids
from microscale.quant.methods import effective_weight, quantize_weights

# label: (method, rotated (by the format's block), GPTQ options)
METHODS = {
    "rtn": ("rtn", False, {}),
    "search": ("search", False, {}),
    "gptq": ("gptq", False, {}),
    "gptq+rot": ("gptq", True, {}),
    "gptq (rtn scales)": ("gptq", False, {"scales": "rtn"}),
    "gptq+rot (rtn scales)": ("gptq", True, {"scales": "rtn"}),
}
DEFAULT_METHODS = ("rtn", "search", "gptq", "gptq+rot")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def layer_linears(model, prefix: str) -> dict:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith(prefix)}


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
    base = next(r for r in rows if r["format"] == "float32")
    minilm = "cos_mean" in base
    metric = "embedding cosine mean | cosine min | pair rank corr" if minilm else "perplexity | vs float32"
    lines = [f"| format | method | {metric} | weight SQNR dB | quantization s |",
             "|---|---|" + "---:|" * (5 if minilm else 4)]
    for r in rows:
        if minilm:
            cells = f"{r['cos_mean']:.5f} | {r['cos_min']:.5f} | {r['spearman']:.4f}"
        else:
            cells = f"{r['ppl']:.3f} | " + ("-" if r is base else f"{100 * (r['ppl'] / base['ppl'] - 1):+.1f}%")
        if r is base:
            lines.append(f"| float32 | - | {cells} | - | - |")
        else:
            lines.append(f"| {r['format']} | {r['method']} | {cells} | {r['sqnr_db']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def load_model(name, n_calib, calib_len, device):
    """(model on device, selected Linears, metric(model) -> dict, calibration ids, description)."""
    if name == "smollm2":
        model, tokenizer = load_smollm2()
        model.to(device)
        ids = tokenizer(wiki_text(200), return_tensors="pt").input_ids[0][:8192]

        def metric(m):
            ppl, scored = perplexity(m, ids)
            return {"ppl": ppl, "tokens": scored}

        text = f"perplexity over the first {ids.numel()} tokens of wiki-200, window 1024, stride 512"
        calib = calibration_ids(tokenizer, n_calib, calib_len)
        return model, layer_linears(model, "model.layers."), metric, calib, text
    model, tokenizer = load_minilm()
    model.to(device)
    sentences = wiki_articles(128)
    ref = sentence_embeddings(model, tokenizer, sentences)

    def metric(m):
        return embedding_agreement(ref, sentence_embeddings(m, tokenizer, sentences))

    text = "embeddings of the first 128 wiki summaries vs float32's"
    return model, layer_linears(model, "encoder."), metric, calibration_ids(tokenizer, n_calib, calib_len), text


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "minilm"], default="smollm2")
    p.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4", "mxfp8"])
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    p.add_argument("--calib-samples", type=int, default=None, help=f"default: {CALIBRATION_SIZE}")
    p.add_argument("--calib-len", type=int, default=None, help=f"default: {CALIBRATION_SIZE}")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="default bench/results/accuracy_<model>.json")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = p.parse_args()
    out = args.out or os.path.join(RESULTS, f"accuracy_{args.model}.json")
    if args.table:
        print(markdown_table(load_rows(out)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    n_calib = args.calib_samples or CALIBRATION_SIZE[args.model][0]
    calib_len = args.calib_len or CALIBRATION_SIZE[args.model][1]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, selected, metric, calib, text = load_model(args.model, n_calib, calib_len, device)
    meta = {"model": args.model, "metric": text, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "device": device,
            "calibration": f"{n_calib} x {calib_len} tokens of wiki articles "
                           f"{CALIBRATION_ARTICLES[0]}-{CALIBRATION_ARTICLES[1] - 1} (sorted by title)"}
    rows = load_rows(out)
    done = {(r["format"], r["method"]) for r in rows}
    originals = {n: m.weight.detach().clone() for n, m in selected.items()}
    groups = fused_groups(selected)

    if ("float32", "-") not in done:
        t0 = time.perf_counter()
        rows.append({"format": "float32", "method": "-", **metric(model), "eval_seconds": time.perf_counter() - t0})
        save_rows(out, rows, meta)
        print(f"float32: {rows[-1]}", flush=True)

    for fmt in args.formats:
        spec = get_format(fmt)
        for label in args.methods:
            if (spec.name, label) in done:
                continue
            method, rotated, options = METHODS[label]
            rotation_block = spec.block if rotated else None
            t0 = time.perf_counter()
            qtensors = quantize_weights(model, selected, spec, method=method, fused_groups=groups,
                                        calibration=calib if method == "gptq" else None,
                                        rotation_block=rotation_block, **options)
            seconds = time.perf_counter() - t0
            effective = {n: effective_weight(q, rotation_block) for n, q in qtensors.items()}
            for n, m in selected.items():
                m.weight.data = effective[n]
            t1 = time.perf_counter()
            row = {"format": spec.name, "method": label, **metric(model),
                   "sqnr_db": weight_sqnr_db(originals, effective), "seconds": seconds}
            row["eval_seconds"] = time.perf_counter() - t1
            for n, m in selected.items():
                m.weight.data = originals[n]
            rows.append(row)
            save_rows(out, rows, meta)
            print(f"{spec.name} {label}: {row}", flush=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
