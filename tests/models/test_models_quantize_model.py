"""quantize_model on tiny transformers models (random weights): outputs, report, rules, shared scales."""

import copy

import pytest
import torch
from conftest import dequantized_reference, sqnr_db, tiny_bert, tiny_llama
from torch import nn

from microscale import FP4Linear, FP8Linear, fuse_linears, quantize_model
from microscale.formats.spec import E2M1_MAX, E4M3_MAX
from microscale.quant import quantize

# Logits of the quantized model against the float model with the same dequantized weights: both
# compute in float32, so they agree to accumulation error.
REFERENCE_RTOL = 1e-5
# Logits against the original float model (random Gaussian weights, 2 layers): per-format floor
# on the SQNR, about 4 dB below what seeded runs gave (NVFP4 17-19, MXFP4 15-18, MXFP8 29-31 dB).
MIN_LOGIT_SQNR_DB = {"nvfp4": 13.0, "mxfp4": 10.0, "mxfp8": 25.0}

LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def weight_bytes(fmt, n, k):
    """Bytes of a quantized [n, k] weight written out from the format's definition."""
    block = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}[fmt]
    kp = -(-k // block) * block
    elem = kp // 2 if fmt != "mxfp8" else kp
    return n * elem + n * kp // block + (4 if fmt == "nvfp4" else 0)


def test_tiny_llama_outputs_and_report(seed, fmt):
    model = tiny_llama()
    original = copy.deepcopy(model)
    report = quantize_model(model, fmt, progress=False)
    ids = torch.randint(0, 160, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
        ref = dequantized_reference(original, model)(ids).logits
        float_logits = original(ids).logits
    assert (logits - ref).abs().max() <= REFERENCE_RTOL * ref.abs().max()
    s = sqnr_db(float_logits, logits)
    print(f"{fmt}: logits SQNR vs float32 {s:.1f} dB")
    assert s >= MIN_LOGIT_SQNR_DB[fmt]

    names = [f"model.layers.{i}.{p}" for i in range(2) for p in LLAMA_LINEARS]
    assert [r.name for r in report.quantized] == names
    assert report.skipped == [("lm_head", "excluded by 'lm_head'")]
    cls = FP8Linear if fmt == "mxfp8" else FP4Linear
    assert all(type(model.get_submodule(n)) is cls for n in names)
    assert type(model.lm_head) is nn.Linear
    for r in report.quantized:
        n, k = original.get_submodule(r.name).weight.shape
        assert r.shape == (n, k) and r.bytes_before == n * k * 4 and r.bytes_after == weight_bytes(fmt, n, k)
    assert report.bytes_before == sum(r.bytes_before for r in report.quantized)
    delta = report.bytes_before - report.bytes_after
    assert report.model_bytes_before - report.model_bytes_after == delta
    text = str(report)
    assert f"{fmt}: 14 Linear layers quantized, 1 skipped" in text and "lm_head: excluded" in text


def test_tiny_bert_outputs(seed, fmt):
    model = tiny_bert()
    original = copy.deepcopy(model)
    report = quantize_model(model, fmt, progress=False)
    assert len(report.quantized) == 2 * 6 + 1 and not report.skipped  # 6 per layer + pooler
    ids = torch.randint(0, 120, (2, 9))
    with torch.no_grad():
        out = model(ids).last_hidden_state
        ref = dequantized_reference(original, model)(ids).last_hidden_state
    assert (out - ref).abs().max() <= REFERENCE_RTOL * ref.abs().max()


def encode_global_scale(amax):
    """448 * 6 / amax in float32, a true division (the spec's compressed-tensors rule)."""
    return torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32) / amax.float()


def test_fused_projections_share_nvfp4_global_scale(seed):
    model = tiny_llama()
    with torch.no_grad():  # make the three projections' ranges differ
        model.model.layers[0].self_attn.k_proj.weight.mul_(7.0)
    original = copy.deepcopy(model)
    report = quantize_model(model, "nvfp4", progress=False)
    assert len(report.shared_global_scale) == 4  # (q, k, v) and (gate, up) in each of 2 layers
    for i in range(2):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            names = [f"model.layers.{i}.{p}" for p in group]
            assert tuple(names) in report.shared_global_scale
            amax = max(original.get_submodule(n).weight.abs().max() for n in names)
            want = encode_global_scale(amax)
            for n in names:
                layer = model.get_submodule(n)
                assert layer.weight_global_scale.item() == want.item()
                q = quantize(original.get_submodule(n).weight, "nvfp4", global_scale=want)
                assert torch.equal(layer.weight_data, q.data)
                assert torch.equal(layer.weight_scale.view(torch.uint8), q.scale.view(torch.uint8))
            layers = [model.get_submodule(n) for n in names]
            fused = fuse_linears(layers)  # one global scale: the group fuses into one GEMM
            x = torch.randn(3, 64)
            separate = torch.cat([m(x) for m in layers], -1)
            assert torch.allclose(fused(x), separate, rtol=1e-5, atol=1e-5 * separate.abs().max().item())
        o_proj = model.get_submodule(f"model.layers.{i}.self_attn.o_proj")
        alone = encode_global_scale(original.get_submodule(f"model.layers.{i}.self_attn.o_proj").weight.abs().max())
        assert o_proj.weight_global_scale.item() == alone.item()
    bert = tiny_bert()
    assert len(quantize_model(bert, "nvfp4", progress=False).shared_global_scale) == 2  # query/key/value
    assert quantize_model(tiny_llama(), "mxfp4", progress=False).shared_global_scale == []


def test_include_exclude_rules(seed):
    model = tiny_llama()
    report = quantize_model(model, "nvfp4", include=["mlp.*"], progress=False)
    assert [r.name for r in report.quantized] == [f"model.layers.{i}.mlp.{p}" for i in range(2)
                                                  for p in ("gate_proj", "up_proj", "down_proj")]
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear

    model = tiny_llama()
    report = quantize_model(model, "mxfp8", exclude=["layers.1.*", "o_proj"], progress=False)
    quantized = {r.name for r in report.quantized}
    assert "lm_head" in quantized  # a given exclude replaces the default
    assert not any(n.startswith("model.layers.1.") or n.endswith("o_proj") for n in quantized)
    assert ("model.layers.0.self_attn.o_proj", "excluded by 'o_proj'") in report.skipped
    assert ("model.layers.1.mlp.up_proj", "excluded by 'layers.1.*'") in report.skipped

    tied = tiny_llama(tie_word_embeddings=True)
    report = quantize_model(tied, "nvfp4", exclude=(), progress=False)
    assert ("lm_head", "weight tied to an embedding") in report.skipped

    again = quantize_model(tied, "nvfp4", progress=False)
    assert not again.quantized and ("model.layers.0.mlp.up_proj", "already quantized") in again.skipped


class Mixed(nn.Module):
    """Layers quantize_model must pad, skip or refuse."""

    def __init__(self):
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.ragged = nn.Linear(72, 24)  # K=72: not a multiple of 16 or 32, padded
        self.narrow = nn.Linear(8, 24)  # K=8: smaller than one block, skipped
        self.conv1d = Conv1D(24, 72)  # GPT-2 style transposed linear: unsupported, skipped
        self.attn = nn.MultiheadAttention(32, 2)  # reads out_proj.weight directly: skipped
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, x):
        return self.ragged(x)


