"""Format descriptions: the one place that knows the numbers of NVFP4, MXFP4 and MXFP8.

Every other module reads a `FormatSpec`; nothing else compares format names or
spells out 6.0, 448 or 127.
"""

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF


@dataclass(frozen=True)
class FormatSpec:
    """One block-scaled format.

    elem:       element encoding, "e2m1" (4-bit, two per byte) or "e4m3" (one byte)
    elem_max:   largest element magnitude (saturation point)
    elem_emax:  exponent of the largest element's binade (OCP MX "emax")
    elem_mbits: explicit mantissa bits of the element
    block:      elements along K that share one scale
    scale:      scale encoding, "e4m3" (NVFP4) or "e8m0" (MX)
    global_scale: whether a per-tensor float32 scale sits above the block scales
    """

    name: str
    elem: str
    elem_max: float
    elem_emax: int
    elem_mbits: int
    block: int
    scale: str
    global_scale: bool

    @property
    def elem_bits(self) -> int:
        return 4 if self.elem == "e2m1" else 8

    @property
    def packed(self) -> bool:
        """Two elements per byte (low nibble = even K index)."""
        return self.elem_bits == 4

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed else torch.float8_e4m3fn

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.scale == "e4m3" else torch.uint8

    @property
    def bits_per_weight(self) -> float:
        """Storage cost per element, block scale included (global scale ignored)."""
        return self.elem_bits + 8 / self.block


NVFP4 = FormatSpec("nvfp4", "e2m1", E2M1_MAX, 2, 1, 16, "e4m3", True)
MXFP4 = FormatSpec("mxfp4", "e2m1", E2M1_MAX, 2, 1, 32, "e8m0", False)
MXFP8 = FormatSpec("mxfp8", "e4m3", E4M3_MAX, 8, 3, 32, "e8m0", False)

FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP8)}


def get_format(fmt) -> FormatSpec:
    """Accept a FormatSpec or its name; reject anything else with the list of names."""
    if isinstance(fmt, FormatSpec):
        return fmt
    spec = FORMATS.get(str(fmt).lower()) if isinstance(fmt, str) else None
    if spec is None:
        raise ValueError(f"unknown format {fmt!r}; accepted: {', '.join(FORMATS)}")
    return spec
