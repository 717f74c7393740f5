"""Static NVFP4 input scales: FP4Linear holding one, calibrating them, and checkpoints that keep them
(compressed-tensors input_global_scale, ModelOpt input_scale).

Expected activations come from tests/spec_reference.py (numpy, independent of microscale)."""

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import spec_reference as ref
from ckpt_helpers import e2m1_table, e4m3_table, modelopt_nvfp4, tiny_llama, write_modelopt
from microscale.formats.checkpoint import load_checkpoint
from microscale.kernels.ops import quantize_dequantize_activations
from microscale.models.linear import FP4Linear, QuantizedLinear
from microscale.models.quantize_model import quantize_model
from microscale.models.serialization import load_quantized, save_quantized
from microscale.quant import quantize
from microscale.quant.calibration import calibrate_input_scales


def encode_scale(amax: float) -> float:
    """compressed-tensors' encode scale 2688 / amax, in float32."""
    return float(np.float32(2688.0) / np.float32(amax))


def spec_fake_quant(x: torch.Tensor, g: float) -> torch.Tensor:
    """x [M, K] quantized to NVFP4 with the encode global scale g and dequantized (float64), by the
    numpy spec reference (compressed-tensors recipe)."""
    xn = x.float().numpy()
    codes, scales, g_out = ref.quantize_nvfp4(xn, "compressed-tensors", global_encode=g)
    m, k = xn.shape
    deq = e2m1_table()[codes].reshape(m, -1, 16) * e4m3_table()[scales][..., None] / float(g_out)
    return torch.from_numpy(deq.reshape(m, -1)[:, :k])


def quantized_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


# ---- the layer --------------------------------------------------------------------------------------
def test_saturation_beyond_the_static_scale(seed):
    """Hand-computed: g = 1344 covers |x| <= 2. Block 0 holds +-1e4: its scale saturates at 448, so its
    step is 448 / 1344 = 1/3 and +-1e4 clamp to +-6 steps = +-2; 1.0 is exactly 3 steps. Block 1
    (amax 0.5) is in range: scale 0.5 / 6 * 1344 = 112, 0.5 is 6 steps."""
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([1e4, -1e4, 1.0])
    x[0, 16] = 0.5
    x[1] = torch.randn(32) * 0.3
    g = torch.tensor(1344.0)
    q = quantize(x, "nvfp4", global_scale=g)
    assert q.scale.view(torch.uint8)[0].tolist() == [0x7E, 0x6E]  # E4M3 448 (saturated) and 112 = 1.75 * 2**6
    want = torch.zeros(32)
    want[:3] = torch.tensor([2.0, -2.0, 1.0])
    want[16] = 0.5
    got = quantize_dequantize_activations(x, "nvfp4", g)
    assert torch.equal(got[0], want)
    # q * (s / g) in float32 against float64: equal to float32 rounding
    torch.testing.assert_close(got.double(), spec_fake_quant(x, 1344.0), rtol=2**-22, atol=0)


def test_static_scale_replaces_the_per_call_one(seed):
    w, bias = torch.randn(40, 80), torch.randn(40)
    qw = quantize(w, "nvfp4")
    layer = FP4Linear.from_qtensor(qw, bias, activations="nvfp4")
    x = torch.randn(6, 80) * 1.5
    x[0] = 0  # an all-zero row
    x[1, 5], x[2, 70] = 40.0, -1e-40  # beyond the static amax (saturates) and a float32 subnormal
    w_deq = qw.dequantize().double()

    dynamic = layer(x)
    torch.testing.assert_close(dynamic.double(), spec_fake_quant(x, encode_scale(x.abs().max())) @ w_deq.T + bias,
                               rtol=1e-5, atol=1e-5)
    g = encode_scale(3.0)
    layer.set_input_global_scale(torch.tensor(g))
    assert layer.input_global_scale.dtype == torch.float32 and layer.input_global_scale.item() == g
    static = layer(x)
    torch.testing.assert_close(static.double(), spec_fake_quant(x, g) @ w_deq.T + bias, rtol=1e-5, atol=1e-5)
    assert not torch.equal(static, dynamic)
    assert "static input scale" in repr(layer)

    state = layer.state_dict()
    assert state["input_global_scale"].item() == g
    half = copy.deepcopy(layer).to(torch.bfloat16)  # the scale keeps float32, like the weight's global scale
    assert half.input_global_scale.dtype == torch.float32 and half.input_global_scale.item() == g
    layer.set_input_global_scale(None)
    assert "input_global_scale" not in layer.state_dict() and torch.equal(layer(x), dynamic)


def test_static_scale_through_the_custom_op_and_dynamo(seed):
    layer = FP4Linear.from_qtensor(quantize(torch.randn(24, 64), "nvfp4"), torch.randn(24), activations="nvfp4",
                                   input_global_scale=torch.tensor(encode_scale(2.0)))
    x = torch.randn(3, 64)
    args = (x, layer.prepared_data, layer.prepared_scale, layer.prepared_global_scale, layer.bias, "nvfp4", 24, 64,
            layer.backend, layer.activations, layer.input_global_scale)
    torch.library.opcheck(torch.ops.microscale.linear.default, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_set_input_global_scale_rejects_bad_input():
    weight_only = FP4Linear(64, 8)
    with pytest.raises(ValueError, match="needs NVFP4 activations; this layer has activations=None"):
        weight_only.set_input_global_scale(1.0)
    with pytest.raises(ValueError, match="activations=mxfp4"):
        FP4Linear(64, 8, fmt="mxfp4", activations="mxfp4").set_input_global_scale(1.0)
    layer = FP4Linear(64, 8, activations="nvfp4")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            layer.set_input_global_scale(bad)
    with pytest.raises(ValueError, match=r"expected one value, got shape \(2,\)"):
        layer.set_input_global_scale(torch.ones(2))
    assert layer.input_global_scale is None


# ---- calibration ------------------------------------------------------------------------------------
def test_calibration_sets_2688_over_the_input_amax(seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", activations="nvfp4", progress=False)
    layers = quantized_layers(model)
    batches = torch.randint(0, 96, (4, 9)).split(2)

    # The inputs each layer sees with per-call scales, recorded here independently in float64.
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = max(seen.get(name, 0.0), args[0].double().abs().max().item())
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in layers.items()]
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in handles:
        h.remove()

    amax = calibrate_input_scales(model, batches)
    assert sorted(amax) == sorted(layers) and len(layers) == 14
    for name, layer in layers.items():
        assert amax[name].item() == seen[name], name
        assert layer.input_global_scale.item() == encode_scale(seen[name]), name
    for i in range(2):
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        assert attn.q_proj.input_global_scale == attn.k_proj.input_global_scale == attn.v_proj.input_global_scale
        assert mlp.gate_proj.input_global_scale == mlp.up_proj.input_global_scale

    # Calibrating again measures with per-call scales again, not with the static ones just set.
    before = {n: m.input_global_scale.clone() for n, m in layers.items()}
    calibrate_input_scales(model, batches)
    assert all(torch.equal(m.input_global_scale, before[n]) for n, m in layers.items())


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        return self.used(x)


def test_calibration_leaves_unreached_layers_dynamic(seed):
    model = Branches()
    with pytest.raises(ValueError, match="no quantized layers with NVFP4 activations"):
        calibrate_input_scales(model, [torch.randn(2, 32)])
    quantize_model(model, "nvfp4", activations="nvfp4", exclude=(), progress=False)
    x = torch.randn(3, 32)
    with pytest.warns(UserWarning, match="no calibration input reached unused"):
        calibrate_input_scales(model, [x[:2], (x[2:],)])
    assert model.unused.input_global_scale is None
    assert model.used.input_global_scale.item() == encode_scale(x.abs().max().item())


def test_calibration_measures_the_rotated_input(seed):
    """A rotated layer quantizes x R (R: one normalized 16 x 16 Hadamard matrix per K block): its scale
    covers the amax of x R, computed here in float64 from a Sylvester matrix built by hand."""
    h = np.array([[1.0]])
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    h /= 4.0
    linear = nn.Linear(64, 24)
    model = nn.Sequential(FP4Linear.from_linear(linear, "nvfp4", activations="nvfp4", rotation=16))
    x = torch.randn(5, 64)
    x[2, 9] = 12.0  # an outlier the rotation spreads over its block
    amax = calibrate_input_scales(model, [x])["0"]
    rotated = np.abs(x.double().numpy().reshape(5, 4, 16) @ h).max()
    assert abs(amax.item() - rotated) <= 1e-6 * rotated and abs(rotated - 12.0) > 1.0
    assert model[0].input_global_scale.item() == encode_scale(amax.item())


# ---- checkpoints ------------------------------------------------------------------------------------
def test_static_w4a4_round_trip(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", activations="nvfp4", progress=False)
    calibrate_input_scales(model, torch.randint(0, 96, (4, 9)).split(2))
    dynamic_layer = "model.layers.1.mlp.down_proj"
    model.get_submodule(dynamic_layer).set_input_global_scale(None)  # one layer left per-call: mixed groups
    save_quantized(model, tmp_path / "ckpt")

    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    groups = {tuple(g["targets"]): g for g in qc["config_groups"].values()}
    assert groups[(dynamic_layer,)]["input_activations"]["dynamic"] is True
    static = next(g for t, g in groups.items() if t != (dynamic_layer,))
    assert len(static["targets"]) == 13
    assert static["input_activations"]["dynamic"] == "local" and static["input_activations"]["strategy"] == \
        "tensor_group" and static["format"] == "nvfp4-pack-quantized"

    layers = quantized_layers(model)
    ck = load_checkpoint(tmp_path / "ckpt")
    assert sorted(ck.input_global_scales) == sorted(n for n in layers if n != dynamic_layer)
    for name, g in ck.input_global_scales.items():
        assert g.item() == layers[name].input_global_scale.item(), name

    loaded = load_quantized(tmp_path / "ckpt")
    for name, layer in layers.items():
        mine = loaded.get_submodule(name)
        assert mine.activations == "nvfp4", name
        if name == dynamic_layer:
            assert mine.input_global_scale is None
        else:
            assert mine.input_global_scale.dtype == torch.float32
            assert mine.input_global_scale.item() == layer.input_global_scale.item(), name
    tokens = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        out = loaded(tokens).logits
        assert torch.equal(out, model(tokens).logits)
        for layer in quantized_layers(loaded).values():
            layer.set_input_global_scale(None)
        assert not torch.equal(out, loaded(tokens).logits)  # the static scales were in use


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(80, 48)

    def forward(self, x):
        return self.lin(x)


def test_modelopt_w4a4_keeps_its_input_scale(tmp_path, seed):
    """A ModelOpt W4A4 export (input_scale = calibrated amax / 2688, a decode scale) built from the spec:
    the layer quantizes its inputs with 1 / input_scale and matches a float64 reference made of the
    hand-dequantized weight and the spec reference's activations; saving it as compressed-tensors keeps
    the scale."""
    w, bias = torch.randn(48, 80) * torch.logspace(-1, 1, 80), torch.randn(48)
    packed, scale, ws2, w_deq = modelopt_nvfp4(w)
    input_scale = torch.tensor(np.float32(2.5) / np.float32(2688.0))
    d = write_modelopt(tmp_path / "mo", {"lin.weight": packed, "lin.weight_scale": scale, "lin.weight_scale_2": ws2,
                                         "lin.input_scale": input_scale, "lin.bias": bias})
    model = load_quantized(d, OneLinear())
    layer = model.lin
    assert isinstance(layer, FP4Linear) and layer.activations == "nvfp4"
    g = float(np.float32(1.0) / np.float32(input_scale.item()))
    assert layer.input_global_scale.item() == g

    x = torch.randn(5, 80)
    x[0, 3], x[4, 77] = 9.0, -30.0  # beyond the calibrated 2.5: saturate
    expected = spec_fake_quant(x, g) @ w_deq.T + bias.double()
    with torch.no_grad():
        y = model(x)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)

    save_quantized(model, tmp_path / "ct")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_quantized(tmp_path / "ct", OneLinear())
    assert again.lin.input_global_scale.item() == g
    with torch.no_grad():
        assert torch.equal(again(x), y)


# ---- CUDA ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_static_activations_on_cuda_match_cpu(seed):
    """The fused quantizer with a static scale gives the CPU reference's values (saturation included);
    a static W4A4 layer on the GPU matches the CPU layer and replays in a CUDA graph."""
    x = torch.randn(37, 160) * 2
    x[3, 10], x[5, 100], x[6] = 50.0, -80.0, 0.0
    g = torch.tensor(encode_scale(4.0))
    cpu = quantize_dequantize_activations(x, "nvfp4", g)
    gpu = quantize_dequantize_activations(x.cuda(), "nvfp4", g.cuda())
    assert torch.equal(gpu.cpu(), cpu)

    layer = FP4Linear.from_qtensor(quantize(torch.randn(96, 160), "nvfp4"), torch.randn(96), activations="nvfp4",
                                   input_global_scale=g)
    want = layer(x)
    reference_on_gpu = FP4Linear.from_qtensor(layer.qweight, layer.bias, activations="nvfp4", backend="reference",
                                              input_global_scale=g).cuda()
    torch.testing.assert_close(reference_on_gpu(x.cuda()).cpu(), want, rtol=1e-5, atol=1e-4)

    fast = copy.deepcopy(layer).cuda()  # the device's own backend
    xb = x.cuda().to(torch.bfloat16)
    eager = fast(xb)
    torch.testing.assert_close(eager.float().cpu(), layer(xb.float().cpu()), rtol=2e-2,
                               atol=2e-2 * want.abs().max().item())
    static_x = xb.clone()
    fast(static_x)  # warm-up (compiles kernels) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast(static_x)
    static_x.copy_(xb.flip(0))
    graph.replay()
    assert torch.equal(out, fast(xb.flip(0)))
