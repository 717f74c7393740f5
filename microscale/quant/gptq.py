"""GPTQ for the block-scaled formats (NVFP4, MXFP4, MXFP8).

GPTQ (Frantar et al., 2022) quantizes a Linear weight W [N, K] one input column at a time and spreads
each column's rounding error over the columns not yet quantized, weighted by the inverse Hessian
H = E[x^T x] of the layer's inputs, so that the layer's output error ||x W^T - x Q^T||^2 (not the weight
error) is what gets minimized. Here the rounding inside the loop is the real format: when the loop
reaches the first column of a 16/32-column block, that block's scale is fixed from the block's current
(error-updated) values, by the RTN rule or by the scale search of scale_search.py weighted by the
columns' GPTQ saliency, and every column of the block is then rounded to that block-scaled grid.
The NVFP4 global scale is fixed before the loop. The result is an ordinary QTensor.

Act-order permutes whole blocks (by their summed Hessian diagonal) and columns inside each block, so
a block's columns are still visited together and its scale is set from up-to-date values (column-wise
act-order would scatter a block over the whole loop). Lazy batch updates and dampening follow the
reference implementation.

gptq_quantize_model streams a model through its decoder layers: the calibration inputs of one layer
are kept at a time, the layer's Hessians accumulated from them, its Linears quantized, and the
layer's output with quantized weights becomes the next layer's input.
"""

from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats.codec import ScaleMode
from ..formats.packing import pack_fp4
from ..formats.spec import get_format
from ..formats.tensor import QTensor, padded_k
from .reference import check_weight, nvfp4_global_scale
from .scale_search import (
    encode_elements,
    round_to_grid,
    rtn_block_scale,
    scale_multiplier,
    search_block_scales,
    search_global_scale,
)

SCALE_CHOICES = ("rtn", "search")


def _check_hessian(h, k: int) -> None:
    if not isinstance(h, torch.Tensor) or tuple(h.shape) != (k, k):
        shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"hessian: expected a [{k}, {k}] tensor for a weight with K={k}, got {shape}")
    if not torch.isfinite(h).all():
        raise ValueError(f"hessian: non-finite values in the [{k}, {k}] Hessian")


def _act_order(diag: torch.Tensor, block: int) -> torch.Tensor:
    """Permutation of K: blocks by descending summed diag(H), columns inside a block by descending diag."""
    d = diag.view(-1, block)
    blocks = torch.argsort(d.sum(1), descending=True, stable=True)
    inside = torch.argsort(d, dim=1, descending=True, stable=True)
    return (blocks[:, None] * block + inside[blocks]).reshape(-1)


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1, computed in float64."""
    h = h.double()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True).float()


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    fmt,
    *,
    scales: str = "search",
    act_order: bool = True,
    damp: float = 0.01,
    lazy_batch: int = 128,
    global_scale=None,
    scale_mode=ScaleMode.RCEIL,
    scale_layout: str = "linear",
) -> QTensor:
    """Quantize w [N, K] with GPTQ against the input Hessian [K, K] (any positive scale of E[x^T x]).

    scales: "rtn" (the reference quantizer's block scale rule, on the updated values) or "search"
    (scale_search candidates, errors weighted by GPTQ's per-column saliency). global_scale: NVFP4
    encode scale to use as is (e.g. shared by fused q/k/v); otherwise searched ("search") or
    2688/amax ("rtn"). Columns whose inputs are always zero (H_ii = 0) are set to zero.
    """
    spec = get_format(fmt)
    check_weight(w)
    if scales not in SCALE_CHOICES:
        raise ValueError(f"scales={scales!r}; accepted: {', '.join(SCALE_CHOICES)}")
    if lazy_batch % spec.block:
        raise ValueError(f"lazy_batch={lazy_batch} must be a multiple of the {spec.name} block ({spec.block})")
    n, k = w.shape
    _check_hessian(hessian, k)
    b = spec.block
    kp = padded_k(k, b)
    W = torch.nn.functional.pad(w.float(), (0, kp - k))
    H = torch.nn.functional.pad(hessian.to(W.device, torch.float32), (0, kp - k, 0, kp - k))
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    g = None
    if spec.global_scale:
        if global_scale is not None:
            g = torch.as_tensor(global_scale, dtype=torch.float32, device=W.device).reshape(())
            if not (torch.isfinite(g) and g > 0):
                raise ValueError(f"global_scale must be finite and > 0, got {g.item()}")
        elif scales == "search":
            g = search_global_scale([W], importance=[H.diagonal()])
        else:
            g = nvfp4_global_scale(W)
    elif global_scale is not None:
        raise ValueError(f"{spec.name} has no global scale; got global_scale={global_scale!r}")

    perm = _act_order(H.diagonal(), b) if act_order else torch.arange(kp, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_hessian_factor(H, damp)
    perm = perm.tolist()

    # Each column is rounded in the loop by round_to_grid (cheap) and encoded after it, all at once, from
    # the same updated values and multipliers: the same arithmetic as encoding column by column.
    updated = torch.empty(n, kp, device=W.device)
    scale = torch.empty(n, kp // b, dtype=torch.uint8, device=W.device)
    for i1 in range(0, kp, lazy_batch):
        i2 = min(i1 + lazy_batch, kp)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = perm[i1 + i]
            if i % b == 0:  # the first column of a block: fix the block's scale from its current values
                x = W1[:, None, i:i + b]
                if scales == "search":
                    s = search_block_scales(x, spec, g, importance=U1.diagonal()[i:i + b].square().reciprocal(),
                                            scale_mode=scale_mode)[0][:, 0]
                else:
                    s = rtn_block_scale(x, spec, g, scale_mode)[:, 0]
                mult = scale_multiplier(s, spec, g)
                scale[:, col // b] = s.view(torch.uint8)
            w_col = W1[:, i]
            updated[:, col] = w_col
            y = w_col / mult
            q = torch.copysign(round_to_grid(y.abs(), spec), y) * mult
            err = (w_col - q) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]

    scale = scale.view(spec.scale_dtype)
    y = updated.view(n, -1, b) / scale_multiplier(scale, spec, g)[..., None]
    codes = encode_elements(y, spec).view(n, kp)
    data = pack_fp4(codes) if spec.packed else codes
    q = QTensor(data=data, scale=scale, fmt=spec, shape=(n, k), global_scale=g, orig_dtype=w.dtype)
    return q.with_scale_layout(scale_layout)


def output_error(w: torch.Tensor, q: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared output error GPTQ minimizes (for H = E[x^T x])."""
    e = (q.double() - w.double())
    return float(((e @ hessian.double()) * e).sum())


# ---- model-level streaming driver -------------------------------------------------------------
def transformer_layers(model: nn.Module) -> tuple:
    """(dotted path, ModuleList) of the model's transformer blocks (Llama-style model.layers,
    BERT encoder.layer, GPT transformer.h)."""
    for path in ("model.layers", "layers", "encoder.layer", "bert.encoder.layer", "transformer.h"):
        try:
            layers = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList):
            return path, layers
    raise TypeError(f"{type(model).__name__}: no transformer layer stack found (looked for model.layers, "
                    f"encoder.layer, transformer.h)")


class _StopForward(Exception):
    pass


class _HessianCollector:
    """Forward pre-hooks on Linears that sum x^T x of their inputs; Linears fed the very same input
    tensor (q/k/v, gate/up) share one sum."""

    def __init__(self, linears: dict):
        self.sums, self.counts, self.owner = {}, {}, {}
        self._last = (None, None)
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in linears.items()]

    def _hook(self, name):
        def hook(module, args):
            x = args[0]
            last_x, last_name = self._last
            if x is last_x:
                self.owner[name] = self.owner[last_name]
                return
            self._last = (x, name)
            self.owner[name] = name
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            self.sums[name] = self.sums.get(name, 0) + x2.T @ x2
            self.counts[name] = self.counts.get(name, 0) + x2.shape[0]

        return hook

    def hessian(self, name: str) -> torch.Tensor:
        owner = self.owner[name]
        return self.sums[owner] / self.counts[owner]

    def remove(self):
        for h in self.handles:
            h.remove()
        self._last = (None, None)


