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

import importlib.util
from typing import Optional

import torch

from ..formats.spec import get_format
from ..quant import quantize
from .dispatch import Backend, get_backend, select_backend

_GPU_QUANTIZER = "microscale.kernels.quantize"


def _activation_quantizer(device: torch.device):
    """The quantizer for activations on `device`: the GPU kernel where it exists, else the reference.

    Both give the same bits (the GPU kernel is tested bit-identical to quant.quantize).
    """
    if device.type == "cuda" and importlib.util.find_spec(_GPU_QUANTIZER) is not None:
        return importlib.import_module(_GPU_QUANTIZER).quantize_gpu
    return quantize


def quantize_dequantize_activations(x2d: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to `fmt` along K (the last dim), returned in x's dtype."""
    q = _activation_quantizer(x2d.device)(x2d, fmt)
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
        if "activations" in b.options:
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
    """The backend for a quantized Linear: one that runs the activation format natively if there is
    one on `device`, else the first weight-only one (`linear` then emulates the activations)."""
    if activations is not None:
        try:
            return select_backend(fmt, device, options={"activations": activations}, override=override)
        except ValueError:
            pass  # no native low-precision-activation kernel here; fall through to weight-only
    return select_backend(fmt, device, override=override)
