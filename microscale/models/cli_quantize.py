"""Quantize a Hugging Face safetensors checkpoint into a compressed-tensors one, streaming.

    python -m microscale quantize SRC_DIR OUT_DIR --format nvfp4

Tensor by tensor, shard by shard: each weight is read from its memory-mapped shard (safetensors
safe_open, opened per tensor so that only one tensor's pages are ever mapped), quantized in row chunks
(on the GPU when there is one), written to its place in the output shard and dropped. Peak memory is
about one input tensor, its quantized form and one chunk's work, whatever the model's size.

Which weights are quantized follows quantize_model's rules as far as a file shows them: every 2-D
floating-point `<module>.weight` is taken to be an nn.Linear [out, in], minus modules matching
DEFAULT_EXCLUDE (or --exclude) and those with in_features smaller than one block; in_features that is
not a multiple of the block is zero-padded (weight_shape records it). Checkpoints with transposed
Conv1D weights (GPT-2) need those modules excluded. NVFP4 projections that engines fuse
(FUSED_PROJECTIONS) share one global scale, the smallest of theirs: a first pass reads their amax.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

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
from ..quant import nvfp4_global_scale, quantize
from .quantize_model import DEFAULT_EXCLUDE, FUSED_PROJECTIONS, matches_pattern
from .serialization import side_file_names

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements quantized per step: bounds the float32 work space (a few copies of one chunk).
CHUNK_ELEMENTS = {"cpu": 2**18, "cuda": 2**24}


@dataclass
class StreamReport:
    fmt: str
    quantized: list = field(default_factory=list)  # module names
    padded: list = field(default_factory=list)  # (module, in_features, padded K)
    skipped: list = field(default_factory=list)  # (module, reason)
    shared_global_scale: list = field(default_factory=list)  # tuples of module names
    bytes_in: int = 0
    bytes_out: int = 0

    def __str__(self) -> str:
        lines = [f"quantize {self.fmt}: {len(self.quantized)} layers quantized, {len(self.skipped)} 2-D weights "
                 f"left in float; checkpoint {self.bytes_in / 2**20:.2f} MiB -> {self.bytes_out / 2**20:.2f} MiB"]
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


def _fused_groups(modules) -> list:
    groups = []
    for names in FUSED_PROJECTIONS:
        for parent in sorted({m.rpartition(".")[0] for m in modules if m.rpartition(".")[2] in names}):
            prefix = parent + "." if parent else ""
            members = [prefix + n for n in names if prefix + n in modules]
            if len(members) > 1:
                groups.append(tuple(members))
    return groups


def _row_chunks(info, device):
    """The tensor's rows, a chunk at a time, from its memory-mapped file (unmapped on return)."""
    n, k = info.shape
    rows = max(1, CHUNK_ELEMENTS[torch.device(device).type] // k)
    with safe_open(str(info.file), framework="pt") as f:
        sl = f.get_slice(info.name)
        for r0 in range(0, n, rows):
            yield r0, sl[r0:r0 + rows].to(device)


def _global_scale(info, device) -> torch.Tensor:
    """compressed-tensors' encode scale 2688/amax, from a chunked amax (in the weight's dtype)."""
    amax = None
    for _, chunk in _row_chunks(info, device):
        m = chunk.abs().amax()
        amax = m if amax is None else torch.maximum(amax, m)
    return nvfp4_global_scale(amax.reshape(1)).cpu()


def _quantize_streamed(info, spec, global_scale, device, scale_mode):
    q = empty_qtensor(spec, info.shape, device="cpu")
    for r0, chunk in _row_chunks(info, device):
        try:
            qc = quantize(chunk, spec, global_scale=global_scale, scale_mode=scale_mode)
        except ValueError as e:
            raise CheckpointError(f"{info.where()} (rows from {r0}): {e}") from None
        q.data[r0:r0 + chunk.shape[0]] = qc.data.cpu()
        q.scale[r0:r0 + chunk.shape[0]] = qc.scale.cpu()
    return q.replace(global_scale=global_scale, orig_dtype=info.dtype)


def _fused_global_scales(selected: dict, device, progress: bool) -> tuple:
    """First pass: NVFP4 encode global scale of every fused projection (its group's smallest), and the groups."""
    groups = _fused_groups(selected)
    members = [m for g in groups for m in g]
    scales = {m: _global_scale(selected[m], device)
              for m in tqdm(members, desc="amax (fused projections)", disable=not progress, unit="tensor")}
    for group in groups:
        shared = torch.stack([scales[m] for m in group]).min()
        scales.update({m: shared for m in group})
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


def quantize_checkpoint(src, out, fmt, *, exclude=None, scale_mode=ScaleMode.RCEIL, device=None,
                        max_shard_size=DEFAULT_MAX_SHARD_SIZE, progress=True) -> StreamReport:
    """Stream-quantize the float checkpoint in `src` into a compressed-tensors checkpoint in `out`."""
    spec = get_format(fmt)
    src, out = Path(src).resolve(), Path(out).resolve()
    if src == out:
        raise CheckpointError(f"{out}: the output directory must differ from the source")
    plan = plan_checkpoint(src)
    if plan.layout != "unquantized":
        raise CheckpointError(f"{src}: already quantized ({plan.layout}); quantize needs a float checkpoint")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    selected, skipped = _select(plan, spec, DEFAULT_EXCLUDE if exclude is None else tuple(exclude))
    report = StreamReport(spec.name, skipped=sorted(skipped.items()))
    global_scales = {}
    if spec.global_scale:
        global_scales, report.shared_global_scale = _fused_global_scales(selected, device, progress)

    ordered = sorted(plan.plain.values(), key=lambda i: (str(i.file), i.start))  # each shard front to back
    quantized_by_tensor = {info.name: m for m, info in selected.items()}
    specs = _output_specs(ordered, quantized_by_tensor, spec)
    config = read_json(src / "config.json") if (src / "config.json").exists() else {}
    config["quantization_config"] = compressed_tensors_config({m: (spec, None, False) for m in selected},
                                                              ignore=list(skipped))

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
                    g = global_scales[module] if module in global_scales else _global_scale(info, device)
                for name, t in qtensor_state(module, _quantize_streamed(info, spec, g, device, scale_mode)).items():
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


def add_arguments(parser) -> None:
    parser.add_argument("src", help="Hugging Face checkpoint directory (safetensors, float weights)")
    parser.add_argument("out", help="output directory (replaced atomically if it holds a checkpoint)")
    parser.add_argument("--format", default="nvfp4", choices=sorted(FORMATS), help="weight format (default nvfp4)")
    parser.add_argument("--exclude", nargs="*", default=None,
                        help=f"module name globs left in float (default: {' '.join(DEFAULT_EXCLUDE)})")
    parser.add_argument("--scale-mode", default=ScaleMode.RCEIL.value, choices=[m.value for m in ScaleMode],
                        help="MX shared-exponent rule (default rceil)")
    parser.add_argument("--device", default=None, help="quantize on this device (default: cuda if available)")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard size cap (default 5GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    try:
        report = quantize_checkpoint(args.src, args.out, args.format, exclude=args.exclude,
                                     scale_mode=ScaleMode(args.scale_mode), device=args.device,
                                     max_shard_size=args.max_shard_size, progress=not args.quiet)
    except CheckpointError as e:
        print(f"microscale quantize: {e}", file=sys.stderr)
        return 2
    print(report)
    print(f"wrote {args.out}")
    return 0
