"""Checkpoint IO: QTensors in safetensors files, in the layouts other tools write and read.

Layouts (formats-spec section 4), all with block scales row-major [N, K/block] (QTensor "linear"):
  compressed-tensors  (what we write; vLLM serves it)
      nvfp4-pack-quantized: <m>.weight_packed U8 [N, K/2], <m>.weight_scale F8_E4M3 [N, K/16],
                            <m>.weight_global_scale F32 [1] (encode, 2688/amax), <m>.input_global_scale F32 [1]
      mxfp4-pack-quantized: <m>.weight_packed U8 [N, K/2], <m>.weight_scale U8 [N, K/32] (biased E8M0)
      mxfp8-quantized:      <m>.weight F8_E4M3 [N, K],     <m>.weight_scale U8 [N, K/32]
      A K that is not a whole number of blocks is stored zero-padded, with <m>.weight_shape I64 [2]
      (compressed-tensors' name for a packed weight's logical shape).
  microscale-rotated  (ours: weights stored block-wise Hadamard rotated, W R)
      the compressed-tensors layout and config, but quant_method "microscale-rotated" and a
      "microscale": {"rotation": {"type": "block_hadamard", "block_size": b}} entry. Run without
      rotating the activations these weights compute garbage, so the quant_method is one no other
      loader knows: vLLM and SGLang refuse it ("Unknown quantization method"). transformers does not
      refuse an unknown quant_method: it warns that it skips quantization and builds a float model
      whose quantized Linears are missing from the checkpoint (its load report lists them MISSING,
      newly initialized), as it does for any method it does not know.
  ModelOpt NVFP4 (read): <m>.weight U8, <m>.weight_scale F8_E4M3, <m>.weight_scale_2 F32 (decode, amax/2688),
      <m>.input_scale F32 (decode), hf_quant_config.json. Imported as compressed-tensors' converter does:
      global scale = 1 / weight_scale_2, input global scale = 1 / input_scale; data and block scales as is.
  gpt-oss MXFP4 (read): <x>_blocks U8 [E, rows, K/32, 16] and <x>_scales U8 [E, rows, K/32]
      (also <x>.blocks / <x>.scales), one MXFP4 QTensor per expert, named <x>.<e>.

Reading is two steps, so a caller never holds half a checkpoint:
  plan_checkpoint(dir): headers and JSON configs only; recognises the layout and checks every tensor's
      presence, dtype and shape. Errors (CheckpointError) name the tensor and the file.
  load_checkpoint(dir): plans, reads every tensor, checks values (global scales finite and > 0, block
      scales not NaN), builds the QTensors; returns only when all of it is valid.
Nothing here unpickles: safetensors and JSON only.

Writing: CheckpointWriter lays out size-capped shards from (name, dtype, shape) before any data exists,
so a streaming producer writes tensor by tensor. Files go to a temporary directory next to the target,
which replaces the target by rename only once everything is on disk.
"""

