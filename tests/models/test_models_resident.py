"""What a quantized layer keeps resident when its backend prepares another layout (issue #6).

The sm90 backend cannot run on the CPU, so its layout (prepare = shuffle_weights, unprepare =
unshuffle_weights) is registered here as a CPU backend, "test-shuffled", whose gemm rebuilds the
canonical weight with unprepare and runs the reference gemm. The module logic it exercises is the
one a layer on an H200 runs; test_sm90_layer_holds_only_the_prepared_copy checks it there.
"""

import copy
import io

import pytest
import torch
from torch import nn

from microscale.kernels import dispatch, sm90
from microscale.models.linear import quantized_linear_class
from microscale.quant import quantize

SHUFFLED = "test-shuffled"


def _shuffled_gemm(x2d, data, scale, row_mult, bias, *, fmt, n, k, options):
    # The prepared tensors carry 2**8 / global_scale rounded to float32, not the global scale:
    # exact for the power-of-two global scales the forward tests use (_layer).
    g = (torch.tensor(2.0**8) / row_mult[0]).reshape(()) if fmt == "nvfp4" else None
    w = sm90.unprepare((data, scale, row_mult), fmt, (n, k), g)
    return dispatch.get_backend("reference").gemm(x2d, w.data, w.scale, w.global_scale, bias, fmt=fmt, n=n, k=k,
                                                  options=options)


@pytest.fixture
def shuffled_backend():
    """While the test runs, layers on the CPU select the sm90 layout (the reference stays last)."""
    dispatch.register(dispatch.Backend(
        name=SHUFFLED, formats=frozenset({"nvfp4", "mxfp4", "mxfp8"}),
        available=lambda device: torch.device(device).type == "cpu",
        prepare=sm90.prepare, gemm=_shuffled_gemm, unprepare=sm90.unprepare))
    yield SHUFFLED
    del dispatch._BACKENDS[SHUFFLED]


def _linear(k=200, n=40):
    """K = 200: not a multiple of 32, 64 or 256 (padded by both layouts); N = 40: padded to 128."""
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-3, 1, k))  # blocks with different scales
    return linear


def _layer(fmt, global_scale_log2=None):
    """A layer on the current backends; NVFP4 with global scale 2**global_scale_log2 (or computed)."""
    g = None if global_scale_log2 is None else torch.tensor(2.0**global_scale_log2)
    return quantized_linear_class(fmt).from_linear(_linear(), fmt, global_scale=g if fmt == "nvfp4" else None)


def _bits(sd: dict) -> dict:
    return {k: (v.dtype, tuple(v.shape), v.reshape(-1).view(torch.uint8).clone()) for k, v in sd.items()}


def _assert_same_state(a: dict, b: dict):
    assert list(a) == list(b)
    for name in a:
        assert a[name][:2] == b[name][:2], name
        assert torch.equal(a[name][2], b[name][2]), name


def _prepared_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.prepared_data, layer.prepared_scale,
                                                        layer.prepared_global_scale))


def _assert_prepared_only(layer):
    assert layer.backend == SHUFFLED
    assert layer.weight_data is None and layer.weight_scale is None
    names = {name for name, _ in layer.named_buffers()}
    assert not names & {"weight_data", "weight_scale"}
    g = layer.weight_global_scale
    assert layer.nbytes == _prepared_bytes(layer) + (0 if g is None else 4)


def test_layer_keeps_only_the_prepared_copy(seed, fmt, shuffled_backend):
    torch.manual_seed(seed)
    linear = _linear()
    q = quantize(linear.weight.detach(), fmt)
    reference = quantized_linear_class(fmt).from_qtensor(q, linear.bias, backend="reference")
    assert reference.backend == "reference" and reference.weight_data is q.data  # holds the canonical tensors
    want = _bits(reference.state_dict())

    layer = quantized_linear_class(fmt).from_qtensor(q, linear.bias)
    _assert_prepared_only(layer)
    _assert_same_state(_bits(layer.state_dict()), want)  # keys, dtypes, shapes and bits of the checkpoint
    _assert_prepared_only(layer)  # state_dict() did not leave the canonical tensors behind
    assert "backend=test-shuffled" in repr(layer)
    rebuilt = layer.qweight
    assert torch.equal(rebuilt.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(rebuilt.scale.view(torch.uint8), q.scale.view(torch.uint8))


def test_forward_equals_the_reference_backend(seed, fmt, shuffled_backend):
    torch.manual_seed(seed)
    layer = _layer(fmt, global_scale_log2=int(torch.randint(-4, 12, ())))
    _assert_prepared_only(layer)
    reference = quantized_linear_class(fmt).from_qtensor(layer.qweight, layer.bias, backend="reference")
    x = torch.randn(2, 3, 200)
    assert torch.equal(layer(x), reference(x))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), reference(x))


