"""Quantize a Hugging Face safetensors checkpoint into a compressed-tensors one, streaming.

    python -m microscale quantize SRC_DIR OUT_DIR --format nvfp4

Tensor by tensor, shard by shard: each weight is read from its memory-mapped shard (safetensors
safe_open, opened per tensor so that only one tensor's pages are ever mapped), quantized in row chunks
(on the GPU when there is one, by the fused quantize kernel: the reference's bits), written to its
place in the output shard and dropped. Peak memory is about one input tensor, its quantized form and
one chunk's work, whatever the model's size.

Which weights are quantized follows quantize_model's rules as far as a file shows them: every 2-D
floating-point `<module>.weight` is taken to be an nn.Linear [out, in], minus modules matching
DEFAULT_EXCLUDE (or --exclude) and those with in_features smaller than one block; in_features that is
not a multiple of the block is zero-padded (weight_shape records it). Checkpoints with transposed
Conv1D weights (GPT-2) need those modules excluded. NVFP4 projections that engines fuse
(quantize_model.fused_groups) share one global scale: a first pass reads their amax (--method rtn)
or searches one over the group (--method search).

--method search (per-block scale search) streams the same way; for NVFP4 it reads each tensor (or
fused group) whole once more to search its global scale. --rotation 16|32 quantizes W R, one
Hadamard matrix per K block, chunk by chunk, and writes a "microscale-rotated" checkpoint.
--method gptq cannot stream: it loads the model with transformers and runs it on calibration text
(quantize_checkpoint_with_model), holding the whole float32 model in memory.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..formats.checkpoint import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointError,
    CheckpointWriter,
    TensorSpec,
    compressed_tensors_config,
    empty_qtensor,
    plan_checkpoint,
    qtensor_state,
    read_json,
    read_tensors,
)
from ..formats.codec import ScaleMode
from ..formats.spec import FORMATS, get_format
from ..formats.tensor import padded_k
from ..kernels.ops import quantizer_for
from ..quant import hadamard, nvfp4_global_scale
from ..quant.calibration import calibration_ids
from ..quant.hadamard import ROTATION_BLOCKS
from ..quant.methods import METHODS, check_method, quantize_weight, shared_global_scale
from ..quant.reference import check_weight
from .quantize_model import DEFAULT_EXCLUDE, fused_groups, matches_pattern, quantize_model
from .serialization import save_quantized, side_file_names

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STREAMING_METHODS = ("rtn", "search")  # per tensor; "gptq" needs the model run
# Elements quantized per step: bounds the float32 work space (a few copies of one chunk).
CHUNK_ELEMENTS = {"cpu": 2**18, "cuda": 2**24}


@dataclass
class StreamReport:
    fmt: str
    method: str = "rtn"
    rotation: Optional[int] = None
    quantized: list = field(default_factory=list)  # module names
    padded: list = field(default_factory=list)  # (module, in_features, padded K)
    skipped: list = field(default_factory=list)  # (module, reason)
    shared_global_scale: list = field(default_factory=list)  # tuples of module names
    bytes_in: int = 0
    bytes_out: int = 0

    def __str__(self) -> str:
        rot = f" + block-wise Hadamard rotation ({self.rotation})" if self.rotation else ""
        lines = [f"quantize {self.fmt}: {len(self.quantized)} layers quantized, {len(self.skipped)} 2-D weights "
                 f"left in float; checkpoint {self.bytes_in / 2**20:.2f} MiB -> {self.bytes_out / 2**20:.2f} MiB "
                 f"(method {self.method}{rot})"]
        lines += [f"  padded: {m} in_features {k} -> {kp}" for m, k, kp in self.padded]
        lines += [f"  skipped: {m}: {why}" for m, why in self.skipped]
        if self.shared_global_scale:
            lines.append(f"  shared NVFP4 global scale: {len(self.shared_global_scale)} fused groups, e.g. "
                         f"{', '.join(self.shared_global_scale[0])}")
        return "\n".join(lines)


def _select(plan, spec, exclude) -> tuple:
    """Weights to quantize (module -> TensorInfo) and the 2-D weights left in float (module -> reason)."""
    selected, skipped = {}, {}
    for name, info in plan.plain.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(info.shape) != 2:
            continue
        pattern = next((p for p in exclude if matches_pattern(module, (p,))), None)
        if pattern:
            skipped[module] = f"excluded by {pattern!r}"
        elif info.dtype not in FLOAT_DTYPES:
            skipped[module] = f"dtype {info.dtype} is not a float weight"
        elif info.shape[1] < spec.block:
            skipped[module] = f"in_features={info.shape[1]} is smaller than one {spec.block}-element block"
        else:
            selected[module] = info
    return selected, skipped


def _row_chunks(info, device, rotation=None):
    """The tensor's rows, a chunk at a time, from its memory-mapped file (unmapped on return); with a
    rotation, W R in float32 (a rotation mixes K within a row only, so chunks of rows rotate alone)."""
    n, k = info.shape
    rows = max(1, CHUNK_ELEMENTS[torch.device(device).type] // k)
    with safe_open(str(info.file), framework="pt") as f:
        sl = f.get_slice(info.name)
        for r0 in range(0, n, rows):
            chunk = sl[r0:r0 + rows].to(device)
            yield r0, chunk if rotation is None else hadamard.rotate(chunk.float(), rotation)


def _global_scale(infos, device, method, rotation) -> torch.Tensor:
    """NVFP4 encode global scale shared by the tensors `infos` (one, or a fused group) as quantized:
    "rtn": 2688 / their amax, from chunked amaxes (in the weights' dtype); "search": searched over
    the whole tensors (methods.shared_global_scale), which are read for it."""
    if method == "rtn":
        amax = None
        for info in infos:
            for _, chunk in _row_chunks(info, device, rotation):
                m = chunk.abs().amax()
                amax = m if amax is None else torch.maximum(amax, m)
        return nvfp4_global_scale(amax.reshape(1)).cpu()
    weights = [torch.cat([c.float() for _, c in _row_chunks(info, device, rotation)]) for info in infos]
    return shared_global_scale(weights, method).cpu()


def _quantize_streamed(info, spec, global_scale, device, scale_mode, method="rtn", rotation=None):
    """One tensor, chunk by chunk: with the global scale fixed, every method quantizes rows alone."""
    q = empty_qtensor(spec, info.shape, device="cpu")
    for r0, chunk in _row_chunks(info, device, rotation):
        try:
            check_weight(chunk)  # the GPU quantizer does not reject NaN/Inf
            if method == "rtn":
                qc = quantizer_for(chunk.device)(chunk, spec, global_scale=global_scale, scale_mode=scale_mode,
                                                 scale_layout="linear")
            else:
                qc = quantize_weight(chunk, spec, method=method, global_scale=global_scale, scale_mode=scale_mode)
        except ValueError as e:
            raise CheckpointError(f"{info.where()} (rows from {r0}): {e}") from None
        q.data[r0:r0 + chunk.shape[0]] = qc.data.cpu()
        q.scale[r0:r0 + chunk.shape[0]] = qc.scale.cpu()
    return q.replace(global_scale=global_scale, orig_dtype=info.dtype)


def _fused_global_scales(selected: dict, device, method, rotation, progress: bool) -> tuple:
    """First pass: the NVFP4 encode global scale each fused group shares, per member, and the groups."""
    groups = fused_groups(selected)
    scales = {}
    for group in tqdm(groups, desc="global scales (fused projections)", disable=not progress, unit="group"):
        g = _global_scale([selected[m] for m in group], device, method, rotation)
        scales.update({m: g for m in group})
    return scales, groups


def _output_specs(ordered, quantized_by_tensor: dict, spec) -> list:
    """Every output tensor's name, dtype and shape, from the input headers alone."""
    specs = []
    for info in ordered:
        module = quantized_by_tensor.get(info.name)
        if module is None:
            specs.append(TensorSpec(info.name, info.dtype, info.shape))
        else:
            meta = qtensor_state(module, empty_qtensor(spec, info.shape))
            specs += [TensorSpec.of(n, t) for n, t in meta.items()]
    return specs


def _float_checkpoint(src, out):
    """(src, out, plan) for quantizing the float checkpoint `src` into another directory `out`."""
    src, out = Path(src).resolve(), Path(out).resolve()
    if src == out:
        raise CheckpointError(f"{out}: the output directory must differ from the source")
    plan = plan_checkpoint(src)
    if plan.layout != "unquantized":
        raise CheckpointError(f"{src}: already quantized ({plan.layout}); quantize needs a float checkpoint")
    return src, out, plan


def quantize_checkpoint(src, out, fmt, *, exclude=None, scale_mode=ScaleMode.RCEIL, device=None,
                        max_shard_size=DEFAULT_MAX_SHARD_SIZE, progress=True, method="rtn",
                        rotation=None) -> StreamReport:
    """Stream-quantize the float checkpoint in `src` into a compressed-tensors checkpoint in `out`.

    method: "rtn" or "search" (both work tensor by tensor; "gptq" runs the model:
    quantize_checkpoint_with_model). rotation: 16 / 32 for a block-wise Hadamard rotation (the
    checkpoint is then a "microscale-rotated" one, formats/checkpoint.py).
    """
    check_method(method, rotation)
    if method not in STREAMING_METHODS:
        raise ValueError(f"quantize_checkpoint streams tensor by tensor; method={method!r} needs the model run "
                         f"(quantize_checkpoint_with_model)")
    spec = get_format(fmt)
    src, out, plan = _float_checkpoint(src, out)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    selected, skipped = _select(plan, spec, DEFAULT_EXCLUDE if exclude is None else tuple(exclude))
    ragged = [info for info in selected.values() if rotation is not None and info.shape[1] % rotation]
    if ragged:
        raise CheckpointError(f"{ragged[0].where()}: in_features={ragged[0].shape[1]} is not a multiple of the "
                              f"rotation block {rotation} ({len(ragged)} such weights); --exclude them")
    report = StreamReport(spec.name, method=method, rotation=rotation, skipped=sorted(skipped.items()))
    global_scales = {}
    if spec.global_scale:
        global_scales, report.shared_global_scale = _fused_global_scales(selected, device, method, rotation, progress)

    ordered = sorted(plan.plain.values(), key=lambda i: (str(i.file), i.start))  # each shard front to back
    quantized_by_tensor = {info.name: m for m, info in selected.items()}
    specs = _output_specs(ordered, quantized_by_tensor, spec)
    config = read_json(src / "config.json") if (src / "config.json").exists() else {}
    config["quantization_config"] = compressed_tensors_config({m: (spec, None, False) for m in selected},
                                                              ignore=list(skipped), rotation=rotation)

    bar = tqdm(total=sum(i.nbytes for i in ordered), desc=f"quantize {spec.name}", disable=not progress,
               unit="B", unit_scale=True)
    with CheckpointWriter(out, specs, max_shard_size=max_shard_size) as writer:
        for info in ordered:
            module = quantized_by_tensor.get(info.name)
            if module is None:
                writer.write(info.name, read_tensors([info])[info.name])
            else:
                g = None
                if spec.global_scale:
                    g = global_scales.get(module)
                    g = _global_scale([info], device, method, rotation) if g is None else g
                q = _quantize_streamed(info, spec, g, device, scale_mode, method, rotation)
                for name, t in qtensor_state(module, q).items():
                    writer.write(name, t)
                report.quantized.append(module)
                kp = padded_k(info.shape[1], spec.block)
                if kp != info.shape[1]:
                    report.padded.append((module, info.shape[1], kp))
            bar.update(info.nbytes)
        writer.add_file("config.json", json.dumps(config, indent=2, sort_keys=True))
        for name in side_file_names(src):
            writer.add_file(name, src / name)
    bar.close()
    report.bytes_in = sum(i.nbytes for i in ordered)
    report.bytes_out = sum(s.nbytes for s in specs)
    return report


def quantize_checkpoint_with_model(src, out, fmt, *, method="gptq", rotation=None, exclude=None,
                                   scale_mode=ScaleMode.RCEIL, device=None, calibration_samples=None,
                                   calibration_len=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE, progress=True):
    """Quantize by running the model, as GPTQ must: transformers loads `src` (AutoModelForCausalLM,
    float32 while quantizing, then back to its own dtype), quantize_model calibrates on
    quant.calibration's text (calibration_ids; sizes default to its own), save_quantized writes `out`.
    Memory: the whole model in float32 on `device`, not one tensor. Returns the QuantizationReport
    (its bytes before quantization are of the float32 copy)."""
    src, out, plan = _float_checkpoint(src, out)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise CheckpointError(f"--method {method} runs the model, which needs transformers "
                              f"(pip install transformers accelerate)") from None
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    dtype = model.dtype
    model.to(device=device, dtype=torch.float32)
    sizes = {k: v for k, v in (("n_samples", calibration_samples), ("seq_len", calibration_len)) if v}
    calibration = calibration_ids(AutoTokenizer.from_pretrained(src), **sizes)
    report = quantize_model(model, fmt, exclude=exclude, method=method, calibration=calibration, rotation=rotation,
                            progress=progress, scale_mode=scale_mode)
    model.to(dtype)  # the float tensors left (embeddings, norms, lm_head) as the source stores them
    save_quantized(model, out, max_shard_size=max_shard_size)  # tokenizer files: copied from src
    return report


def add_arguments(parser) -> None:
    parser.add_argument("src", help="Hugging Face checkpoint directory (safetensors, float weights)")
    parser.add_argument("out", help="output directory (replaced atomically if it holds a checkpoint)")
    parser.add_argument("--format", default="nvfp4", choices=sorted(FORMATS), help="weight format (default nvfp4)")
    parser.add_argument("--exclude", nargs="*", default=None,
                        help=f"module name globs left in float (default: {' '.join(DEFAULT_EXCLUDE)})")
    parser.add_argument("--scale-mode", default=ScaleMode.RCEIL.value, choices=[m.value for m in ScaleMode],
                        help="MX shared-exponent rule (default rceil)")
    parser.add_argument("--method", default="rtn", choices=METHODS,
                        help="rtn: round to nearest (default); search: per-block scale search; both stream tensor "
                             "by tensor. gptq: loads the model with transformers and runs it on calibration text "
                             "(memory: the whole float32 model)")
    parser.add_argument("--rotation", type=int, default=None, choices=ROTATION_BLOCKS,
                        help="quantize block-wise Hadamard rotated weights (16 or 32 wide); the checkpoint then "
                             "loads in microscale only (quant_method microscale-rotated)")
    parser.add_argument("--calib-samples", type=int, default=None,
                        help="gptq: calibration sequences (default: quant.calibration's)")
    parser.add_argument("--calib-len", type=int, default=None,
                        help="gptq: tokens per calibration sequence (default: quant.calibration's)")
    parser.add_argument("--device", default=None, help="quantize on this device (default: cuda if available)")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard size cap (default 5GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    common = dict(exclude=args.exclude, scale_mode=ScaleMode(args.scale_mode), device=args.device,
                  max_shard_size=args.max_shard_size, progress=not args.quiet, method=args.method,
                  rotation=args.rotation)
    try:
        if args.method in STREAMING_METHODS:
            if args.calib_samples or args.calib_len:
                raise ValueError(f"--calib-samples/--calib-len are for --method gptq (got --method {args.method})")
            report = quantize_checkpoint(args.src, args.out, args.format, **common)
        else:
            report = quantize_checkpoint_with_model(args.src, args.out, args.format, **common,
                                                    calibration_samples=args.calib_samples,
                                                    calibration_len=args.calib_len)
    except (CheckpointError, ValueError) as e:
        print(f"microscale quantize: {e}", file=sys.stderr)
        return 2
    print(report)
    print(f"wrote {args.out}")
    return 0