import ctypes
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from ..quant.hadamard import ROTATION_CONFIG_KEY, rotation_block_from_config, rotation_config
from .spec import FORMATS, FormatSpec, get_format
from .tensor import QTensor, padded_k


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the tensor and file."""


# ---- safetensors headers ----------------------------------------------------------------------
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_TAGS = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it; `start`/`end` are absolute file offsets."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def where(self) -> str:
        return f"tensor {self.name!r} in {self.file}"


def read_header(path) -> dict:
    """Tensor name -> TensorInfo for one safetensors file, every entry checked against the file size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header (truncated file?)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the file size {size} (truncated or not "
                                  f"a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    infos = {}
    for name, entry in header.items():
        where = f"tensor {name!r} in {path}"
        try:
            tag = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            start, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{where}: malformed header entry {entry!r}") from None
        if tag not in DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {tag!r}")
        need = math.prod(shape) * DTYPES[tag].itemsize
        if min(shape, default=0) < 0 or start < 0 or end - start != need:
            raise CheckpointError(f"{where}: data_offsets [{start}, {end}] do not hold {tag} {list(shape)} "
                                  f"({need} bytes)")
        if 8 + n + end > size:
            raise CheckpointError(f"{where}: data ends at byte {8 + n + end} but the file has {size} bytes "
                                  f"(truncated file)")
        infos[name] = TensorInfo(name, path, DTYPES[tag], shape, 8 + n + start, 8 + n + end)
    return infos


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def scan_tensors(directory) -> dict:
    """Tensor name -> TensorInfo over a checkpoint directory (index JSON, or every *.safetensors file)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    index = d / INDEX_NAME
    infos = {}
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        for fname in sorted(set(weight_map.values())):
            path = d / fname
            if Path(fname).name != fname or not path.is_file():
                first = next(k for k, v in weight_map.items() if v == fname)
                raise CheckpointError(f"{index}: tensor {first!r} is mapped to {fname!r}, which is not a file in {d}")
            for name, info in read_header(path).items():
                if weight_map.get(name) != fname:
                    raise CheckpointError(f"{info.where()}: not mapped to this file by {index}")
                infos[name] = info
        for name, fname in weight_map.items():
            if name not in infos:
                raise CheckpointError(f"tensor {name!r}: {index} maps it to {d / fname}, which does not contain it")
    else:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors files and no {INDEX_NAME}")
        for path in files:
            for name, info in read_header(path).items():
                if name in infos:
                    raise CheckpointError(f"tensor {name!r} appears in both {infos[name].file} and {path}")
                infos[name] = info
    return infos


# ---- naming: which tensors make up one quantized Linear -----------------------------------------
@dataclass(frozen=True)
class Naming:
    """Tensor suffixes of one quantized module in one layout (None: the layout has no such tensor)."""

    data: str
    scale: str
    global_scale: Optional[str] = None
    input_scale: Optional[str] = None
    shape: Optional[str] = None
    scales_are_decode: bool = False  # ModelOpt stores amax/2688; QTensor keeps the encode scale 2688/amax

    def suffixes(self):
        return [s for s in (self.data, self.scale, self.global_scale, self.input_scale, self.shape) if s]


ROTATED_QUANT_METHOD = "microscale-rotated"
MICROSCALE_CONFIG_KEY = "microscale"  # quantization_config entry with what only microscale applies
CT_FORMAT_TAGS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}
CT_NAMING = {
    "nvfp4": Naming("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "weight_shape"),
    "mxfp4": Naming("weight_packed", "weight_scale", shape="weight_shape"),
    "mxfp8": Naming("weight", "weight_scale", shape="weight_shape"),
}
MODELOPT_NAMING = Naming("weight", "weight_scale", "weight_scale_2", "input_scale", scales_are_decode=True)
# Suffixes only a quantized module carries: a module with any of them must be a complete quantized module.
QUANT_SUFFIXES = frozenset({"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale",
                            "weight_shape", "weight_zero_point", "weight_g_idx", "weight_scale_2", "input_scale"})


def qtensor_state(module: str, q: QTensor, input_global_scale: Optional[torch.Tensor] = None) -> dict:
    """The compressed-tensors tensors of one quantized Linear (its bias is stored as a plain tensor)."""
    naming = CT_NAMING[q.fmt.name]
    q = q.with_scale_layout("linear")
    state = {f"{module}.{naming.data}": q.data, f"{module}.{naming.scale}": q.scale}
    if q.fmt.global_scale:
        state[f"{module}.{naming.global_scale}"] = q.global_scale.reshape(1).float()
    if input_global_scale is not None:
        if naming.input_scale is None:
            raise CheckpointError(f"{module}: {q.fmt.name} stores no input global scale")
        state[f"{module}.{naming.input_scale}"] = input_global_scale.reshape(1).float()
    if padded_k(q.shape[1], q.fmt.block) != q.shape[1]:
        state[f"{module}.{naming.shape}"] = torch.tensor(q.shape, dtype=torch.int64, device=q.data.device)
    return state


def empty_qtensor(fmt, shape, device="meta") -> QTensor:
    """An uninitialised QTensor of logical shape [N, K] (meta by default: names, dtypes and shapes only)."""
    spec = get_format(fmt)
    n, k = shape
    kp = padded_k(k, spec.block)
    data = torch.empty(n, kp // 2 if spec.packed else kp, dtype=spec.data_dtype, device=device)
    scale = torch.empty(n, kp // spec.block, dtype=spec.scale_dtype, device=device)
    g = torch.empty((), dtype=torch.float32, device=device) if spec.global_scale else None
    return QTensor(data=data, scale=scale, fmt=spec, shape=(n, k), global_scale=g)


# ---- compressed-tensors quantization_config ------------------------------------------------------
def _ct_args(spec: FormatSpec, dynamic) -> dict:
    return {
        "num_bits": spec.elem_bits, "type": "float", "symmetric": True, "group_size": spec.block,
        "strategy": "tensor_group" if spec.global_scale else "group", "block_structure": None,
        "dynamic": dynamic, "actorder": None,
        "scale_dtype": str(spec.scale_dtype), "zp_dtype": None, "observer": "minmax", "observer_kwargs": {},
    }


def compressed_tensors_config(schemes: dict, ignore=(), rotation: Optional[int] = None) -> dict:
    """config.json quantization_config for compressed-tensors checkpoints.

    schemes: module name -> (weight format, activation format or None, whether an input_global_scale
    tensor is stored). One scheme for all modules gives one group targeting "Linear" (with `ignore`
    listing the Linear modules left in float); several give "mixed-precision" groups naming their modules.
    rotation: block of the Hadamard rotation the weights were quantized under: the config becomes a
    "microscale-rotated" one (module docstring).
    """
    groups = {}
    for module, (fmt, act, static_input) in schemes.items():
        fmt, act = get_format(fmt), (get_format(act) if act else None)
        groups.setdefault((fmt, act, bool(static_input)), []).append(module)
    config_groups = {}
    for i, ((fmt, act, static_input), modules) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        config_groups[f"group_{i}"] = {
            "targets": ["Linear"] if len(groups) == 1 else sorted(modules),
            "weights": _ct_args(fmt, False),
            "input_activations": _ct_args(act, "local" if static_input else True) if act else None,
            "output_activations": None,
            "format": CT_FORMAT_TAGS[fmt.name],
        }
    tags = {g["format"] for g in config_groups.values()}
    config = {
        "quant_method": "compressed-tensors",
        "format": tags.pop() if len(tags) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
    if rotation is not None:
        config["quant_method"] = ROTATED_QUANT_METHOD
        config[MICROSCALE_CONFIG_KEY] = {ROTATION_CONFIG_KEY: rotation_config(rotation)}
    return config


def _planned_rotation(qc: dict, method: str, where: str) -> Optional[int]:
    """The rotation block a compressed-tensors-layout config records: only a microscale-rotated one has one."""
    extension = qc.get(MICROSCALE_CONFIG_KEY)
    if extension is not None and not isinstance(extension, dict):
        raise CheckpointError(f"{where}: {MICROSCALE_CONFIG_KEY!r} must be an object, got {extension!r}")
    try:
        block = rotation_block_from_config(extension or {})
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if (block is not None) != (method == ROTATED_QUANT_METHOD):
        raise CheckpointError(f"{where}: quant_method {method!r} with rotation {block}: a rotation must come with "
                              f"quant_method {ROTATED_QUANT_METHOD!r} (so that other loaders refuse the checkpoint), "
                              f"and that quant_method with a rotation")
    return block


# ---- plans: what a directory holds, checked from headers -----------------------------------------
@dataclass(frozen=True)
class QuantizedEntry:
    """One quantized weight [N, K] of a checkpoint and the tensors it is read from."""

    module: str
    fmt: FormatSpec
    shape: tuple
    data: TensorInfo
    scale: TensorInfo
    global_scale: Optional[TensorInfo] = None
    input_scale: Optional[TensorInfo] = None
    shape_tensor: Optional[TensorInfo] = None
    scales_are_decode: bool = False
    expert: Optional[int] = None  # index into stacked [E, ...] data and scales (gpt-oss)
    activations: Optional[FormatSpec] = None  # activation format the producer declared, if any

    def tensors(self) -> list:
        return [t for t in (self.data, self.scale, self.global_scale, self.input_scale, self.shape_tensor) if t]

    @property
    def nbytes(self) -> int:
        """Bytes of this weight's tensors as stored (a stacked tensor's share for one expert)."""
        per = self.data.shape[0] if self.expert is not None else 1
        return sum(t.nbytes // per if t in (self.data, self.scale) else t.nbytes for t in self.tensors())


@dataclass
class CheckpointPlan:
    directory: Path
    layout: str  # "compressed-tensors", "modelopt", "gpt-oss-mxfp4" or "unquantized"
    format_tag: str  # e.g. "nvfp4-pack-quantized", "NVFP4", "mxfp4"; "" when unquantized
    config: dict  # config.json ({} when absent)
    quantized: dict = field(default_factory=dict)  # module -> QuantizedEntry
    plain: dict = field(default_factory=dict)  # tensor name -> TensorInfo (everything else)
    rotation: Optional[int] = None  # Hadamard rotation block of the weights (microscale-rotated), None if none


def _split(name: str):
    module, _, suffix = name.rpartition(".")
    return module, suffix


def _file_list(infos) -> str:
    return ", ".join(sorted({str(i.file) for i in infos}))


def _check_dtype(info: TensorInfo, dtype: torch.dtype, role: str):
    if info.dtype != dtype:
        raise CheckpointError(f"{info.where()}: {role} must be {DTYPE_TAGS[dtype]}, got {DTYPE_TAGS[info.dtype]}")


def _check_scalar(info: TensorInfo, role: str):
    _check_dtype(info, torch.float32, role)
    if info.shape not in ((), (1,)):
        raise CheckpointError(f"{info.where()}: {role} must be a float32 scalar ([] or [1]), got shape "
                              f"{list(info.shape)}")


def _read_raw(info: TensorInfo) -> torch.Tensor:
    """A small tensor's values straight from its byte range (used for weight_shape while planning)."""
    with open(info.file, "rb") as f:
        f.seek(info.start)
        buf = bytearray(f.read(info.nbytes))
    return torch.frombuffer(buf, dtype=info.dtype).reshape(info.shape)


