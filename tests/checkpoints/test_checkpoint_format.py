"""compressed-tensors checkpoints at the QTensor level: names, dtypes, shapes and bytes on disk
against formats-spec section 4 (read back with safetensors itself), sharding, and round trips."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import spec_reference as ref
from ckpt_helpers import pack_codes
from microscale.formats.checkpoint import (
    INDEX_NAME,
    compressed_tensors_config,
    load_checkpoint,
    plan_checkpoint,
    qtensor_state,
    write_checkpoint,
)
from microscale.quant import quantize

FORMATS = ("nvfp4", "mxfp4", "mxfp8")


def _weight(n, k):
    """Rows spanning 12 decades, an all-zero row, subnormal-sized values and a huge one."""
    w = torch.randn(n, k) * torch.logspace(-6, 6, n)[:, None]
    w[0] = 0
    w[1, :7] = 1e-41
    w[2, 3] = 3e37
    return w


def _read_all(directory):
    """Every tensor of a checkpoint directory through safetensors' own loader (and the index)."""
    index = directory / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(directory / f)))
    return out


def _config(schemes, ignore=()):
    return {"config.json": json.dumps({"quantization_config": compressed_tensors_config(schemes, ignore)})}


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_disk_layout_matches_spec(tmp_path, seed, fmt):
    """Names/dtypes/shapes as compressed-tensors defines them; bytes from the numpy reference;
    scales row-major even when the QTensor held them swizzled."""
    n, k = 40, 96
    w = _weight(n, k)
    q = quantize(w, fmt, scale_layout="swizzled")
    write_checkpoint(tmp_path / "ck", qtensor_state("blk.proj", q), files=_config({"blk.proj": (fmt, None, False)}))
    disk = _read_all(tmp_path / "ck")

    x = w.numpy()
    if fmt == "nvfp4":
        codes, scale_codes, g = ref.quantize_nvfp4(x, "compressed-tensors")
        assert set(disk) == {"blk.proj.weight_packed", "blk.proj.weight_scale", "blk.proj.weight_global_scale"}
        assert disk["blk.proj.weight_global_scale"].dtype == torch.float32
        assert disk["blk.proj.weight_global_scale"].shape == (1,)
        assert disk["blk.proj.weight_global_scale"].item() == float(g)
        assert disk["blk.proj.weight_scale"].dtype == torch.float8_e4m3fn
    else:
        elem = "e2m1" if fmt == "mxfp4" else "e4m3"
        codes, scale_codes = ref.quantize_mx(x, 32, elem, "rceil")
        assert set(disk) == {f"blk.proj.{'weight_packed' if fmt == 'mxfp4' else 'weight'}", "blk.proj.weight_scale"}
        assert disk["blk.proj.weight_scale"].dtype == torch.uint8
    block = 16 if fmt == "nvfp4" else 32
    assert disk["blk.proj.weight_scale"].shape == (n, k // block)
    assert np.array_equal(disk["blk.proj.weight_scale"].view(torch.uint8).numpy(), scale_codes)
    if fmt == "mxfp8":
        assert disk["blk.proj.weight"].dtype == torch.float8_e4m3fn and disk["blk.proj.weight"].shape == (n, k)
        assert np.array_equal(disk["blk.proj.weight"].view(torch.uint8).numpy(), codes)
    else:
        assert disk["blk.proj.weight_packed"].dtype == torch.uint8 and disk["blk.proj.weight_packed"].shape == (n, k // 2)
        assert np.array_equal(disk["blk.proj.weight_packed"].numpy(), pack_codes(codes))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [64, 72])  # whole blocks; K padded to the next block (weight_shape)
def test_qtensor_round_trip_is_bit_exact(tmp_path, seed, fmt, k):
    w = _weight(33, k)
    q = quantize(w, fmt)
    bias = torch.randn(33, dtype=torch.bfloat16)
    state = {**qtensor_state("a.proj", q), "a.proj.bias": bias, "norm.weight": torch.randn(k)}
    write_checkpoint(tmp_path / "ck", state, files=_config({"a.proj": (fmt, None, False)}), max_shard_size=700)

    ck = load_checkpoint(tmp_path / "ck")
    got = ck.quantized["a.proj"]
    assert got.shape == (33, k) and got.fmt.name == fmt and got.scale_layout == "linear"
    assert torch.equal(got.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.uint8), q.scale.view(torch.uint8))
    if fmt == "nvfp4":
        assert got.global_scale.shape == () and got.global_scale.item() == q.global_scale.item()
    assert torch.equal(got.dequantize(), q.dequantize())
    assert torch.equal(ck.tensors["a.proj.bias"], bias) and ck.tensors["a.proj.bias"].dtype == torch.bfloat16
    assert torch.equal(ck.tensors["norm.weight"], state["norm.weight"])
    padded = (k % (16 if fmt == "nvfp4" else 32)) != 0
    assert ("a.proj.weight_shape" in _read_all(tmp_path / "ck")) == padded


