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
- NVFP4: sibling projections that inference engines fuse (fused_groups: FUSED_PROJECTIONS under one
  parent) share one global scale, as vLLM requires: the smallest of theirs (2688 / the group's amax)
  for method "rtn", one searched over the group for the others.
Methods (quant/methods.py): "rtn" round to nearest (default), "search" per-block scale search,
"gptq" GPTQ on calibration token ids (the model is run layer by layer). rotation=16 or 32 quantizes
W R with a block-wise Hadamard R (quant/hadamard.py) and the layers rotate their inputs at run time;
it needs every selected in_features to be a multiple of the rotation block.
A model on the meta device gets all-zero quantized layers of the right shapes (to load a
quantized state_dict with assign=True afterwards).

fuse_gated_mlps (after quantize_model, for inference): each SiLU-gated MLP (Llama, Mistral, Qwen2 and the like)
becomes a GatedMLP whose gate and up projections are one fuse_gated layer, so the model's own forward (generate
included) runs one GEMM for both, with SiLU x up in the Hopper decode kernels' epilogue.
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn

from ..formats.spec import get_format
from ..formats.tensor import padded_k
from ..kernels import ops
from ..quant.methods import check_method, quantize_weights
from .linear import QuantizedLinear, fuse_gated, quantized_linear_class

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
    method: str = "rtn"
    rotation: Optional[int] = None  # block of the Hadamard rotation, None when not rotated
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
        rot = f" + block-wise Hadamard rotation ({self.rotation})" if self.rotation else ""
        lines = [
            f"quantize_model: {self.fmt}{act}: {len(self.quantized)} Linear layers quantized, "
            f"{len(self.skipped)} skipped (method {self.method}{rot})",
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
    """Bytes of all parameters and buffers, each storage counted once and whole (tied weights, aliases, views
    such as the sm90 backend's prepared data and scale, two halves of one buffer)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta:
            total += t.numel() * t.element_size()
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
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


def fused_groups(names) -> list:
    """Tuples of layer names that inference engines fuse into one GEMM (FUSED_PROJECTIONS siblings
    under one parent, two or more present in `names`): they must share one NVFP4 global scale."""
    groups = []
    for members in FUSED_PROJECTIONS:
        for parent in sorted({n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in members}):
            prefix = parent + "." if parent else ""
            group = tuple(prefix + m for m in members if prefix + m in names)
            if len(group) > 1:
                groups.append(group)
    return groups


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: nn.Module, fmt, *, include: Optional[Iterable[str]] = None,
                   exclude: Optional[Iterable[str]] = None, activations: Optional[str] = None,
                   progress: bool = True, method: str = "rtn", calibration: Optional[torch.Tensor] = None,
                   rotation: Optional[int] = None, **gptq_options) -> QuantizationReport:
    """Replace the model's nn.Linear layers by quantized ones in place; return what was done.

    fmt: "nvfp4" | "mxfp4" | "mxfp8". activations: format the Linear inputs are quantized to
    (None keeps float inputs). method: "rtn" | "search" | "gptq". calibration: token ids [S, T]
    for "gptq" (microscale.quant.calibration.calibration_ids). rotation: None, or 16 / 32 for a
    block-wise Hadamard rotation. gptq_options: scale_mode (MX exponent rule, any method) and, for
    "gptq", gptq_quantize's options (act_order, damp, lazy_batch, scales). See the module docstring
    for include/exclude and the skip rules.
    """
    spec = get_format(fmt)
    activations = ops.check_activations(activations)
    check_method(method, rotation)
    if calibration is not None and method != "gptq":
        raise ValueError(f"quantize_model: calibration data is used by method='gptq' only (method={method!r})")
    include = None if include is None else tuple(include)
    exclude = DEFAULT_EXCLUDE if exclude is None else tuple(exclude)
    report = QuantizationReport(fmt=spec.name, activations=activations, method=method, rotation=rotation,
                                model_bytes_before=model_bytes(model))
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

    if rotation is not None:
        ragged = [n for n, m in selected.items() if m.in_features % rotation]
        if ragged:
            raise ValueError(f"quantize_model: rotation={rotation} needs in_features divisible by {rotation}; "
                             f"{len(ragged)} layers are not, e.g. {ragged[0]!r} (in_features="
                             f"{selected[ragged[0]].in_features}): exclude them")

    # Meta layers (a model built for loading) become all-zero layers; the others are quantized by `method`.
    real = {n: m for n, m in selected.items() if not m.weight.is_meta}
    groups = fused_groups(real)
    report.shared_global_scale = groups if spec.global_scale else []
    qtensors = quantize_weights(model, real, spec, method=method, fused_groups=groups, calibration=calibration,
                                rotation_block=rotation, progress=progress, **gptq_options)
    cls = quantized_linear_class(spec)
    for name, linear in selected.items():
        if name in qtensors:
            layer = cls.from_qtensor(qtensors[name], linear.bias, activations=activations, rotation=rotation)
        else:
            layer = cls.from_linear(linear, spec, activations=activations, rotation=rotation)
        _set_submodule(model, name, layer)
        kp = padded_k(linear.in_features, spec.block)
        report.quantized.append(LayerRecord(
            name=name, shape=(linear.out_features, linear.in_features),
            bytes_before=linear.weight.numel() * linear.weight.element_size(), bytes_after=layer.nbytes,
            padded_k=kp if kp != linear.in_features else None))
    report.model_bytes_after = model_bytes(model)
    return report


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with gate and up as one fuse_gated layer."""

    def __init__(self, gated: QuantizedLinear, down_proj: nn.Module):
        super().__init__()
        self.gated, self.down_proj = gated, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))


def _is_silu(act) -> bool:
    """Whether act is SiLU, judged by what it computes (nn.SiLU, transformers' SiLUActivation, ...)."""
    if not isinstance(act, nn.Module):
        return False
    probe = torch.linspace(-8.0, 8.0, 33)
    with torch.no_grad():
        return torch.equal(act(probe), nn.functional.silu(probe))


def fuse_gated_mlps(model: nn.Module) -> list:
    """Replace, in place, every module with quantized `gate_proj` and `up_proj`, a `down_proj` and an `act_fn`
    that is SiLU (the gated MLP of Llama-style models) by a GatedMLP over fuse_gated(gate_proj, up_proj); returns
    the names replaced. Other modules are left as they are. The fused layers are for inference: save_quantized
    refuses them, so save the model before fusing."""
    fused = []
    for name, module in list(model.named_modules()):
        gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
        if not (isinstance(gate, QuantizedLinear) and isinstance(up, QuantizedLinear)
                and _is_silu(getattr(module, "act_fn", None)) and hasattr(module, "down_proj")):
            continue
        try:
            gated = fuse_gated(gate, up)
        except ValueError as e:
            raise ValueError(f"fuse_gated_mlps: {name}: {e}") from e
        _set_submodule(model, name, GatedMLP(gated, module.down_proj))
        fused.append(name)
    return fused
