"""torch.library custom ops over dispatch, so torch.compile and CUDA graphs see one opaque op.

`microscale::linear` takes the tensors a backend prepared (Backend.prepare) and the backend's
name, and runs that backend's gemm. Its fake implementation gives the output's shape and
dtype only, so torch.compile(fullgraph=True) traces through quantized layers without a graph
break, and the op's body is what a CUDA graph captures (the backend's kernels must then be
capturable: no host synchronization, no allocation of host tensors).

Quantized activations: when the backend runs them natively (it lists "activations" in its
options, e.g. a Blackwell W4A4 kernel), it gets the option. Otherwise the activations are
quantized and dequantized here before a weight-only gemm: numerically the same W4A4 product
with float accumulation, computed on hardware without an FP4 datapath (the H200). NVFP4
activations use a per-call global scale from the activation tensor's absolute maximum, or a static
one (`input_global_scale`, the encode scale 2688/amax of calibrated inputs): inputs beyond the
calibrated amax then saturate (block scale clamped at E4M3's 448, elements at E2M1's 6). A native
backend gets a static scale only if it lists "input_global_scale" in its options; otherwise the
activations are emulated here with it.

Rotated layers (quant/hadamard.py: weights W R, the op multiplies x R): the op gets the b x b
Hadamard matrix and rotates x itself. Emulated low-precision activations on CUDA with b dividing
the activation format's block are rotated inside the activation quantize kernel (quantize_gpu's
`rotation`: x R never goes to memory); elsewhere (CPU, NVFP4 with b = 32, float activations,
native low-precision backends) x R is a torch op before the quantizer or the GEMM.

Gated pairs (`epilogue="silu_mul"`, kernels/gated.py): the weight holds gate and up rows interleaved and
the op returns silu(gate) * up, [M, N / 2]. A backend that lists "epilogue" in its options gets it (the
sm90 decode kernels apply it in their epilogue); for the others the op finishes their output with
gated.silu_mul.

Decoder glue (kernels/rmsnorm.py): `norm_weight`, `norm_eps` make the op the GEMM of rms_norm(x) * norm_weight,
applied before anything else (activation quantization, rotation); `residual` is added to the op's output. A
backend that lists "rms_norm" / "residual" in its options gets them (sm90: in the decode_ws kernel, torch ops
around its other kernels; Backend.fusions says which); for the others the op runs rmsnorm's torch ops.
"""

from typing import Optional

import torch

from ..formats.spec import get_format
from ..quant import hadamard, quantize
from . import gated, rmsnorm
from .dispatch import Backend, get_backend, select_backend


def quantizer_for(device: torch.device):
    """The fused Triton quantizer on CUDA, the reference elsewhere: the same bits (tested so in
    tests/kernels), but the kernel neither synchronizes nor builds host tensors (CUDA graphs), nor
    rejects NaN/Inf (check_weight first where that matters)."""
    if device.type == "cuda":
        from .quantize import quantize_gpu  # imports Triton, only where a GPU runs

        return quantize_gpu
    return quantize


def quantize_dequantize_activations(x2d: torch.Tensor, fmt: str, global_scale: Optional[torch.Tensor] = None,
                                    rotation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] rounded to `fmt` along K, returned in x's dtype; NVFP4 with `global_scale` (encode)
    when given, else with one from x's amax. rotation: hadamard_matrix(b), to round x R instead
    (rotated in float32: in the quantize kernel where it can, module docstring)."""
    if x2d.shape[0] == 0:
        return x2d
    quantizer, dtype, fused = quantizer_for(x2d.device), x2d.dtype, {}
    if rotation is not None:
        b = rotation.shape[0]
        if quantizer is not quantize and get_format(fmt).block % b == 0:  # the kernel rotates
            fused["rotation"] = b
        else:
            x2d = hadamard.rotate(x2d.float(), b, rotation)
    return quantizer(x2d, fmt, global_scale=global_scale, scale_layout="linear", **fused).dequantize(dtype)


@torch.library.custom_op("microscale::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    fmt: str,
    n: int,
    k: int,
    backend: str,
    activations: Optional[str],
    input_global_scale: Optional[torch.Tensor] = None,
    rotation: Optional[torch.Tensor] = None,
    epilogue: Optional[str] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W).T (+ bias) with W as prepared by `backend`; the activations
    quantized to `activations` (if given), NVFP4 with the static `input_global_scale` (if given);
    x R instead of x with `rotation` = hadamard_matrix(b); with `epilogue` the gated pairs of y,
    [M, N / 2]; of rms_norm(x) * norm_weight instead of x; plus `residual` (module docstring)."""
    b = get_backend(backend)
    options = {}
    gated.check_epilogue(epilogue)
    if norm_weight is not None:
        if "rms_norm" in b.options and activations is None and rotation is None:
            options["rms_norm"] = (norm_weight, norm_eps)
        else:
            x = rmsnorm.rms_norm(x, norm_weight, norm_eps)
    if activations is not None:
        static_ok = input_global_scale is None or "input_global_scale" in b.options
        if "activations" in b.options and activations == fmt and static_ok:
            options["activations"] = activations
            if input_global_scale is not None:
                options["input_global_scale"] = input_global_scale
        else:
            x = quantize_dequantize_activations(x, activations, input_global_scale, rotation)
            rotation = None  # x R is what was quantized
    if rotation is not None:
        x = hadamard.rotate(x, rotation.shape[0], rotation)
    if epilogue is not None and "epilogue" in b.options:
        options["epilogue"], epilogue = epilogue, None  # the backend applies it
    if residual is not None and epilogue is None and "residual" in b.options:
        options["residual"], residual = residual, None  # after the epilogue: the backend adds it
    y = b.gemm(x, data, scale, global_scale, bias, fmt=fmt, n=n, k=k, options=options)
    y = y if epilogue is None else gated.silu_mul(y)
    return y if residual is None else rmsnorm.add_residual(y, residual)


@linear.register_fake
def _linear_fake(x, data, scale, global_scale, bias, fmt, n, k, backend, activations, input_global_scale=None,
                 rotation=None, epilogue=None, norm_weight=None, norm_eps=0.0, residual=None):
    return x.new_empty((x.shape[0], gated.output_features(n, epilogue)))


def check_activations(activations: Optional[str]) -> Optional[str]:
    """Normalize an activation format name (None = float activations); unknown names raise."""
    return None if activations is None else get_format(activations).name


def select_linear_backend(fmt, device, activations: Optional[str] = None, override: Optional[str] = None,
                          static_input: bool = False) -> Backend:
    """The backend for a quantized Linear: one that runs the activations natively if there is one on
    `device`, else the first weight-only one (`linear` then emulates the activations). Native
    low-precision-activation kernels (Blackwell W4A4 / W8A8) take activations in the weights' format;
    with `static_input` (a static input global scale), only those that take the scale too."""
    if activations is not None and activations == get_format(fmt).name:
        options = {"activations": activations, "input_global_scale": True if static_input else None}
        try:
            return select_backend(fmt, device, options=options, override=override)
        except ValueError:
            pass  # no native low-precision-activation kernel here; fall through to weight-only
    return select_backend(fmt, device, override=override)
