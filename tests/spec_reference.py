"""An independent reference for the formats, written in numpy from formats-spec.md.

It never calls microscale. Grids are enumerated from the bit definitions and rounding is
a nearest-value search in float64 with explicit tie rules; where a recipe prescribes
float32 arithmetic (scale computations), numpy float32 reproduces it.
"""

import numpy as np

F32 = np.float32

# ---- element grids from the bit definitions ---------------------------------------------


def e2m1_value(code: int) -> float:
    """E2M1: bit 3 sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0x8 else 1.0
    e, m = (code >> 1) & 0x3, code & 0x1
    mag = (m * 0.5) if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1)
    return sign * mag


def e4m3_value(code: int) -> float:
    """E4M3FN: bit 7 sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, no Inf."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    mag = (m / 8.0) * 2.0**-6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
    return sign * mag


def e8m0_value(b: int) -> float:
    return float("nan") if b == 0xFF else 2.0 ** (b - 127)


E2M1_POS = np.array([e2m1_value(c) for c in range(8)])
E4M3_POS = np.array([e4m3_value(c) for c in range(0x7F)])  # codes 0..126: all finite non-negative


def _round_to_grid(v, grid):
    """Index of the nearest grid value to |v| (grid ascending, code = index), ties to even index.
    Magnitudes beyond the grid saturate to its last value."""
    a = np.abs(np.asarray(v, dtype=np.float64))[..., None]
    dist = np.abs(a - grid)
    best = dist.min(-1, keepdims=True)
    ties = dist == best
    # among tied indices prefer an even one (there are at most two, adjacent)
    idx = np.argmax(ties & (np.arange(len(grid)) % 2 == 0), axis=-1)
    has_even = (ties & (np.arange(len(grid)) % 2 == 0)).any(-1)
    return np.where(has_even, idx, np.argmax(ties, axis=-1))


def e2m1_code(v):
    """RNE to E2M1 with saturation; sign bit for strictly negative values."""
    v = np.asarray(v, dtype=np.float64)
    return (_round_to_grid(v, E2M1_POS) | ((v < 0) << 3)).astype(np.uint8)


def e4m3_code(v):
    """RNE to E4M3FN with saturation at 448; sign bit from signbit."""
    v = np.asarray(v, dtype=np.float64)
    return (_round_to_grid(v, E4M3_POS) | (np.signbit(v) << 7)).astype(np.uint8)


# ---- scale rules ------------------------------------------------------------------------


def floor_log2(v):
    m, e = np.frexp(np.asarray(v, dtype=np.float64))
    return e - 1


def ceil_log2(v):
    m, e = np.frexp(np.asarray(v, dtype=np.float64))
    return np.where(m == 0.5, e - 1, e)


def mx_exponent(amax, elem_max, emax, mbits, mode):
    """Biased E8M0 exponent of a block, from the spec's definition of each mode."""
    amax = np.asarray(amax, dtype=np.float32)
    if mode == "floor":
        e = floor_log2(amax) - emax
    elif mode == "ceil":
        e = ceil_log2(amax) - emax
    elif mode == "rceil":
        e = ceil_log2(amax / F32(elem_max))  # the quotient is a float32 division
    elif mode == "even":
        m, ex = np.frexp(amax.astype(np.float64))  # amax = m * 2**ex, m in [0.5, 1)
        steps = 2.0 ** (mbits + 1)
        rounded = np.floor(m * steps + 0.5) / steps * 2.0**ex  # half up in magnitude
        e = floor_log2(rounded) - emax
    else:
        raise ValueError(mode)
    b = np.clip(e + 127, 0, 254)
    return np.where(amax == 0, 0, b).astype(np.uint8)


def blocks(x, block):
    n, k = x.shape
    kp = -(-k // block) * block
    out = np.zeros((n, kp), dtype=np.float32)
    out[:, :k] = x
    return out.reshape(n, kp // block, block)


def quantize_mx(x, block, elem, mode):
    """Returns (element codes [N, Kp] uint8, biased exponents [N, Kp/block])."""
    elem_max, emax, mbits = (6.0, 2, 1) if elem == "e2m1" else (448.0, 8, 3)
    xb = blocks(x, block)  # float32
    b = mx_exponent(np.abs(xb).max(-1).astype(np.float64), elem_max, emax, mbits, mode)
    # A float32 quotient, as torchao and compressed-tensors divide: exact for a power-of-two scale unless it
    # underflows, and then a negative element's quotient is -0.0, which e2m1_code codes as +0 (as for NVFP4).
    with np.errstate(under="ignore"):
        y = xb / np.exp2(b.astype(np.float64) - 127).astype(np.float32)[..., None]
    y = np.clip(y, -elem_max, elem_max)
    codes = e2m1_code(y) if elem == "e2m1" else e4m3_code(y)
    return codes.reshape(x.shape[0], -1), b


def quantize_nvfp4(x, recipe, global_encode=None):
    """Returns (E2M1 codes [N, Kp], E4M3 block-scale codes [N, Kp/16], encode global scale)."""
    xb = blocks(x, 16)
    amax_t = F32(np.abs(x).max())
    amax_b = np.abs(xb).max(-1).astype(np.float32)
    e4m3 = lambda v: E4M3_POS[e4m3_code(v) & 0x7F].astype(np.float32)  # noqa: E731 (value after rounding)
    if recipe == "compressed-tensors":
        with np.errstate(divide="ignore", over="ignore"):
            g = F32(2688.0) / amax_t if global_encode is None else F32(global_encode)
        g = F32(1.0) if not np.isfinite(g) else g
        s = e4m3(np.minimum((amax_b / F32(6.0)) * g, F32(448)))
        s = np.where(s == 0, F32(0.125), s)
        y = xb / (s / g)[..., None]
        g_out = g
    elif recipe in ("modelopt", "torchao"):
        if global_encode is None:
            d = amax_t / F32(2688.0)
            with np.errstate(divide="ignore", over="ignore"):
                d = F32(1.0) if not np.isfinite(F32(1.0) / d) else d
        else:
            d = F32(1.0) / F32(global_encode)
        if recipe == "modelopt":
            s = amax_b / (F32(6.0) * d)
            s = np.clip(np.where(s == 0, F32(1.0), s), F32(2.0**-9), F32(448))
            s = e4m3(s)
            y = xb / (s * d)[..., None]
        else:
            s = e4m3(np.clip((amax_b / F32(6.0)) / d, F32(2.0**-6), F32(448)))
            y = xb * ((F32(1.0) / d) / s)[..., None]
        g_out = F32(1.0) / d
    else:
        raise ValueError(recipe)
    y = np.clip(y.astype(np.float32), -6, 6)
    return e2m1_code(y).reshape(x.shape[0], -1), e4m3_code(s), g_out


def swizzle_offset(r, c, cols):
    """Byte offset of scale (r, c) in the 128x4 layout, from the spec formula."""
    cp = -(-cols // 4) * 4
    return (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
