"""Reference quantizers in pure torch: the definition every kernel is tested against.

quantize(w, fmt) turns a 2-D float weight [N, K] into a QTensor along K; dequantize(q)
goes back. Runs on any device. K that is not a multiple of the block is zero-padded.
"""

import torch

from ..formats.codec import ScaleMode, e2m1_encode, e4m3_encode, e8m0_from_amax, pow2
from ..formats.packing import pack_fp4
from ..formats.spec import E2M1_MAX, E4M3_MAX, E8M0_BIAS, get_format
from ..formats.tensor import QTensor, padded_k

ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: maps the tensor amax to 6 * 448
NVFP4_RECIPES = ("compressed-tensors", "modelopt", "torchao")


def check_weight(w, name: str = "weight", *, finite: bool = True) -> None:
    """Reject what the quantizers cannot take, saying what is accepted and where it failed.

    finite=False skips the scan for NaN/Inf, which synchronizes a GPU (run-time activation
    quantization skips it)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in ACCEPTED_DTYPES:
        raise TypeError(f"{name}: dtype {w.dtype} not accepted; accepted: {', '.join(map(str, ACCEPTED_DTYPES))}")
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty 2-D tensor [N, K], got shape {tuple(w.shape)}")
    if not finite:
        return
    bad = ~torch.isfinite(w)
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}: {count} non-finite value(s) (NaN/Inf) in shape {tuple(w.shape)}, first at index {first}: "
            f"{w[first].item()}"
        )


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> zero-padded [N, Kp/block, block]."""
    n, k = w.shape
    kp = padded_k(k, block)
    if kp != k:
        w = torch.nn.functional.pad(w, (0, kp - k))
    return w.reshape(n, kp // block, block)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c, correctly rounded on every device: CUDA turns a division by a Python scalar into a
    multiplication by its (rounded) reciprocal, which can differ by 1 ulp and flip a rounding tie."""
    return x / torch.full_like(x, c)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' encode global scale 448*6/amax, as float32 0-d; 1.0 when not finite."""
    amax = w.abs().amax().float()
    # not `2688 / amax`: torch evaluates `scalar / tensor` as scalar * reciprocal(tensor)
    g = torch.full_like(amax, NVFP4_GLOBAL_NUMERATOR) / amax
    return torch.where(torch.isfinite(g), g, torch.ones_like(g))


def _nvfp4_compressed_tensors(x, amax_blk, g):
    """Block scale = e4m3((amax/6) * g), 0 -> 0.125; elements = x / (scale / g)."""
    s = e4m3_encode(_div(amax_blk, E2M1_MAX) * g)
    s = torch.where(s.float() == 0, torch.full_like(s, 0.125), s)
    y = x / (s.float() / g)[..., None]
    return s, y


def _nvfp4_modelopt(x, amax_blk, d):
    """ModelOpt: d = weight_scale_2; block scale = amax/(6d), 0 -> 1, clamped to [2^-9, 448]."""
    s = amax_blk / (E2M1_MAX * d)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(2.0**-9, E4M3_MAX)
    s = e4m3_encode(s)
    y = x / (s.float() * d)[..., None]
    return s, y


def _nvfp4_torchao(x, amax_blk, d):
    """torchao: d = per_tensor_scale; block scale clamp((amax/6)/d, 2^-6, 448); x * ((1/d)/s)."""
    s = e4m3_encode((_div(amax_blk, E2M1_MAX) / d).clamp(2.0**-6, E4M3_MAX))
    y = x * ((1.0 / d) / s.float())[..., None]
    return s, y


# recipe -> (block function, whether its global scale is an encode scale)
_NVFP4_RECIPES = {
    "compressed-tensors": (_nvfp4_compressed_tensors, True),
    "modelopt": (_nvfp4_modelopt, False),
    "torchao": (_nvfp4_torchao, False),
}


def _nvfp4_recipe_global(w, recipe, global_scale):
    """The recipe's own global scale (encode for compressed-tensors, decode otherwise).

    Given scales are always in the encode direction and inverted for decode recipes; a computed
    decode scale stays exactly as that library computes it (amax / 2688; 1.0 for an all-zero
    tensor or one below about 1e-35, whose encode scale would overflow).
    """
    encode = _NVFP4_RECIPES[recipe][1]
    if global_scale is not None:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(())
        if not (torch.isfinite(g) and g > 0):
            raise ValueError(f"global_scale must be finite and > 0, got {g.item()}")
        return g if encode else 1.0 / g
    if encode:
        return nvfp4_global_scale(w)
    d = _div(w.abs().amax().float(), NVFP4_GLOBAL_NUMERATOR)
    # zero, or so small that its reciprocal (the encode scale we store) overflows: use 1.0
    return torch.where(torch.isfinite(1.0 / d), d, torch.ones_like(d))


def quantize(
    w: torch.Tensor,
    fmt,
    *,
    recipe: str = "compressed-tensors",
    scale_mode=ScaleMode.RCEIL,
    global_scale=None,
    scale_layout: str = "linear",
) -> QTensor:
    """Quantize a 2-D weight [N, K] along K to "nvfp4", "mxfp4" or "mxfp8".

    NVFP4 recipes ("compressed-tensors" default, "modelopt", "torchao") reproduce those
    libraries' codes and block scales bit for bit (formats-spec section 1), in float32
    arithmetic throughout (compressed-tensors' observers keep a bf16 weight's amax in bf16,
    so on bf16 weights its scales can differ from these in rare rounding cases). global_scale is
    the encode scale (448*6/amax convention); computed from w when not given. Recipes that
    use a decode scale (ModelOpt, torchao) use its reciprocal. An all-zero tensor gets 1.0.
    MX formats take scale_mode (FLOOR, RCEIL, CEIL, EVEN; see ScaleMode).
    """
    spec = get_format(fmt)
    check_weight(w)
    n, k = w.shape
    x = _blocks(w.float(), spec.block)
    amax = x.abs().amax(-1)

    if spec.global_scale:
        if recipe not in _NVFP4_RECIPES:
            raise ValueError(f"unknown NVFP4 recipe {recipe!r}; accepted: {', '.join(_NVFP4_RECIPES)}")
        block_fn, encode = _NVFP4_RECIPES[recipe]
        d = _nvfp4_recipe_global(w, recipe, global_scale)
        scale, y = block_fn(x, amax, d)
        g = d if encode else 1.0 / d
    else:
        if global_scale is not None:
            raise ValueError(f"{spec.name} has no global scale; got global_scale={global_scale!r}")
        if recipe != "compressed-tensors":
            raise ValueError(f"recipe applies to nvfp4 only; {spec.name} takes scale_mode")
        scale = e8m0_from_amax(amax, spec, scale_mode)
        y = x * pow2(E8M0_BIAS - scale.to(torch.int32))[..., None]
        g = None

    y = y.clamp(-spec.elem_max, spec.elem_max).reshape(n, -1)
    data = pack_fp4(e2m1_encode(y)) if spec.packed else e4m3_encode(y)
    q = QTensor(data=data, scale=scale, fmt=spec, shape=(n, k), global_scale=g, orig_dtype=w.dtype)
    return q.with_scale_layout(scale_layout)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QTensor -> dense [N, K] in dtype (float32 by default)."""
    return q.dequantize(dtype)
