"""save_quantized / load_quantized: models with FP4Linear / FP8Linear layers as compressed-tensors checkpoints.

save_quantized writes each quantized layer under compressed-tensors' names (formats/checkpoint.py),
every other tensor as it is, config.json with the compressed-tensors quantization_config and, for a
transformers model, its tokenizer and generation files; the write is atomic (CheckpointWriter).

load_quantized reads compressed-tensors checkpoints (ours and llm-compressor's) and ModelOpt NVFP4
exports. Without a model it builds one from config.json with transformers, parameters on the meta
device (no float weights are materialized), and puts quantized layers in place of the Linear ones.
Everything is read and checked against the model before the model is touched, so a bad checkpoint
leaves a given model as it was.

Static input scales are kept: a layer with one (QuantizedLinear.input_global_scale, e.g. from
quant.calibration.calibrate_input_scales) is written with compressed-tensors' input_global_scale and
its input_activations declared "dynamic": "local" (block scales per call, global scale static);
loading sets it from input_global_scale, or from ModelOpt's input_scale as 1 / input_scale.
KV-cache scales (k_scale, v_scale) are not used; they are skipped with a warning.

Rotated layers (quantize_model(..., rotation=b)) are written as a "microscale-rotated" checkpoint
(formats/checkpoint.py: the compressed-tensors layout under a quant_method other loaders refuse);
loading gives every quantized layer that rotation.
"""

import fnmatch
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from torch import nn

from ..formats.checkpoint import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointError,
    compressed_tensors_config,
    load_checkpoint,
    qtensor_state,
    write_checkpoint,
)
from .linear import CANONICAL_BUFFERS, QuantizedLinear, quantized_linear_class

# Side files a transformers model directory carries besides weights and config.json.
SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.model", "chat_template.*", "generation_config.json", "preprocessor_config.json",
                      "processor_config.json")
KV_CACHE_SCALES = ("k_scale", "v_scale")


# ---- save -------------------------------------------------------------------------------------
def _quantized_layers(model: nn.Module) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def checkpoint_tensors(model: nn.Module) -> dict:
    """Name -> tensor as written: quantized layers under compressed-tensors names, the rest as in
    state_dict(). A tensor aliasing an earlier one (tied weights) is written once, under the first name."""
    layers = _quantized_layers(model)
    tensors, seen = {}, set()
    for key, t in model.state_dict().items():
        module, _, name = key.rpartition(".")
        if module in layers and name in CANONICAL_BUFFERS:
            if name == CANONICAL_BUFFERS[0]:
                tensors.update(qtensor_state(module, layers[module].qweight, layers[module].input_global_scale))
            continue
        if t.is_meta:
            raise CheckpointError(f"save_quantized: tensor {key!r} is on the meta device (never loaded)")
        alias = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if alias not in seen:
            seen.add(alias)
            tensors[key] = t
    return tensors


def quantization_config(model: nn.Module) -> dict:
    layers = _quantized_layers(model)
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    schemes = {n: (m.fmt, m.activations, m.input_global_scale is not None) for n, m in layers.items()}
    rotations = {m.rotation for m in layers.values()}
    if len(rotations) > 1:
        raise ValueError(f"save_quantized: the quantized layers have different rotations "
                         f"{sorted(rotations, key=str)}; a checkpoint records one for all of them")
    return compressed_tensors_config(schemes, ignore, rotation=rotations.pop())


def _config_dict(model: nn.Module) -> dict:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return {}
    d = json.loads(config.to_json_string(use_diff=False))
    d["architectures"] = [type(model).__name__]
    return d


def side_file_names(directory) -> list:
    """Tokenizer and generation files in a model directory (SIDE_FILE_PATTERNS)."""
    return [p.name for p in sorted(Path(directory).iterdir())
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in SIDE_FILE_PATTERNS)]


def _side_files(model: nn.Module, tokenizer) -> dict:
    """Tokenizer and generation files: from the model's source directory, then the given tokenizer."""
    src = str(getattr(model, "name_or_path", "") or "")
    files = {name: Path(src) / name for name in side_file_names(src)} if src and Path(src).is_dir() else {}
    generation = getattr(model, "generation_config", None)
    if generation is not None and "generation_config.json" not in files:
        files["generation_config.json"] = generation.to_json_string()
    if tokenizer is not None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            for p in sorted(Path(tmp).iterdir()):
                if p.is_file():
                    files[p.name] = p.read_bytes()
    return files


