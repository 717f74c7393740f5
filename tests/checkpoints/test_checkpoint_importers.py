"""Importers: ModelOpt NVFP4 exports and gpt-oss MXFP4 experts, built from the spec with safetensors'
own writer and numpy values (tests/spec_reference.py), then loaded."""

import numpy as np
import pytest
import torch

from ckpt_helpers import e2m1_table, modelopt_nvfp4, pack_codes, tiny_llama, write_modelopt, write_plain
from microscale.formats.checkpoint import CheckpointError, load_checkpoint, plan_checkpoint
from microscale.models.cli_inspect import describe
from microscale.models.linear import FP4Linear
from microscale.models.serialization import load_quantized
from microscale.quant import quantize


# ---- ModelOpt NVFP4 -----------------------------------------------------------------------------
def test_modelopt_import_is_bit_exact(tmp_path, seed):
    w = torch.randn(48, 80) * torch.logspace(-2, 2, 80)
    w[3] = 0  # an all-zero row: ModelOpt sets those block scales to 1.0
    packed, scale, ws2, deq = modelopt_nvfp4(w)
    input_scale = torch.tensor(0.0123, dtype=torch.float32)
    d = write_modelopt(tmp_path / "mo", {"lin.weight": packed, "lin.weight_scale": scale, "lin.weight_scale_2": ws2,
                                         "lin.input_scale": input_scale, "lin.bias": torch.randn(48)})
    ck = load_checkpoint(d)
    assert ck.plan.layout == "modelopt" and ck.plan.format_tag == "NVFP4"
    q = ck.quantized["lin"]
    assert q.fmt.name == "nvfp4" and q.shape == (48, 80)
    assert torch.equal(q.data, packed)  # the file's bytes, unchanged
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
    # decode -> encode as compressed-tensors' converter does: 1 / weight_scale_2 in float32
    assert q.global_scale.item() == float(np.float32(1.0) / np.float32(ws2.item()))
    assert ck.input_global_scales["lin"].item() == float(np.float32(1.0) / np.float32(input_scale.item()))
    assert ck.plan.quantized["lin"].activations.name == "nvfp4"
    # q * s / (1/ws2) against the float64 q * s * ws2: equal to float32 rounding
    torch.testing.assert_close(q.dequantize().double(), deq, rtol=2**-22, atol=0)
    # and the same codes and scales our own quantizer produces with the ModelOpt recipe
    ours = quantize(w, "nvfp4", recipe="modelopt")
    assert torch.equal(ours.data, q.data) and torch.equal(ours.scale.view(torch.uint8), q.scale.view(torch.uint8))


def test_modelopt_model_loads_and_matches_float_reference(tmp_path, seed):
    model = tiny_llama()
    tensors, reference = {}, {}
    for name, t in model.state_dict().items():
        module = name.rpartition(".")[0]
        if name.endswith("proj.weight"):
            packed, scale, ws2, deq = modelopt_nvfp4(t)
            tensors.update({f"{module}.weight": packed, f"{module}.weight_scale": scale,
                            f"{module}.weight_scale_2": ws2})
            reference[name] = deq.float()
        else:
            tensors[name] = t
            reference[name] = t
    # FP8 KV-cache scales, as ModelOpt exports them: not used here, skipped with a warning
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(0.5)
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    d = write_modelopt(tmp_path / "mo", tensors, config=config)

    with pytest.warns(UserWarning, match="k_proj.k_scale, model.layers.0.self_attn.v_proj.v_scale skipped"):
        loaded = load_quantized(d)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, FP4Linear)
    assert loaded.model.layers[1].mlp.down_proj.activations is None  # no input_scale: weight-only
    float_model = tiny_llama()
    float_model.load_state_dict(reference)
    x = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, float_model(x).logits, rtol=1e-4, atol=1e-4)


def test_modelopt_mixed_precision_with_nvfp4_layers(tmp_path, seed):
    packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 32))
    quant = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": {"quant_algo": "NVFP4", "group_size": 16}}}
    d = write_modelopt(tmp_path / "mo", {"a.weight": packed, "a.weight_scale": scale, "a.weight_scale_2": ws2},
                       quant=quant)
    assert plan_checkpoint(d).quantized["a"].fmt.name == "nvfp4"


