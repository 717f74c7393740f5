"""quantize_model(method=, rotation=), rotated layers, their checkpoints and the CLI (issue 8's wiring)."""

import copy
import json

import pytest
import torch
from conftest import sqnr_db, tiny_llama
from torch import nn

from microscale.__main__ import main
from microscale.formats.checkpoint import CheckpointError, plan_checkpoint
from microscale.kernels.ops import quantize_dequantize_activations
from microscale.models import eval as ev
from microscale.models.cli_quantize import quantize_checkpoint
from microscale.models.linear import FP4Linear, FP8Linear, QuantizedLinear, quantized_linear_class
from microscale.models.quantize_model import fused_groups, quantize_model
from microscale.models.serialization import load_quantized, save_quantized
from microscale.quant import quantize
from microscale.quant.calibration import calibration_ids
from microscale.quant.methods import quantize_weight
from microscale.quant.scale_search import search_quantize

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB_SHAPE = (4, 32)  # calibration sequences x tokens: enough for every Hessian of the tiny model


def hadamard_reference(k: int, block: int) -> torch.Tensor:
    """Block-diagonal R [k, k] in float64: Kronecker powers of [[1, 1], [1, -1]], normalized."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.kron(h2, h)
    return torch.block_diag(*[h / block**0.5] * (k // block))


def linears(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantizedLinear))}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def same_layers(a: nn.Module, b: nn.Module):
    qa = {n: m for n, m in a.named_modules() if isinstance(m, QuantizedLinear)}
    qb = {n: m for n, m in b.named_modules() if isinstance(m, QuantizedLinear)}
    assert qa.keys() == qb.keys() and qa
    for n in qa:
        assert qa[n].rotation == qb[n].rotation, n
        for buf in ("weight_data", "weight_scale", "weight_global_scale"):
            x, y = getattr(qa[n], buf), getattr(qb[n], buf)
            if x is None or y is None:
                assert x is y, f"{n}.{buf}"
            else:
                assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{n}.{buf}"


# ---- rotation: float identity, rotated layers --------------------------------------------------------
@pytest.mark.parametrize("block", [16, 32])
def test_rotated_float_model_equals_the_original(seed, block):
    """Every Linear computing (x R)(W R)^T gives the original logits: R is orthogonal (before quantization)."""
    model = tiny_llama()
    rotated = copy.deepcopy(model)
    for layer in linears(rotated).values():
        r = hadamard_reference(layer.in_features, block).float()
        layer.weight.data = layer.weight.data @ r
        layer.register_forward_pre_hook(lambda mod, args, r=r: (args[0] @ r,))
    ids = torch.randint(0, 160, (2, 11))
    assert sqnr_db(logits(model, ids), logits(rotated, ids)) > 100
    layer = FP4Linear.from_linear(nn.Linear(64, 8), rotation=block)
    x = torch.randn(3, 64)
    assert torch.allclose(layer.rotate_input(layer.rotate_input(x)), x, atol=1e-6)  # R R = I


@pytest.mark.parametrize("fmt,block,activations", [("nvfp4", 16, None), ("mxfp4", 32, None), ("mxfp8", 16, None),
                                                   ("nvfp4", 32, "nvfp4")])
def test_rotated_layer_multiplies_the_rotated_input(seed, fmt, block, activations):
    """y = (x R) dequant(Q)^T + b, with Q = quantized W R; inputs in low precision are x R quantized."""
    w, bias = torch.randn(24, 96), torch.randn(24)
    q = quantize_weight(w, fmt, rotation_block=block)
    layer = quantized_linear_class(fmt).from_qtensor(q, bias, activations=activations, rotation=block)
    x = torch.randn(2, 5, 96)
    x_rot = (x.double() @ hadamard_reference(96, block)).float()
    if activations:
        # quantized from the layer's own float32 x R: a value one rounding away from the float64 one can
        # land on the other side of a code boundary (1 seed in 200 did)
        layer_rot = layer.rotate_input(x)
        assert torch.allclose(layer_rot, x_rot, rtol=0, atol=1e-5)
        x_rot = quantize_dequantize_activations(layer_rot.reshape(-1, 96), activations).reshape(x.shape)
    want = x_rot.double() @ q.dequantize().double().T + bias.double()
    assert torch.allclose(layer(x).double(), want, rtol=1e-5, atol=1e-4)
    # and it approximates the unrotated float layer (to the format's error, not garbage)
    assert sqnr_db(x @ w.T + bias, layer(x)) > {"nvfp4": 13, "mxfp4": 11, "mxfp8": 25}[fmt]


def test_rotation_survives_state_dict_meta_copy_and_moves(seed):
    layer = FP4Linear.from_linear(nn.Linear(64, 16), "mxfp4", rotation=32)
    assert "rotation=block_hadamard(32)" in repr(layer) and "rotation" not in repr(FP4Linear(64, 16))
    assert not any("rotation" in k for k in layer.state_dict())  # recorded in the checkpoint config instead
    x = torch.randn(4, 64)
    empty = FP4Linear(64, 16, fmt="mxfp4", device="meta", rotation=32)
    empty.load_state_dict(layer.state_dict(), assign=True)
    for other in (empty, copy.deepcopy(layer), copy.deepcopy(layer).to("cpu")):
        assert other.rotation == 32 and torch.equal(other(x), layer(x))
    bf16 = copy.deepcopy(layer).to(torch.bfloat16)  # the rotation stays exact float32, cast per call
    assert bf16.prepared_rotation.dtype == torch.float32
    assert sqnr_db(layer(x), bf16(x.bfloat16()).float()) > 40
    with pytest.raises(ValueError, match=r"rotation=8 needs a block size in \(16, 32\)"):
        FP4Linear(64, 16, rotation=8)
    with pytest.raises(ValueError, match="divides in_features=48"):
        FP4Linear(48, 16, rotation=32)


def test_rotated_layer_compiles_fullgraph(seed):
    layer = FP8Linear.from_linear(nn.Linear(64, 16), "mxfp8", rotation=16)
    x = torch.randn(3, 64)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x))


# ---- quantize_model(method=, rotation=) -------------------------------------------------------------
def test_search_never_loses_to_rtn_and_fused_groups_share_the_searched_scale(seed):
    model = tiny_llama()
    floats = {n: m.weight.detach().clone() for n, m in linears(model).items()}
    report = quantize_model(model, "nvfp4", method="search", progress=False)
    assert report.method == "search" and "(method search)" in str(report)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    for group in fused_groups(layers):
        assert len({layers[n].weight_global_scale.item() for n in group}) == 1
        assert len({layers[n].weight_global_scale.data_ptr() for n in group}) == len(group)  # own storage
    for n, layer in layers.items():
        g = layer.weight_global_scale
        err = (layer.qweight.dequantize() - floats[n]).square().sum()
        rtn = quantize(floats[n], "nvfp4", global_scale=g)  # RTN under the same global scale
        assert err <= (rtn.dequantize() - floats[n]).square().sum(), n
        assert torch.equal(layer.weight_data, search_quantize(floats[n], "nvfp4", global_scale=g).data), n


@pytest.mark.parametrize("rotation", [None, 16])
def test_gptq_is_wired_with_groups_calibration_and_rotation(seed, rotation):
    """quantize_model(method="gptq") gives each layer what quantize_weight gives it with the layer's
    Hessian (collected here independently), the group's shared global scale and the rotation."""
    model = tiny_llama()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 160, CALIB_SHAPE)
    report = quantize_model(model, "nvfp4", method="gptq", calibration=ids, rotation=rotation, progress=False)
    assert (report.method, report.rotation) == ("gptq", rotation)
    # the first layer's q_proj sees the embeddings' RMS-normed output, the same with or without quantization
    layer0 = original.model.layers[0]
    seen = []
    handle = layer0.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 64)))
    logits(original, ids)
    handle.remove()
    x = torch.cat(seen).double()
    hessian = (x.T @ x / x.shape[0]).float()
    q = model.model.layers[0].self_attn.q_proj
    want = quantize_weight(layer0.self_attn.q_proj.weight.detach(), "nvfp4", method="gptq", hessian=hessian,
                           global_scale=q.weight_global_scale, rotation_block=rotation)
    assert q.rotation == rotation
    same = (q.weight_data == want.data).float().mean().item()  # Hessians summed in another order: ~all codes
    assert same > 0.99 and torch.equal(q.weight_global_scale, want.global_scale)
    # GPTQ minimizes the output error on the calibration inputs: better than RTN's on them
    rtn = copy.deepcopy(original)
    quantize_model(rtn, "nvfp4", rotation=rotation, progress=False)
    ref = logits(original, ids)
    assert sqnr_db(ref, logits(model, ids)) > sqnr_db(ref, logits(rtn, ids))