def test_padding_and_skip_reasons(seed, fmt):
    model = Mixed()
    original = copy.deepcopy(model)
    report = quantize_model(model, fmt, progress=False)
    assert [r.name for r in report.quantized] == ["ragged"]
    block = 16 if fmt == "nvfp4" else 32
    assert report.padded[0].padded_k == -(-72 // block) * block
    reasons = dict(report.skipped)
    assert reasons["narrow"] == f"in_features=8 is smaller than one {block}-element block"
    assert reasons["conv1d"] == "unsupported module type Conv1D"
    assert reasons["attn.out_proj"].startswith("subclass of nn.Linear (NonDynamicallyQuantizableLinear)")
    assert "conv" not in reasons  # not a 2-D weight: not a candidate
    assert "padded: ragged in_features 72" in str(report)
    x = torch.randn(5, 72)
    ref = dequantized_reference(original, model)(x)
    assert (model(x) - ref).abs().max() <= REFERENCE_RTOL * ref.abs().max()


def test_errors():
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        quantize_model(tiny_llama(), "fp4", progress=False)
    with pytest.raises(ValueError, match="unknown format 'int8'"):
        quantize_model(tiny_llama(), "nvfp4", activations="int8", progress=False)
    with pytest.raises(TypeError, match="include names 'conv', a Conv1d"):
        quantize_model(Mixed(), "nvfp4", include=["conv", "ragged"], progress=False)
    with pytest.raises(ValueError, match="include pattern 'q_projj' matches no module"):
        quantize_model(tiny_llama(), "nvfp4", include=["q_projj"], progress=False)
    with pytest.raises(TypeError, match="the model is itself an nn.Linear"):
        quantize_model(nn.Linear(32, 32), "nvfp4", progress=False)


def test_activations_reach_every_layer(seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", activations="nvfp4", progress=False)
    layers = [m for m in model.modules() if isinstance(m, FP4Linear)]
    assert len(layers) == 14 and all(m.activations == "nvfp4" for m in layers)
    assert torch.isfinite(model(torch.randint(0, 160, (1, 8))).logits).all()


def test_fuse_gated_mlps(seed, fmt, tmp_path):
    """After quantize_model, every SiLU-gated MLP becomes a GatedMLP over one fuse_gated layer: the logits are the
    unfused model's up to float rounding, generate runs, GELU MLPs and float MLPs are left alone, and the fused
    model cannot be saved."""
    from microscale import fuse_gated_mlps, save_quantized
    from microscale.models.quantize_model import GatedMLP

    model = tiny_llama()
    quantize_model(model, fmt, progress=False)
    ids = torch.randint(0, 160, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
    assert fuse_gated_mlps(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    mlp = model.model.layers[1].mlp
    assert type(mlp) is GatedMLP and mlp.gated.epilogue == "silu_mul" and mlp.gated.out_features == 2 * 96
    with torch.no_grad():
        got = model(ids).logits
    assert (got - want).abs().max() <= REFERENCE_RTOL * want.abs().max()
    assert model.generate(ids[:1, :4], max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 7)
    assert fuse_gated_mlps(model) == []  # nothing left to fuse
    with pytest.raises(ValueError, match="model.layers.0.mlp.gated is a fused gate/up layer"):
        save_quantized(model, tmp_path / "out")

    gelu = tiny_llama(hidden_act="gelu")
    quantize_model(gelu, fmt, progress=False)
    unquantized = tiny_llama()
    quantize_model(unquantized, fmt, exclude=["lm_head", "mlp.*"], progress=False)
    assert fuse_gated_mlps(gelu) == [] and fuse_gated_mlps(unquantized) == []
