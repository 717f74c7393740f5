"""Builders for checkpoint tests: tiny transformers models and checkpoints written from the spec.

Foreign layouts (ModelOpt, gpt-oss) are written with safetensors' own save_file and values from
tests/spec_reference.py (numpy, independent of microscale), never with microscale's writer.
"""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import spec_reference as ref


def write_sharded(directory, shards: dict):
    """A sharded safetensors checkpoint {file: {name: tensor}} with its index and a llama config.json."""
    from microscale.formats.checkpoint import INDEX_NAME

    directory.mkdir()
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(directory / fname))
        weight_map.update({n: fname for n in tensors})
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(**overrides):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes [..., K] -> bytes [..., K/2], even K index in the low nibble (spec section 0)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e2m1_table() -> np.ndarray:
    return np.array([ref.e2m1_value(c) for c in range(16)])


def e4m3_table() -> np.ndarray:
    return np.array([ref.e4m3_value(c) for c in range(256)])


def modelopt_nvfp4(w: torch.Tensor):
    """ModelOpt's NVFP4 export of one weight (spec section 1): (weight U8, weight_scale E4M3,
    weight_scale_2 F32 decode scale) as torch tensors, plus the dequantized weight in float64."""
    x = w.float().numpy()
    codes, scale_codes, _ = ref.quantize_nvfp4(x, "modelopt")
    d = np.float32(np.abs(x).max()) / np.float32(2688.0)  # weight_scale_2 = amax / (6 * 448)
    deq = e2m1_table()[codes].reshape(x.shape[0], -1, 16) * e4m3_table()[scale_codes][..., None] * float(d)
    return (torch.from_numpy(pack_codes(codes)), torch.from_numpy(scale_codes).view(torch.float8_e4m3fn),
            torch.tensor(d, dtype=torch.float32), torch.from_numpy(deq.reshape(x.shape[0], -1)[:, :x.shape[1]]))


def write_modelopt(directory: Path, tensors: dict, config: dict = None, quant: dict = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    quant = quant or {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                      "exclude_modules": ["lm_head"]}
    (directory / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.0-test"}, "quantization": quant}))
    config = dict(config or {})
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_plain(directory: Path, tensors: dict, config: dict) -> Path:
    """A checkpoint written with safetensors' save_file and a given config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory

