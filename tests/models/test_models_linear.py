"""FP4Linear / FP8Linear: forward against a float64 product with the dequantized weight, buffers,
state_dict and meta-device loading, the custom op, errors."""

import copy
import io

import pytest
import torch
from torch import nn

from microscale import FP4Linear, FP8Linear
from microscale.kernels.dispatch import linear as dispatch_linear
from microscale.models.linear import quantized_linear_class
from microscale.quant import quantize

# |y - y_ref| <= BOUND[dtype] * (|x| @ |W|^T + |b|) elementwise, with y_ref the float64 product of the
# same input and the dequantized weight. fp32: accumulation error over K <= 100 terms. bf16/fp16:
# the weight rounded to the input dtype (2^-9 relative) and the output rounding (2^-9), with a 2x margin.
BOUND = {torch.float32: 2.0**-16, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-7}


def make_layer(fmt, k=80, n=40, bias=True, activations=None):
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-3, 1, k))  # columns over four decades: blocks with different scales
    return linear, quantized_linear_class(fmt).from_linear(linear, fmt, activations=activations)


def reference_product(x, layer, x_dequantized=None):
    w = layer.qweight.dequantize(torch.float64)
    x64 = (x if x_dequantized is None else x_dequantized).double()
    b = layer.bias.double() if layer.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    y = x64 @ w.t() + b
    scale = x64.abs() @ w.abs().t() + b.abs()
    return y, scale


def assert_within_bound(y, x, layer, x_dequantized=None):
    y_ref, scale = reference_product(x, layer, x_dequantized)
    err = (y.double() - y_ref).abs()
    limit = BOUND[x.dtype] * scale + 1e-30
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3e} exceeds the bound by {worst:.2f}x"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (2, 3, 4)])
def test_forward_matches_dequantized_product(seed, fmt, dtype, lead):
    _, layer = make_layer(fmt, k=72)  # K=72: zero-padded to the block for every format
    x = torch.randn(*lead, 72).to(dtype)
    y = layer(x)
    assert y.shape == (*lead, 40) and y.dtype == dtype
    assert_within_bound(y.reshape(-1, 40), x.reshape(-1, 72), layer)
    # one dispatch call: the same result as dispatch.linear on the QTensor
    assert torch.equal(y.reshape(-1, 40), dispatch_linear(x.reshape(-1, 72), layer.qweight, layer.bias))


def test_forward_edge_inputs(seed, fmt):
    _, layer = make_layer(fmt)
    zeros = torch.zeros(4, 80)
    assert torch.equal(layer(zeros), layer.bias.expand(4, -1))
    huge = torch.randn(2, 80) * 1e30
    assert_within_bound(layer(huge), huge, layer)
    x = torch.randn(3, 80)
    x[1, 7] = float("inf")  # a non-finite input poisons its own row only
    finite = torch.isfinite(layer(x))
    assert finite[0].all() and finite[2].all() and not finite[1].all()
    assert layer(torch.zeros(0, 80)).shape == (0, 40)


def test_quantized_activations_match_quantize_dequantize(seed, fmt):
    _, layer = make_layer(fmt, activations=fmt)
    x = torch.randn(6, 80) * torch.logspace(-2, 2, 80)
    y = layer(x)
    xq = quantize(x, fmt).dequantize()
    assert_within_bound(y, x, layer, x_dequantized=xq)
    y_float = layer.from_qtensor(layer.qweight, layer.bias)(x)
    assert not torch.allclose(y, y_float), "activations were not quantized"


def test_no_bias_and_from_qtensor_any_scale_layout(seed, fmt):
    linear, _ = make_layer(fmt, bias=False)
    q = quantize(linear.weight.detach(), fmt, scale_layout="swizzled")
    layer = quantized_linear_class(fmt).from_qtensor(q)
    assert layer.bias is None
    assert torch.equal(layer.weight_scale, q.linear_scale())
    x = torch.randn(5, 80)
    assert_within_bound(layer(x), x, layer)


def test_state_dict_roundtrip_and_meta_load(seed, fmt):
    _, layer = make_layer(fmt)
    sd = layer.state_dict()
    want = {"weight_data", "weight_scale", "bias"} | ({"weight_global_scale"} if fmt == "nvfp4" else set())
    assert set(sd) == want  # prepared tensors are not persistent
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    cls = quantized_linear_class(fmt)
    x = torch.randn(3, 80)

    fresh = cls(80, 40, fmt=fmt)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh(x), layer(x))

    on_meta = cls(80, 40, fmt=fmt, device="meta")
    on_meta.load_state_dict(loaded, assign=True)
    assert not any(t.is_meta for t in on_meta.buffers())
    assert on_meta.backend == layer.backend
    assert torch.equal(on_meta(x), layer(x))


