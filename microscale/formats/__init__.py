"""Block-scaled formats: specs, exact codecs, packing, scale layouts and the QTensor container."""

from .codec import (
    E2M1_VALUES,
    ScaleMode,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_from_amax,
)
from .packing import as_float4_x2, pack_fp4, unpack_fp4
from .scale_layout import (
    swizzle_scales_128x4,
    swizzled_scale_offset,
    swizzled_scale_shape,
    unswizzle_scales_128x4,
)
from .spec import FORMATS, MXFP4, MXFP8, NVFP4, FormatSpec, get_format
from .tensor import QTensor
