"""Tiny transformers models built from configs (random weights) and the float reference they are
compared against."""

import copy

import pytest
import torch
from torch import nn

from microscale.models.linear import QuantizedLinear

FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def tiny_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    return BertModel(cfg).eval()


def dequantized_reference(original: nn.Module, quantized: nn.Module) -> nn.Module:
    """A float copy of `original` whose Linears hold the quantized layers' dequantized weights."""
    ref = copy.deepcopy(original)
    for name, layer in quantized.named_modules():
        if isinstance(layer, QuantizedLinear):
            ref.get_submodule(name).weight.data = layer.qweight.dequantize(torch.float32)
    return ref


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return (10 * torch.log10(ref.pow(2).sum() / (test - ref).pow(2).sum())).item()


@pytest.fixture(params=FORMATS)
def fmt(request):
    return request.param