# ---- gpt-oss MXFP4 ------------------------------------------------------------------------------
def _gpt_oss_tensors(experts, rows, k, sep="_", name="model.layers.0.mlp.experts.gate_up_proj"):
    """Random E2M1 codes and E8M0 exponents, and the float64 weights they encode per expert."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    codes = rng.integers(0, 16, size=(experts, rows, k), dtype=np.uint8)
    exps = rng.integers(100, 150, size=(experts, rows, k // 32), dtype=np.uint8)
    exps[0, 0, 0], exps[-1, -1, -1] = 0, 252  # extreme exponents: 2^-127, and 2^125 (x6 still a float32)
    values = e2m1_table()[codes] * np.exp2(exps.astype(np.float64) - 127).repeat(32, axis=-1)
    blocks = pack_codes(codes).reshape(experts, rows, k // 32, 16)
    tensors = {f"{name}{sep}blocks": torch.from_numpy(blocks), f"{name}{sep}scales": torch.from_numpy(exps)}
    return tensors, values


def _gpt_oss_config():
    return {"model_type": "gpt_oss", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}


def test_gpt_oss_experts_dequantize_to_the_float_reference(tmp_path, seed):
    gate_up, gate_up_ref = _gpt_oss_tensors(4, 24, 64)
    down, down_ref = _gpt_oss_tensors(4, 64, 96, name="model.layers.0.mlp.experts.down_proj")
    bias = torch.randn(4, 24, dtype=torch.bfloat16)
    d = write_plain(tmp_path / "oss", {**gate_up, **down, "model.layers.0.mlp.experts.gate_up_proj_bias": bias,
                                       "model.layers.0.mlp.router.weight": torch.randn(4, 64)}, _gpt_oss_config())
    ck = load_checkpoint(d)
    assert ck.plan.layout == "gpt-oss-mxfp4"
    assert set(ck.tensors) == {"model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.router.weight"}
    for e in range(4):
        q = ck.quantized[f"model.layers.0.mlp.experts.gate_up_proj.{e}"]
        assert q.fmt.name == "mxfp4" and q.shape == (24, 64)
        assert torch.equal(q.dequantize(torch.float64), torch.from_numpy(gate_up_ref[e]))
        q = ck.quantized[f"model.layers.0.mlp.experts.down_proj.{e}"]
        assert q.shape == (64, 96)
        assert torch.equal(q.dequantize(torch.float64), torch.from_numpy(down_ref[e]))


def test_gpt_oss_original_openai_names(tmp_path, seed):
    tensors, values = _gpt_oss_tensors(2, 8, 32, sep=".", name="block.0.mlp.mlp1_weight")
    d = write_plain(tmp_path / "oss", tensors, _gpt_oss_config())
    q = load_checkpoint(d).quantized["block.0.mlp.mlp1_weight.1"]
    assert torch.equal(q.dequantize(torch.float64), torch.from_numpy(values[1]))


def test_gpt_oss_is_not_loaded_into_linear_modules(tmp_path, seed):
    tensors, _ = _gpt_oss_tensors(2, 8, 32)
    d = write_plain(tmp_path / "oss", tensors, _gpt_oss_config())
    with pytest.raises(CheckpointError, match="load_checkpoint"):
        load_quantized(d)


# ---- inspect on imported layouts ----------------------------------------------------------------
def test_inspect_reports_imported_layouts(tmp_path, seed):
    tensors, _ = _gpt_oss_tensors(4, 32, 64)
    text = describe(plan_checkpoint(write_plain(tmp_path / "oss", tensors, _gpt_oss_config())))
    assert "gpt-oss-mxfp4" in text
    row = next(line for line in text.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj "))
    assert row.split()[1:4] == ["mxfp4", "4x32x64", "4.250"]  # 4 bits + one 8-bit scale per 32

    packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 64))
    d = write_modelopt(tmp_path / "mo", {"x.weight": packed, "x.weight_scale": scale, "x.weight_scale_2": ws2,
                                         "head.weight": torch.randn(8, 64, dtype=torch.bfloat16)})
    text = describe(plan_checkpoint(d))
    assert "modelopt (NVFP4)" in text
    row = next(line for line in text.splitlines() if line.startswith("x "))
    # 16*64/2 data + 16*4 scales + 4 (weight_scale_2) bytes over 1024 weights
    assert row.split()[1:5] == ["nvfp4", "16x64", f"{(512 + 64 + 4) * 8 / 1024:.3f}", "580"]
    assert any(line.startswith("head.weight ") and "BF16" in line for line in text.splitlines())