def _plan_module(module, fmt, naming, tensors, *, input_scale_required=None, activations=None) -> QuantizedEntry:
    """Check one quantized module's tensors (presence, extras, dtypes, shapes) against `naming`."""
    own = {s: tensors[f"{module}.{s}"] for s in QUANT_SUFFIXES | {"weight"} if f"{module}.{s}" in tensors}
    files = _file_list(own.values())

    def get(suffix, required):
        if suffix is None:
            return None
        if required and suffix not in own:
            raise CheckpointError(f"missing tensor {module}.{suffix} in {files}: a {fmt.name} module needs "
                                  f"{', '.join(naming.suffixes())}; found {', '.join(sorted(own))}")
        return own.get(suffix)

    for suffix, info in own.items():
        if suffix not in naming.suffixes():
            raise CheckpointError(f"{info.where()}: unexpected tensor for a {fmt.name} module (expected "
                                  f"{', '.join(naming.suffixes())})")
    data, scale = get(naming.data, True), get(naming.scale, True)
    global_scale = get(naming.global_scale, True)
    input_scale = get(naming.input_scale, bool(input_scale_required))
    if input_scale is not None and input_scale_required is False:
        raise CheckpointError(f"{input_scale.where()}: unexpected: the config declares no static input scale "
                              f"for {module}")
    shape_tensor = get(naming.shape, False)

    _check_dtype(data, fmt.data_dtype, f"{fmt.name} data")
    if len(data.shape) != 2:
        raise CheckpointError(f"{data.where()}: {fmt.name} data must be 2-D, got shape {list(data.shape)}")
    n, kp = data.shape[0], data.shape[1] * (2 if fmt.packed else 1)
    if kp % fmt.block:
        raise CheckpointError(f"{data.where()}: shape {list(data.shape)} holds K={kp}, not a multiple of the "
                              f"{fmt.name} block {fmt.block}")
    shape = _logical_shape(shape_tensor, n, kp, fmt) if shape_tensor else (n, kp)
    _check_scale(scale, data, fmt, (n, kp // fmt.block))
    for info, role in ((global_scale, "global scale"), (input_scale, "input scale")):
        if info is not None:
            _check_scalar(info, role)
    return QuantizedEntry(module, fmt, shape, data, scale, global_scale, input_scale, shape_tensor,
                          naming.scales_are_decode, activations=activations)


def _logical_shape(info: TensorInfo, n: int, kp: int, fmt: FormatSpec) -> tuple:
    _check_dtype(info, torch.int64, "weight_shape")
    if info.shape != (2,):
        raise CheckpointError(f"{info.where()}: weight_shape must have shape [2], got {list(info.shape)}")
    rows, k = (int(v) for v in _read_raw(info))
    if rows != n or k < 1 or padded_k(k, fmt.block) != kp:
        raise CheckpointError(f"{info.where()}: logical shape [{rows}, {k}] does not fit data with {n} rows and "
                              f"K={kp} (padded to the {fmt.name} block {fmt.block})")
    return rows, k


def _check_scale(scale: TensorInfo, data: TensorInfo, fmt: FormatSpec, want: tuple):
    _check_dtype(scale, fmt.scale_dtype, f"{fmt.name} block scale")
    if scale.shape != want:
        raise CheckpointError(f"{scale.where()}: block scale shape {list(scale.shape)} does not match weight "
                              f"{data.name!r} of shape {list(data.shape)} ({fmt.name} needs {list(want)})")


def _quantized_modules(tensors: dict, suffixes) -> list:
    return sorted({_split(n)[0] for n in tensors if _split(n)[1] in suffixes})


def _target_matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _ct_activation_format(args, where) -> Optional[FormatSpec]:
    if not args:
        return None
    for spec in FORMATS.values():
        if args.get("type") == "float" and args.get("num_bits") == spec.elem_bits and \
                args.get("group_size") == spec.block:
            return spec
    raise CheckpointError(f"{where}: unsupported input_activations {args!r} (supported: "
                          f"{', '.join(FORMATS)} block formats)")


def _plan_compressed_tensors(plan: CheckpointPlan, tensors: dict, qc: dict, where: str):
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"{where}: quantization_status {status!r}; only 'compressed' checkpoints are stored "
                              f"packed")
    top = qc.get("format")
    groups = []  # (name, targets, fmt, activations, static input scale)
    for gname, group in (qc.get("config_groups") or {}).items():
        tag = group.get("format") or top
        if tag not in CT_FORMAT_TAGS.values():
            raise CheckpointError(f"{where}: config group {gname!r} has unknown format tag {tag!r}; supported: "
                                  f"{', '.join(CT_FORMAT_TAGS.values())}")
        fmt = get_format(next(k for k, v in CT_FORMAT_TAGS.items() if v == tag))
        w = group.get("weights") or {}
        if w.get("num_bits") != fmt.elem_bits or w.get("group_size") != fmt.block:
            raise CheckpointError(f"{where}: config group {gname!r} weights (num_bits {w.get('num_bits')}, "
                                  f"group_size {w.get('group_size')}) contradict its format {tag!r}")
        act_args = group.get("input_activations")
        act = _ct_activation_format(act_args, f"{where}: config group {gname!r}")
        static = act is not None and act.global_scale and act_args.get("dynamic") == "local"
        groups.append((gname, list(group.get("targets") or []), fmt, act, static))
    if not groups:
        raise CheckpointError(f"{where}: compressed-tensors quantization_config has no config_groups")
    plan.format_tag = top or CT_FORMAT_TAGS[groups[0][2].name]

    def group_for(module):
        for g in groups:
            if any(_target_matches(t, module) for t in g[1]):
                return g
        # A class-name target ("Linear") matches every module: a file does not say which class a module has.
        by_class = [g for g in groups if any(t[:1].isupper() for t in g[1])]
        if len(by_class) == 1:
            return by_class[0]
        raise CheckpointError(f"module {module} has quantized tensors in {_file_list(_module_infos(tensors, module))}"
                              f" but no config group in {where} targets it unambiguously")

    for module in _quantized_modules(tensors, QUANT_SUFFIXES):
        _, _, fmt, act, static = group_for(module)
        plan.quantized[module] = _plan_module(
            module, fmt, CT_NAMING[fmt.name], tensors,
            input_scale_required=static if fmt.global_scale else None, activations=act)
    for name, info in tensors.items():
        module, suffix = _split(name)
        if suffix == "weight" and module not in plan.quantized and info.dtype in (torch.float8_e4m3fn, torch.uint8):
            raise CheckpointError(f"{info.where()}: {DTYPE_TAGS[info.dtype]} weight without its block scales "
                                  f"(missing tensor {module}.weight_scale)")


def _module_infos(tensors: dict, module: str) -> list:
    return [i for n, i in tensors.items() if _split(n)[0] == module]


def _plan_modelopt(plan: CheckpointPlan, tensors: dict, quant: dict, where: str):
    algo = quant.get("quant_algo")
    plan.format_tag = str(algo)
    per_layer = quant.get("quantized_layers") if algo == "MIXED_PRECISION" else None
    if algo != "NVFP4" and per_layer is None:
        raise CheckpointError(f"{where}: ModelOpt quant_algo {algo!r} is not supported (supported: NVFP4, "
                              f"MIXED_PRECISION of NVFP4 layers)")
    for module in _quantized_modules(tensors, {"weight_scale", "weight_scale_2"}):
        layer = per_layer.get(module, {}) if per_layer is not None else quant
        if per_layer is not None and layer.get("quant_algo") != "NVFP4":
            raise CheckpointError(f"{where}: layer {module} has quant_algo {layer.get('quant_algo')!r}; only NVFP4 "
                                  f"layers are supported")
        group_size = layer.get("group_size", 16)
        if group_size != 16:
            raise CheckpointError(f"{where}: layer {module} has NVFP4 group_size {group_size}; NVFP4 needs 16")
        entry = _plan_module(module, get_format("nvfp4"), MODELOPT_NAMING, tensors)
        # A calibrated input_scale is what ModelOpt exports for NVFP4 activations (W4A4).
        plan.quantized[module] = dataclasses.replace(entry, activations=entry.fmt if entry.input_scale else None)


_GPT_OSS_BLOCKS = re.compile(r"(.*)([._])blocks$")


def _plan_gpt_oss(plan: CheckpointPlan, tensors: dict):
    plan.format_tag = "mxfp4"
    fmt = get_format("mxfp4")
    bytes_per_block = fmt.block // 2
    for name, blocks in tensors.items():
        m = _GPT_OSS_BLOCKS.fullmatch(name)
        if not m:
            continue
        base, sep = m.groups()
        scales = tensors.get(f"{base}{sep}scales")
        if scales is None:
            raise CheckpointError(f"missing tensor {base}{sep}scales in {blocks.file}: needed by {name!r}")
        _check_dtype(blocks, torch.uint8, "gpt-oss MXFP4 blocks")
        _check_dtype(scales, torch.uint8, "gpt-oss MXFP4 scales (biased E8M0)")
        if len(blocks.shape) not in (3, 4) or blocks.shape[-1] != bytes_per_block:
            raise CheckpointError(f"{blocks.where()}: gpt-oss blocks must be [E, rows, K/32, 16] or [rows, K/32, 16],"
                                  f" got {list(blocks.shape)}")
        if scales.shape != blocks.shape[:-1]:
            raise CheckpointError(f"{scales.where()}: scale shape {list(scales.shape)} does not match blocks "
                                  f"{name!r} of shape {list(blocks.shape)} (needs {list(blocks.shape[:-1])})")
        rows, groups = blocks.shape[-3], blocks.shape[-2]
        experts = range(blocks.shape[0]) if len(blocks.shape) == 4 else [None]
        for e in experts:
            module = base if e is None else f"{base}.{e}"
            plan.quantized[module] = QuantizedEntry(module, fmt, (rows, groups * fmt.block), blocks, scales, expert=e)
    claimed = {t.name for q in plan.quantized.values() for t in q.tensors()}
    for name, info in tensors.items():
        if re.search(r"[._]scales$", name) and name not in claimed:
            raise CheckpointError(f"{info.where()}: MXFP4 scales without their blocks tensor")


def plan_checkpoint(directory) -> CheckpointPlan:
    """Recognise a checkpoint's layout and check its tensors from headers and JSON only (no data read)."""
    d = Path(directory)
    tensors = scan_tensors(d)
    config_path = d / "config.json"
    config = read_json(config_path) if config_path.exists() else {}
    qc = config.get("quantization_config")
    modelopt_path = d / "hf_quant_config.json"
    plan = CheckpointPlan(d, "unquantized", "", config)
    if modelopt_path.exists():
        plan.layout = "modelopt"
        quant = read_json(modelopt_path).get("quantization")
        if not isinstance(quant, dict):
            raise CheckpointError(f"{modelopt_path}: no 'quantization' object")
        _plan_modelopt(plan, tensors, quant, str(modelopt_path))
    elif qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        where = f"{config_path} quantization_config"
        if method in ("compressed-tensors", ROTATED_QUANT_METHOD):
            plan.layout = "compressed-tensors"
            plan.rotation = _planned_rotation(qc, method, where)
            _plan_compressed_tensors(plan, tensors, qc, where)
        elif method == "modelopt":
            plan.layout = "modelopt"
            _plan_modelopt(plan, tensors, qc, where)
        elif method == "mxfp4":
            plan.layout = "gpt-oss-mxfp4"
            _plan_gpt_oss(plan, tensors)
        else:
            raise CheckpointError(f"{where}: unknown quant_method {method!r} (supported: compressed-tensors, "
                                  f"{ROTATED_QUANT_METHOD}, modelopt, mxfp4)")
    else:
        for name, info in tensors.items():
            if _split(name)[1] in QUANT_SUFFIXES or _GPT_OSS_BLOCKS.fullmatch(name):
                raise CheckpointError(f"{info.where()}: looks quantized, but {d} has no config.json "
                                      f"quantization_config or hf_quant_config.json saying how")
    claimed = {t.name for q in plan.quantized.values() for t in q.tensors()}
    plan.plain = {n: i for n, i in tensors.items() if n not in claimed}
    return plan


# ---- loading ------------------------------------------------------------------------------------
@dataclass
class LoadedCheckpoint:
    plan: CheckpointPlan
    quantized: dict  # module -> QTensor (linear scale layout)
    input_global_scales: dict  # module -> float32 0-d encode scale (2688/amax of the activations)
    tensors: dict  # unquantized tensor name -> tensor


def read_tensors(infos, device="cpu") -> dict:
    """Read tensors through safetensors (memory-mapped), one open per file; errors name tensor and file."""
    by_file = {}
    for info in infos:
        by_file.setdefault(info.file, []).append(info)
    out = {}
    for path, group in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for info in group:
                    out[info.name] = f.get_tensor(info.name)
        except SafetensorError as e:
            names = ", ".join(i.name for i in group[:3]) + (" ..." if len(group) > 3 else "")
            raise CheckpointError(f"{path}: cannot read tensors ({names}): {e}") from None
    return out


def _check_finite_positive(value: torch.Tensor, info: TensorInfo, what: str) -> None:
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise CheckpointError(f"{info.where()}: {what} scale is {x}; it must be finite and > 0")


def _encode_scale(info: Optional[TensorInfo], raw: dict, stored_as_decode: bool) -> Optional[torch.Tensor]:
    """A global (or input) scale as QTensor keeps it: the float32 0-d encode scale, finite and > 0."""
    if info is None:
        return None
    stored = raw[info.name].float().reshape(())
    _check_finite_positive(stored, info, "stored")
    if not stored_as_decode:
        return stored
    encode = 1.0 / stored
    _check_finite_positive(encode, info, "reciprocal of the stored decode")
    return encode


def _check_block_scales(scale: torch.Tensor, fmt: FormatSpec, where: str) -> None:
    if fmt.scale == "e4m3":
        s = scale.float()
        bad = torch.isnan(s) | (s < 0)
    else:
        bad = scale == 0xFF  # E8M0 NaN
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(f"{where}: {count} block scale(s) are NaN or negative, first at {first}")


def entry_to_qtensor(entry: QuantizedEntry, raw: dict, orig_dtype=torch.float32):
    """QTensor (and its input encode scale, or None) from an entry's tensors, values checked."""
    data, scale = raw[entry.data.name], raw[entry.scale.name]
    if entry.expert is not None:
        data, scale = data[entry.expert], scale[entry.expert]
    data = data.reshape(data.shape[0], -1)
    _check_block_scales(scale, entry.fmt, entry.scale.where())
    g = _encode_scale(entry.global_scale, raw, entry.scales_are_decode)
    q = QTensor(data=data, scale=scale, fmt=entry.fmt, shape=entry.shape, global_scale=g, orig_dtype=orig_dtype)
    return q, _encode_scale(entry.input_scale, raw, entry.scales_are_decode)


def _config_dtype(config: dict) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_checkpoint(directory, device="cpu") -> LoadedCheckpoint:
    """Plan, read and check a whole checkpoint; raises before returning anything if any part is bad."""
    plan = plan_checkpoint(directory)
    needed = {t.name: t for q in plan.quantized.values() for t in q.tensors() if t is not q.shape_tensor}
    raw = read_tensors(list(needed.values()) + list(plan.plain.values()), device)
    dtype = _config_dtype(plan.config)
    quantized, inputs = {}, {}
    for module, entry in plan.quantized.items():
        quantized[module], inp = entry_to_qtensor(entry, raw, dtype)
        if inp is not None:
            inputs[module] = inp
    return LoadedCheckpoint(plan, quantized, inputs, {n: raw[n] for n in plan.plain})


# ---- writing ------------------------------------------------------------------------------------
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
SHARD_DELAY_ENV = "MICROSCALE_TEST_SHARD_DELAY_S"  # tests only: sleep after each shard to be killed mid-save
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {size!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSpec":
        return cls(name, t.dtype, tuple(t.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _is_checkpoint_dir(d: Path) -> bool:
    return (d / "config.json").exists() or (d / INDEX_NAME).exists() or any(d.glob("*.safetensors"))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_dir(d: Path):
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes tensors, in the order of `specs`, into size-capped safetensors shards, atomically.

    Shards are laid out from the specs up front, so tensors arrive one at a time and none is kept.
    Everything goes into a temporary directory in out_dir's parent; commit() fsyncs it and swaps it
    with out_dir in one rename (Linux renameat2 RENAME_EXCHANGE; elsewhere two renames, between which
    the earlier checkpoint sits in `.<name>.old-*/checkpoint`). A crash before that leaves the earlier
    checkpoint as it was, plus a stale hidden `.<name>.tmp-*` directory. An existing out_dir is
    replaced as a whole, and only if it looks like a checkpoint (config.json or safetensors files).
    """

    def __init__(self, out_dir, specs, *, max_shard_size=DEFAULT_MAX_SHARD_SIZE):
        self.out_dir = Path(out_dir).resolve()
        if self.out_dir.exists() and (not self.out_dir.is_dir() or (any(self.out_dir.iterdir())
                                                                     and not _is_checkpoint_dir(self.out_dir))):
            raise CheckpointError(f"{self.out_dir}: exists and is not a checkpoint directory; refusing to replace it")
        cap = parse_size(max_shard_size)
        if cap <= 0:
            raise ValueError(f"max_shard_size must be > 0, got {max_shard_size!r}")
        self.specs = list(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise CheckpointError(f"duplicate tensor names for {self.out_dir}: "
                                  f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
        self._shards, self._shard_of = self._layout(cap)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        self._next = 0
        self._file = None
        self._shard = -1

    def _layout(self, cap: int) -> tuple:
        """Shards as [(file name, {tensor: offset in the data section}, data bytes, header bytes)], and
        tensor name -> shard index. A new shard starts where the next tensor would pass the cap."""
        groups, size = [[]], 0
        for spec in self.specs:
            if groups[-1] and size + spec.nbytes > cap:
                groups.append([])
                size = 0
            groups[-1].append(spec)
            size += spec.nbytes
        count = len(groups)
        shards = []
        for i, group in enumerate(groups):
            fname = SINGLE_FILE_NAME if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            # Widest dtypes first, as safetensors itself orders them, so every tensor is aligned.
            ordered = sorted(group, key=lambda s: -s.dtype.itemsize)
            header, offsets, pos = {"__metadata__": {"format": "pt"}}, {}, 0
            for spec in ordered:
                header[spec.name] = {"dtype": DTYPE_TAGS[spec.dtype], "shape": list(spec.shape),
                                     "data_offsets": [pos, pos + spec.nbytes]}
                offsets[spec.name] = pos
                pos += spec.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            shards.append((fname, offsets, pos, len(raw).to_bytes(8, "little") + raw))
        return shards, {s.name: i for i, g in enumerate(groups) for s in g}

    def write(self, name: str, tensor: torch.Tensor):
        if self._next >= len(self.specs) or self.specs[self._next].name != name:
            want = self.specs[self._next].name if self._next < len(self.specs) else "nothing more"
            raise CheckpointError(f"{self.out_dir}: got tensor {name!r} but the layout expects {want!r} next")
        spec = self.specs[self._next]
        if (tensor.dtype, tuple(tensor.shape)) != (spec.dtype, spec.shape):
            raise CheckpointError(f"tensor {name!r} for {self.out_dir}: {tensor.dtype} {list(tensor.shape)} does not "
                                  f"match the planned {spec.dtype} {list(spec.shape)}")
        shard = self._shard_of[name]
        if shard != self._shard:
            self._close_shard()
            self._open_shard(shard)
        _, offsets, _, header = self._shards[shard]
        self._file.seek(len(header) + offsets[name])
        self._file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        self._next += 1

    def _open_shard(self, i: int):
        fname, _, data_bytes, header = self._shards[i]
        self._file = open(self.tmp / fname, "wb")
        self._file.write(header)
        self._file.truncate(len(header) + data_bytes)
        self._shard = i

    def _close_shard(self):
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)

    def add_file(self, name: str, content):
        """A side file (config.json, tokenizer files): str/bytes content, or a Path to copy."""
        if Path(name).name != name or name.endswith(".safetensors") or name == INDEX_NAME:
            raise CheckpointError(f"{self.out_dir}: bad side-file name {name!r}")
        dst = self.tmp / name
        if isinstance(content, Path):
            shutil.copyfile(content, dst)
        else:
            dst.write_bytes(content.encode() if isinstance(content, str) else content)

    def commit(self) -> Path:
        if self._next != len(self.specs):
            raise CheckpointError(f"{self.out_dir}: tensor {self.specs[self._next].name!r} was never written")
        if not self.specs:  # an empty checkpoint still gets its (empty) file
            self._open_shard(0)
        self._close_shard()
        if len(self._shards) > 1:
            index = {"metadata": {"total_size": sum(s[2] for s in self._shards)},
                     "weight_map": {n: self._shards[i][0] for n, i in self._shard_of.items()}}
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        for p in self.tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        self._publish()
        return self.out_dir

    def _publish(self):
        old = None
        if not self.out_dir.exists():
            os.rename(self.tmp, self.out_dir)
        elif _exchange(self.tmp, self.out_dir):
            old = self.tmp  # now holds the earlier checkpoint
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.old-", dir=self.out_dir.parent))
            os.rename(self.out_dir, old / "checkpoint")
            os.rename(self.tmp, self.out_dir)
        _fsync_dir(self.out_dir.parent)
        if old is not None:
            shutil.rmtree(old)

    def abort(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
            return False
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
        return False


def write_checkpoint(out_dir, tensors: dict, *, files: Optional[dict] = None,
                     max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write name -> tensor (plus side files name -> str/bytes/Path) as a sharded checkpoint, atomically."""
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    with CheckpointWriter(out_dir, specs, max_shard_size=max_shard_size) as w:
        for name, t in tensors.items():
            w.write(name, t)
        for name, content in (files or {}).items():
            w.add_file(name, content)
    return w.out_dir
