"""save_quantized / load_quantized with tiny transformers Llama models (random weights)."""

import json

import pytest
import torch
from torch import nn

from ckpt_helpers import tiny_llama
from microscale.formats.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from microscale.models.linear import FP4Linear, FP8Linear, QuantizedLinear
from microscale.models.quantize_model import quantize_model
from microscale.models.serialization import checkpoint_tensors, load_quantized, model_from_config, save_quantized


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _same_buffers(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k]), k


@pytest.mark.parametrize("fmt,activations", [("nvfp4", None), ("mxfp4", None), ("mxfp8", None), ("nvfp4", "nvfp4"),
                                             ("mxfp8", "mxfp8")])
def test_round_trip_builds_the_model_from_config(tmp_path, seed, fmt, activations):
    model = tiny_llama()
    quantize_model(model, fmt, activations=activations, progress=False)
    tokens = torch.randint(0, 96, (2, 9))
    save_quantized(model, tmp_path / "q", max_shard_size="30KB")
    assert len(list((tmp_path / "q").glob("*.safetensors"))) > 1

    loaded = load_quantized(tmp_path / "q")
    layer = loaded.model.layers[1].self_attn.v_proj
    assert isinstance(layer, FP8Linear if fmt == "mxfp8" else FP4Linear)
    assert layer.fmt.name == fmt and layer.activations == activations
    assert not isinstance(loaded.lm_head, QuantizedLinear)
    _same_buffers(model, loaded)
    assert torch.equal(_logits(loaded, tokens), _logits(model, tokens))


