"""`python -m microscale quantize` (streaming) and `python -m microscale inspect`."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckpt_helpers import tiny_llama, write_sharded
from microscale.__main__ import main
from microscale.formats.checkpoint import INDEX_NAME, CheckpointError, load_checkpoint
from microscale.models.cli_quantize import quantize_checkpoint
from microscale.models.quantize_model import quantize_model
from microscale.models.serialization import load_quantized
from microscale.quant import quantize

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def float_checkpoint(tmp_path, seed):
    """A tiny Llama saved by transformers in several shards, with a tokenizer file beside it."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "src", max_shard_size="60KB")
    assert (tmp_path / "src" / INDEX_NAME).exists()
    (tmp_path / "src" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return tmp_path / "src", model


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_cli_quantize_matches_quantize_model(tmp_path, float_checkpoint, fmt, capsys):
    src, model = float_checkpoint
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--format", fmt, "--max-shard-size", "40KB", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "14 layers quantized" in printed and "lm_head: excluded by 'lm_head'" in printed

    assert (out / INDEX_NAME).exists() and (out / "tokenizer.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["quantization_config"]["config_groups"]["group_0"]["format"]

    loaded = load_quantized(out)
    quantize_model(model, fmt, progress=False)  # the in-memory path, same rules
    for name, layer in model.named_modules():
        if hasattr(layer, "qweight"):
            mine = loaded.get_submodule(name)
            assert torch.equal(mine.weight_data.view(torch.uint8), layer.weight_data.view(torch.uint8)), name
            assert torch.equal(mine.weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8)), name
            if fmt == "nvfp4":
                assert mine.weight_global_scale.item() == layer.weight_global_scale.item(), name
    tokens = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_fused_projections_share_one_global_scale(tmp_path, float_checkpoint):
    src, model = float_checkpoint
    quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    ck = load_checkpoint(tmp_path / "out")
    for layer in range(2):
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = f"model.layers.{layer}.{'self_attn' if 'q_proj' in group else 'mlp'}"
            weights = [model.get_submodule(f"{parent}.{g}").weight.detach() for g in group]
            # 448 * 6 / (the group's largest |w|), in float32 as compressed-tensors computes it
            want = np.float32(2688.0) / np.float32(max(w.abs().max().item() for w in weights))
            for g in group:
                assert ck.quantized[f"{parent}.{g}"].global_scale.item() == float(want)
        o_proj = model.get_submodule(f"model.layers.{layer}.self_attn.o_proj").weight.detach()
        want = np.float32(2688.0) / np.float32(o_proj.abs().max().item())
        assert ck.quantized[f"model.layers.{layer}.self_attn.o_proj"].global_scale.item() == float(want)


def test_quantize_rejects_quantized_source_and_non_finite_weights(tmp_path, float_checkpoint):
    src, _ = float_checkpoint
    quantize_checkpoint(src, tmp_path / "q", "mxfp4", progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "q2", "nvfp4", progress=False)
    with pytest.raises(CheckpointError, match="must differ"):
        quantize_checkpoint(src, src, "nvfp4", progress=False)

    bad = tmp_path / "bad"
    bad.mkdir()
    w = torch.randn(16, 32)
    w[3, 5] = float("nan")
    save_file({"layer.weight": w}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(bad, tmp_path / "bad_out", "nvfp4", progress=False)
    assert "'layer.weight'" in str(e.value) and "model.safetensors" in str(e.value) and "NaN" in str(e.value)
    assert not (tmp_path / "bad_out").exists()


def test_inspect_our_checkpoint(tmp_path, float_checkpoint, capsys):
    src, _ = float_checkpoint
    quantize_checkpoint(src, tmp_path / "out", "nvfp4", progress=False)
    assert main(["inspect", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "compressed-tensors (nvfp4-pack-quantized)" in text
    summary = next(line for line in text.splitlines() if line.startswith("quantized layers:"))
    assert summary.split()[2:4] == ["14", "nvfp4"]
    n, k = 96, 64  # gate_proj: data N*K/2 + scales N*K/16 + one float32 global scale
    row = next(line for line in text.splitlines() if line.startswith("model.layers.0.mlp.gate_proj "))
    nbytes = n * k // 2 + n * k // 16 + 4
    assert row.split()[1:5] == ["nvfp4", f"{n}x{k}", f"{8 * nbytes / (n * k):.3f}", f"{nbytes:,}"]
    assert any(line.startswith("lm_head.weight ") and "F32" in line for line in text.splitlines())

    assert main(["inspect", str(tmp_path / "out"), "--summary"]) == 0
    assert "model.layers.0.mlp.gate_proj" not in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


# ---- bounded memory --------------------------------------------------------------------------------
MEASURE = """
import json, sys, torch
from microscale.models.cli_quantize import quantize_checkpoint
from microscale.quant import quantize

def hwm_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))

# Baseline: the interpreter with torch and microscale imported and the quantizer's code paths run once
# on a small tensor, before any checkpoint data is touched.
for fmt in ("nvfp4", "mxfp4", "mxfp8"):
    quantize(torch.randn(64, 2048), fmt)
baseline = hwm_kib()
quantize_checkpoint(sys.argv[1], sys.argv[2], "nvfp4", device="cpu", progress=False)
print(json.dumps({"baseline_kib": baseline, "peak_kib": hwm_kib()}))
"""


def test_streaming_peak_memory_is_bounded_by_the_largest_tensor(tmp_path, seed):
    """Peak RSS (VmHWM) above the baseline stays under 3x the largest tensor, on a 3-shard checkpoint
    of 80 MiB whose largest tensor is 32 MiB (float32 4096 x 2048)."""
    shards = {
        "model-00001-of-00003.safetensors": {
            f"model.layers.0.self_attn.{p}.weight": torch.randn(1024, 2048) for p in ("q_proj", "k_proj", "v_proj")},
        "model-00002-of-00003.safetensors": {"model.layers.0.mlp.up_proj.weight": torch.randn(4096, 2048)},
        "model-00003-of-00003.safetensors": {"model.layers.0.mlp.down_proj.weight": torch.randn(2048, 1024),
                                             "model.norm.weight": torch.ones(2048),
                                             "lm_head.weight": torch.randn(1024, 2048)},
    }
    src = write_sharded(tmp_path / "src", shards)
    largest = 4096 * 2048 * 4
    expected_up = quantize(shards["model-00002-of-00003.safetensors"]["model.layers.0.mlp.up_proj.weight"], "nvfp4")
    del shards

    # One thread: the 2-core CI machine is shared, and memory, not speed, is measured here.
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(tmp_path / "out")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    grown = (m["peak_kib"] - m["baseline_kib"]) * 1024
    print(f"baseline {m['baseline_kib'] / 1024:.1f} MiB, peak {m['peak_kib'] / 1024:.1f} MiB, "
          f"growth {grown / 2**20:.1f} MiB = {grown / largest:.2f} x the largest tensor ({largest / 2**20:.0f} MiB)")
    assert grown < 3 * largest

    ck = load_checkpoint(tmp_path / "out")
    got = ck.quantized["model.layers.0.mlp.up_proj"]
    assert torch.equal(got.data, expected_up.data) and torch.equal(got.scale.view(torch.uint8),
                                                                   expected_up.scale.view(torch.uint8))
    assert sorted(ck.quantized) == [f"model.layers.0.{m}" for m in ("mlp.down_proj", "mlp.up_proj",
                                                                     "self_attn.k_proj", "self_attn.q_proj",
                                                                     "self_attn.v_proj")]
    assert "lm_head.weight" in ck.tensors
