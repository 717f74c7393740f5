"""microscale: block-scaled low-precision formats (NVFP4, MXFP4, MXFP8) for PyTorch."""

from .formats import FORMATS, MXFP4, MXFP8, NVFP4, QTensor, ScaleMode, get_format
from .quant import dequantize, quantize

__version__ = "0.1.0"
