"""The first-use self-test gate (microscale.kernels.selftest) and the sm100-triton backend's use of it.

The gate is backend-agnostic: a run_fn computes y for (x, W, bias, activation format). Here run_fns
are fakes on the CPU: a correct W4A4 one, a correct weight-only one, and deliberately broken ones
(the kinds of bug a wrong layout or descriptor gives on hardware). The sm100-triton backend is then
gated end to end with compute capability 10.0 faked and the kernel replaced by such a fake.
"""

import warnings

import pytest
import torch

from microscale.formats import QTensor, get_format
from microscale.kernels import dispatch, selftest
from microscale.kernels.sm100 import triton_gemm as tg
from microscale.quant import quantize

PAIRS = tg.FORMAT_PAIRS


def w4a4(x, w, bias, act):
    """What a correct quantized-activation GEMM computes (float64 here, bf16 out)."""
    a = quantize(x.float(), act).dequantize().double()
    return (a @ w.dequantize().double().T + bias.double()).to(torch.bfloat16)


def weight_only(x, w, bias, act):
    return (x.double() @ w.dequantize().double().T + bias.double()).to(torch.bfloat16)


def shifted_scales(x, w, bias, act):
    """Scale column c read for block c + 1 (a K-offset bug in the scale view)."""
    s = w.block_scale_as_float()
    s = torch.cat([s[:, 1:], s[:, -1:]], dim=1)
    wd = (w.codes_as_float().view(w.shape[0], -1, w.fmt.block) * s[..., None]).view(w.shape[0], -1)[:, : w.shape[1]]
    a = quantize(x.float(), act).dequantize().double()
    return (a @ wd.double().T + bias.double()).to(torch.bfloat16)


def last_row_unwritten(x, w, bias, act):
    y = w4a4(x, w, bias, act)
    y[-1] = float("nan")
    return y


def global_scale_dropped(x, w, bias, act):
    """NVFP4 alpha = 1 / (g_x g_w) forgotten: only NVFP4 pairs fail."""
    if not get_format(act).global_scale:
        return w4a4(x, w, bias, act)
    a = quantize(x.float(), act)
    g = a.global_scale.double() * w.global_scale.double()
    return ((a.dequantize().double() @ w.dequantize().double().T) * g + bias.double()).to(torch.bfloat16)


def raises(x, w, bias, act):
    raise RuntimeError("out of resource: shared memory")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_selftest_activations_are_lossless(fmt):
    """The premise that makes the gate backend-agnostic: quantizing its x changes nothing."""
    x = selftest.lossless_activations(150, selftest.SELFTEST_K, torch.Generator().manual_seed(1))
    assert torch.equal(quantize(x, fmt).dequantize(torch.bfloat16), x)


@pytest.mark.parametrize("run_fn", [w4a4, weight_only])
def test_selftest_passes_correct_backends(run_fn):
    assert selftest.run_selftest(run_fn, "cpu", PAIRS) == []


@pytest.mark.parametrize("run_fn, failing_acts", [(shifted_scales, {"nvfp4", "mxfp4", "mxfp8"}),
                                                  (last_row_unwritten, {"nvfp4", "mxfp4", "mxfp8"}),
                                                  (global_scale_dropped, {"nvfp4"})])
def test_selftest_catches_forced_mismatches(run_fn, failing_acts):
    failures = selftest.run_selftest(run_fn, "cpu", PAIRS)
    failing_pairs = {tuple(p) for p in PAIRS if p[0] in failing_acts}
    assert len(failures) == len(failing_pairs) * len(selftest.SELFTEST_MS)
    for label, figures in failures:
        assert figures["bad"] > 0 and figures["total"] > 0 and "max_rel_err" in figures, (label, figures)


def test_selftest_reports_exceptions_as_failures():
    failures = selftest.run_selftest(raises, "cpu", [("mxfp8", "mxfp8")])
    assert len(failures) == len(selftest.SELFTEST_MS)
    assert all("out of resource" in figures["error"] for _, figures in failures)