def test_round_trip_into_a_given_float_model(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", progress=False)
    save_quantized(model, tmp_path / "q")
    target = tiny_llama()  # other random weights, float Linear layers
    loaded = load_quantized(tmp_path / "q", model=target)
    assert loaded is target and isinstance(target.model.layers[0].mlp.up_proj, FP4Linear)
    tokens = torch.randint(0, 96, (1, 5))
    assert torch.equal(_logits(target, tokens), _logits(model, tokens))


def test_mixed_formats_round_trip(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "mxfp8", include=["*.mlp.*"], progress=False)
    quantize_model(model, "nvfp4", include=["*.self_attn.*"], progress=False)
    save_quantized(model, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mixed-precision"
    loaded = load_quantized(tmp_path / "q")
    assert isinstance(loaded.model.layers[0].mlp.gate_proj, FP8Linear)
    assert loaded.model.layers[0].self_attn.o_proj.fmt.name == "nvfp4"
    tokens = torch.randint(0, 96, (1, 6))
    assert torch.equal(_logits(loaded, tokens), _logits(model, tokens))


def test_tied_embeddings_are_written_once(tmp_path, seed):
    model = tiny_llama(tie_word_embeddings=True)
    quantize_model(model, "mxfp4", progress=False)
    save_quantized(model, tmp_path / "q")
    names = set(load_checkpoint(tmp_path / "q").tensors)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    loaded = load_quantized(tmp_path / "q")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 96, (1, 6))
    assert torch.equal(_logits(loaded, tokens), _logits(model, tokens))


def test_model_from_config_materializes_no_weights(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", progress=False)
    save_quantized(model, tmp_path / "q")
    empty = model_from_config(tmp_path / "q")
    assert all(p.is_meta for p in empty.parameters())
    loaded = load_quantized(tmp_path / "q")
    # quantized layers hold only their packed buffers: no float weight anywhere in them
    for m in loaded.modules():
        if isinstance(m, QuantizedLinear):
            assert not any(t.is_floating_point() and t.dtype.itemsize > 1 for t in (m.weight_data, m.weight_scale))
            assert not list(m.parameters())
    assert not any(t.is_meta for t in loaded.state_dict().values())


def test_config_tokenizer_and_generation_files(tmp_path, seed):
    from transformers import LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (tmp_path / "src" / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (tmp_path / "src" / "notes.md").write_text("not a side file")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "src").eval()
    quantize_model(model, "mxfp4", progress=False)

    class StubTokenizer:
        def save_pretrained(self, directory):
            (directory if hasattr(directory, "joinpath") else __import__("pathlib").Path(directory)).joinpath(
                "special_tokens_map.json").write_text('{"bos_token": "<s>"}')

    save_quantized(model, tmp_path / "q", tokenizer=StubTokenizer())
    out = tmp_path / "q"
    assert (out / "tokenizer.json").read_text() == (tmp_path / "src" / "tokenizer.json").read_text()
    assert (out / "tokenizer_config.json").exists() and (out / "special_tokens_map.json").exists()
    assert (out / "generation_config.json").exists() and not (out / "notes.md").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert "lm_head" in config["quantization_config"]["ignore"]


def test_padded_in_features_round_trip(tmp_path, seed):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(40, 24)
            self.b = nn.Linear(24, 8, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    net = Net()
    report = quantize_model(net, "nvfp4", exclude=(), progress=False)
    assert [r.name for r in report.padded] == ["a", "b"]
    save_quantized(net, tmp_path / "q")
    fresh = load_quantized(tmp_path / "q", model=Net())
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert torch.equal(fresh(x), net(x))


def test_save_needs_quantized_layers(tmp_path):
    with pytest.raises(ValueError, match="no FP4Linear/FP8Linear"):
        save_quantized(tiny_llama(), tmp_path / "q")


# ---- loading into a given model: errors name tensor and file, and leave the model untouched ---------
def _saved(tmp_path, edit):
    model = tiny_llama()
    quantize_model(model, "nvfp4", progress=False)
    save_quantized(model, tmp_path / "good")
    tensors = dict(checkpoint_tensors(model))
    edit(tensors)
    config = (tmp_path / "good" / "config.json").read_text()
    return write_checkpoint(tmp_path / "bad", tensors, files={"config.json": config})


def _fails_untouched(directory, *fragments, model=None):
    model = model or tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_quantized(directory, model=model)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in: {e.value}"
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_stored_non_persistent_buffer_is_skipped(tmp_path, seed):
    """Older checkpoints store buffers that models now compute (BERT position_ids, rotary inv_freq)."""
    model = tiny_llama()
    quantize_model(model, "mxfp8", progress=False)
    inv_freq = model.model.rotary_emb.inv_freq
    d = _saved(tmp_path, lambda t: t.__setitem__("model.rotary_emb.inv_freq", torch.full_like(inv_freq, 7.0)))
    loaded = load_quantized(d)
    assert torch.equal(loaded.model.rotary_emb.inv_freq, inv_freq)  # computed, not the stored 7s


def test_unexpected_tensor_for_the_model(tmp_path, seed):
    d = _saved(tmp_path, lambda t: t.__setitem__("model.extra.weight", torch.ones(3)))
    _fails_untouched(d, "'model.extra.weight'", "model.safetensors", "unexpected")


def test_missing_tensor_for_the_model(tmp_path, seed):
    d = _saved(tmp_path, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    _fails_untouched(d, "missing tensor 'model.layers.1.post_attention_layernorm.weight'", str(d))


def test_plain_tensor_of_the_wrong_shape(tmp_path, seed):
    d = _saved(tmp_path, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    _fails_untouched(d, "'model.norm.weight'", "model.safetensors", "[65]")


def test_quantized_layer_does_not_fit_the_model(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", progress=False)
    save_quantized(model, tmp_path / "q")
    other = tiny_llama(intermediate_size=128)
    _fails_untouched(tmp_path / "q", "model.layers.0.mlp.", "weight_packed'", "model.safetensors", "does not fit",
                     model=other)


def test_quantized_layer_missing_from_the_model(tmp_path, seed):
    d = _saved(tmp_path, lambda t: t.update({k.replace("layers.1.", "layers.7."): v for k, v in t.items()
                                              if "layers.1.self_attn.q_proj" in k}))
    _fails_untouched(d, "model.layers.7.self_attn.q_proj.weight_packed", "model.safetensors", "no Linear layer")
