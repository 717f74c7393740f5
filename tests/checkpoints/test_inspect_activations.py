"""`python -m microscale inspect` reports how each group of quantized layers runs its activations:
static NVFP4 where the checkpoint stores a calibrated input scale (compressed-tensors
input_global_scale, ModelOpt input_scale), per-call quantized, or float (weight-only)."""

import torch

from ckpt_helpers import modelopt_nvfp4, write_modelopt, write_plain
from microscale.__main__ import main
from microscale.formats.checkpoint import compressed_tensors_config, qtensor_state
from microscale.quant import quantize


def activation_lines(capsys, directory) -> dict:
    """{description: layer count} from the 'activations:' lines of `inspect --summary`."""
    assert main(["inspect", str(directory), "--summary"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("activations:")]
    groups = {}
    for line in lines:
        _, count, description = line.split(None, 2)
        groups[description] = int(count)
    assert len(groups) == len(lines), lines  # one line per group
    return groups


def test_inspect_shows_static_nvfp4_activations_of_a_compressed_tensors_checkpoint(tmp_path, capsys, seed):
    # module -> (weight format, activation format, static input global scale)
    schemes = {"layers.0.q_proj": ("nvfp4", "nvfp4", True), "layers.0.k_proj": ("nvfp4", "nvfp4", True),
               "layers.0.o_proj": ("nvfp4", "nvfp4", False), "layers.0.up_proj": ("nvfp4", None, False),
               "layers.0.down_proj": ("mxfp4", "mxfp8", False)}
    tensors = {"lm_head.weight": torch.randn(8, 64)}
    for module, (fmt, _, static) in schemes.items():
        g = torch.tensor(2688.0) / (torch.rand(()) * 10 + 1) if static else None
        tensors.update(qtensor_state(module, quantize(torch.randn(32, 64), fmt), g))
    d = write_plain(tmp_path / "ct", tensors, {"quantization_config": compressed_tensors_config(schemes)})
    assert activation_lines(capsys, d) == {
        "nvfp4 weights, static nvfp4 activations (global scale from input_global_scale)": 2,
        "nvfp4 weights, dynamic nvfp4 activations (per-call global scale)": 1,
        "nvfp4 weights, float activations (weight-only)": 1,
        "mxfp4 weights, dynamic mxfp8 activations": 1,
    }


def test_inspect_shows_static_nvfp4_activations_of_a_modelopt_checkpoint(tmp_path, capsys, seed):
    tensors = {}
    for module, input_scale in (("a", 0.02), ("b", 0.5), ("c", None)):
        packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 64))
        tensors.update({f"{module}.weight": packed, f"{module}.weight_scale": scale, f"{module}.weight_scale_2": ws2})
        if input_scale is not None:
            tensors[f"{module}.input_scale"] = torch.tensor(input_scale)
    d = write_modelopt(tmp_path / "mo", tensors)
    assert activation_lines(capsys, d) == {
        "nvfp4 weights, static nvfp4 activations (global scale from input_scale)": 2,
        "nvfp4 weights, float activations (weight-only)": 1,
    }


def test_inspect_counts_stacked_experts_as_one_layer(tmp_path, capsys):
    """gpt-oss MXFP4 experts: one stacked tensor is one layer (as in the per-layer table), weight-only."""
    blocks = torch.randint(0, 256, (4, 8, 2, 16), dtype=torch.uint8)  # 4 experts, 8 rows, K = 64
    scales = torch.full((4, 8, 2), 127, dtype=torch.uint8)
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    d = write_plain(tmp_path / "oss", {"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
                                       "model.layers.0.mlp.experts.gate_up_proj_scales": scales}, config)
    assert activation_lines(capsys, d) == {"mxfp4 weights, float activations (weight-only)": 1}