def test_verdict_is_cached_and_the_warning_given_once(monkeypatch):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    calls = []

    def counting(x, w, bias, act):
        calls.append(act)
        return shifted_scales(x, w, bias, act)

    with pytest.warns(RuntimeWarning, match=r"(?s)'fake-sm100' failed its self-test on cpu.*max_rel_err"):
        assert not selftest.selftest_passed("fake-sm100", counting, "cpu", [("mxfp4", "mxfp4")])
    first = len(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not selftest.selftest_passed("fake-sm100", counting, "cpu", [("mxfp4", "mxfp4")])
    assert first == len(selftest.SELFTEST_MS) and len(calls) == first


@pytest.mark.parametrize("correct", [True, False])
def test_dispatcher_falls_back_when_the_selftest_fails(monkeypatch, correct):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    run_fn = w4a4 if correct else shifted_scales
    fake = dispatch.Backend(name="fake-sm100", formats=frozenset({"mxfp4"}),
                            available=lambda device: selftest.selftest_passed("fake-sm100", run_fn, device,
                                                                              [("mxfp4", "mxfp4")]),
                            prepare=None, gemm=None)
    # The fake is tried first, the reference backend after it.
    monkeypatch.setattr(dispatch, "_BACKENDS", {"fake-sm100": fake, "reference": dispatch.get_backend("reference")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = dispatch.select_backend("mxfp4", "cpu")
    assert chosen.name == ("fake-sm100" if correct else "reference")
    assert len([w for w in caught if "failed its self-test" in str(w.message)]) == (0 if correct else 1)


# ---- the sm100-triton backend's gate, with the kernel faked --------------------------------------
def fake_kernel(broken):
    """Stands in for block_scaled_gemm: checks what the backend passes, computes in float64."""

    def run(a, w_data, w_scale, w_global, bias, *, w_fmt, n, out_dtype, emulate, config):
        spec = get_format(w_fmt)
        assert config == tg.tile_config(a.fmt, spec, a.shape[0], emulate)
        assert a.scale_layout == ("linear" if config.swap_ab else "swizzled")
        k = a.shape[1]
        kp = -(-k // spec.block) * spec.block
        w = QTensor(data=w_data[:, : kp // 2 if spec.packed else kp], scale=w_scale, fmt=spec, shape=(n, k),
                    global_scale=w_global, scale_layout="swizzled")  # prepare_weight keeps the swizzled table
        y = a.dequantize().double() @ w.dequantize().double().T
        if broken:
            y = y.flip(0)  # rows of the output tile swapped
        if bias is not None:
            y = y + bias.double()
        return y.to(out_dtype)

    return run


@pytest.mark.parametrize("broken", [False, True])
def test_sm100_triton_available_only_after_its_selftest(monkeypatch, broken):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    monkeypatch.setattr(tg, "compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(tg, "block_scaled_gemm", fake_kernel(broken))
    monkeypatch.setattr("microscale.kernels.quantize.quantize_gpu", quantize)
    if broken:
        with pytest.warns(RuntimeWarning, match="'sm100-triton' failed its self-test"):
            assert not tg.BACKEND.available(torch.device("cpu"))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tg.BACKEND.available(torch.device("cpu"))


@pytest.mark.parametrize("capability, emulate, expected", [((9, 0), False, False), ((12, 0), False, False),
                                                           ((9, 0), True, True), (None, True, False)])
def test_sm100_triton_offered_on_sm100_or_when_emulation_is_forced(monkeypatch, capability, emulate, expected):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    monkeypatch.setattr(tg, "compute_capability", lambda device: capability)
    monkeypatch.setattr(tg, "block_scaled_gemm", fake_kernel(False))
    monkeypatch.setattr("microscale.kernels.quantize.quantize_gpu", quantize)
    if emulate:
        monkeypatch.setenv(tg.EMULATE_ENV, "1")
    else:
        monkeypatch.delenv(tg.EMULATE_ENV, raising=False)
    assert tg.BACKEND.available(torch.device("cpu")) is expected


def test_sm100_triton_gemm_refuses_float_activations_and_foreign_pairs():
    w = quantize(torch.randn(8, 64), "nvfp4")
    data, scale, g = tg.prepare_weight(w)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="quantized activations only"):
        tg.BACKEND.gemm(x, data, scale, g, None, fmt="nvfp4", n=8, k=64, options={})
    with pytest.raises(ValueError, match="quantized activations only"):
        tg.BACKEND.gemm(x, data, scale, g, None, fmt="nvfp4", n=8, k=64, options={"activations": "mxfp8"})
