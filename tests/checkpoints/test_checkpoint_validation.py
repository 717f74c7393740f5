"""Every malformed input gets a CheckpointError that names the tensor and the file (one test per case).

Checkpoints are written with safetensors' own save_file, then broken in one place.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from ckpt_helpers import modelopt_nvfp4, write_modelopt, write_plain
from microscale.formats.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    CheckpointWriter,
    compressed_tensors_config,
    load_checkpoint,
    qtensor_state,
)
from microscale.quant import quantize

M = "layers.0.proj"
FILE = "model.safetensors"


def _tensors(fmt="nvfp4", k=64):
    q = quantize(torch.randn(32, k), fmt)
    return {**qtensor_state(M, q), f"{M}.bias": torch.randn(32), "norm.weight": torch.ones(64)}


def _ct(tmp_path, tensors, fmt="nvfp4", qc=None, act=None, static=False):
    qc = qc or compressed_tensors_config({M: (fmt, act, static)})
    return write_plain(tmp_path / "ck", tensors, {"quantization_config": qc})


def _fails(directory, *fragments):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in: {e.value}"
    return str(e.value)


# ---- tensors present / absent ---------------------------------------------------------------------
def test_missing_global_scale(tmp_path, seed):
    t = _tensors()
    del t[f"{M}.weight_global_scale"]
    _fails(_ct(tmp_path, t), f"missing tensor {M}.weight_global_scale", FILE)


def test_missing_block_scale(tmp_path, seed):
    t = _tensors("mxfp4")
    del t[f"{M}.weight_scale"]
    _fails(_ct(tmp_path, t, "mxfp4"), f"missing tensor {M}.weight_scale", FILE)


def test_fp8_weight_without_block_scales(tmp_path, seed):
    t = _tensors("mxfp8")
    del t[f"{M}.weight_scale"]
    _fails(_ct(tmp_path, t, "mxfp8"), f"'{M}.weight'", FILE, "weight_scale")


def test_extra_zero_point(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_zero_point"] = torch.zeros(32, 4, dtype=torch.float8_e4m3fn)
    _fails(_ct(tmp_path, t), f"{M}.weight_zero_point", FILE, "unexpected")


def test_float_weight_next_to_packed_weight(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight"] = torch.randn(32, 64)
    _fails(_ct(tmp_path, t), f"'{M}.weight'", FILE, "unexpected")


def test_input_global_scale_not_declared(tmp_path, seed):
    t = _tensors()
    t[f"{M}.input_global_scale"] = torch.tensor([10.0])
    _fails(_ct(tmp_path, t), f"{M}.input_global_scale", FILE, "unexpected")


def test_input_global_scale_declared_but_missing(tmp_path, seed):
    _fails(_ct(tmp_path, _tensors(), act="nvfp4", static=True), f"missing tensor {M}.input_global_scale", FILE)


# ---- dtypes and shapes ----------------------------------------------------------------------------
def test_wrong_data_dtype(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_packed"] = t[f"{M}.weight_packed"].view(torch.int8)
    _fails(_ct(tmp_path, t), f"{M}.weight_packed", FILE, "must be U8, got I8")


def test_wrong_scale_dtype(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_scale"] = t[f"{M}.weight_scale"].float()
    _fails(_ct(tmp_path, t), f"{M}.weight_scale", FILE, "must be F8_E4M3, got F32")


def test_mx_scale_stored_as_float8(tmp_path, seed):
    t = _tensors("mxfp4")
    t[f"{M}.weight_scale"] = t[f"{M}.weight_scale"].view(torch.float8_e4m3fn)
    _fails(_ct(tmp_path, t, "mxfp4"), f"{M}.weight_scale", FILE, "must be U8")


def test_scale_shape_does_not_match_weight(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_scale"] = t[f"{M}.weight_scale"][:, :3].contiguous()
    _fails(_ct(tmp_path, t), f"{M}.weight_scale", FILE, f"{M}.weight_packed", "[32, 4]")


def test_data_not_whole_blocks(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_packed"] = t[f"{M}.weight_packed"][:, :20].contiguous()
    _fails(_ct(tmp_path, t), f"{M}.weight_packed", FILE, "K=40", "block 16")


def test_data_not_2d(tmp_path, seed):
    t = _tensors("mxfp8")
    t[f"{M}.weight"] = t[f"{M}.weight"].reshape(32, 2, 32)
    _fails(_ct(tmp_path, t, "mxfp8"), f"{M}.weight", FILE, "2-D")


def test_global_scale_not_a_scalar(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_global_scale"] = torch.ones(2)
    _fails(_ct(tmp_path, t), f"{M}.weight_global_scale", FILE, "scalar")


def test_weight_shape_does_not_fit(tmp_path, seed):
    t = _tensors("mxfp4", k=72)  # padded to 96, with weight_shape [32, 72]
    t[f"{M}.weight_shape"] = torch.tensor([32, 40])
    _fails(_ct(tmp_path, t, "mxfp4"), f"{M}.weight_shape", FILE, "[32, 40]")


# ---- values -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf")])
def test_bad_global_scale_value(tmp_path, seed, value):
    t = _tensors()
    t[f"{M}.weight_global_scale"] = torch.tensor([value])
    _fails(_ct(tmp_path, t), f"{M}.weight_global_scale", FILE, "finite and > 0")


def test_zero_input_global_scale(tmp_path, seed):
    t = _tensors()
    t[f"{M}.input_global_scale"] = torch.tensor([0.0])
    _fails(_ct(tmp_path, t, act="nvfp4", static=True), f"{M}.input_global_scale", FILE, "finite and > 0")


def test_nan_e4m3_block_scale(tmp_path, seed):
    t = _tensors()
    t[f"{M}.weight_scale"].view(torch.uint8)[5, 2] = 0x7F  # E4M3 NaN
    _fails(_ct(tmp_path, t), f"{M}.weight_scale", FILE, "NaN", "(5, 2)")


def test_nan_e8m0_block_scale(tmp_path, seed):
    t = _tensors("mxfp8")
    t[f"{M}.weight_scale"][7, 1] = 0xFF  # E8M0 NaN
    _fails(_ct(tmp_path, t, "mxfp8"), f"{M}.weight_scale", FILE, "NaN", "(7, 1)")


# ---- configs --------------------------------------------------------------------------------------
def test_unknown_format_tag(tmp_path, seed):
    qc = compressed_tensors_config({M: ("nvfp4", None, False)})
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "int4-pack-quantized"
    _fails(_ct(tmp_path, _tensors(), qc=qc), "config.json", "unknown format tag 'int4-pack-quantized'")


def test_group_arguments_contradict_format_tag(tmp_path, seed):
    qc = compressed_tensors_config({M: ("nvfp4", None, False)})
    qc["config_groups"]["group_0"]["weights"]["group_size"] = 32
    _fails(_ct(tmp_path, _tensors(), qc=qc), "config.json", "group_size 32", "nvfp4-pack-quantized")


def test_unknown_quant_method(tmp_path, seed):
    _fails(_ct(tmp_path, _tensors(), qc={"quant_method": "gptq"}), "config.json", "unknown quant_method 'gptq'")


def test_not_compressed_status(tmp_path, seed):
    qc = compressed_tensors_config({M: ("nvfp4", None, False)})
    qc["quantization_status"] = "frozen"
    _fails(_ct(tmp_path, _tensors(), qc=qc), "config.json", "'frozen'")


def test_module_not_targeted_by_any_group(tmp_path, seed):
    qc = compressed_tensors_config({"other.a": ("nvfp4", None, False), "other.b": ("mxfp4", None, False)})
    _fails(_ct(tmp_path, _tensors(), qc=qc), M, FILE, "no config group")


def test_quantized_tensors_without_a_quantization_config(tmp_path, seed):
    _fails(write_plain(tmp_path / "ck", _tensors(), {"model_type": "llama"}), M, FILE, "looks quantized")


# ---- damaged files --------------------------------------------------------------------------------
def test_truncated_file(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    path = d / FILE
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    msg = _fails(d, str(path), "truncated")
    assert "norm.weight" in msg or M in msg  # the tensor whose bytes are cut off


def test_file_shorter_than_its_header(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    (d / FILE).write_bytes((d / FILE).read_bytes()[:100])
    _fails(d, str(d / FILE), "truncated")


def test_corrupt_header(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    raw = bytearray((d / FILE).read_bytes())
    raw[20:30] = b"\xff" * 10
    (d / FILE).write_bytes(bytes(raw))
    _fails(d, str(d / FILE), "corrupt safetensors header")


def test_header_entry_with_wrong_byte_count(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    raw = (d / FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["norm.weight"]["shape"] = [65]  # 260 bytes claimed, 256 stored
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    (d / FILE).write_bytes(raw[:8] + new + raw[8 + n:])
    _fails(d, "'norm.weight'", str(d / FILE), "data_offsets")


def test_unsupported_dtype_in_header(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    raw = (d / FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (d / FILE).write_bytes(raw[:8] + raw[8:8 + n].replace(b'"F32"', b'"Q99"', 1) + raw[8 + n:])
    _fails(d, str(d / FILE), "unsupported dtype 'Q99'")


def test_index_names_a_missing_shard(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {f"{M}.bias": "model-00002-of-00002.safetensors"}}))
    _fails(d, f"{M}.bias", "model-00002-of-00002.safetensors", INDEX_NAME)


def test_index_and_file_disagree(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    weight_map = {n: FILE for n in _tensors()}
    weight_map["ghost.weight"] = FILE
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    _fails(d, "ghost.weight", FILE, "does not contain it")


def test_tensor_in_file_but_not_in_index(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    weight_map = {n: FILE for n in _tensors() if n != "norm.weight"}
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    _fails(d, "norm.weight", FILE, "not mapped")


def test_same_tensor_in_two_files(tmp_path, seed):
    d = _ct(tmp_path, _tensors())
    save_file({"norm.weight": torch.ones(64)}, str(d / "extra.safetensors"))
    _fails(d, "norm.weight", FILE, "extra.safetensors")


# ---- ModelOpt and gpt-oss specifics -------------------------------------------------------------
def _modelopt(tmp_path, **changes):
    packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 32))
    t = {"a.weight": packed, "a.weight_scale": scale, "a.weight_scale_2": ws2, "a.input_scale": torch.tensor(0.01)}
    for name, value in changes.items():
        if value is None:
            del t[name]
        else:
            t[name] = value
    return write_modelopt(tmp_path / "mo", t)


def test_modelopt_zero_weight_scale_2(tmp_path, seed):
    _fails(_modelopt(tmp_path, **{"a.weight_scale_2": torch.tensor(0.0)}), "a.weight_scale_2", FILE, "finite and > 0")


def test_modelopt_uncalibrated_zero_input_scale(tmp_path, seed):
    """vllm#45212: an input_scale of 0 would become an infinite global scale; refuse it."""
    _fails(_modelopt(tmp_path, **{"a.input_scale": torch.tensor(0.0)}), "a.input_scale", FILE, "finite and > 0")


