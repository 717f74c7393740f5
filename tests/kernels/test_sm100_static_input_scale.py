"""The three sm100 backends with a static NVFP4 input scale (a layer's calibrated input_global_scale).

A static scale reaches a backend as options["input_global_scale"] (microscale.kernels.ops, only for
backends that list that option). The backend must quantize its activations with it, bit for bit
quant.quantize(x, "nvfp4", global_scale=g), and fold that same g into alpha = 1 / (g * g_W). The
inputs here exceed the calibrated amax (their largest blocks saturate), so a backend that computed
its own per-call scale would give other codes and an output off by the ratio of the two scales.

CPU: sm100-nvrtc with its launch replaced by the kernel-addressing emulation of test_tcgen05_selftest,
in process. sm100-triton (EMULATE_MMA) and sm100-cublas (torch._scaled_mm computed as cuBLAS documents
it, test_sm100_cublas) under TRITON_INTERPRET=1 in a subprocess, where their activation quantizer,
quantize_gpu, runs too. Each goes through the microscale::linear op, as an FP4Linear calls it.
GPU (`-m gpu`, the H200): sm100-triton's compiled emulation and sm100-nvrtc's on-device quantizer.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from microscale.kernels import dispatch, ops, selftest
from microscale.kernels.sm100 import cublas_gemm as cb
from microscale.kernels.sm100 import tcgen05_backend as T
from microscale.kernels.sm100 import triton_gemm as tg
from microscale.kernels.sm100.operands import pad_codes, prepare_weight
from microscale.quant import quantize
from test_sm100_cublas import blocked_scaled_mm
from test_sm100_triton_emulated import ACC, GPU_REL, INTERPRETER_REL, float64_reference, patch_interpreter_index
from test_tcgen05_selftest import assert_gemm_close, emulate_kernel

CALIBRATED_FRACTION = 0.5  # the static scale covers half the inputs' amax: larger blocks saturate
BLACKWELL_BACKENDS = (T.NAME, tg.BACKEND_NAME, cb.BACKEND_NAME)


def static_problem(m, n, k, seed, device="cpu"):
    """bf16 activations (a zero row, a row of tiny blocks), their static encode scale 2688 / amax from a
    calibration that saw only CALIBRATED_FRACTION of their amax, NVFP4 weights and a bf16 bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0] = 0.0
    if m > 1:
        x[1, : k // 2] *= 1e-4
    x = x.to(torch.bfloat16)
    static = torch.tensor(2688.0) / (x.float().abs().amax() * CALIBRATED_FRACTION)
    w = quantize(torch.randn(n, k, generator=g) * 2, "nvfp4")
    bias = (torch.randn(n, generator=g) * 4).to(torch.bfloat16)
    return x.to(device), static.to(device), w.to(device), bias.to(device)


def same_bits(a, b) -> bool:
    """Codes, block scales (same layout) and global scale identical."""
    a, b = a.to("cpu"), b.to("cpu")
    return (a.scale_layout == b.scale_layout and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
            and torch.equal(a.global_scale.reshape(()), b.global_scale.reshape(())))


def spy_on(module, name, seen, patch=setattr):
    """Replace module.name (whose first argument is the activation QTensor) by a wrapper recording it."""
    original = getattr(module, name)

    def spy(a, *args, **kwargs):
        seen.append(a)
        return original(a, *args, **kwargs)

    patch(module, name, spy)


def run_static_case(backend, seen, m, n, k, seed, device, rel, acc) -> dict:
    """One static-scale call through the microscale::linear op; `seen` receives the activation QTensor the
    backend hands its MMA. Error bound: rel |ref| + acc (|a| @ |w|^T)."""
    x, static, w, bias = static_problem(m, n, k, seed, device)
    data, scale, gw = dispatch.get_backend(backend).prepare(w)
    y = ops.linear(x, data, scale, gw, bias, "nvfp4", n, k, backend, "nvfp4", static)
    a = seen.pop()
    want = quantize(x.cpu(), "nvfp4", global_scale=static.cpu(), scale_layout=a.scale_layout)
    ref, magnitude = float64_reference(want, w.to("cpu"), bias.cpu())
    err = (y.cpu().double() - ref).abs()
    bound = rel * ref.abs() + acc * magnitude
    return dict(backend=backend, shape=[m, n, k], same_bits=same_bits(a, want), dtype=str(y.dtype),
                nan=int(y.isnan().sum()), bad=int((~(err <= bound)).sum()))


# ---- which backends take a static scale ----------------------------------------------------------
@pytest.mark.parametrize("name", BLACKWELL_BACKENDS)
def test_static_layers_select_the_blackwell_backends(monkeypatch, name):
    """With the backend available, a static-scale NVFP4 layer gets it (no fallback to the reference)."""
    monkeypatch.delenv("MICROSCALE_BACKEND", raising=False)
    monkeypatch.delenv("MICROSCALE_FORCE_REFERENCE", raising=False)
    b = dispatch.get_backend(name)
    monkeypatch.setattr(dispatch, "_BACKENDS", {"reference": dispatch.get_backend("reference"),
                                                name: dataclasses.replace(b, available=lambda device: True)})
    assert ops.select_linear_backend("nvfp4", "cpu", "nvfp4", static_input=True).name == name
    # and without the option it is skipped: the check is not vacuous
    monkeypatch.setitem(dispatch._BACKENDS, name, dataclasses.replace(
        b, available=lambda device: True, options=b.options - {"input_global_scale"}))
    assert ops.select_linear_backend("nvfp4", "cpu", "nvfp4", static_input=True).name == "reference"


# ---- sm100-nvrtc: host side on the CPU -----------------------------------------------------------
@pytest.mark.parametrize("m", [37, 150])  # the 1-CTA and the 2-CTA variant
def test_nvrtc_quantizes_with_the_static_scale(monkeypatch, m, seed):
    """Faked sm100 + emulated launch: the self-test gate, then the microscale::linear op, the backend's
    quantizer and alpha; the launch gets quantize(x, global_scale=static)'s bytes and 1 / (static * g_W)."""
    n, k = 50, 96
    monkeypatch.setattr(T, "compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    launches = []

    def launch(variant, a_data, a_scale, b_data, b_scale, alpha, bias, m, n):
        launches.append((a_data, a_scale, alpha))
        return emulate_kernel(variant, a_data, a_scale, b_data, b_scale, alpha, bias, m, n)

    monkeypatch.setattr(T, "run_gemm", launch)
    assert T._available(torch.device("cpu"))  # the self-test gate, through the emulated launch
    launches.clear()
    x, static, w, bias = static_problem(m, n, k, seed)
    data, scale, gw = prepare_weight(w)
    y = ops.linear(x, data, scale, gw, bias, "nvfp4", n, k, T.NAME, "nvfp4", static)
    (a_data, a_scale, alpha), = launches
    want = quantize(x, "nvfp4", global_scale=static, scale_layout="swizzled")
    assert torch.equal(a_data.view(torch.uint8), pad_codes(want.data, want.fmt).view(torch.uint8))
    assert torch.equal(a_scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert alpha.dtype == torch.float32 and alpha.item() == ((1.0 / static) * (1.0 / gw)).item()
    xd, wd = want.dequantize(torch.float64), w.dequantize(torch.float64)
    ref = xd @ wd.T + bias.double()
    assert_gemm_close(y, ref, xd.abs() @ wd.abs().T + bias.double().abs(), k)
    # a per-call scale would have given other bytes and a product outside that bound
    dynamic = quantize(x, "nvfp4", scale_layout="swizzled")
    assert not torch.equal(dynamic.scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert not torch.allclose(dynamic.dequantize(torch.float64) @ w.dequantize(torch.float64).T + bias.double(),
                              ref, rtol=2**-7, atol=1e-9)


# ---- sm100-triton and sm100-cublas: the interpreter ----------------------------------------------
INTERPRETER_CASES = [  # (backend, (M, N, K), rel, acc)
    # swapped operands (linear activation scales) and the unswapped tile (swizzled), the emulated tests' bound
    (tg.BACKEND_NAME, (5, 100, 96), INTERPRETER_REL, ACC),
    (tg.BACKEND_NAME, (65, 200, 176), INTERPRETER_REL, ACC),
    # cuBLAS rounds the product to bf16 before the global scales and the bias are applied (2^-9 of
    # |a| @ |w|^T, which a bias can cancel down to a small output), then the output to bf16 (2^-9 |y|)
    (cb.BACKEND_NAME, (5, 100, 96), 2.0**-8, 2.0**-8),
    (cb.BACKEND_NAME, (150, 100, 96), 2.0**-8, 2.0**-8),
]


def _interpreter_child(seed):
    """Runs in the TRITON_INTERPRET=1 subprocess (emulated MMA forced); one JSON line per case."""
    patch_interpreter_index()
    torch._scaled_mm = blocked_scaled_mm
    seen = []
    spy_on(tg, "block_scaled_gemm", seen)
    spy_on(cb, "scaled_mm", seen)
    for i, (backend, (m, n, k), rel, acc) in enumerate(INTERPRETER_CASES):
        print(json.dumps(run_static_case(backend, seen, m, n, k, seed + i, "cpu", rel, acc)))


def test_triton_and_cublas_quantize_with_the_static_scale_under_the_interpreter(seed):
    here = os.path.dirname(__file__)
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_child']({seed})"
    env = {**os.environ, "TRITON_INTERPRET": "1", tg.EMULATE_ENV: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["backend"], tuple(r["shape"])) for r in reports] == [(c[0], c[1]) for c in INTERPRETER_CASES]
    for r in reports:
        assert r["same_bits"] and r["nan"] == 0 and r["bad"] == 0 and r["dtype"] == "torch.bfloat16", r


# ---- GPU: the H200 ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 130])  # swapped and unswapped tiles
def test_triton_static_scale_emulated_on_gpu(monkeypatch, m, seed):
    """The self-test gate with the emulated MMA, then a static-scale call: compiled quantize_gpu and kernel."""
    monkeypatch.setenv(tg.EMULATE_ENV, "1")
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    assert tg.BACKEND.available(torch.device("cuda"))
    seen = []
    spy_on(tg, "block_scaled_gemm", seen, monkeypatch.setattr)
    report = run_static_case(tg.BACKEND_NAME, seen, m, 200, 384, seed, "cuda", GPU_REL, ACC)
    assert report["same_bits"] and report["nan"] == 0 and report["bad"] == 0, report


@pytest.mark.gpu
def test_nvrtc_activation_quantizer_takes_the_static_scale_on_gpu(seed):
    x, static, _, _ = static_problem(130, 8, 320, seed)
    got = T._quantize_activations(x.cuda(), "nvfp4", static.cuda())
    assert same_bits(got, quantize(x, "nvfp4", global_scale=static, scale_layout="swizzled"))
