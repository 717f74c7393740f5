"""Nibble packing and the 128x4 swizzled scale layout."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from microscale.formats import (
    as_float4_x2,
    e2m1_encode,
    pack_fp4,
    swizzle_scales_128x4,
    swizzled_scale_offset,
    swizzled_scale_shape,
    unpack_fp4,
    unswizzle_scales_128x4,
)
from spec_reference import swizzle_offset


def test_pack_worked_vector_low_nibble_is_even_k():
    codes = e2m1_encode(torch.tensor([[0.5, -6.0]]))
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0xF1]]
    assert as_float4_x2(packed).dtype == torch.float4_e2m1fn_x2


def test_pack_unpack_roundtrip_and_bit_positions(seed):
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(packed, (codes[:, 0::2] + 16 * codes[:, 1::2]).to(torch.uint8))
    assert torch.equal(unpack_fp4(packed), codes)


def test_swizzle_offsets_worked_examples():
    assert swizzled_scale_offset(1, 0, 8) == 16
    assert swizzled_scale_offset(32, 0, 8) == 4
    assert swizzled_scale_offset(0, 1, 8) == 1
    assert swizzled_scale_offset(0, 4, 8) == 512
    assert swizzled_scale_offset(128, 0, 38) == (40 // 4) * 512  # 38 columns pad to 40


def _check_placement(rows, cols):
    r_ids = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, cols)
    c_ids = torch.arange(cols, dtype=torch.int32)[None, :].expand(rows, cols)
    ones = torch.ones(rows, cols, dtype=torch.uint8)
    swz_r = swizzle_scales_128x4((r_ids % 256).to(torch.uint8)).flatten().numpy()
    swz_c = swizzle_scales_128x4(c_ids.to(torch.uint8)).flatten().numpy()
    swz_1 = swizzle_scales_128x4(ones).flatten().numpy()
    rp, cp = swizzled_scale_shape(rows, cols)
    assert swz_1.size == rp * cp and rp % 128 == 0 and cp % 4 == 0
    offs = np.array([[swizzle_offset(r, c, cols) for c in range(cols)] for r in range(rows)])
    assert np.array_equal(swz_r[offs], (r_ids % 256).numpy())
    assert np.array_equal(swz_c[offs], c_ids.numpy())
    assert swz_1.sum() == rows * cols  # padding is zero


def test_swizzle_places_every_scale_at_the_spec_offset():
    for rows, cols in [(1, 1), (128, 4), (130, 9), (300, 36), (256, 40)]:
        _check_placement(rows, cols)


def test_swizzle_matches_torchao_to_blocked_derivation(seed):
    """Independent derivation: torchao's to_blocked permutation, written from the spec."""
    rows, cols = 257, 13
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    rp, cp = swizzled_scale_shape(rows, cols)
    padded = torch.zeros(rp, cp, dtype=torch.uint8)
    padded[:rows, :cols] = s
    blocked = (padded.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4)
               .transpose(1, 2).reshape(-1, 32, 16).flatten())
    assert torch.equal(swizzle_scales_128x4(s).flatten(), blocked)


def test_swizzle_keeps_fp8_dtype():
    s = torch.rand(5, 3).to(torch.float8_e4m3fn)
    swz = swizzle_scales_128x4(s)
    assert swz.dtype == torch.float8_e4m3fn and swz.shape == (128, 4)
    assert torch.equal(unswizzle_scales_128x4(swz, 5, 3).view(torch.uint8), s.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 400), cols=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_unswizzle_inverts_swizzle(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    assert torch.equal(unswizzle_scales_128x4(swizzle_scales_128x4(s), rows, cols), s)


def test_same_codes_and_scales_compares_every_byte(seed):
    import microscale as ms

    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        q = ms.quantize(torch.randn(8, 64), fmt)
        assert q.same_codes_and_scales(q.replace(data=q.data.clone(), scale=q.scale.clone()))
        for field in ("data", "scale"):
            flipped = getattr(q, field).clone()
            raw = flipped.view(torch.uint8).view(-1)
            i = int(torch.randint(raw.numel(), ()))
            raw[i] ^= 0x01  # one bit of one byte
            assert not q.same_codes_and_scales(q.replace(**{field: flipped})), (fmt, field, i)