def test_modelopt_subnormal_decode_scale_overflows(tmp_path, seed):
    _fails(_modelopt(tmp_path, **{"a.weight_scale_2": torch.tensor(1e-45)}), "a.weight_scale_2", FILE, "reciprocal")


def test_modelopt_missing_weight_scale_2(tmp_path, seed):
    _fails(_modelopt(tmp_path, **{"a.weight_scale_2": None}), "missing tensor a.weight_scale_2", FILE)


def test_modelopt_unsupported_algorithm(tmp_path, seed):
    packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 32))
    d = write_modelopt(tmp_path / "mo", {"a.weight": packed, "a.weight_scale": scale, "a.weight_scale_2": ws2},
                       quant={"quant_algo": "W4A8_AWQ"})
    _fails(d, "hf_quant_config.json", "'W4A8_AWQ'")


def test_modelopt_mixed_precision_non_nvfp4_layer(tmp_path, seed):
    packed, scale, ws2, _ = modelopt_nvfp4(torch.randn(16, 32))
    quant = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": {"quant_algo": "FP8"}}}
    d = write_modelopt(tmp_path / "mo", {"a.weight": packed, "a.weight_scale": scale, "a.weight_scale_2": ws2},
                       quant=quant)
    _fails(d, "hf_quant_config.json", "layer a", "'FP8'")