def test_quantize_model_rejects_mismatched_method_arguments():
    model = tiny_llama()
    with pytest.raises(ValueError, match="needs calibration token ids"):
        quantize_model(model, "nvfp4", method="gptq", progress=False)
    with pytest.raises(ValueError, match="used by method='gptq' only"):
        quantize_model(model, "nvfp4", method="search", calibration=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="takes no GPTQ options; got damp"):
        quantize_model(model, "nvfp4", method="rtn", damp=0.1, progress=False)
    with pytest.raises(ValueError, match="method='awq'"):
        quantize_model(model, "nvfp4", method="awq")
    with pytest.raises(ValueError, match=r"outside the transformer layers \(model.layers\) .* 'lm_head'"):
        quantize_model(model, "nvfp4", method="gptq", calibration=torch.zeros(1, 4, dtype=torch.long), exclude=())
    ragged = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    with pytest.raises(ValueError, match=r"rotation=32 needs in_features divisible by 32; .* '2' \(in_features=48\)"):
        quantize_model(ragged, "mxfp4", rotation=32)
    assert all(type(m) is nn.Linear for m in linears(ragged).values())  # refused before touching the model
    assert all(type(m) is nn.Linear for m in linears(model).values())


def test_meta_model_gets_rotated_empty_layers():
    with torch.device("meta"):
        model = tiny_llama()
    quantize_model(model, "nvfp4", rotation=16, progress=False)
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, FP4Linear) and layer.rotation == 16 and layer.weight_data.is_meta


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,method,rotation", [("nvfp4", "rtn", None), ("mxfp4", "search", None),
                                                 ("nvfp4", "gptq", None), ("nvfp4", "gptq", 16),
                                                 ("mxfp4", "search", 32)])
