"""Element and scale codecs against bit definitions written from the spec (tests/spec_reference.py)."""

import math

import numpy as np
import pytest
import torch

from microscale.formats import (
    MXFP4,
    MXFP8,
    ScaleMode,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    e8m0_from_amax,
)
from spec_reference import e2m1_code, e2m1_value, e4m3_code, e4m3_value, mx_exponent


def test_e2m1_all_16_codes_decode_and_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    for c in range(16):
        assert values[c].item() == e2m1_value(c)
    assert torch.signbit(values[8])  # 0x8 is -0
    back = e2m1_encode(values)
    want = codes.clone()
    want[8] = 0  # -0.0 encodes as +0 (sign bit only for strictly negative values)
    assert torch.equal(back, want)


@pytest.mark.parametrize(
    "x, code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
     (-0.25, 8), (-0.75, 10), (-5.0, 14), (0.2500001, 1), (4.9999995, 6), (5.0000005, 7),
     (6.0, 7), (7.0, 7), (1e30, 7), (-1e30, 15), (0.1, 0), (-0.1, 8), (-0.0, 0), (0.0, 0)],
)
def test_e2m1_ties_to_even_saturation_and_signed_zero(x, code):
    assert e2m1_encode(torch.tensor([x], dtype=torch.float32)).item() == code


def test_e2m1_encode_matches_reference_on_dense_random_values(seed):
    x = torch.cat([torch.randn(20000) * 3, (torch.rand(20000) - 0.5) * 16,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).repeat(2) * torch.tensor([1.0, -1.0]).repeat_interleave(7)])
    assert np.array_equal(e2m1_encode(x).numpy(), e2m1_code(x.numpy()))


def test_e4m3_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e4m3_decode(codes.view(torch.float8_e4m3fn))
    for c in range(256):
        ref = e4m3_value(c)
        if math.isnan(ref):
            assert math.isnan(values[c].item()), c
        else:
            assert values[c].item() == ref, c
            assert e4m3_encode(values[c : c + 1]).view(torch.uint8).item() == c


def test_e4m3_midpoints_tie_to_even_and_saturate():
    finite = np.array([e4m3_value(c) for c in range(0x7F)])
    mids = torch.tensor((finite[:-1] + finite[1:]) / 2, dtype=torch.float32)
    got = e4m3_encode(mids).view(torch.uint8).numpy()
    lower = np.arange(0x7E)
    want = np.where(lower % 2 == 0, lower, lower + 1)
    assert np.array_equal(got, want)
    big = torch.tensor([449.0, 464.0, 1e10, float("inf"), -1e10, float("-inf")])
    assert e4m3_decode(e4m3_encode(big)).tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    assert torch.isnan(e4m3_decode(e4m3_encode(torch.tensor([float("nan")])))).all()


def test_e4m3_encode_matches_reference_including_subnormals(seed):
    x = torch.cat([torch.randn(20000) * 100, torch.randn(5000) * 2.0**-8, torch.randn(100) * 1e-30])
    got = e4m3_encode(x).view(torch.uint8).numpy()
    assert np.array_equal(got, e4m3_code(x.numpy()))


def test_e8m0_all_256_codes():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_decode(b)
    for i in range(255):
        assert v[i].item() == 2.0 ** (i - 127), i
    assert torch.isnan(v[255])
    assert v[0].item() == 2.0**-127 and v[0].item() != 0.0


@pytest.mark.parametrize("spec", [MXFP4, MXFP8], ids=lambda s: s.name)
@pytest.mark.parametrize("mode", list(ScaleMode), ids=lambda m: m.value)
def test_mx_shared_exponent_matches_spec(spec, mode, seed):
    mant = torch.rand(4000) + 0.5
    amax = mant * torch.exp2(torch.randint(-140, 128, (4000,)).float())
    pow2s = torch.exp2(torch.arange(-149, 128).float())
    edges = torch.tensor([0.0, 6.0, 7.0, 448.0, 449.0, 3.0, 5.999, 2.0**-149, 1.7e38])
    amax = torch.cat([amax, pow2s, pow2s * 1.5, pow2s * 0.75, edges]).float()
    amax = amax[torch.isfinite(amax)]
    got = e8m0_from_amax(amax, spec, mode).numpy()
    want = mx_exponent(amax.numpy(), spec.elem_max, spec.elem_emax, spec.elem_mbits, mode.value)
    assert np.array_equal(got, want)


def test_mx_exponent_worked_examples_and_special_values():
    seven = torch.tensor([7.0])
    assert e8m0_from_amax(seven, MXFP4, "floor").item() == 127  # 7 -> clipped to 6
    assert e8m0_from_amax(seven, MXFP4, "rceil").item() == 128  # 7/2 = 3.5 -> 4
    special = torch.tensor([float("nan"), float("inf"), 0.0])
    for mode in ScaleMode:
        assert e8m0_from_amax(special, MXFP8, mode).tolist() == [255, 254, 0]
