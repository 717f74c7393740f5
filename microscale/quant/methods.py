"""Weight quantization methods behind quantize_model(..., method=...): one entry per layer, one per model.

- "rtn":    round to nearest, the reference quantizer (what every peer library does).
- "search": per-block scale search (scale_search.py); no calibration data.
- "gptq":   GPTQ with searched block scales (gptq.py); needs calibration token ids.
Any of them can run on block-wise Hadamard rotated weights (hadamard.py, rotation_block=16 or 32):
the QTensor then holds W R, and the layer must rotate its inputs by the same R at run time.
"""

from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats.codec import ScaleMode
from ..formats.spec import get_format
from ..formats.tensor import QTensor
from . import hadamard
from .gptq import calibrated_quantize, gptq_quantize, transformer_layers
from .reference import nvfp4_global_scale, quantize
from .scale_search import search_global_scale, search_quantize

METHODS = ("rtn", "search", "gptq")


def check_method(method: str, rotation_block: Optional[int]) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r}; accepted: {', '.join(METHODS)}")
    if rotation_block is not None and rotation_block not in hadamard.ROTATION_BLOCKS:
        raise ValueError(f"rotation_block={rotation_block!r}; accepted: None, "
                         f"{', '.join(map(str, hadamard.ROTATION_BLOCKS))}")


def quantize_weight(w: torch.Tensor, fmt, *, method: str = "rtn", hessian: Optional[torch.Tensor] = None,
                    global_scale=None, rotation_block: Optional[int] = None, scale_mode=ScaleMode.RCEIL,
                    **gptq_options) -> QTensor:
    """One Linear weight [N, K] -> QTensor by `method`, of W R when rotation_block is given.

    hessian: E[x^T x] of the layer's (unrotated) inputs, [K, K]; required by "gptq".
    global_scale: NVFP4 encode scale to use (shared by fused projections; of the rotated weights).
    scale_mode: the MX exponent rule of RTN (for "search" and "gptq": the candidate that wins ties).
    With a given global scale, every method quantizes each row on its own, so a tensor can be
    quantized a chunk of rows at a time (the streaming CLI does).
    """
    check_method(method, rotation_block)
    if gptq_options and method != "gptq":
        raise TypeError(f"method={method!r} takes no GPTQ options; got {', '.join(sorted(gptq_options))}")
    if rotation_block is not None:
        w = hadamard.rotate(w.float(), rotation_block)
        hessian = None if hessian is None else hadamard.rotate_hessian(hessian.float(), rotation_block)
    if method == "rtn":
        return quantize(w, fmt, global_scale=global_scale, scale_mode=scale_mode)
    if method == "search":
        return search_quantize(w, fmt, global_scale=global_scale, scale_mode=scale_mode)
    if hessian is None:
        raise ValueError("method='gptq' needs the layer's input Hessian (quantize_weights collects it from "
                         "calibration data)")
    return gptq_quantize(w, hessian, fmt, global_scale=global_scale, scale_mode=scale_mode, **gptq_options)


def effective_weight(q: QTensor, rotation_block: Optional[int] = None) -> torch.Tensor:
    """The float weight [N, K] a quantized layer computes with: dequant(Q), rotated back (Q R) if rotated."""
    w = q.dequantize()
    return w if rotation_block is None else hadamard.rotate(w, rotation_block)


def shared_global_scale(weights, method: str) -> torch.Tensor:
    """One NVFP4 encode global scale for `weights` (as quantized: rotated if rotated), e.g. fused
    q/k/v: 2688 / their amax for "rtn", searched over all of them otherwise."""
    if method == "rtn":
        return nvfp4_global_scale(torch.stack([w.abs().amax() for w in weights]))
    return search_global_scale(weights)


def _shared_global_scales(selected: dict, groups, method: str, rotation_block, fmt) -> dict:
    """NVFP4 encode global scale per layer of each fused group (see shared_global_scale)."""
    if not get_format(fmt).global_scale:
        return {}
    scales = {}
    for group in groups:
        ws = [selected[n].weight.detach().float() for n in group]
        if rotation_block is not None:
            ws = [hadamard.rotate(w, rotation_block) for w in ws]
        g = shared_global_scale(ws, method)
        scales.update({n: g.clone() for n in group})  # own tensors: safetensors refuses shared storage
    return scales


def quantize_weights(model: nn.Module, selected: dict, fmt, *, method: str = "rtn", fused_groups=(),
                     calibration: Optional[torch.Tensor] = None, rotation_block: Optional[int] = None,
                     progress: bool = True, **gptq_options) -> dict:
    """{name: QTensor} for the Linears `selected` ({name: nn.Linear}) of `model`.

    fused_groups: tuples of layer names that must share one NVFP4 global scale (q/k/v, gate/up).
    calibration: token ids [S, T] for "gptq" (calibration.calibration_ids); the model is run layer by
    layer on them and comes back unchanged. gptq_options: scale_mode (any method), and gptq_quantize's
    options for "gptq".
    """
    check_method(method, rotation_block)
    global_scales = _shared_global_scales(selected, fused_groups, method, rotation_block, fmt)
    if method != "gptq":
        layers = tqdm(selected.items(), desc=f"quantize ({method})", unit="layer", disable=not progress)
        return {name: quantize_weight(linear.weight.detach(), fmt, method=method, global_scale=global_scales.get(name),
                                      rotation_block=rotation_block, **gptq_options)
                for name, linear in layers}
    if calibration is None:
        raise ValueError("method='gptq' needs calibration token ids (see microscale.quant.calibration)")
    path, _ = transformer_layers(model)
    outside = sorted(n for n in selected if not n.startswith(path + "."))
    if outside:  # checked before calibrating: the driver only calibrates the transformer layers
        raise ValueError(f"method='gptq': {len(outside)} selected layers are outside the transformer layers "
                         f"({path}) and would get no calibration, e.g. {outside[0]!r}; exclude them or use "
                         f"method='search'")

    def quantize_linear(name, weight, hessian):
        q = quantize_weight(weight, fmt, method="gptq", hessian=hessian, global_scale=global_scales.get(name),
                            rotation_block=rotation_block, **gptq_options)
        return q, effective_weight(q, rotation_block)

    return calibrated_quantize(model, calibration, quantize_linear, names=set(selected), progress=progress)
