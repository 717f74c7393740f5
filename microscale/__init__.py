"""microscale: block-scaled low-precision formats (NVFP4, MXFP4, MXFP8) for PyTorch."""

from .formats import FORMATS, MXFP4, MXFP8, NVFP4, QTensor, ScaleMode, get_format
from .quant import dequantize, quantize
from .quant.calibration import calibrate_input_scales
from .models.linear import FP4Linear, FP8Linear, fuse_gated, fuse_linears
from .models.quantize_model import fuse_gated_mlps, quantize_model
from .models.serialization import load_quantized, save_quantized

__version__ = "0.1.0"
