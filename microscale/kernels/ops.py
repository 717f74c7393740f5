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
activations use a per-call global scale from the activation tensor's absolute maximum.
"""

from typing import Optional

import torch

from ..formats.spec import get_format
from ..quant import quantize
from .dispatch import Backend, get_backend, select_backend


def _activation_quantizer(device: torch.device):
    """The fused Triton quantizer on CUDA, the reference elsewhere: the same bits (tested so in
    tests/kernels), but the kernel neither synchronizes nor builds host tensors (CUDA graphs)."""
    if device.type == "cuda":
        from .quantize import quantize_gpu  # imports Triton, only where a GPU runs

        return quantize_gpu
    return quantize


def quantize_dequantize_activations(x2d: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [M, K] rounded to `fmt` along K, returned in x's dtype."""
    if x2d.shape[0] == 0:
        return x2d
    q = _activation_quantizer(x2d.device)(x2d, fmt, scale_layout="linear")
    return q.dequantize(x2d.dtype)


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
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W).T (+ bias) with W as prepared by `backend`."""
    b = get_backend(backend)
    options = {}
    if activations is not None:
        if "activations" in b.options and activations == fmt:
            options["activations"] = activations
        else:
            x = quantize_dequantize_activations(x, activations)
    return b.gemm(x, data, scale, global_scale, bias, fmt=fmt, n=n, k=k, options=options)


@linear.register_fake
def _linear_fake(x, data, scale, global_scale, bias, fmt, n, k, backend, activations):
    return x.new_empty((x.shape[0], n))


def check_activations(activations: Optional[str]) -> Optional[str]:
    """Normalize an activation format name (None = float activations); unknown names raise."""
    return None if activations is None else get_format(activations).name


def select_linear_backend(fmt, device, activations: Optional[str] = None, override: Optional[str] = None) -> Backend:
    """The backend for a quantized Linear: one that runs the activations natively if there is one on
    `device`, else the first weight-only one (`linear` then emulates the activations). Native
    low-precision-activation kernels (Blackwell W4A4 / W8A8) take activations in the weights' format."""
    if activations is not None and activations == get_format(fmt).name:
        try:
            return select_backend(fmt, device, options={"activations": activations}, override=override)
        except ValueError:
            pass  # no native low-precision-activation kernel here; fall through to weight-only
    return select_backend(fmt, device, override=override)
