"""Kernel dispatch: the only module that reads the device's compute capability.

A backend is a family of kernels for one kind of device (reference, sm90, sm100-triton,
sm100-nvrtc). At load time `prepare` turns a canonical QTensor into the tensors that
family's kernels read (a re-layout done once); at call time `gemm` picks the kernel for
M and the options and runs y = x @ dequant(W).T (+ bias). Modules store the prepared
tensors as buffers and pass them back in, so the call is one op on plain tensors
(torch.compile and CUDA graphs see no Python objects). A backend whose prepared tensors are a
different layout may give `unprepare`, its inverse; modules keep only the prepared copy of a
weight the inverse gives back bit for bit, and rebuild the canonical tensors with it when they
need them (checkpoints, device moves).

Order of preference: the first available backend that supports the format and options.
Override with `backend=` or the environment variable MICROSCALE_BACKEND;
MICROSCALE_FORCE_REFERENCE=1 forces the reference path.
"""

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..formats.spec import get_format
from ..formats.tensor import QTensor

Prepared = tuple  # (data, scale, global_scale or None)


@dataclass(frozen=True)
class Backend:
    name: str
    formats: frozenset
    available: Callable[[torch.device], bool]
    prepare: Callable[[QTensor], Prepared]
    gemm: Callable[..., torch.Tensor]  # (x2d, data, scale, global_scale, bias, *, fmt, n, k, options) -> [M, N]
    options: frozenset = field(default_factory=frozenset)  # option names it honours (e.g. "activations")
    requires: frozenset = field(default_factory=frozenset)  # options it cannot run without (W4A4 kernels)
    # (prepared, fmt, shape, global_scale) -> the canonical QTensor prepare was given (global_scale:
    # the NVFP4 one, passed back in); None where prepare keeps the canonical tensors (the reference)
    unprepare: Optional[Callable[[Prepared, str, tuple, Optional[torch.Tensor]], QTensor]] = None
    # (fmt, m, n, k, device, options) -> which of rmsnorm.FUSIONS its kernel for such a call applies itself
    # (options "rms_norm", "residual"); the others run as torch ops around it. None: none.
    fusions: Optional[Callable[[str, int, int, int, torch.device, dict], frozenset]] = None


_BACKENDS: dict = {}


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def backends() -> dict:
    return dict(_BACKENDS)


def compute_capability(device: torch.device) -> Optional[tuple]:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]


def select_backend(fmt, device, *, options: Optional[dict] = None, override: Optional[str] = None) -> Backend:
    """First backend that runs on `device`, supports `fmt` and every given option, and needs no
    option that was not given."""
    spec = get_format(fmt)
    device = torch.device(device)
    wanted = {k for k, v in (options or {}).items() if v is not None}
    if os.environ.get("MICROSCALE_FORCE_REFERENCE") == "1":
        override = "reference"
    override = override or os.environ.get("MICROSCALE_BACKEND") or None
    if override:
        b = get_backend(override)
        if spec.name not in b.formats or not b.available(device):
            raise ValueError(f"backend {override!r} cannot run {spec.name} on {device}")
        return b
    # the reference runs everywhere: it is the fallback, tried after every kernel family
    for b in sorted(_BACKENDS.values(), key=lambda b: b.name == "reference"):
        if spec.name in b.formats and b.requires <= wanted <= b.options and b.available(device):
            return b
    raise ValueError(f"no backend runs {spec.name} with options {sorted(wanted)} on {device}")


def linear(x: torch.Tensor, w: QTensor, bias: Optional[torch.Tensor] = None, *, backend: Optional[str] = None,
           options: Optional[dict] = None) -> torch.Tensor:
    """y = x @ dequant(w).T + bias for x [..., K]; eager convenience (prepares w on each call)."""
    b = select_backend(w.fmt, x.device, options=options, override=backend)
    data, scale, g = b.prepare(w)
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: input of shape {tuple(x.shape)} does not match weight K={k}")
    y = b.gemm(x.reshape(-1, k), data, scale, g, bias, fmt=w.fmt.name, n=n, k=k, options=options or {})
    return y.reshape(*x.shape[:-1], n)


# ---- reference backend: dequantize, then matmul in the input dtype --------------------------
def _reference_prepare(w: QTensor) -> Prepared:
    w = w.with_scale_layout("linear")
    return w.data, w.scale, w.global_scale


def _reference_gemm(x2d, data, scale, global_scale, bias, *, fmt, n, k, options):
    w = QTensor(data=data, scale=scale, fmt=fmt, shape=(n, k), global_scale=global_scale)
    wd = w.dequantize(x2d.dtype if x2d.dtype != torch.float16 or x2d.is_cuda else torch.float32)
    y = x2d.to(wd.dtype) @ wd.t()
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x2d.dtype)


register(Backend(
    name="reference",
    formats=frozenset({"nvfp4", "mxfp4", "mxfp8"}),
    available=lambda device: True,
    prepare=_reference_prepare,
    gemm=_reference_gemm,
))
