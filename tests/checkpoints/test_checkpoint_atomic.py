"""Atomic checkpoint writes: a save killed mid-way (SIGKILL after its first shard) leaves the earlier
checkpoint in the directory byte for byte; a completed save replaces it entirely."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from microscale.formats.checkpoint import SHARD_DELAY_ENV, CheckpointError, CheckpointWriter, TensorSpec, \
    load_checkpoint, write_checkpoint

REPO = Path(__file__).resolve().parents[2]

SAVE_B = """
import sys, torch
from microscale.formats.checkpoint import write_checkpoint
torch.manual_seed(1)
tensors = {f"b{i}": torch.randn(256) for i in range(6)}  # 1 KiB each: six shards under a 1 KiB cap
write_checkpoint(sys.argv[1], tensors, files={"config.json": "{}"}, max_shard_size=1024)
"""


def _snapshot(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_killed_save_leaves_the_earlier_checkpoint_intact(tmp_path, seed):
    out = tmp_path / "ck"
    earlier = {f"a{i}": torch.randn(300) for i in range(5)}
    write_checkpoint(out, earlier, files={"config.json": "{}"}, max_shard_size=2400)  # 2 tensors a shard
    before = _snapshot(out)
    assert len([n for n in before if n.endswith(".safetensors")]) == 3

    env = dict(os.environ, PYTHONPATH=str(REPO), **{SHARD_DELAY_ENV: "60"})
    proc = subprocess.Popen([sys.executable, "-c", SAVE_B, str(out)], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        first_shard = None
        while first_shard is None and time.monotonic() < deadline and proc.poll() is None:
            first_shard = next(iter(tmp_path.glob(".ck.tmp-*/model-00001-of-00006.safetensors")), None)
            time.sleep(0.05)
        assert first_shard is not None, "the killed save never wrote its first shard"
        time.sleep(0.3)  # inside the writer's post-shard sleep: shard 1 is complete, shard 2 not begun
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    assert _snapshot(out) == before
    ck = load_checkpoint(out)
    assert ck.tensors.keys() == earlier.keys() and all(torch.equal(ck.tensors[n], t) for n, t in earlier.items())
    stale = list(tmp_path.glob(".ck.tmp-*"))
    assert len(stale) == 1 and sorted(p.name for p in stale[0].iterdir()) == ["model-00001-of-00006.safetensors"]


def test_completed_save_replaces_every_file(tmp_path, seed):
    out = tmp_path / "ck"
    write_checkpoint(out, {f"a{i}": torch.randn(300) for i in range(5)}, files={"config.json": "{}"},
                     max_shard_size=2000)
    newer = {"b": torch.randn(10)}
    write_checkpoint(out, newer, files={"config.json": "{}"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_checkpoint(out).tensors["b"], newer["b"])
    assert not list(tmp_path.glob(".ck.*"))  # neither the temporary nor the replaced directory is left


def test_failed_write_removes_its_temporary_directory(tmp_path, seed):
    out = tmp_path / "ck"
    write_checkpoint(out, {"a": torch.ones(4)})
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match="'b'"):
        with CheckpointWriter(out, [TensorSpec("a", torch.float32, (4,)), TensorSpec("b", torch.float32, (4,))]) as w:
            w.write("a", torch.zeros(4))
            w.write("b", torch.zeros(5))  # not the planned shape
    assert _snapshot(out) == before and not list(tmp_path.glob(".ck.*"))


def test_unwritten_tensor_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="'b' was never written"):
        with CheckpointWriter(tmp_path / "ck", [TensorSpec("a", torch.float32, (1,)),
                                                TensorSpec("b", torch.float32, (1,))]) as w:
            w.write("a", torch.zeros(1))
    assert not (tmp_path / "ck").exists()