def test_checkpoint_per_method_loads_with_identical_outputs(tmp_path, seed, fmt, method, rotation, capsys):
    model = tiny_llama()
    ids = torch.randint(0, 160, CALIB_SHAPE)
    quantize_model(model, fmt, method=method, rotation=rotation, progress=False,
                   calibration=ids if method == "gptq" else None)
    save_quantized(model, tmp_path / "q", max_shard_size="40KB")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    if rotation is None:  # an ordinary compressed-tensors checkpoint: nothing only microscale reads
        assert qc["quant_method"] == "compressed-tensors" and "microscale" not in qc
    else:  # a quant_method no other loader accepts
        assert qc["quant_method"] == "microscale-rotated"
        assert qc["microscale"] == {"rotation": {"type": "block_hadamard", "block_size": rotation}}
    assert plan_checkpoint(tmp_path / "q").rotation == rotation
    assert main(["inspect", str(tmp_path / "q")]) == 0
    assert (f"Hadamard rotated ({rotation})" in capsys.readouterr().out) == (rotation is not None)

    loaded = load_quantized(tmp_path / "q")
    same_layers(model, loaded)
    tokens = torch.randint(0, 160, (2, 9))
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))


def _rewrite_config(directory, change):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config["quantization_config"])
    path.write_text(json.dumps(config))


def test_rotation_records_are_checked(tmp_path, seed):
    model = tiny_llama()
    quantize_model(model, "nvfp4", rotation=16, progress=False)
    save_quantized(model, tmp_path / "q")
    _rewrite_config(tmp_path / "q", lambda qc: qc.update(quant_method="compressed-tensors"))
    with pytest.raises(CheckpointError, match="a rotation must come with quant_method 'microscale-rotated'"):
        load_quantized(tmp_path / "q")
    _rewrite_config(tmp_path / "q", lambda qc: qc.update(quant_method="microscale-rotated",
                                                        microscale={"rotation": {"type": "givens", "block_size": 16}}))
    with pytest.raises(CheckpointError, match="unsupported rotation.*'givens'"):
        load_quantized(tmp_path / "q")
    _rewrite_config(tmp_path / "q", lambda qc: qc.pop("microscale"))
    with pytest.raises(CheckpointError, match="quant_method 'microscale-rotated' with rotation None"):
        load_quantized(tmp_path / "q")

    mixed = tiny_llama()
    quantize_model(mixed, "nvfp4", include=["*.mlp.*"], rotation=16, progress=False)
    quantize_model(mixed, "nvfp4", include=["*.self_attn.*"], progress=False)
    with pytest.raises(ValueError, match=r"different rotations \[16, None\]"):
        save_quantized(mixed, tmp_path / "mixed")