@torch.no_grad()
def _first_layer_inputs(model, layers, calibration: torch.Tensor, batch_size: int) -> list:
    """(hidden states, other args, kwargs) of the first transformer layer's call per calibration batch."""
    captured = []

    def catch(module, args, kwargs):
        if args:
            captured.append((args[0], args[1:], kwargs))
        else:
            kwargs = dict(kwargs)
            captured.append((kwargs.pop("hidden_states"), (), kwargs))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for i in range(0, calibration.shape[0], batch_size):
            try:
                model(calibration[i:i + batch_size], use_cache=False)  # a KV cache would grow across calls
            except _StopForward:
                pass
    finally:
        handle.remove()
    return captured


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def calibrated_quantize(
    model: nn.Module,
    calibration: torch.Tensor,
    quantize_linear: Callable,
    *,
    names=None,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """Quantize a model's Linears layer by layer with input Hessians from calibration token ids [S, T].

    quantize_linear(name, weight, hessian) -> (QTensor, effective float weight): the float weight the
    layer computes with once quantized (the dequantized QTensor, rotated back if rotated); the driver
    puts it in place while the following layers are calibrated and restores the original weights at
    the end, so the model comes back unchanged. names: the Linears to quantize (default: all inside the
    transformer layers). Returns {name: QTensor}. Peak memory: one layer's inputs for all samples.
    """
    path, layers = transformer_layers(model)
    device = next(model.parameters()).device
    captured = _first_layer_inputs(model, layers, calibration.to(device), batch_size)
    hidden = [h for h, _, _ in captured]
    results, originals = {}, {}
    try:
        for index, layer in enumerate(tqdm(layers, desc="calibrate + quantize", unit="layer", disable=not progress)):
            linears = {f"{path}.{index}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
            if names is not None:
                linears = {n: m for n, m in linears.items() if n in names}
            collector = _HessianCollector(linears)
            try:
                for h, (_, args, kwargs) in zip(hidden, captured):
                    layer(h, *args, **kwargs)
            finally:
                collector.remove()
            for name, linear in linears.items():
                qt, effective = quantize_linear(name, linear.weight.detach(), collector.hessian(name))
                results[name] = qt
                originals[name] = (linear, linear.weight.data)
                linear.weight.data = effective.to(linear.weight.dtype)
            del collector
            hidden = [_layer_output(layer(h, *args, **kwargs)) for h, (_, args, kwargs) in zip(hidden, captured)]
    finally:
        for linear, weight in originals.values():
            linear.weight.data = weight
    return results
