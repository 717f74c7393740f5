"""Reference quantizers against the independent numpy reference, bit for bit."""

import numpy as np
import pytest
import torch

import microscale as ms
from microscale.formats import ScaleMode, unpack_fp4
from spec_reference import quantize_mx, quantize_nvfp4


def _inputs(kind: str, shape, g: torch.Generator) -> torch.Tensor:
    n, k = shape
    if kind == "gaussian":
        return torch.randn(n, k, generator=g)
    if kind == "heavy_tailed":  # Student-t with 2 degrees of freedom: outliers
        z = torch.randn(n, k, generator=g)
        chi = torch.randn(n, k, 2, generator=g).pow(2).sum(-1)
        return z / (chi / 2).sqrt()
    if kind == "rows_over_40_binades":
        return torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 21, (n, 1), generator=g).float())
    if kind == "zero_blocks":
        x = torch.randn(n, k, generator=g)
        x[:, : k // 2] = 0
        x[0] = 0
        return x
    if kind == "subnormal":
        return torch.randn(n, k, generator=g) * 2.0**-135
    if kind == "huge":
        return torch.randn(n, k, generator=g) * 1e36
    raise ValueError(kind)


KINDS = ["gaussian", "heavy_tailed", "rows_over_40_binades", "zero_blocks", "subnormal", "huge"]
SHAPES = [(33, 64), (7, 100), (130, 37)]  # K ragged against 16 and 32


def _codes(q):
    return (unpack_fp4(q.data) if q.fmt.packed else q.data.view(torch.uint8)).numpy()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", list(ScaleMode), ids=lambda m: m.value)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_quantize_bit_exact(fmt, mode, kind, shape, seed):
    x = _inputs(kind, shape, torch.Generator().manual_seed(seed))
    q = ms.quantize(x, fmt, scale_mode=mode)
    spec = ms.get_format(fmt)
    codes, exps = quantize_mx(x.numpy(), spec.block, spec.elem, mode.value)
    assert np.array_equal(q.scale.numpy(), exps)
    assert np.array_equal(_codes(q), codes)


def test_mxfp4_sign_of_elements_that_round_to_zero():
    """Hand-computed: amax 6 * 2**122 gives the block 2**122 (e8m0 249). -2**120 quotes -0.25, a tie that rounds to
    the even -0 and keeps the sign bit (0x8); -2**-30 quotes -2**-152, which underflows float32 to -0.0 and is coded
    as +0 like -0.0 itself (the float32 quotient's sign, as for NVFP4); 3 * 2**122 is 3.0 (code 5)."""
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([6 * 2.0**122, -2.0**120, -2.0**-30, -0.0, 3 * 2.0**122])
    q = ms.quantize(x, "mxfp4", scale_mode=ScaleMode.RCEIL)
    assert q.scale.view(torch.uint8)[0, 0].item() == 249
    assert _codes(q)[0, :5].tolist() == [7, 8, 0, 0, 5]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", ms.quant.NVFP4_RECIPES)
def test_nvfp4_quantize_bit_exact(recipe, kind, shape, seed):
    x = _inputs(kind, shape, torch.Generator().manual_seed(seed))
    if kind == "huge":
        x = x * 1e-6  # the tensor amax must fit float32 after * 6 * 448 scaling
    q = ms.quantize(x, "nvfp4", recipe=recipe)
    codes, scales, g = quantize_nvfp4(x.numpy(), recipe)
    assert q.global_scale.item() == g
    assert np.array_equal(q.scale.view(torch.uint8).numpy(), scales)
    assert np.array_equal(_codes(q), codes)


@pytest.mark.parametrize("recipe", ms.quant.NVFP4_RECIPES)
def test_nvfp4_given_global_scale_bit_exact(recipe, seed):
    x = torch.randn(64, 96) * 3
    given = torch.tensor(37.5)  # deliberately not 2688/amax: some blocks clamp at 448
    q = ms.quantize(x, "nvfp4", recipe=recipe, global_scale=given)
    codes, scales, g = quantize_nvfp4(x.numpy(), recipe, global_encode=37.5)
    assert q.global_scale.item() == g
    assert np.array_equal(q.scale.view(torch.uint8).numpy(), scales)
    assert np.array_equal(_codes(q), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_half_precision_inputs_quantize_as_their_float32_values(fmt, dtype, seed):
    x = torch.randn(16, 64).to(dtype)
    a, b = ms.quantize(x, fmt), ms.quantize(x.float(), fmt)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert a.orig_dtype == dtype


def test_compressed_tensors_zero_and_tiny_blocks():
    x = torch.zeros(2, 32)
    x[1, 16] = 1.0
    x[1, 0] = 1e-9  # block scale rounds to 0 in e4m3 -> 0.125
    q = ms.quantize(x, "nvfp4")
    s = q.scale.float()
    assert s[0].tolist() == [0.125, 0.125]  # an all-zero tensor: global 1.0, zero blocks 0.125
    assert q.global_scale.item() == 2688.0
    assert s[1, 0].item() == 0.125 and s[1, 1].item() == 448.0
    assert ms.dequantize(q)[1, 16].item() == 1.0 and ms.dequantize(q)[1, 0].item() == 0.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_ragged_k_pads_with_zeros_and_dequantizes_to_logical_shape(fmt, seed):
    x = torch.randn(5, 37)
    q = ms.quantize(x, fmt)
    assert q.shape == (5, 37)
    assert ms.dequantize(q).shape == (5, 37)
    codes = _codes(q)
    assert codes.shape[1] % q.fmt.block == 0 and codes.shape[1] > 37
    assert (codes[:, 37:] == 0).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_swizzled_and_linear_scales_hold_the_same_quantization(fmt, seed):
    x = torch.randn(200, 96)
    lin, swz = ms.quantize(x, fmt), ms.quantize(x, fmt, scale_layout="swizzled")
    assert swz.scale.shape == (256, 8 if fmt == "nvfp4" else 4)
    assert torch.equal(swz.linear_scale().view(torch.uint8), lin.scale.view(torch.uint8))
    assert torch.equal(swz.dequantize(), lin.dequantize())


def test_non_finite_input_error_counts_and_locates():
    x = torch.randn(4, 32)
    x[2, 5] = float("nan")
    x[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"2 non-finite .* first at index \(2, 5\)"):
        ms.quantize(x, "nvfp4")


@pytest.mark.parametrize(
    "args, err, msg",
    [
        ((torch.randn(4, 32), "nvfp5"), ValueError, "accepted: nvfp4, mxfp4, mxfp8"),
        ((torch.randint(0, 5, (4, 32)), "nvfp4"), TypeError, "accepted: torch.float32"),
        ((torch.randn(32), "mxfp4"), ValueError, r"2-D tensor \[N, K\], got shape \(32,\)"),
        ((torch.randn(2, 4, 32), "mxfp8"), ValueError, "got shape"),
        ((torch.zeros(0, 32), "mxfp8"), ValueError, "non-empty"),
        (([[1.0]], "mxfp8"), TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs_get_clear_errors(args, err, msg):
    with pytest.raises(err, match=msg):
        ms.quantize(*args)


def test_bad_options_get_clear_errors():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="unknown NVFP4 recipe 'foo'; accepted"):
        ms.quantize(x, "nvfp4", recipe="foo")
    with pytest.raises(ValueError, match="mxfp4 has no global scale"):
        ms.quantize(x, "mxfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        ms.quantize(x, "nvfp4", global_scale=0.0)
    with pytest.raises(ValueError, match="'bogus' is not a valid ScaleMode"):
        ms.quantize(x, "mxfp8", scale_mode="bogus")


def test_qtensor_rejects_inconsistent_fields():
    q = ms.quantize(torch.randn(8, 64), "nvfp4")
    with pytest.raises(ValueError, match=r"data must be torch.uint8 of shape \[8, 32\]"):
        q.replace(data=q.data[:, :16])
    with pytest.raises(ValueError, match=r"linear scale must be torch.float8_e4m3fn of shape \[8, 4\]"):
        q.replace(scale=q.scale.view(torch.uint8))
    with pytest.raises(ValueError, match="global_scale must be a float32 scalar"):
        q.replace(global_scale=None)
    with pytest.raises(ValueError, match="swizzled scale must be"):
        q.replace(scale_layout="swizzled")
