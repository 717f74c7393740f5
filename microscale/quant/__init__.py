"""Quantizers: the pure-torch reference (and, on GPU, fast kernels with the same results)."""

from .reference import NVFP4_RECIPES, dequantize, nvfp4_global_scale, quantize
