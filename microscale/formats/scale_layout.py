"""Scale layouts: linear [rows, cols] and the 128x4 swizzled tile layout.

The swizzled layout is the one cuBLAS, CUTLASS (SfKMajorAtom), torchao (to_blocked),
FlashInfer (SWIZZLED_128x4) and tcgen05 read. Rows are padded to a multiple of 128 and
scale columns to a multiple of 4, with zeros. Scale (r, c) sits at byte

    (r // 128) * (Cp / 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

so each 512-byte atom holds 128 rows x 4 scale columns, atoms ordered K-fastest, and the
four scales of one row in an atom form one 32-bit word (one TMEM cell). Triton reads the
same bytes as a 5-D tensor (rows/128, cols/4, 32, 4, 4).

Swizzled scales are stored as a 2-D tensor [Rp, Cp] whose row-major bytes are that order.
"""

import torch

ROW_TILE = 128
COL_TILE = 4


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_scale_shape(rows: int, cols: int) -> tuple:
    """Padded [Rp, Cp] shape of a swizzled scale table for a [rows, cols] linear one."""
    return _ceil_to(rows, ROW_TILE), _ceil_to(cols, COL_TILE)


def swizzled_scale_offset(r: int, c: int, cols: int) -> int:
    """Byte offset of scale (r, c) in the swizzled layout of a table with `cols` columns."""
    cp = _ceil_to(cols, COL_TILE)
    return (r // 128) * (cp // 4) * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear [rows, cols] -> swizzled [Rp, Cp] (zero padded), same dtype."""
    if scales.dim() != 2:
        raise ValueError(f"swizzle_scales_128x4: expected a 2-D scale tensor, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    rp, cp = swizzled_scale_shape(rows, cols)
    raw = scales.view(torch.uint8)
    padded = torch.zeros(rp, cp, dtype=torch.uint8, device=scales.device)
    padded[:rows, :cols] = raw
    # (a, b, d, k, j) with r = 128a + 32b + d and c = 4k + j  ->  (a, k, d, b, j)
    tiled = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiled.reshape(rp, cp).view(scales.dtype)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled [Rp, Cp] -> linear [rows, cols], same dtype."""
    rp, cp = swizzled_scale_shape(rows, cols)
    if tuple(swizzled.shape) != (rp, cp):
        raise ValueError(
            f"unswizzle_scales_128x4: swizzled scales of shape {tuple(swizzled.shape)} do not fit "
            f"a [{rows}, {cols}] table (expected [{rp}, {cp}])"
        )
    raw = swizzled.contiguous().view(torch.uint8)
    linear = raw.view(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return linear[:rows, :cols].contiguous().view(swizzled.dtype)
