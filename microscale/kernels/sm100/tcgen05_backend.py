"""The `sm100-nvrtc` backend: the hand-written tcgen05 block-scaled GEMM (tcgen05_gemm.cuh).

    y[M, N] = dequant(quantize(x))[M, K] @ dequant(W)[N, K]^T * alpha (+ bias),   bf16 out

W4A4 / W8A8: activations are quantized per call to the weight's format (NVFP4 with a per-call
global scale, compressed-tensors convention, or the layer's static one: options["input_global_scale"]),
so the backend lists "activations" in its options and refuses calls that do not ask for them.
alpha = 1 / (g_x * g_W) folds the two NVFP4 encode global scales in, g_x as the activations were
quantized with; MX formats have none.

Variants (one template, descriptors.py and TmemPlan supply the numbers):
    cta_group 1: one CTA per 128 x 128 output tile;
    cta_group 2: a CTA pair per 256 x 128 tile (M > 128), cluster of 2, B split along N.
Stages are the most that fit 227 KB of shared memory and 512 TMEM columns (at most 8).

It is never the default: `available` is true only on a compute-capability 10.0 device (sm_100a
cubins run nowhere else) and only once the self-test (microscale.kernels.selftest) has checked a
small problem per format and variant against the reference on that device.
"""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ...formats.scale_layout import COL_TILE, ROW_TILE
from ...formats.spec import get_format
from ...formats.tensor import QTensor
from ..dispatch import Backend, compute_capability, register
from ..selftest import selftest_passed
from .. import nvrtc
from . import descriptors as D
from .operands import pad_codes, prepare_weight

SOURCE_PATH = Path(__file__).with_name("tcgen05_gemm.cuh")
NAME = "sm100-nvrtc"
FORMAT_INDEX = {"nvfp4": 0, "mxfp4": 1, "mxfp8": 2}  # the kernel's FMT template parameter
BLOCK_M = 128
BLOCK_N = 128
THREADS = 192  # 4 epilogue warps, 1 TMA warp, 1 MMA warp
SMEM_LIMIT = 232448  # opt-in dynamic shared memory per block on sm_90 / sm_100 (227 KB)
SMEM_ALIGN_SLACK = 1024  # the kernel rounds its base up to 1024 bytes for the 128B swizzle
MAX_STAGES = 8


