"""Exact element and scale codecs: one function per direction, vectorized torch, any device.

E2M1 codes are uint8 in 0..15 (bit 3 = sign). E4M3 values are torch.float8_e4m3fn.
E8M0 values are uint8 biased exponents (value = 2**(b - 127), 0xFF = NaN).
"""

import enum

import torch

from .spec import E4M3_MAX, E8M0_BIAS, E8M0_NAN, FormatSpec

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Decision points between neighbouring E2M1 magnitudes. At a tie the even code wins,
# so ties at 0.25, 1.25, 2.5 and 5 go down (">") and ties at 0.75, 1.75, 3.5 go up (">=").
_E2M1_ROUND_DOWN_AT_TIE = (0.25, 1.25, 2.5, 5.0)
_E2M1_ROUND_UP_AT_TIE = (0.75, 1.75, 3.5)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> E2M1 code (uint8), round to nearest even, saturating at +-6.

    Strictly negative inputs get the sign bit (also those that round to zero, giving 0x8);
    -0.0 gives 0x0, as compressed-tensors (x * sign(x)) does.
    NaN has no E2M1 code; callers reject it before encoding (quantize does).
    """
    a = x.abs().float()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t in _E2M1_ROUND_DOWN_AT_TIE:
        mag += (a > t).to(torch.uint8)
    for t in _E2M1_ROUND_UP_AT_TIE:
        mag += (a >= t).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8, low 4 bits used) -> float32.

    Built from float32 bits rather than a lookup table, so it allocates nothing on the host
    and can run inside CUDA-graph capture: exponent field e > 0 is (1 + m/2) * 2**(e-1),
    e = 0 is the subnormal m * 0.5.
    """
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 0x3, c & 0x1
    normal = ((e + 126) << 23) | (m << 22)
    bits = torch.where(e > 0, normal, m * 0x3F000000) | ((c & 0x8) << 28)
    return bits.view(torch.float32)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, round to nearest even, saturating at +-448 (NaN stays NaN).

    The explicit clamp keeps saturation independent of torch's cast behaviour, which
    did not saturate before torch 2.13.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32 (exact)."""
    return x.to(torch.float32)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) -> float32 2**(b - 127); 0xFF -> NaN.

    b = 0 gives 2**-127, a float32 subnormal, built exactly from its bits.
    """
    bi = b.to(torch.int32)
    normal = (bi << 23).view(torch.float32)
    sub = torch.full_like(normal, 2.0**-127)
    out = torch.where(bi == 0, sub, normal)
    return torch.where(bi == E8M0_NAN, torch.full_like(out, float("nan")), out)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127]."""
    return e8m0_decode((e + E8M0_BIAS).to(torch.uint8))


class ScaleMode(str, enum.Enum):
    """How an MX block's shared exponent is chosen from the block's absolute maximum.

    FLOOR: OCP MX v1.0, floor(log2 amax) - emax (torchao's default; may clip the block max).
    RCEIL: NVIDIA hardware / TransformerEngine, ceil(log2(amax / elem_max)) (our default).
    CEIL:  ceil(log2 amax) - emax.
    EVEN:  round amax to the element's mantissa width (half up), then FLOOR.
           compressed-tensors' MXFP4 rule; its MXFP8 rule rounds to 1 mantissa bit instead.
    """

    FLOOR = "floor"
    RCEIL = "rceil"
    CEIL = "ceil"
    EVEN = "even"


def _floor_ceil_log2(v: torch.Tensor):
    """floor(log2 v) and ceil(log2 v) for positive finite float32 v (subnormals too)."""
    m, e = torch.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    floor = e.to(torch.int32) - 1
    ceil = floor + (m != 0.5).to(torch.int32)
    return floor, ceil


def e8m0_from_amax(amax: torch.Tensor, spec: FormatSpec, mode=ScaleMode.RCEIL) -> torch.Tensor:
    """Block absolute maximum (float32) -> biased E8M0 shared exponent (uint8).

    Exponents are clamped to [0, 254]; a zero block gets 0 (scale 2**-127), NaN gets 0xFF
    and Inf 0xFE. Exponents come from float32 bits (frexp), never from torch's e8m0 cast,
    which rounds half up and maps 0 to 2**-127.
    """
    mode = ScaleMode(mode)
    amax = amax.float()
    v = amax
    if mode is ScaleMode.EVEN:
        bits = amax.view(torch.int32) + (1 << (22 - spec.elem_mbits))
        v = (bits & 0x7F800000).view(torch.float32)
    if mode is ScaleMode.RCEIL:
        # a tensor divisor: CUDA divides by a Python scalar through its rounded reciprocal
        _, e = _floor_ceil_log2(v / torch.full_like(v, spec.elem_max))
    else:
        floor, ceil = _floor_ceil_log2(v)
        e = (ceil if mode is ScaleMode.CEIL else floor) - spec.elem_emax
    b = (e + E8M0_BIAS).clamp(0, 254)
    b = torch.where(v == 0, torch.zeros_like(b), b)  # no exponent: the smallest scale
    b = torch.where(torch.isinf(amax), torch.full_like(b, 254), b)
    b = torch.where(torch.isnan(amax), torch.full_like(b, E8M0_NAN), b)
    return b.to(torch.uint8)
