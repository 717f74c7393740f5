"""The decoder glue around a quantized projection (kernels/rmsnorm.py): an RMSNorm in front, a residual add behind.

CPU: the torch definitions against float64 and transformers' LlamaRMSNorm; the custom op and QuantizedLinear.forward
with `norm` / `residual` on the reference backend against the composed steps (bit for bit: the same torch ops), their
errors; the sm90 rule for which calls' kernel takes them (Backend.fusions). The kernel's numerics run on the H200
(tests/kernels/test_sm90_gemm.py, marked gpu).
"""

import pytest
import torch

from microscale import FP4Linear, FP8Linear
from microscale.kernels import rmsnorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_llamas(seed, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = (torch.randn(5, 96) * torch.exp(torch.randn(5, 1) * 3)).to(dtype)
    x[2] = 0  # a zero row: eps keeps it finite
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
        want = norm(x)
    got = rmsnorm.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == dtype and torch.equal(got, want)
    x64 = x.double()
    exact = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # the normalized x and the product each rounded
    assert ((got.double() - exact).abs() <= tol * exact.abs() + 1e-30).all()
    assert torch.equal(got[2], torch.zeros(96, dtype=dtype))


def test_add_residual_rounds_once(seed):
    y = torch.randn(4, 32).to(torch.bfloat16)
    r = torch.randn(4, 32).to(torch.bfloat16) * 100
    got = rmsnorm.add_residual(y, r)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (y.double() + r.double()).to(torch.float32).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"residual of shape \(4, 31\) does not match the output \(4, 32\)"):
        rmsnorm.add_residual(y, r[:, :31])


def test_norm_parameters_of_modules_and_pairs():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = LlamaRMSNorm(8, eps=1e-6)
    assert rmsnorm.norm_parameters(llama) == (llama.weight, 1e-6)
    plain = torch.nn.RMSNorm(8)
    w, eps = rmsnorm.norm_parameters(plain, torch.bfloat16)
    assert w is plain.weight and eps == torch.finfo(torch.bfloat16).eps
    assert rmsnorm.norm_parameters((llama.weight, 1e-3)) == (llama.weight, 1e-3)
    with pytest.raises(TypeError, match="expected \\(weight, eps\\) or an RMSNorm module, got LayerNorm"):
        rmsnorm.norm_parameters(torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match="needs a weight of one dimension, got None"):
        rmsnorm.norm_parameters(torch.nn.RMSNorm(8, elementwise_affine=False))


def _layer(cls, fmt, n=48, k=96, bias=True):
    return cls.from_linear(torch.nn.Linear(k, n, bias=bias), fmt)


@pytest.mark.parametrize("cls,fmt", [(FP4Linear, "nvfp4"), (FP4Linear, "mxfp4"), (FP8Linear, "mxfp8")])
def test_forward_norm_and_residual_compose_on_the_reference_backend(seed, cls, fmt):
    layer = _layer(cls, fmt)
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    r = torch.randn(2, 3, 48).to(torch.bfloat16)
    w = (torch.rand(96) + 0.5).to(torch.bfloat16)
    normed = rmsnorm.rms_norm(x, w, 1e-6)
    assert torch.equal(layer(x, norm=(w, 1e-6)), layer(normed))
    assert torch.equal(layer(x, residual=r), rmsnorm.add_residual(layer(x), r))
    assert torch.equal(layer(x, norm=(w, 1e-6), residual=r), rmsnorm.add_residual(layer(normed), r))
    assert layer.fusions(1) == frozenset()  # the reference backend runs them as torch ops


def test_forward_norm_comes_before_activation_quantization(seed):
    """W4A4 emulated: the normalized x is what gets quantized."""
    layer = FP4Linear.from_linear(torch.nn.Linear(64, 32), "nvfp4", activations="nvfp4")
    x = torch.randn(3, 64) * 5
    w = torch.rand(64) + 0.5
    assert torch.equal(layer(x, norm=(w, 1e-6)), layer(rmsnorm.rms_norm(x, w, 1e-6)))


def test_gated_layer_takes_the_residual_after_its_epilogue(seed):
    from microscale.models.linear import fuse_gated

    gate, up = (_layer(FP4Linear, "nvfp4", n=16, k=64, bias=False) for _ in range(2))
    up.weight_global_scale = gate.weight_global_scale  # fuse_gated needs one NVFP4 global scale
    up.prepare()
    fused = fuse_gated(gate, up)
    x = torch.randn(2, 64).to(torch.bfloat16)
    r = torch.randn(2, 16).to(torch.bfloat16)
    assert torch.equal(fused(x, residual=r), rmsnorm.add_residual(fused(x), r))
    with pytest.raises(ValueError, match=r"residual of shape \(2, 32\) does not match the output shape \(2, 16\)"):
        fused(x, residual=torch.zeros(2, 32, dtype=torch.bfloat16))


def test_forward_rejects_mismatched_glue():
    layer = _layer(FP4Linear, "nvfp4")
    x = torch.randn(3, 96)
    with pytest.raises(ValueError, match=r"norm weight of shape \(95,\) does not match in_features=96"):
        layer(x, norm=(torch.ones(95), 1e-6))
    with pytest.raises(ValueError, match=r"residual of shape \(3, 47\) does not match the output shape \(3, 48\)"):
        layer(x, residual=torch.zeros(3, 47))


def test_custom_op_opcheck_with_glue(seed):
    layer = _layer(FP4Linear, "nvfp4")
    args = (torch.randn(3, 96), layer.prepared_data, layer.prepared_scale, layer.prepared_global_scale, layer.bias,
            "nvfp4", 48, 96, layer.backend, None, None, None, None, torch.rand(96) + 0.5, 1e-6, torch.randn(3, 48))
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.microscale.linear.default, args, test_utils=tests)


def test_sm90_fusions_follow_the_kernel_choice(monkeypatch):
    """sm90.fusions says the kernel takes the residual exactly where choose_kernel picks decode_ws, and the norm
    there up to M = 8: the Llama-8B projections at M = 1, only the residual at M = 16, nothing at M = 17 (no
    decode_ws) or where cuda-python is missing."""
    from microscale.kernels import sm90

    monkeypatch.setattr(sm90, "compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(sm90.paths, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm90.paths, "device_index", lambda device: 0)
    monkeypatch.setattr(sm90.wgmma_ws, "have_cuda_python", lambda: True)
    both = frozenset(rmsnorm.FUSIONS)
    for m, n, k in ((1, 4096, 4096), (1, 6144, 4096), (4, 4096, 14336), (8, 4096, 4096), (16, 4096, 4096),
                    (17, 4096, 4096), (1, 57344, 4096), (16, 57344, 4096)):
        kernel = sm90.choose_kernel("nvfp4", m, {}, torch.bfloat16, (9, 0), n, True, k, 132)
        want = (both if m <= 8 else frozenset({"residual"})) if kernel == "decode_ws" else frozenset()
        assert sm90.fusions("nvfp4", m, n, k, "cuda") == want
    assert sm90.fusions("nvfp4", 1, 6144, 4096, "cuda") == both
    assert sm90.fusions("nvfp4", 16, 4096, 4096, "cuda") == frozenset({"residual"})
    assert sm90.fusions("nvfp4", 17, 4096, 4096, "cuda") == frozenset()
    assert sm90.fusions("mxfp8", 1, 28672, 4096, "cuda") == both
    monkeypatch.setattr(sm90.wgmma_ws, "have_cuda_python", lambda: False)
    assert sm90.fusions("nvfp4", 1, 4096, 4096, "cuda") == frozenset()
