"""Block-wise Hadamard rotation along K.

R is block-diagonal, one normalized Hadamard matrix Hb (b = 16 or 32, the format's block) per b-wide
K block. Hb is symmetric and orthogonal, so R^T = R and R R = I: for y = x W^T,

    y = (x R) (W R)^T,

i.e. the weight is rotated once, offline (W -> W R, what the checkpoint stores), and the activations
by the same R at run time. Inside one block the rotation spreads an outlier over all b values, so the
block's scale is no longer set by one large value; blocks never mix, so it stays cheap (a b x b matmul
per block) and fits the block-scaled formats exactly.

A rotated checkpoint computes garbage unless the loader rotates the activations too, so the rotation
is recorded in the checkpoint config (rotation_config) and loaders that cannot apply it must refuse.
"""

from typing import Optional

import torch

# Checkpoint config entry: {"rotation": {"type": "block_hadamard", "block_size": b}} in the "microscale"
# object of quantization_config (formats/checkpoint.py). Absent means no rotation.
ROTATION_CONFIG_KEY = "rotation"
ROTATION_TYPE = "block_hadamard"
ROTATION_BLOCKS = (16, 32)  # the block sizes of NVFP4 and MX


def hadamard_matrix(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [n, n] (n a power of two): symmetric and orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


def _check_k(k: int, block: int, name: str) -> None:
    if k % block:
        raise ValueError(f"{name}: K={k} is not a multiple of the rotation block {block}")


def rotate(x: torch.Tensor, block: int, matrix: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] -> x R: every `block`-wide slice of the last dim times Hb (in x's dtype).

    The same call rotates a weight W [N, K] offline and the activations at run time; applied twice
    it gives x back (R R = I). matrix: hadamard_matrix(block) on x's device, kept by a layer so that
    no matrix is built (and copied to the GPU) per call.
    """
    k = x.shape[-1]
    _check_k(k, block, f"rotate (shape {tuple(x.shape)})")
    h = hadamard_matrix(block, dtype=x.dtype, device=x.device) if matrix is None else matrix.to(x.dtype)
    return (x.reshape(*x.shape[:-1], k // block, block) @ h).reshape(x.shape)


def rotate_hessian(h: torch.Tensor, block: int) -> torch.Tensor:
    """H = E[x^T x] [K, K] of the original inputs -> R^T H R, that of the rotated inputs x R."""
    k = h.shape[0]
    _check_k(k, block, f"rotate_hessian (shape {tuple(h.shape)})")
    return rotate(rotate(h, block).transpose(0, 1), block).transpose(0, 1)


def rotation_config(block: int) -> dict:
    """The checkpoint config entry value that records a block-wise Hadamard rotation."""
    return {"type": ROTATION_TYPE, "block_size": int(block)}


def rotation_block_from_config(quantization_config: dict):
    """Rotation block size recorded in a checkpoint's quantization_config, or None.

    Raises for a rotation this library does not know, so the checkpoint is refused rather than run
    without its rotation.
    """
    entry = quantization_config.get(ROTATION_CONFIG_KEY)
    if entry is None:
        return None
    ok = isinstance(entry, dict) and entry.get("type") == ROTATION_TYPE
    block = entry.get("block_size") if ok else None
    if not isinstance(block, int) or block not in ROTATION_BLOCKS:
        raise ValueError(f"unsupported rotation in the checkpoint's quantization_config: {entry!r} "
                         f"(supported: type {ROTATION_TYPE!r}, block_size 16 or 32)")
    return block