def test_meta_model_load_with_assign(seed, fmt):
    from microscale import quantize_model

    def build():
        return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))

    model = build()
    quantize_model(model, fmt, progress=False)
    with torch.device("meta"):
        skeleton = build()
    quantize_model(skeleton, fmt, progress=False)  # structure only: all-zero layers on meta
    skeleton.load_state_dict(model.state_dict(), assign=True)
    x = torch.randn(4, 64)
    assert torch.equal(skeleton(x), model(x))


def test_to_dtype_moves_bias_only(seed, fmt):
    _, layer = make_layer(fmt)
    before = {n: b.clone() for n, b in layer.state_dict().items()}
    layer.to(torch.bfloat16)
    for name in ("weight_data", "weight_scale", "weight_global_scale"):
        if name in before:
            assert getattr(layer, name).dtype == before[name].dtype
            assert torch.equal(getattr(layer, name), before[name])
    assert layer.bias.dtype == torch.bfloat16
    assert layer.prepared_data is not None and layer.backend == "reference"
    x = torch.randn(2, 80, dtype=torch.bfloat16)
    assert_within_bound(layer(x), x, layer)
    clone = copy.deepcopy(layer)
    assert torch.equal(clone(x), layer(x))


def test_extra_repr(fmt):
    _, layer = make_layer(fmt, k=72)
    r = repr(layer)
    assert f"fmt={fmt}" in r and "in_features=72" in r and "out_features=40" in r and "backend=reference" in r
    assert "padded to" in r


