"""Nibble packing of E2M1 codes along K.

byte[i] = q[2i] | q[2i+1] << 4: the even K index sits in the low nibble. This is the
order of the tcgen05 kind::mxf4* operands, cuBLAS, CUTLASS, compressed-tensors, ModelOpt,
torchao and gpt-oss, and of torch.float4_e2m1fn_x2.
"""

import torch


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K] (uint8 0..15, K even) -> packed bytes [..., K/2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., K/2] -> E2M1 codes [..., K]."""
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def as_float4_x2(packed: torch.Tensor) -> torch.Tensor:
    """View packed bytes as torch.float4_e2m1fn_x2 (what torch._scaled_mm takes)."""
    return packed.view(torch.float4_e2m1fn_x2)