def test_state_dict_loads_strict_assign_and_on_meta(seed, fmt, shuffled_backend):
    torch.manual_seed(seed)
    source = _layer(fmt)
    sd = source.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    want = _bits(sd)
    cls = quantized_linear_class(fmt)

    into_built = cls(200, 40, fmt=fmt)  # all-zero, then loaded: the copy path
    into_built.load_state_dict(loaded, strict=True)
    assigned = cls(200, 40, fmt=fmt)
    assigned.load_state_dict(copy.deepcopy(loaded), strict=True, assign=True)
    on_meta = cls(200, 40, fmt=fmt, device="meta")
    assert on_meta.backend == "reference"  # the test backend runs on the CPU only
    on_meta.load_state_dict(copy.deepcopy(loaded), assign=True)
    for layer in (into_built, assigned, on_meta):
        _assert_prepared_only(layer)
        _assert_same_state(_bits(layer.state_dict()), want)

    bad = dict(loaded)
    bad["weight_scale"] = bad["weight_scale"][:, :2]
    with pytest.raises(RuntimeError, match="weight_scale"):
        cls(200, 40, fmt=fmt).load_state_dict(bad)
    missing = {k: v for k, v in loaded.items() if k != "weight_data"}
    with pytest.raises(RuntimeError, match="Missing key.*weight_data"):
        cls(200, 40, fmt=fmt).load_state_dict(missing)


def test_to_dtype_deepcopy_and_meta(seed, fmt, shuffled_backend):
    torch.manual_seed(seed)
    layer = _layer(fmt, global_scale_log2=3)
    reference = quantized_linear_class(fmt).from_qtensor(layer.qweight, layer.bias, backend="reference")
    want = _bits(layer.state_dict())

    for m in (layer, reference):
        m.to(torch.bfloat16)  # the bias follows; the weight is rebuilt, kept as it is and re-prepared
    _assert_prepared_only(layer)
    assert layer.bias.dtype == torch.bfloat16
    want["bias"] = _bits({"bias": reference.bias})["bias"]
    _assert_same_state(_bits(layer.state_dict()), want)
    x = torch.randn(4, 200, dtype=torch.bfloat16)
    y = reference(x)
    assert torch.equal(layer(x), y)

    clone = copy.deepcopy(layer)
    _assert_prepared_only(clone)
    assert clone.prepared_data.data_ptr() != layer.prepared_data.data_ptr()
    assert torch.equal(clone(x), y)
    _assert_same_state(_bits(clone.state_dict()), _bits(layer.state_dict()))

    layer.to("meta")  # to the reference backend, which keeps the canonical tensors
    assert layer.backend == "reference" and layer.weight_data.is_meta and layer.weight_scale.is_meta


def test_weights_the_layout_cannot_rebuild_stay_resident(seed, shuffled_backend):
    """An NVFP4 zero block scale (prepare folds it into the elements) cannot come back: that layer
    keeps both copies, and its checkpoint is unchanged."""
    torch.manual_seed(seed)
    q = quantize(torch.randn(40, 200), "nvfp4")
    s = q.scale.view(torch.uint8).clone()
    s[3, 2] = 0
    q = q.replace(scale=s.view(torch.float8_e4m3fn))
    layer = quantized_linear_class("nvfp4").from_qtensor(q)
    assert layer.backend == SHUFFLED and layer.weight_data is not None
    assert layer.nbytes == _prepared_bytes(layer) + q.nbytes + 4
    sd = layer.state_dict()
    assert torch.equal(sd["weight_scale"].view(torch.uint8), s) and torch.equal(sd["weight_data"], q.data)


