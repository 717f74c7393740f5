"""sm100 block-scaled GEMM through cuBLAS (torch._scaled_mm): a second backend and a cross-check.

torch._scaled_mm takes A [M, K] row-major and B [K, N] column-major (our K-major weight, transposed
as a view), E2M1 as torch.float4_e2m1fn_x2, and the block scales flattened in exactly our 128x4
swizzled layout: float8_e4m3fn per 16 elements (NVFP4) or float8_e8m0fnu per 32 (MX). The NVFP4
global scales and the bias are applied to its output, as torchao does.

Only the pairs cuBLAS documents are offered: NVFP4 x NVFP4 and MXFP8 x MXFP8 (cuBLAS 13.1 has no
MXFP4 or mixed block-scaled GEMM). Shapes are padded to what torch checks (K to 32 elements, B's
N to 16) and A to 128 rows below M = 128 (vllm#48491: cuBLAS NVFP4 rejects M < 128). Nothing here
has run on a Blackwell GPU: the backend is gated by the first-use self-test; CI checks the arguments
against torch's own shape rules (fake CUDA tensors) and the glue around a stand-in _scaled_mm.
"""

from typing import Optional

import torch

from ...formats.spec import FormatSpec, get_format
from ...formats.tensor import QTensor
from ..dispatch import Backend, compute_capability, register
from ..selftest import backend_run_fn, selftest_passed
from .operands import check_format_pair, pad_codes
from .operands import prepare_weight as _prepare_weight

BACKEND_NAME = "sm100-cublas"
FORMAT_PAIRS = (("nvfp4", "nvfp4"), ("mxfp8", "mxfp8"))  # (activations, weights)
WEIGHT_ROW_ALIGN = 16  # torch._scaled_mm: both dims of B divisible by 16
SMALL_M_ROWS = 128


def scaled_mm_supported() -> bool:
    """The installed torch has the fp4/e8m0 dtypes and _scaled_mm (torch >= 2.8)."""
    return all(hasattr(torch, name) for name in ("float4_e2m1fn_x2", "float8_e8m0fnu", "_scaled_mm"))


def prepare_weight(w: QTensor) -> tuple:
    return _prepare_weight(w, row_align=WEIGHT_ROW_ALIGN)


def _as_operand(codes: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    return codes.view(torch.float4_e2m1fn_x2) if fmt.packed else codes


def _as_scale(swizzled: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    flat = swizzled.reshape(-1)
    return flat if fmt.scale == "e4m3" else flat.view(torch.float8_e8m0fnu)


def scaled_mm_operands(a: QTensor, w_data: torch.Tensor, w_scale: torch.Tensor, *, w_fmt) -> tuple:
    """(A, B, scale_a, scale_b) for torch._scaled_mm from swizzled activations and prepare_weight's tensors."""
    act, wt = check_format_pair(a.fmt, w_fmt)
    if (act.name, wt.name) not in FORMAT_PAIRS:
        raise ValueError(f"{BACKEND_NAME}: {act.name} activations x {wt.name} weights is not a cuBLAS "
                         f"block-scaled GEMM; supported: {FORMAT_PAIRS}")
    a = a.with_scale_layout("swizzled")
    rows = max(a.shape[0], SMALL_M_ROWS)  # the swizzled table has 128 rows per block already
    return (_as_operand(pad_codes(a.data, act, rows), act), _as_operand(w_data, wt).t(),
            _as_scale(a.scale, act), _as_scale(w_scale, wt))


def scaled_mm(a: QTensor, w_data: torch.Tensor, w_scale: torch.Tensor, w_global: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], *, w_fmt, n: int, out_dtype=torch.bfloat16) -> torch.Tensor:
    """y [M, N] = dequant(a) @ dequant(W)^T (+ bias) with torch._scaled_mm, from prepare_weight's tensors."""
    operands = scaled_mm_operands(a, w_data, w_scale, w_fmt=w_fmt)
    y = torch._scaled_mm(*operands, out_dtype=torch.bfloat16)[: a.shape[0], :n].float()
    if a.global_scale is not None:
        y = y * ((1.0 / a.global_scale) * (1.0 / w_global))  # the product g_a * g_w can overflow
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _gemm(x2d, data, scale, global_scale, bias, *, fmt, n, k, options):
    """W4A4 / W8A8: the activations are quantized per call to the weight's format (required option);
    NVFP4 with the static encode scale options["input_global_scale"] when given."""
    from ..quantize import quantize_gpu  # the activation quantizer lives with the Hopper kernels

    act = (options or {}).get("activations")
    if act is None or get_format(act).name != get_format(fmt).name:
        raise ValueError(f"{BACKEND_NAME} runs {fmt} weights with {fmt} activations only: pass "
                         f"options={{'activations': '{fmt}'}}, got {act!r}")
    if x2d.dim() != 2 or x2d.shape[1] != k:
        raise ValueError(f"{BACKEND_NAME}: activations of shape {tuple(x2d.shape)} do not match K={k}")
    if x2d.shape[0] == 0:
        return x2d.new_empty(0, n)
    a = quantize_gpu(x2d, fmt, global_scale=options.get("input_global_scale"), scale_layout="swizzled")
    return scaled_mm(a, data, scale, global_scale, bias, w_fmt=fmt, n=n, out_dtype=x2d.dtype)


def _available(device) -> bool:
    cc = compute_capability(device)
    if cc is None or cc[0] != 10 or not scaled_mm_supported():
        return False
    return selftest_passed(BACKEND_NAME, backend_run_fn(BACKEND), device, FORMAT_PAIRS)


BACKEND = register(Backend(
    name=BACKEND_NAME,
    formats=frozenset({"nvfp4", "mxfp8"}),
    available=_available,
    prepare=prepare_weight,
    gemm=_gemm,
    options=frozenset({"activations", "input_global_scale"}),
    requires=frozenset({"activations"}),
))
