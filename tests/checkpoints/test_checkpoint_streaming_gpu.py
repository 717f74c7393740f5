"""`python -m microscale quantize` on CUDA (the default device when there is one) writes the CPU's bytes."""

import pytest
import torch

from ckpt_helpers import write_sharded
from microscale.__main__ import main
from microscale.formats.checkpoint import INDEX_NAME, CheckpointError
from microscale.models import cli_quantize
from microscale.models.cli_quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture
def synthetic_checkpoint(tmp_path, seed):
    """Three shards: fused q/k/v (a shared NVFP4 global scale), bf16 and fp16 weights, a K that is not a
    whole number of blocks (zero-padded), subnormal, huge and zero rows, and float tensors left as they are."""
    down = torch.randn(96, 200) * torch.logspace(-3, 3, 200)
    down[0], down[1, :7], down[2, 3] = 0.0, 1e-41, 3e4
    return write_sharded(tmp_path / "src", {
        "model-00001-of-00003.safetensors": {
            f"model.layers.0.self_attn.{p}.weight": torch.randn(n, 256) * s
            for p, n, s in (("q_proj", 256, 1.0), ("k_proj", 64, 4.0), ("v_proj", 64, 0.25))},
        "model-00002-of-00003.safetensors": {"model.layers.0.mlp.up_proj.weight": torch.randn(320, 256).bfloat16(),
                                             "model.layers.0.mlp.gate_proj.weight": torch.randn(320, 256).half()},
        "model-00003-of-00003.safetensors": {"model.layers.0.mlp.down_proj.weight": down,
                                             "model.norm.weight": torch.ones(256),
                                             "lm_head.weight": torch.randn(100, 256)},
    })


def files(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_cuda_output_bytes_equal_cpu(tmp_path, synthetic_checkpoint, fmt, monkeypatch, capsys):
    # Small chunks, of different sizes on the two devices: many chunks per tensor, split differently.
    monkeypatch.setitem(cli_quantize.CHUNK_ELEMENTS, "cpu", 2**13)
    monkeypatch.setitem(cli_quantize.CHUNK_ELEMENTS, "cuda", 3 * 2**12)
    quantize_checkpoint(synthetic_checkpoint, tmp_path / "cpu", fmt, device="cpu", max_shard_size="60KB",
                        progress=False)
    assert main(["quantize", str(synthetic_checkpoint), str(tmp_path / "cuda"), "--format", fmt,
                 "--max-shard-size", "60KB", "--quiet"]) == 0  # the default device: cuda
    assert "6 layers quantized" in capsys.readouterr().out
    cpu, cuda = files(tmp_path / "cpu"), files(tmp_path / "cuda")
    assert sorted(cpu) == sorted(cuda) and INDEX_NAME in cpu
    for name in cpu:
        assert cpu[name] == cuda[name], f"{name} differs between the CPU and the CUDA output"


def test_cuda_path_runs_the_fused_kernel_and_rejects_nan(tmp_path, synthetic_checkpoint, monkeypatch):
    from microscale.kernels import quantize as kernel

    calls = []
    original = kernel.quantize_gpu
    monkeypatch.setattr(kernel, "quantize_gpu", lambda *a, **kw: calls.append(a[0].device) or original(*a, **kw))
    quantize_checkpoint(synthetic_checkpoint, tmp_path / "out", "nvfp4", device="cuda", progress=False)
    assert calls and all(d.type == "cuda" for d in calls)

    w = torch.randn(16, 64)
    w[3, 5] = float("nan")
    bad = write_sharded(tmp_path / "bad", {"model.safetensors": {"layer.weight": w}})
    with pytest.raises(CheckpointError, match=r"'layer.weight'.*NaN"):
        quantize_checkpoint(bad, tmp_path / "bad_out", "nvfp4", device="cuda", progress=False)
    assert not (tmp_path / "bad_out").exists()
