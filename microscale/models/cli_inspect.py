"""Show a checkpoint's layout and format, its quantized and unquantized layers, bits per weight and bytes,
and how the quantized layers' activations run (float, or quantized with a per-call or static scale).

Reads headers and configs only (no tensor data), for our compressed-tensors checkpoints and the
imported layouts (ModelOpt NVFP4, gpt-oss MXFP4) alike.
"""

import sys
from collections import Counter
from dataclasses import dataclass

from ..formats.checkpoint import DTYPE_TAGS, CheckpointError, CheckpointPlan, plan_checkpoint


@dataclass
class Row:
    name: str
    kind: str  # format name, or the dtype tag of an unquantized tensor
    shape: str
    weights: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.weights if self.weights else 0.0


def _row_name(entry) -> str:
    """The layer an entry belongs to: its module, or for one expert of a stacked tensor that tensor."""
    return entry.module if entry.expert is None else entry.module.rpartition(".")[0]


def quantized_rows(plan: CheckpointPlan) -> list:
    """One row per quantized weight; the experts of one stacked tensor (gpt-oss) share a row."""
    rows = {}
    for entry in plan.quantized.values():
        n, k = entry.shape
        name = _row_name(entry)
        if entry.expert is None:
            rows[name] = Row(name, entry.fmt.name, f"{n}x{k}", n * k, entry.nbytes)
            continue
        experts = entry.data.shape[0]
        row = rows.setdefault(name, Row(name, entry.fmt.name, f"{experts}x{n}x{k}", 0, 0))
        row.weights += n * k
        row.nbytes += entry.nbytes
    return list(rows.values())


def activations(entry) -> str:
    """How a quantized layer's inputs run, as its checkpoint declares: float (weight-only), or quantized
    per call; NVFP4 with a static global scale when the checkpoint stores one (compressed-tensors
    input_global_scale, ModelOpt input_scale)."""
    act = entry.activations
    if act is None:
        return "float activations (weight-only)"
    if entry.input_scale is not None:
        return f"static {act.name} activations (global scale from {entry.input_scale.name.rpartition('.')[2]})"
    return f"dynamic {act.name} activations" + (" (per-call global scale)" if act.global_scale else "")


def activation_groups(plan: CheckpointPlan) -> Counter:
    """(weight format, activations(entry)) -> number of layers (the experts of one stacked tensor: one)."""
    layers = {(_row_name(e), e.fmt.name, activations(e)) for e in plan.quantized.values()}
    return Counter((fmt, act) for _, fmt, act in layers)


def plain_rows(infos) -> list:
    return [Row(i.name, DTYPE_TAGS[i.dtype], "x".join(map(str, i.shape)) or "scalar",
                max(1, _numel(i.shape)), i.nbytes) for i in infos]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _total(rows) -> tuple:
    weights, nbytes = sum(r.weights for r in rows), sum(r.nbytes for r in rows)
    return weights, nbytes, (8 * nbytes / weights if weights else 0.0)


def _table(title: str, rows: list, with_bits: bool) -> list:
    width = max([len(title)] + [len(r.name) for r in rows])
    head = f"{title:<{width}}  {'format' if with_bits else 'dtype':<8} {'shape':<18} "
    head += f"{'bits/w':>7} {'bytes':>14}" if with_bits else f"{'bytes':>14}"
    lines = [head]
    for r in rows:
        line = f"{r.name:<{width}}  {r.kind:<8} {r.shape:<18} "
        line += f"{r.bits_per_weight:>7.3f} {r.nbytes:>14,}" if with_bits else f"{r.nbytes:>14,}"
        lines.append(line)
    return lines


def describe(plan: CheckpointPlan, layers: bool = True) -> str:
    quantized = quantized_rows(plan)
    # 2-D and up: Linear weights, embeddings; the rest: norms, biases, scalars
    unquantized_layers = plain_rows(i for i in plan.plain.values() if len(i.shape) >= 2)
    others = plain_rows(i for i in plan.plain.values() if len(i.shape) < 2)
    plain = unquantized_layers + others
    files = sorted({t.file.name for e in plan.quantized.values() for t in e.tensors()} |
                   {i.file.name for i in plan.plain.values()})
    formats = sorted({r.kind for r in quantized})
    layout = plan.layout + (f" ({plan.format_tag})" if plan.format_tag else "")
    if plan.rotation:
        layout += f", weights block-wise Hadamard rotated ({plan.rotation}): loads in microscale only"
    qw, qb, qbits = _total(quantized)
    uw, ub, ubits = _total(unquantized_layers)
    ow, ob, _ = _total(others)
    tw, tb, tbits = _total(quantized + plain)
    lines = [
        f"checkpoint: {plan.directory}",
        f"layout:     {layout}; {len(files)} safetensors file(s)",
        f"quantized layers:   {len(quantized):>5}  {', '.join(formats) or '-':<14} {qw:>14,} weights "
        f"{_mib(qb):>12}  {qbits:.3f} bits/weight",
        f"unquantized layers: {len(unquantized_layers):>5}  {'':<14} {uw:>14,} weights {_mib(ub):>12}  "
        f"{ubits:.3f} bits/weight",
        f"other tensors:      {len(others):>5}  {'(norms, biases)':<14} {ow:>14,} values  {_mib(ob):>12}",
        f"total:              {len(quantized) + len(plain):>5}  {'':<14} {tw:>14,} params  {_mib(tb):>12}  "
        f"{tbits:.3f} bits/param",
    ]
    lines += [f"{'activations:':<20}{count:>5}  {fmt} weights, {act}"
              for (fmt, act), count in sorted(activation_groups(plan).items())]
    if layers:
        if quantized:
            lines += [""] + _table("quantized layer", quantized, True)
        if unquantized_layers:
            lines += [""] + _table("unquantized layer", unquantized_layers, True)
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="checkpoint directory (safetensors + config.json)")
    parser.add_argument("--summary", action="store_true", help="totals only, no per-layer table")


def run(args) -> int:
    try:
        plan = plan_checkpoint(args.directory)
    except CheckpointError as e:
        print(f"microscale inspect: {e}", file=sys.stderr)
        return 2
    print(describe(plan, layers=not args.summary))
    return 0
