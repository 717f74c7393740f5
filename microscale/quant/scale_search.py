"""Scale search: per block, the candidate scale with the least squared error.

Round-to-nearest (RTN) takes each block's scale from the block maximum alone: amax/6 rounded to
E4M3 for NVFP4, the FLOOR or RCEIL exponent for MX. Which scale gives a block the least error
depends on all its values: a smaller scale clips the maximum but resolves the rest more finely,
a larger one (NVFP4's "4 over 6", block maximum mapped to 4) trades the top of the grid for a
better fit of the middle. So every block is quantized with a few candidate scales and keeps the
best. Once the NVFP4 global scale is fixed the blocks are independent, so the per-block choice
minimizes the tensor's error as well; the global scale itself is picked by a search over a
handful of values below 2688/amax (which shift the E4M3 rounding of every block scale).

The RTN scale is always the first candidate and wins ties, so the error is never above RTN's.
The result is an ordinary QTensor (standard codes and scales) that every loader reads.
Everything is vectorized torch and runs on the weight's device.
"""

from typing import Optional, Sequence

import torch

from ..formats.codec import (
    ScaleMode,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_from_amax,
)
from ..formats.packing import pack_fp4
from ..formats.spec import NVFP4, FormatSpec, get_format
from ..formats.tensor import QTensor
from .reference import _blocks, _nvfp4_compressed_tensors, check_weight, nvfp4_global_scale

# NVFP4 block-scale candidates, in E4M3 code steps from the RTN scale (a step is 1/8 of the scale's
# binade: 6-12%). +4..+6 is "4 over 6" (amax/4 sits 3.5 to 7 steps above amax/6); -1 and -2 clip the
# block maximum. On real and Gaussian weights every one of these wins in some blocks; +-8 never did.
NVFP4_SCALE_STEPS = (-2, -1, 1, 2, 3, 4, 5, 6, 7)
# NVFP4 global-scale candidates: 2688/amax times 2**(-j/32), j < 8: steps finer than one E4M3
# step that move every block scale's rounding, down to a quarter binade, which opens "4 over 6"
# to the largest blocks. It gains about 1% of error over 2688/amax, so it is scored on a subset
# of at most NVFP4_GLOBAL_ROWS rows (evenly spaced) to stay cheap next to the block search.
NVFP4_GLOBAL_STEPS = 8
NVFP4_GLOBAL_STEP = 2.0 ** (-1 / 32)
NVFP4_GLOBAL_ROWS = 256
E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN


def encode_elements(y: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Scaled values -> element codes (E2M1 uint8 or float8_e4m3fn), saturating at the element max."""
    y = y.clamp(-spec.elem_max, spec.elem_max)
    return e2m1_encode(y) if spec.packed else e4m3_encode(y)


def decode_elements(codes: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    return e2m1_decode(codes) if spec.packed else e4m3_decode(codes)


def scale_multiplier(scale: torch.Tensor, spec: FormatSpec, global_scale=None) -> torch.Tensor:
    """Stored block scales -> float32 multipliers, the global scale folded in (as QTensor dequantizes)."""
    if spec.scale == "e4m3":
        return e4m3_decode(scale) / global_scale
    return e8m0_decode(scale)


def round_to_grid(a: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Magnitudes a >= 0 (already divided by the scale) -> nearest element magnitude, float32.

    Equal to decode(encode(a)) (round to nearest even, saturating), in a few elementwise ops: the
    error of every candidate scale is computed with it, so it is the search's inner loop. E2M1 is
    uniform inside each binade, steps 0.5 below 2, 1 below 4, 2 up to 6 (the step is the same
    for a pair of binades below 2: subnormal and [1, 2)), and torch.round is half-to-even, which
    picks the even code at every E2M1 tie.
    """
    a = a.clamp(max=spec.elem_max)
    if not spec.packed:
        return a.to(torch.float8_e4m3fn).float()
    step = 0.5 + (a >= 2).float() * 0.5 + (a >= 4).float()
    return torch.round(a / step) * step


def block_error(x_abs, mult, spec, importance=None):
    """Squared error per block of |x| [..., nb, block] quantized with multipliers mult [..., nb]."""
    m = mult[..., None]
    err = (round_to_grid(x_abs / m, spec) * m - x_abs).square()
    if importance is not None:
        err = err * importance
    return err.sum(-1)


def rtn_block_scale(x, spec, global_scale=None, scale_mode=ScaleMode.RCEIL):
    """The reference quantizer's scale for blocks x [..., nb, block] (compressed-tensors rule for NVFP4)."""
    amax = x.abs().amax(-1)
    if spec.global_scale:
        return _nvfp4_compressed_tensors(x, amax, global_scale)[0]
    return e8m0_from_amax(amax, spec, scale_mode)


def _candidates(x, spec, rtn):
    """Candidate block scales [C, ..., nb] (stored encoding), RTN first."""
    if spec.global_scale:
        code = rtn.view(torch.uint8).to(torch.int16)
        steps = torch.tensor((0,) + NVFP4_SCALE_STEPS, dtype=torch.int16, device=x.device)
        steps = steps.view(-1, *([1] * code.dim()))
        return (code + steps).clamp(1, E4M3_MAX_CODE).to(torch.uint8).view(torch.float8_e4m3fn)
    amax = x.abs().amax(-1)
    floor, rceil = (e8m0_from_amax(amax, spec, m).to(torch.int16) for m in (ScaleMode.FLOOR, ScaleMode.RCEIL))
    lo, hi = torch.minimum(floor, rceil), torch.maximum(floor, rceil)
    return torch.stack([rtn.to(torch.int16), floor, rceil, lo - 1, hi + 1]).clamp(0, 254).to(torch.uint8)


def search_block_scales(x, spec, global_scale=None, *, importance=None, scale_mode=ScaleMode.RCEIL):
    """Per block of x [..., nb, block], the candidate scale with the least (importance-weighted) error.

    All candidates are scored in one vectorized pass. Returns (scales, errors): scales in the stored
    encoding [..., nb], errors float32 [..., nb].
    """
    rtn = rtn_block_scale(x, spec, global_scale, scale_mode)
    cands = _candidates(x, spec, rtn)
    err = block_error(x.abs(), scale_multiplier(cands, spec, global_scale), spec, importance)
    best = err.argmin(0, keepdim=True)  # the first minimum: RTN wins ties
    scale = cands.view(torch.uint8).gather(0, best)[0].view(rtn.dtype)
    return scale, err.gather(0, best)[0]


def _importance_blocks(importance, k, block, device):
    if importance is None:
        return None
    imp = torch.as_tensor(importance, dtype=torch.float32, device=device).reshape(-1)
    if imp.numel() != k or not (torch.isfinite(imp).all() and (imp >= 0).all()):
        raise ValueError(f"importance: expected {k} finite non-negative values (one per K column), "
                         f"got shape {tuple(imp.shape)}")
    return _blocks(imp[None], block)[0]


def search_global_scale(weights: Sequence[torch.Tensor], *, importance=None) -> torch.Tensor:
    """NVFP4 encode global scale with the least total block-searched error over `weights`.

    Several tensors (q/k/v, gate/up) get one shared scale, as vLLM requires of fused layers.
    Candidates are 2688/amax of the group times NVFP4_GLOBAL_STEP**j; the first one (RTN's) wins ties.
    importance, if given, is one [K] vector per tensor.
    """
    g0 = nvfp4_global_scale(torch.stack([w.abs().amax() for w in weights]))
    ws = [w[:: max(1, w.shape[0] // NVFP4_GLOBAL_ROWS)].float() for w in weights]
    imps = [None] * len(ws) if importance is None else list(importance)
    xs = [_blocks(w, NVFP4.block) for w in ws]
    imps = [_importance_blocks(i, w.shape[1], NVFP4.block, w.device) for i, w in zip(imps, ws)]
    best_g, best_err = g0, None
    for j in range(NVFP4_GLOBAL_STEPS):
        g = g0 * NVFP4_GLOBAL_STEP**j
        err = sum(search_block_scales(x, NVFP4, g, importance=i)[1].double().sum() for x, i in zip(xs, imps))
        if best_err is None or err < best_err:
            best_g, best_err = g, err
    return best_g


def quantize_with_scales(w: torch.Tensor, fmt, scale, global_scale=None, scale_layout="linear") -> QTensor:
    """Quantize w [N, K] with given linear block scales [N, Kp/block] (stored encoding)."""
    spec = get_format(fmt)
    n, k = w.shape
    x = _blocks(w.float(), spec.block)
    y = x / scale_multiplier(scale, spec, global_scale)[..., None]
    codes = encode_elements(y, spec).reshape(n, -1)
    data = pack_fp4(codes) if spec.packed else codes
    q = QTensor(data=data, scale=scale, fmt=spec, shape=(n, k), global_scale=global_scale, orig_dtype=w.dtype)
    return q.with_scale_layout(scale_layout)


def search_quantize(
    w: torch.Tensor,
    fmt,
    *,
    global_scale=None,
    search_global: bool = True,
    importance: Optional[torch.Tensor] = None,
    scale_mode=ScaleMode.RCEIL,
    scale_layout: str = "linear",
) -> QTensor:
    """Quantize w [N, K] along K with searched block scales (and, for NVFP4, global scale).

    global_scale: NVFP4 encode scale to use as is (e.g. one shared by fused q/k/v); otherwise
    searched (search_global=True) or 2688/amax. importance: optional non-negative weight per K
    column (e.g. the activations' mean square) for the error being minimized.
    scale_mode: the MX RTN rule used as the first candidate (ties go to it).
    """
    spec = get_format(fmt)
    check_weight(w)
    if global_scale is not None and not spec.global_scale:
        raise ValueError(f"{spec.name} has no global scale; got global_scale={global_scale!r}")
    n, k = w.shape
    if spec.global_scale:
        if global_scale is not None:
            global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device).reshape(())
            if not (torch.isfinite(global_scale) and global_scale > 0):
                raise ValueError(f"global_scale must be finite and > 0, got {global_scale.item()}")
        elif search_global:
            global_scale = search_global_scale([w], importance=None if importance is None else [importance])
        else:
            global_scale = nvfp4_global_scale(w)
    x = _blocks(w.float(), spec.block)
    imp = _importance_blocks(importance, k, spec.block, w.device)
    scale, _ = search_block_scales(x, spec, global_scale, importance=imp, scale_mode=scale_mode)
    return quantize_with_scales(w, spec, scale, global_scale, scale_layout)