def _gpt_oss(tmp_path, blocks, scales):
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    tensors = {"e.gate_up_proj_blocks": blocks}
    if scales is not None:
        tensors["e.gate_up_proj_scales"] = scales
    return write_plain(tmp_path / "oss", tensors, config)


def test_gpt_oss_scales_shape_mismatch(tmp_path, seed):
    blocks = torch.zeros(2, 8, 3, 16, dtype=torch.uint8)
    _fails(_gpt_oss(tmp_path, blocks, torch.zeros(2, 8, 2, dtype=torch.uint8)), "e.gate_up_proj_scales", FILE,
           "[2, 8, 3]")


def test_gpt_oss_blocks_without_scales(tmp_path, seed):
    _fails(_gpt_oss(tmp_path, torch.zeros(2, 8, 3, 16, dtype=torch.uint8), None), "e.gate_up_proj_scales", FILE)


def test_gpt_oss_blocks_of_wrong_width(tmp_path, seed):
    blocks = torch.zeros(2, 8, 3, 8, dtype=torch.uint8)
    _fails(_gpt_oss(tmp_path, blocks, torch.zeros(2, 8, 3, dtype=torch.uint8)), "e.gate_up_proj_blocks", FILE,
           "[E, rows, K/32, 16]")


def test_gpt_oss_nan_scale(tmp_path, seed):
    scales = torch.full((2, 8, 3), 127, dtype=torch.uint8)
    scales[1, 4, 2] = 0xFF
    _fails(_gpt_oss(tmp_path, torch.zeros(2, 8, 3, 16, dtype=torch.uint8), scales), "e.gate_up_proj_scales", FILE,
           "(4, 2)")


# ---- writer -------------------------------------------------------------------------------------
def test_writer_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        CheckpointWriter(tmp_path / "home", [])
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"
