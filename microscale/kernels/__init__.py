"""GEMM/GEMV and quantize kernels per architecture, behind one dispatch."""

from .dispatch import Backend, backends, linear, register, select_backend