def test_shards_respect_the_cap_and_the_index_is_complete(tmp_path, seed):
    tensors = {f"t{i}": torch.randn(50 + i) for i in range(12)}
    tensors["big"] = torch.randn(1000)  # larger than the cap: a shard of its own
    cap = 1000
    write_checkpoint(tmp_path / "ck", tensors, max_shard_size=cap)
    index = json.loads((tmp_path / "ck" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    for s in shards:
        with safe_open(str(tmp_path / "ck" / s), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            size = sum(f.get_tensor(name).numel() * 4 for name in f.keys())
            assert size <= cap or list(f.keys()) == ["big"]
    back = _read_all(tmp_path / "ck")
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_single_shard_has_no_index(tmp_path):
    write_checkpoint(tmp_path / "ck", {"a": torch.ones(3)})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["model.safetensors"]


def test_mixed_dtypes_in_one_shard_are_aligned(tmp_path):
    """Odd-sized uint8/fp8 tensors next to float32 scalars: safetensors reads every one back."""
    tensors = {"u": torch.arange(3, dtype=torch.uint8), "g": torch.tensor([2.5]), "s": torch.ones(5, dtype=torch.float8_e4m3fn),
               "h": torch.tensor([1.5, 2.5], dtype=torch.bfloat16), "d": torch.tensor([7], dtype=torch.int64)}
    write_checkpoint(tmp_path / "ck", tensors)
    back = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items())


def test_quantization_config_single_format():
    cfg = compressed_tensors_config({"m.q": ("nvfp4", None, False), "m.k": ("nvfp4", None, False)}, ["lm_head"])
    assert cfg["quant_method"] == "compressed-tensors" and cfg["quantization_status"] == "compressed"
    assert cfg["format"] == "nvfp4-pack-quantized" and cfg["ignore"] == ["lm_head"]
    (group,) = cfg["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["scale_dtype"], w["dynamic"]) == \
        (4, "float", "tensor_group", 16, "torch.float8_e4m3fn", False)


def test_quantization_config_mixed_formats_and_activations():
    cfg = compressed_tensors_config({"a": ("mxfp8", "mxfp8", False), "b": ("mxfp4", None, False),
                                     "c": ("nvfp4", "nvfp4", True), "d": ("mxfp4", None, False)})
    assert cfg["format"] == "mixed-precision"
    groups = {g["format"]: g for g in cfg["config_groups"].values()}
    assert set(groups) == {"mxfp8-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized"}
    assert groups["mxfp4-pack-quantized"]["targets"] == ["b", "d"]
    w = groups["mxfp8-quantized"]["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"], w["scale_dtype"]) == (8, "group", 32, "torch.uint8")
    assert groups["mxfp8-quantized"]["input_activations"]["dynamic"] is True
    assert groups["nvfp4-pack-quantized"]["input_activations"]["dynamic"] == "local"


def test_mixed_precision_checkpoint_round_trip(tmp_path, seed):
    w = torch.randn(32, 64)
    qs = {"x.a": quantize(w, "nvfp4"), "x.b": quantize(w, "mxfp4"), "x.c": quantize(w, "mxfp8")}
    state = {}
    for name, q in qs.items():
        state.update(qtensor_state(name, q))
    state.update(qtensor_state("x.d", qs["x.a"], input_global_scale=torch.tensor(3.0)))
    schemes = {n: (q.fmt, None, False) for n, q in qs.items()}
    schemes["x.d"] = ("nvfp4", "nvfp4", True)
    write_checkpoint(tmp_path / "ck", state, files=_config(schemes))
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.plan.format_tag == "mixed-precision"
    for name, q in qs.items():
        assert ck.quantized[name].fmt == q.fmt and torch.equal(ck.quantized[name].dequantize(), q.dequantize())
    assert ck.input_global_scales == {"x.d": torch.tensor(3.0)}
    assert ck.plan.quantized["x.d"].activations.name == "nvfp4" and ck.plan.quantized["x.a"].activations is None


def test_plan_reads_headers_only(tmp_path, seed, monkeypatch):
    q = quantize(torch.randn(16, 32), "mxfp4")
    write_checkpoint(tmp_path / "ck", qtensor_state("p", q), files=_config({"p": ("mxfp4", None, False)}))
    import microscale.formats.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "safe_open", None)  # any data read would fail
    plan = plan_checkpoint(tmp_path / "ck")
    assert plan.layout == "compressed-tensors" and plan.quantized["p"].shape == (16, 32)