def save_quantized(model: nn.Module, out_dir, *, tokenizer=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write `model` (quantized with quantize_model or built from FP4Linear/FP8Linear) to out_dir.

    Sharded safetensors in the compressed-tensors layout + config.json (the model's transformers
    config, if any, with quantization_config) + tokenizer/generation files; atomic (an earlier
    checkpoint at out_dir survives a crash mid-save). Returns out_dir.
    """
    layers = _quantized_layers(model)
    if not layers:
        raise ValueError("save_quantized: the model has no FP4Linear/FP8Linear layers (run quantize_model first)")
    fused = [name for name, m in layers.items() if m.epilogue is not None]
    if fused:  # their rows are interleaved gate/up pairs, which no checkpoint format describes
        raise ValueError(f"save_quantized: {fused[0]} is a fused gate/up layer (fuse_gated); save the model "
                         f"before fusing")
    config = _config_dict(model)
    config["quantization_config"] = quantization_config(model)
    files = {"config.json": json.dumps(config, indent=2, sort_keys=True)}
    files.update(_side_files(model, tokenizer))
    return write_checkpoint(out_dir, checkpoint_tensors(model), files=files, max_shard_size=max_shard_size)


# ---- load -------------------------------------------------------------------------------------
def model_from_config(directory) -> nn.Module:
    """The transformers model that config.json describes, parameters on the meta device.

    Buffers are materialized (accelerate's init_empty_weights): they are small and some, like rotary
    inv_freq, are computed at construction and never stored.
    """
    import transformers
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we place the quantized layers, not transformers' quantizers
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else transformers.AutoModelForCausalLM
    if cls is None:
        raise CheckpointError(f"{directory}/config.json: architecture {archs[0]!r} is not in transformers "
                              f"{transformers.__version__}")
    with init_empty_weights():
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    model.tie_weights()  # init_empty_weights leaves tied parameters as separate meta tensors
    return model.eval()


def _aliases(model: nn.Module) -> dict:
    """State key -> keys of the same tensor object (tied parameters)."""
    groups = {}
    for key, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(
            remove_duplicate=False)):
        groups.setdefault(id(t), []).append(key)
    return {k: ks for ks in groups.values() for k in ks}


def _computed_by_model(model: nn.Module, key: str) -> bool:
    """A stored tensor the model builds itself: a non-persistent buffer (e.g. BERT's position_ids in older
    checkpoints), or a key its transformers class declares safe to ignore."""
    module, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(module)
    except AttributeError:
        owner = None
    if owner is not None and name in owner._non_persistent_buffers_set:
        return True
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def _plan_load(model: nn.Module, ck, directory: Path):
    """New quantized layers and the float tensors to load, all checked against the model."""
    plain = dict(ck.tensors)
    new_layers = {}
    for name, q in ck.quantized.items():
        entry = ck.plan.quantized[name]
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if not isinstance(old, (nn.Linear, QuantizedLinear)):
            raise CheckpointError(f"{entry.data.where()}: the model has no Linear layer {name!r} "
                                  f"(found {type(old).__name__})")
        if (old.out_features, old.in_features) != q.shape:
            raise CheckpointError(f"{entry.data.where()}: quantized weight of shape {list(q.shape)} does not fit "
                                  f"{name} ({old.out_features} x {old.in_features})")
        bias = plain.pop(f"{name}.bias", None)
        if (bias is None) != (old.bias is None):
            what = "has no bias tensor" if bias is None else "has a bias but the model's layer has none"
            raise CheckpointError(f"{name}.bias: the checkpoint in {directory} {what}")
        act = entry.activations.name if entry.activations is not None else None
        new_layers[name] = quantized_linear_class(q.fmt).from_qtensor(
            q, bias, activations=act, input_global_scale=ck.input_global_scales.get(name), rotation=ck.plan.rotation)

    kv_scales = [n for n in plain if n.rpartition(".")[2] in KV_CACHE_SCALES]
    if kv_scales:
        warnings.warn(f"load_quantized: {', '.join(kv_scales)} skipped (KV-cache quantization is not implemented)")
    for name in kv_scales + [n for n in plain if _computed_by_model(model, n)]:
        del plain[name]

    replaced = tuple(n + "." for n in new_layers)
    expected = {k: t for k, t in model.state_dict().items() if not k.startswith(replaced)}
    aliases = _aliases(model)
    for key, t in plain.items():
        info = ck.plan.plain[key]
        if key not in expected:
            raise CheckpointError(f"{info.where()}: unexpected tensor, the model has no such parameter or buffer")
        if tuple(t.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{info.where()}: shape {list(t.shape)} does not match the model's "
                                  f"{list(expected[key].shape)}")
    for key in expected:
        if key not in plain and not any(a in plain for a in aliases.get(key, ())):
            raise CheckpointError(f"missing tensor {key!r}: the model needs it and {directory} does not have it")
    return new_layers, plain


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def load_quantized(directory, model: Optional[nn.Module] = None, *, device=None) -> nn.Module:
    """Load a quantized checkpoint into `model` (or into a model built from its config.json).

    Linear layers that the checkpoint holds quantized become FP4Linear/FP8Linear; the other tensors
    are loaded as they are stored. Returns the model, moved to `device` if one is given.
    gpt-oss MXFP4 experts are not Linear layers: read them with formats.checkpoint.load_checkpoint.
    """
    directory = Path(directory)
    ck = load_checkpoint(directory)
    if ck.plan.layout == "gpt-oss-mxfp4":
        raise CheckpointError(f"{directory}: gpt-oss MXFP4 experts are stacked MoE tensors, not Linear layers; "
                              f"use microscale.formats.checkpoint.load_checkpoint for per-expert QTensors")
    if model is None:
        model = model_from_config(directory)
    new_layers, plain = _plan_load(model, ck, directory)

    assign = any(t.is_meta for t in model.state_dict().values())
    for name, layer in new_layers.items():
        _set_submodule(model, name, layer)
    model.load_state_dict(plain, strict=False, assign=assign)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [k for k, t in model.state_dict().items() if t.is_meta]
    if still_meta:  # guarded by _plan_load; a model that ties differently from its aliases would land here
        raise CheckpointError(f"{directory}: tensors left unloaded after loading: {still_meta[:5]}")
    return model if device is None else model.to(device)