def test_quantize_model_reports_resident_bytes(seed, shuffled_backend):
    from microscale import quantize_model

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(200, 96), nn.GELU(), nn.Linear(96, 40))
    report = quantize_model(model, "mxfp4", progress=False)
    layers = [model[0], model[2]]
    for layer, record in zip(layers, report.quantized):
        _assert_prepared_only(layer)
        assert record.bytes_after == layer.nbytes == _prepared_bytes(layer)
    biases = sum(layer.bias.numel() * 4 for layer in layers)
    assert report.model_bytes_after == report.bytes_after + biases


def test_save_and_load_quantized_as_on_the_reference(seed, fmt, tmp_path, monkeypatch, shuffled_backend):
    from microscale import quantize_model
    from microscale.models.serialization import load_quantized, save_quantized

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(200, 96), nn.GELU(), nn.Linear(96, 40))
    floats, on_reference = copy.deepcopy(model), copy.deepcopy(model)
    monkeypatch.setenv("MICROSCALE_BACKEND", "reference")
    quantize_model(on_reference, fmt, progress=False)
    monkeypatch.delenv("MICROSCALE_BACKEND")
    quantize_model(model, fmt, progress=False)
    assert on_reference[0].backend == "reference"
    _assert_prepared_only(model[0])
    save_quantized(on_reference, tmp_path / "reference")
    save_quantized(model, tmp_path / "shuffled")
    files = sorted(p.name for p in (tmp_path / "reference").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "shuffled").iterdir())
    for name in files:
        assert (tmp_path / "reference" / name).read_bytes() == (tmp_path / "shuffled" / name).read_bytes(), name
    loaded = load_quantized(tmp_path / "shuffled", floats)
    _assert_prepared_only(loaded[2])
    _assert_same_state(_bits(loaded.state_dict()), _bits(on_reference.state_dict()))


@pytest.mark.gpu
def test_sm90_layer_holds_only_the_prepared_copy(seed, fmt):
    """On the H200: the sm90 layer frees the canonical tensors, gives them back bit for bit, and
    computes what the sm90 kernels compute from a freshly prepared weight."""
    if not dispatch.get_backend("sm90").available(torch.device("cuda")):
        pytest.skip("needs an sm_80 .. sm_9x GPU")
    cls = quantized_linear_class(fmt)
    w = torch.randn(4096, 4096, device="cuda") * torch.logspace(-3, 1, 4096, device="cuda")
    q = quantize(w, fmt)
    canonical = {"data": q.data.cpu(), "scale": q.scale.cpu()}
    canonical_bytes = q.data.nbytes + q.scale.nbytes
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    y_want = dispatch.linear(x, q, backend="sm90")  # prepares its own copy on each call
    torch.cuda.synchronize()

    layer = cls.from_qtensor(q)
    assert layer.backend == "sm90" and layer.weight_data is None and layer.weight_scale is None
    held = torch.cuda.memory_allocated()
    del q  # the layer holds no reference to the canonical tensors: they are freed now
    freed = held - torch.cuda.memory_allocated()
    # the caching allocator counts whole blocks: one reused from its cache may be up to 1 MiB larger
    assert canonical_bytes <= freed <= canonical_bytes + 2**20 + 1024
    assert layer.nbytes == _prepared_bytes(layer) + (4 if fmt == "nvfp4" else 0)

    sd = layer.state_dict()
    assert sd["weight_data"].dtype == canonical["data"].dtype
    assert torch.equal(sd["weight_data"].cpu().view(torch.uint8), canonical["data"].view(torch.uint8))
    assert torch.equal(sd["weight_scale"].cpu().view(torch.uint8), canonical["scale"].view(torch.uint8))
    del sd
    assert torch.equal(layer(x), y_want)
    assert layer.weight_data is None

    layer.cpu()  # the reference backend on the CPU holds the canonical tensors again
    assert layer.backend == "reference"
    assert torch.equal(layer.weight_data.view(torch.uint8), canonical["data"].view(torch.uint8))
    assert torch.equal(layer.weight_scale.view(torch.uint8), canonical["scale"].view(torch.uint8))
    layer.cuda()
    assert layer.backend == "sm90" and layer.weight_data is None
    assert torch.equal(layer(x), y_want)