def _smem_bytes(fmt: str, stages: int, cta_group: int) -> int:
    """Dynamic shared memory of one CTA; mirrors SmemLayout in the kernel, which traps if short."""
    atoms = D.scale_atoms_per_stage(get_format(fmt))
    per_stage = (BLOCK_M + BLOCK_N // cta_group) * D.SWIZZLE_ROW_BYTES + 2 * atoms * D.SCALE_ATOM_BYTES
    barriers = 8 * (2 * stages + 4) + 16  # full/empty per stage, 2 + 2 accumulator barriers, TMEM base
    return stages * per_stage + barriers + SMEM_ALIGN_SLACK


@dataclass(frozen=True)
class Variant:
    fmt: str
    cta_group: int
    stages: int

    @property
    def name_expression(self) -> str:
        return f"ms::tcgen05_block_scaled_gemm<{FORMAT_INDEX[self.fmt]}, {self.stages}, {self.cta_group}>"

    @property
    def smem_bytes(self) -> int:
        return _smem_bytes(self.fmt, self.stages, self.cta_group)

    @property
    def tmem(self) -> D.TmemPlan:
        return D.TmemPlan(block_n=BLOCK_N, stages=self.stages, atoms=D.scale_atoms_per_stage(get_format(self.fmt)))

    @property
    def mma_m(self) -> int:
        return BLOCK_M * self.cta_group

    @property
    def b_rows(self) -> int:
        """Rows of B each CTA loads: the pair splits the MMA's N between its two CTAs."""
        return BLOCK_N // self.cta_group

    def idescs(self) -> tuple:
        """Instruction descriptors of the four MMAs of a stage (they differ in the scale factor ID)."""
        return tuple(D.instr_desc_for(self.fmt, self.mma_m, BLOCK_N, sf) for sf in D.mma_sf_ids(self.fmt))


def _max_stages(fmt: str, cta_group: int) -> int:
    atoms = D.scale_atoms_per_stage(get_format(fmt))
    fits = [s for s in range(2, MAX_STAGES + 1)
            if _smem_bytes(fmt, s, cta_group) <= SMEM_LIMIT
            and D.TmemPlan(BLOCK_N, s, atoms).used_columns <= D.TMEM_COLUMNS]
    return max(fits)


VARIANTS = {(fmt, cg): Variant(fmt, cg, _max_stages(fmt, cg)) for fmt in FORMAT_INDEX for cg in (1, 2)}


def variant_for(fmt: str, m: int) -> Variant:
    """The CTA pair only pays off when there are rows for both of its CTAs."""
    return VARIANTS[(get_format(fmt).name, 2 if m > BLOCK_M else 1)]


PROBE_NAMES = ("ms::tma_box_probe<2>", "ms::tma_box_probe<3>")  # tensor-map check on any TMA GPU (tests)


@lru_cache(maxsize=None)
def compiled(arch: str = nvrtc.DEFAULT_ARCH) -> nvrtc.CompiledKernels:
    """Every variant in one NVRTC program, cached on disk."""
    return compile_source(tuple(v.name_expression for v in VARIANTS.values()), arch)


def compile_source(names, arch: str) -> nvrtc.CompiledKernels:
    """The instantiations `names` of tcgen05_gemm.cuh (kernel variants or the TMA probes)."""
    return nvrtc.compile_kernels(names, source=SOURCE_PATH.read_text(), label=SOURCE_PATH.name, arch=arch)


@lru_cache(maxsize=None)
def _kernel(name_expression: str, device_index: int):
    return nvrtc.load_kernel(compiled(), name_expression, device_index)


# ---- tensor maps ------------------------------------------------------------------------------------


def operand_map(data: torch.Tensor, box_rows: int) -> nvrtc.TensorMapSpec:
    """A or B: [rows, K bytes], 128-byte-wide boxes of `box_rows` rows, 128B swizzle."""
    rows, k_bytes = data.shape
    return nvrtc.TensorMapSpec(address=data.data_ptr(), global_dims=(k_bytes, rows),
                               global_strides=(data.stride(0) * data.element_size(),),
                               box_dims=(D.SWIZZLE_ROW_BYTES, box_rows), swizzle="128B")


def scale_map(scale: torch.Tensor, atoms_per_stage: int) -> nvrtc.TensorMapSpec:
    """Swizzled scales [Rp, Cp] as (256-byte half atoms, half atoms along K, 128-row blocks).

    A stage's atoms are contiguous (atoms run K-fastest), so one box of 2 * atoms half atoms of one
    row block brings them in the 128x4 order tcgen05.cp reads; beyond the last atom TMA fills zeros.
    """
    rp, cp = scale.shape
    half = D.SCALE_ATOM_BYTES // 2
    return nvrtc.TensorMapSpec(address=scale.data_ptr(), global_dims=(half, 2 * cp // COL_TILE, rp // ROW_TILE),
                               global_strides=(half, cp * ROW_TILE), box_dims=(half, 2 * atoms_per_stage, 1),
                               swizzle="none")


def tensor_map_specs(variant: Variant, a_data, a_scale, b_data, b_scale) -> tuple:
    atoms = D.scale_atoms_per_stage(get_format(variant.fmt))
    return (operand_map(a_data, BLOCK_M), operand_map(b_data, variant.b_rows),
            scale_map(a_scale, atoms), scale_map(b_scale, atoms))


# ---- operands ---------------------------------------------------------------------------------------


def _quantize_activations(x2d: torch.Tensor, fmt: str, global_scale: Optional[torch.Tensor] = None) -> QTensor:
    """x in `fmt` with 128x4 swizzled scales: the fused quantize kernel on a GPU, the reference elsewhere
    (the same bits); NVFP4 with the encode `global_scale` when given (static), else one from x's amax."""
    from ...quant import quantize

    try:
        if x2d.is_cuda:
            from ..quantize import quantize_gpu

            return quantize_gpu(x2d, fmt, global_scale=global_scale, scale_layout="swizzled")
        return quantize(x2d, fmt, global_scale=global_scale, scale_layout="swizzled")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{NAME}: activations x of shape {tuple(x2d.shape)} cannot be quantized to {fmt}: {e}") from e


# The kernel's parameters in order, as (name, type); a test holds this against the C++ signature.
KERNEL_PARAMS = (
    ("tmap_a", "tmap"), ("tmap_b", "tmap"), ("tmap_sfa", "tmap"), ("tmap_sfb", "tmap"),
    ("out", "ptr"), ("bias", "ptr"), ("alpha", "ptr"),
    ("M", "int"), ("N", "int"), ("k_stages", "int"), ("ldo", "int"),
    ("idesc0", "u32"), ("idesc1", "u32"), ("idesc2", "u32"), ("idesc3", "u32"),
    ("ab_desc", "u64"), ("sf_desc", "u64"),
    ("tmem_columns", "u32"), ("acc_columns", "u32"), ("sf_column0", "u32"), ("sf_slot_columns", "u32"),
    ("sfb_offset", "u32"),
)
_ARG_TYPES = {"tmap": bytes, "ptr": int, "int": np.int32, "u32": np.uint32, "u64": np.uint64}  # nvrtc.pack_params


def kernel_args(**values) -> tuple:
    """The launch arguments in KERNEL_PARAMS order, typed for nvrtc.launch."""
    names = [name for name, _ in KERNEL_PARAMS]
    if sorted(values) != sorted(names):
        raise TypeError(f"kernel arguments {sorted(values)} do not match the kernel's {names}")
    return tuple(_ARG_TYPES[kind](values[name]) for name, kind in KERNEL_PARAMS)


def variant_args(variant: Variant) -> dict:
    """The compile-time-per-variant arguments: descriptors and the TMEM plan."""
    plan = variant.tmem
    idescs = variant.idescs()
    return dict(**{f"idesc{i}": d for i, d in enumerate(idescs)},
                ab_desc=D.operand_desc(), sf_desc=D.scale_atom_desc(), tmem_columns=plan.alloc_columns,
                acc_columns=plan.acc_columns, sf_column0=plan.sfa_column(0), sf_slot_columns=plan.sf_slot_columns,
                sfb_offset=plan.sfb_column(0) - plan.sfa_column(0))


def run_gemm(variant: Variant, a_data, a_scale, b_data, b_scale, alpha: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], m: int, n: int) -> torch.Tensor:
    """Launch one variant on operands as operands.py prepares them (codes with 16-byte-multiple rows,
    128x4 swizzled scales)."""
    device = a_data.device
    if a_data.shape[1] != b_data.shape[1]:
        raise ValueError(f"{NAME}: A has {a_data.shape[1]} K bytes per row, B has {b_data.shape[1]}")
    tmap_a, tmap_b, tmap_sfa, tmap_sfb = (nvrtc.encode_tensor_map(s)
                                          for s in tensor_map_specs(variant, a_data, a_scale, b_data, b_scale))
    out = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    if bias is not None:
        bias = bias.to(device=device, dtype=torch.bfloat16).contiguous()
        if bias.shape != (n,):
            raise ValueError(f"{NAME}: bias of shape {tuple(bias.shape)} does not match N={n}")
    args = kernel_args(tmap_a=tmap_a, tmap_b=tmap_b, tmap_sfa=tmap_sfa, tmap_sfb=tmap_sfb, out=out.data_ptr(),
                       bias=0 if bias is None else bias.data_ptr(),
                       alpha=0 if alpha is None else alpha.data_ptr(), M=m, N=n,
                       k_stages=-(-a_data.shape[1] // D.SWIZZLE_ROW_BYTES), ldo=out.stride(0),
                       **variant_args(variant))
    tiles = -(-m // variant.mma_m) * -(-n // BLOCK_N)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    nvrtc.launch(_kernel(variant.name_expression, device.index), clusters=min(tiles, sms // variant.cta_group),
                 cluster=variant.cta_group, block=THREADS, smem_bytes=variant.smem_bytes, device_index=device.index,
                 stream_handle=torch.cuda.current_stream(device).cuda_stream, args=args)
    return out


def _gemm(x2d, data, scale, global_scale, bias, *, fmt, n, k, options):
    fmt = get_format(fmt).name
    wanted = (options or {}).get("activations")
    if wanted is None or get_format(wanted).name != fmt:
        raise ValueError(f"{NAME} runs {fmt} weights with {fmt} activations only (W4A4/W8A8): pass "
                         f"options={{'activations': '{fmt}'}}, got {wanted!r}")
    if x2d.dim() != 2 or x2d.shape[1] != k:
        raise ValueError(f"{NAME}: activations of shape {tuple(x2d.shape)} do not match K={k}")
    qx = _quantize_activations(x2d, fmt, (options or {}).get("input_global_scale"))
    alpha = None
    if get_format(fmt).global_scale:
        alpha = ((1.0 / qx.global_scale.float()) * (1.0 / global_scale.float())).reshape(1)  # no overflow of gx * gw
    y = run_gemm(variant_for(fmt, x2d.shape[0]), pad_codes(qx.data, qx.fmt), qx.scale, data, scale, alpha, bias,
                 x2d.shape[0], n)
    return y.to(x2d.dtype)


# ---- first-use self-test ----------------------------------------------------------------------------

SELFTEST_PAIRS = tuple((fmt, fmt) for fmt in FORMAT_INDEX)  # W4A4 / W8A8 in each format


def selftest_run(x: torch.Tensor, w: QTensor, bias: torch.Tensor, act_fmt: str) -> torch.Tensor:
    """run_fn for microscale.kernels.selftest: prepare W, then the W4A4/W8A8 GEMM on x."""
    data, scale, g = prepare_weight(w)
    n, k = w.shape
    return _gemm(x, data, scale, g, bias, fmt=w.fmt.name, n=n, k=k, options={"activations": act_fmt})


def _available(device) -> bool:
    """Only on compute capability 10.0 (where sm_100a cubins run), and only after the self-test passed there
    (its M = 5, 40, 150 run both the 1-CTA and the 2-CTA variant)."""
    if compute_capability(device) != (10, 0):
        return False
    return selftest_passed(NAME, selftest_run, device, SELFTEST_PAIRS)


register(Backend(
    name=NAME,
    formats=frozenset(FORMAT_INDEX),
    available=_available,
    prepare=prepare_weight,
    gemm=_gemm,
    options=frozenset({"activations", "input_global_scale"}),
    requires=frozenset({"activations"}),
))