# ---- CLI ----------------------------------------------------------------------------------------
@pytest.fixture
def float_checkpoint(tmp_path, seed):
    """A tiny Llama saved by transformers, with a character-level tokenizer (for GPTQ's calibration text)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama()
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="60KB")
    vocab = {"[UNK]": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="[UNK]")),
                                        unk_token="[UNK]")
    tokenizer.save_pretrained(src)
    return src, model, tokenizer


@pytest.mark.parametrize("fmt,method,rotation", [("nvfp4", "search", None), ("mxfp4", "search", None),
                                                 ("nvfp4", "rtn", 16), ("mxfp8", "search", 32)])
def test_cli_streaming_methods_match_quantize_model(tmp_path, float_checkpoint, fmt, method, rotation, capsys):
    src, model, _ = float_checkpoint
    out = tmp_path / "out"
    argv = ["quantize", str(src), str(out), "--format", fmt, "--method", method, "--max-shard-size", "30KB",
            "--quiet"] + (["--rotation", str(rotation)] if rotation else [])
    assert main(argv) == 0
    assert f"(method {method}" in capsys.readouterr().out
    quantize_model(model, fmt, method=method, rotation=rotation, progress=False)
    loaded = load_quantized(out)
    same_layers(model, loaded)  # chunked, tensor by tensor: the same bits as the whole-model path
    tokens = torch.randint(0, 96, (2, 7))
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))


def test_cli_gptq_loads_the_model_and_matches_quantize_model(tmp_path, float_checkpoint, capsys):
    src, model, tokenizer = float_checkpoint
    out = tmp_path / "out"
    argv = ["quantize", str(src), str(out), "--method", "gptq", "--rotation", "16", "--quiet",
            "--calib-samples", str(CALIB_SHAPE[0]), "--calib-len", str(CALIB_SHAPE[1])]
    assert main(argv) == 0
    assert "(method gptq + block-wise Hadamard rotation (16))" in capsys.readouterr().out
    assert (out / "tokenizer.json").exists()
    calibration = calibration_ids(tokenizer, *CALIB_SHAPE)
    quantize_model(model, "nvfp4", method="gptq", calibration=calibration, rotation=16, progress=False)
    loaded = load_quantized(out)
    same_layers(model, loaded)
    tokens = torch.randint(0, 96, (2, 7))
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))


def test_cli_method_errors(tmp_path, float_checkpoint, capsys):
    src, _, _ = float_checkpoint
    assert main(["quantize", str(src), str(tmp_path / "o"), "--calib-samples", "4", "--quiet"]) == 2
    assert "--calib-samples/--calib-len are for --method gptq" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs the model run"):
        quantize_checkpoint(src, tmp_path / "o", "nvfp4", method="gptq")
    with pytest.raises(SystemExit):
        main(["quantize", str(src), str(tmp_path / "o"), "--rotation", "8"])


# ---- eval ---------------------------------------------------------------------------------------
def test_eval_variants_quantize_by_method_and_measure_rotated_weights_unrotated(seed):
    model = tiny_llama()
    reference = {n: m.weight.detach().clone() for n, m in linears(model).items()}
    plain, rotated = ev.Variant("nvfp4", method="search"), ev.Variant("nvfp4", method="search", rotation=16)
    assert (plain.label, rotated.label, ev.Variant("nvfp4").label) == ("nvfp4 search", "nvfp4 search+rot16", "nvfp4")
    errors = {}
    for v in (plain, rotated):
        m, report = ev.quantized_copy(model, v, "cpu")
        assert report.method == "search" and m.model.layers[0].mlp.up_proj.rotation == v.rotation
        errors[v.label] = ev.weight_error(reference, m)["sqnr_db"]
    assert abs(errors["nvfp4 search+rot16"] - errors["nvfp4 search"]) < 3  # rotated back before comparing


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block,activations", [("nvfp4", 16, None), ("mxfp4", 32, None), ("mxfp8", 32, None),
                                                   ("nvfp4", 16, "nvfp4")])
@torch.no_grad()
def test_rotated_layer_on_gpu_matches_cpu_and_captures_in_a_cuda_graph(seed, fmt, block, activations):
    """The device backend (sm90 on Hopper) multiplies the rotated input as the CPU reference does; the
    rotation builds nothing on the host per call, so the layer captures in a CUDA graph."""
    layer = quantized_linear_class(fmt).from_linear(nn.Linear(256, 192), fmt, activations=activations,
                                                    rotation=block)
    x = torch.randn(8, 256)
    want = layer(x)
    gpu = copy.deepcopy(layer).cuda().to(torch.bfloat16)
    static_x = x.cuda().bfloat16()
    got = gpu(static_x)
    assert sqnr_db(want, got.float().cpu()) > (25 if activations else 35), gpu.backend
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(static_x)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