def test_custom_op_opcheck(seed, fmt):
    _, layer = make_layer(fmt, activations="nvfp4" if fmt == "nvfp4" else None)
    x = torch.randn(3, 80)
    args = (x, layer.prepared_data, layer.prepared_scale, layer.prepared_global_scale, layer.bias, fmt, 40, 80,
            layer.backend, layer.activations)
    # opcheck's schema test cannot compare float8 tensors, so non-mutation and non-aliasing of
    # the inputs are checked here directly for every format.
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.microscale.linear.default, args, test_utils=tests)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    y = torch.ops.microscale.linear(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            assert a.data_ptr() != y.data_ptr()


def test_dynamo_fullgraph_equals_eager(seed, fmt):
    _, layer = make_layer(fmt)
    x = torch.randn(2, 3, 80)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_errors():
    with pytest.raises(ValueError, match="FP4Linear holds 4-bit formats; mxfp8"):
        FP4Linear(32, 8, fmt="mxfp8")
    with pytest.raises(ValueError, match="FP8Linear holds 8-bit formats; nvfp4"):
        FP8Linear(32, 8, fmt="nvfp4")
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        FP4Linear(32, 8, fmt="int4")
    with pytest.raises(ValueError, match="unknown format 'int8'"):
        FP4Linear(32, 8, activations="int8")
    with pytest.raises(TypeError, match="expected an nn.Linear, got Conv1d"):
        FP4Linear.from_linear(nn.Conv1d(4, 4, 1))
    layer = FP4Linear.from_linear(nn.Linear(32, 8))
    with pytest.raises(ValueError, match=r"input of shape \(2, 16\) does not match in_features=32"):
        layer(torch.randn(2, 16))
    with pytest.raises(TypeError, match="input dtype torch.int64 not accepted"):
        layer(torch.ones(2, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="bias of shape"):
        FP4Linear.from_qtensor(layer.qweight, torch.zeros(5))
    bad = layer.state_dict()
    bad["weight_data"] = bad["weight_data"][:, :8]
    with pytest.raises(RuntimeError, match="weight_data"):
        FP4Linear(32, 8).load_state_dict(bad)


def test_fused_layer_is_the_separate_layers_side_by_side(seed, fmt):
    """q/k/v-like layers quantized with one NVFP4 global scale fuse into one layer: its weight dequantizes
    to the concatenated weights bit for bit, and its output is theirs side by side (the same float64
    bound; the sums may run in another order)."""
    from microscale import fuse_linears
    from microscale.quant.reference import nvfp4_global_scale

    linears = [nn.Linear(72, n, bias=b) for n, b in ((40, True), (24, False), (8, True))]
    shared = nvfp4_global_scale(torch.cat([m.weight for m in linears]).detach()) if fmt == "nvfp4" else None
    layers = [quantized_linear_class(fmt).from_linear(m, fmt, global_scale=shared) for m in linears]
    fused = fuse_linears(layers)
    assert (fused.in_features, fused.out_features, type(fused)) == (72, 72, type(layers[0]))
    assert torch.equal(fused.qweight.dequantize(), torch.cat([m.qweight.dequantize() for m in layers]))
    assert torch.equal(fused.bias, torch.cat([layers[0].bias, torch.zeros(24), layers[2].bias]))
    x = torch.randn(3, 5, 72)
    y = fused(x)
    assert_within_bound(y.reshape(-1, 72), x.reshape(-1, 72), fused)
    separate = torch.cat([m(x) for m in layers], -1)
    assert torch.allclose(y, separate, rtol=1e-5, atol=1e-5 * separate.abs().max().item())


def test_fuse_errors():
    from microscale import fuse_linears

    a, b = FP4Linear.from_linear(nn.Linear(32, 8)), FP4Linear.from_linear(nn.Linear(32, 8))  # own global scales
    with pytest.raises(ValueError, match="tensor 1 has NVFP4 global scale .* rows under different global scales"):
        fuse_linears([a, b])
    with pytest.raises(ValueError, match="layer 1 is a FP4Linear with in_features=64, layer 0 a FP4Linear with 32"):
        fuse_linears([a, FP4Linear.from_linear(nn.Linear(64, 8))])
    with pytest.raises(ValueError, match="layer 1 is a FP8Linear"):
        fuse_linears([FP4Linear.from_linear(nn.Linear(32, 8), "mxfp4"), FP8Linear.from_linear(nn.Linear(32, 8))])
    with pytest.raises(ValueError, match="layer 1 has activations='mxfp4', layer 0 None"):
        fuse_linears([FP4Linear.from_linear(nn.Linear(32, 8), "mxfp4"),
                      FP4Linear.from_linear(nn.Linear(32, 8), "mxfp4", activations="mxfp4")])
    with pytest.raises(TypeError, match=r"expected quantized layers, got \['FP4Linear', 'Linear'\]"):
        fuse_linears([a, nn.Linear(32, 8)])


def test_fused_gated_layer_gives_silu_of_gate_times_up(seed, fmt):
    """gate/up layers with one NVFP4 global scale fuse into one layer of gate/up row pairs: its weight holds
    their rows in the pair order of kernels/gated.py bit for bit, and its output is silu(gate(x)) * up(x) against
    float64 from the separate layers' dequantized weights (bound: each product's BOUND, through silu's slope of
    at most 1.1, plus the output rounding)."""
    from microscale import fuse_gated
    from microscale.kernels.gated import interleave_index
    from microscale.quant.reference import nvfp4_global_scale

    linears = [nn.Linear(72, 24, bias=True), nn.Linear(72, 24, bias=False)]
    shared = nvfp4_global_scale(torch.cat([m.weight for m in linears]).detach()) if fmt == "nvfp4" else None
    gate, up = (quantized_linear_class(fmt).from_linear(m, fmt, global_scale=shared) for m in linears)
    fused = fuse_gated(gate, up)
    assert (fused.in_features, fused.out_features, fused.epilogue) == (72, 48, "silu_mul")
    rows = torch.cat([gate.qweight.dequantize(), up.qweight.dequantize()])
    assert torch.equal(fused.qweight.dequantize(), rows[interleave_index(24)])
    assert "epilogue=silu_mul" in repr(fused)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 72).to(dtype)
        y = fused(x)
        assert y.shape == (3, 5, 24) and y.dtype == dtype
        (g, g_err), (u, u_err) = (reference_product(x.reshape(-1, 72), m) for m in (gate, up))
        g_err, u_err = BOUND[dtype] * g_err, BOUND[dtype] * u_err
        silu = g / (1 + torch.exp(-g))
        want = silu * u
        limit = 1.1 * g_err * u.abs() + silu.abs() * u_err + g_err * u_err + 2.0**-8 * want.abs() + 1e-30
        worst = ((y.reshape(-1, 24).double() - want).abs() / limit).max().item()
        assert worst <= 1.0, f"{dtype}: error {worst:.2f}x the bound"


def test_fused_gated_state_dict_and_errors(seed):
    from microscale import fuse_gated, save_quantized
    from microscale.quant.reference import nvfp4_global_scale

    linears = [nn.Linear(32, 16), nn.Linear(32, 16)]
    shared = nvfp4_global_scale(torch.cat([m.weight for m in linears]).detach())
    gate, up = (FP4Linear.from_linear(m, global_scale=shared) for m in linears)
    fused = fuse_gated(gate, up)
    again = FP4Linear(32, 32, epilogue="silu_mul", device="meta")
    again.load_state_dict(fused.state_dict(), assign=True)
    x = torch.randn(4, 32)
    assert torch.equal(again(x), fused(x))
    with pytest.raises(ValueError, match="gate has out_features=16, up 8"):
        fuse_gated(gate, FP4Linear.from_linear(nn.Linear(32, 8), global_scale=shared))
    with pytest.raises(ValueError, match="12 gate rows is not a multiple of 8"):
        fuse_gated(*(FP4Linear.from_linear(nn.Linear(32, 12), "mxfp4") for _ in range(2)))
    with pytest.raises(ValueError, match="a layer of gate/up pairs .* cannot be fused again"):
        fuse_gated(fused, fused)
    with pytest.raises(ValueError, match="epilogue='silu_mul' needs gate/up row pairs, out_features a multiple of 16"):
        FP4Linear(32, 24, epilogue="silu_mul")
    with pytest.raises(ValueError, match="unknown epilogue 'relu'"):
        FP4Linear(32, 32, epilogue="relu")
    with pytest.raises(ValueError, match="mlp is a fused gate/up layer"):
        save_quantized(nn.ModuleDict({"mlp": fused}), "/nonexistent/never-written")
