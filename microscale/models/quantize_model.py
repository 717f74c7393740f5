"""quantize_model: replace a model's nn.Linear layers, in place, by FP4Linear / FP8Linear.

Rules, in the order they are applied to each module `name`:
- Patterns are fnmatch globs matched against the dotted module name or any dotted suffix of it,
  so "lm_head" matches "lm_head" and "model.lm_head", and "mlp.*" every module under an "mlp".
- include=None selects every module; otherwise only modules matching one of `include`. An
  include entry that matches no module, or one without wildcards that names a module which is
  not an nn.Linear, is an error.
- exclude=None means DEFAULT_EXCLUDE (the output head and anything named like an embedding);
  a given `exclude` replaces the default (exclude=() quantizes lm_head too). Excluded layers are
  listed in the report as skipped.
- Skipped, with the reason in the report: subclasses of nn.Linear (their owners may read
  .weight directly, as nn.MultiheadAttention does), weights tied to an nn.Embedding,
  in_features smaller than one block, other modules with a 2-D weight (e.g. transformers' Conv1D).
- in_features not a multiple of the block is zero-padded to the next block (QTensor records the
  logical K); the report lists the padded layers.
- NVFP4: sibling projections that inference engines fuse (FUSED_PROJECTIONS under one parent)
  share one global scale, the smallest of theirs (2688 / the group's amax), as vLLM requires.
A model on the meta device gets all-zero quantized layers of the right shapes (to load a
quantized state_dict with assign=True afterwards).
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats.spec import get_format
from ..formats.tensor import padded_k
from ..kernels import ops
from ..quant import nvfp4_global_scale
from .linear import QuantizedLinear, quantized_linear_class

DEFAULT_EXCLUDE = ("lm_head", "*embed*")
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"),
                     ("w1", "w3"))


@dataclass
class LayerRecord:
    name: str
    shape: tuple  # (out_features, in_features)
    bytes_before: int
    bytes_after: int
    padded_k: Optional[int] = None  # K after padding, when in_features is not a multiple of the block


@dataclass
class QuantizationReport:
    fmt: str
    activations: Optional[str]
    quantized: list = field(default_factory=list)  # LayerRecord
    skipped: list = field(default_factory=list)  # (name, reason)
    shared_global_scale: list = field(default_factory=list)  # tuples of layer names
    model_bytes_before: int = 0
    model_bytes_after: int = 0

    @property
    def bytes_before(self) -> int:
        """Weight bytes of the quantized layers before quantization."""
        return sum(r.bytes_before for r in self.quantized)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.quantized)

    @property
    def padded(self) -> list:
        return [r for r in self.quantized if r.padded_k is not None]

    def __str__(self) -> str:
        act = f", activations {self.activations}" if self.activations else ""
        lines = [
            f"quantize_model: {self.fmt}{act}: {len(self.quantized)} Linear layers quantized, "
            f"{len(self.skipped)} skipped",
            f"  quantized weights: {_mib(self.bytes_before)} -> {_mib(self.bytes_after)}",
            f"  whole model (parameters + buffers): {_mib(self.model_bytes_before)} -> {_mib(self.model_bytes_after)}",
        ]
        for r in self.padded:
            lines.append(f"  padded: {r.name} in_features {r.shape[1]} -> {r.padded_k}")
        for name, reason in self.skipped:
            lines.append(f"  skipped: {name}: {reason}")
        if self.shared_global_scale:
            lines.append(f"  shared NVFP4 global scale: {len(self.shared_global_scale)} fused groups, "
                         f"e.g. {', '.join(self.shared_global_scale[0])}")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def model_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied weights, aliases)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr()) if not t.is_meta else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def matches_pattern(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p) for p in patterns)


def _is_weight_layer(module: nn.Module) -> bool:
    """nn.Linear layers and other modules with a 2-D weight (embeddings aside)."""
    if isinstance(module, (nn.Linear, QuantizedLinear)):
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding)


def _skip_reason(module: nn.Module, block: int, embedding_weights: set) -> Optional[str]:
    if isinstance(module, QuantizedLinear):
        return "already quantized"
    if not isinstance(module, nn.Linear):
        return f"unsupported module type {type(module).__name__}"
    if type(module) is not nn.Linear:
        return f"subclass of nn.Linear ({type(module).__name__}): its owner may read .weight directly"
    if id(module.weight) in embedding_weights:
        return "weight tied to an embedding"
    if module.in_features < block:
        return f"in_features={module.in_features} is smaller than one {block}-element block"
    return None


def _check_includes(model: nn.Module, include) -> None:
    """Every include entry must match a module; one without wildcards must name nn.Linear layers."""
    names = [(name, module) for name, module in model.named_modules() if name]
    for pattern in include:
        hits = [(name, module) for name, module in names if matches_pattern(name, (pattern,))]
        if not hits:
            raise ValueError(f"quantize_model: include pattern {pattern!r} matches no module")
        if any(c in pattern for c in "*?["):
            continue
        for name, module in hits:
            if not isinstance(module, nn.Linear):
                raise TypeError(f"quantize_model: include names {name!r}, a {type(module).__name__}; only "
                                f"nn.Linear layers can be quantized")


def _fused_global_scales(selected: dict) -> tuple:
    """NVFP4 encode global scale per layer name for fused sibling groups, and the groups."""
    scales, groups = {}, []
    for names in FUSED_PROJECTIONS:
        parents = {n.rpartition(".")[0] for n in selected if n.rpartition(".")[2] in names}
        for parent in sorted(parents):
            prefix = parent + "." if parent else ""
            members = [prefix + n for n in names if prefix + n in selected]
            if len(members) < 2 or any(selected[m].weight.is_meta for m in members):
                continue
            shared = torch.stack([nvfp4_global_scale(selected[m].weight.detach()) for m in members]).min()
            scales.update({m: shared.clone() for m in members})  # own tensors: safetensors refuses shared storage
            groups.append(tuple(members))
    return scales, groups


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: nn.Module, fmt, *, include: Optional[Iterable[str]] = None,
                   exclude: Optional[Iterable[str]] = None, activations: Optional[str] = None,
                   progress: bool = True) -> QuantizationReport:
    """Replace the model's nn.Linear layers by quantized ones in place; return what was done.

    fmt: "nvfp4" | "mxfp4" | "mxfp8". activations: format the Linear inputs are quantized to
    (None keeps float inputs). See the module docstring for include/exclude and the skip rules.
    """
    spec = get_format(fmt)
    activations = ops.check_activations(activations)
    include = None if include is None else tuple(include)
    exclude = DEFAULT_EXCLUDE if exclude is None else tuple(exclude)
    report = QuantizationReport(fmt=spec.name, activations=activations, model_bytes_before=model_bytes(model))
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    if isinstance(model, nn.Linear):
        raise TypeError("quantize_model: the model is itself an nn.Linear; use FP4Linear/FP8Linear.from_linear")
    if include is not None:
        _check_includes(model, include)

    selected = {}
    for name, module in model.named_modules():
        if not name or not _is_weight_layer(module) or (include is not None and not matches_pattern(name, include)):
            continue
        pattern = next((p for p in exclude if matches_pattern(name, (p,))), None)
        reason = f"excluded by {pattern!r}" if pattern else _skip_reason(module, spec.block, embedding_weights)
        if reason:
            report.skipped.append((name, reason))
        else:
            selected[name] = module

    global_scales, report.shared_global_scale = _fused_global_scales(selected) if spec.global_scale else ({}, [])
    cls = quantized_linear_class(spec)
    for name, linear in tqdm(selected.items(), desc=f"quantize {spec.name}", disable=not progress, unit="layer"):
        layer = cls.from_linear(linear, spec, activations=activations, global_scale=global_scales.get(name))
        _set_submodule(model, name, layer)
        kp = padded_k(linear.in_features, spec.block)
        report.quantized.append(LayerRecord(
            name=name, shape=(linear.out_features, linear.in_features),
            bytes_before=linear.weight.numel() * linear.weight.element_size(), bytes_after=layer.nbytes,
            padded_k=kp if kp != linear.in_features else None))
    report.model_bytes_after = model_bytes(model)
    return report
