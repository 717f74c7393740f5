"""The decoder's glue around a projection: an RMSNorm in front of it and a residual add behind it.

A Llama-style decoder layer runs x = norm(h), qkv(x), ..., h = h + o_proj(o), x = norm(h), gate/up(x), ...,
h = h + down(...). At batch 1 each norm is a kernel of its own between two GEMMs, and each costs about as much
as its launch gap (session 24: the NVFP4 decode step without the norms and residual adds 2.017 -> 1.854 ms).
The decode_ws kernel takes both instead (`Backend.fusions`):
- rms_norm (weight w, eps): y = W norm(x) with norm(x) = w * (x * rsqrt(mean(x^2) + eps)), as transformers'
  LlamaRMSNorm computes it (`rms_norm` below). The kernel multiplies x by w on its way into the MMA (bf16, as
  the module rounds it) and the outputs by rsqrt(mean(x^2) + eps) in the epilogue, from the sum of squares it
  takes of x as x passes through: x * rsqrt(...) is never rounded to bf16 there, so its outputs differ from
  those of norm-then-GEMM by a rounding of x.
- residual r: y = r + W x, the sum in float32 before the one rounding to y's dtype.
Where the kernel does not take them, `rms_norm` and `add_residual` are these steps in torch ops.
"""

import torch

FUSIONS = ("rms_norm", "residual")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) in float32, the normalized x rounded to x's dtype before the
    product (LlamaRMSNorm's order); the result in x's dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.to(x.dtype) * normed).to(x.dtype)


def add_residual(y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + y, summed in float32, in y's dtype."""
    if residual.shape != y.shape:
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not match the output {tuple(y.shape)}")
    return (residual.float() + y.float()).to(y.dtype)


def norm_parameters(norm, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(weight, eps) of an RMSNorm given as such a pair or as a module: transformers' RMSNorms (weight,
    variance_epsilon) and torch.nn.RMSNorm (weight, eps; None: the eps of `dtype`, x's)."""
    if isinstance(norm, tuple):
        weight, eps = norm
    elif hasattr(norm, "variance_epsilon"):
        weight, eps = norm.weight, norm.variance_epsilon
    elif isinstance(norm, torch.nn.RMSNorm):
        weight, eps = norm.weight, torch.finfo(dtype).eps if norm.eps is None else norm.eps
    else:
        raise TypeError(f"norm: expected (weight, eps) or an RMSNorm module, got {type(norm).__name__}")
    if weight is None or weight.dim() != 1:
        raise ValueError(f"norm: the RMSNorm needs a weight of one dimension, got "
                         f"{None if weight is None else tuple(weight.shape)}")
    return weight, float(eps)
