"""The reference quantizer gives the same bits on CUDA as on CPU."""

import pytest
import torch

import microscale as ms
from microscale.formats import ScaleMode


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_quantize_cuda_equals_cpu(fmt, dtype, seed):
    x = (torch.randn(300, 1000) * torch.exp2(torch.randint(-20, 20, (300, 1)).float())).to(dtype)
    x[:, :64] = 0
    # exact powers of two times the element maximum: where a reciprocal-multiply division would
    # round a shared exponent or a block scale differently
    x[:64, 64] = (6.0 * torch.exp2(torch.arange(-32, 32).float())).to(dtype)
    x[64:128, 96] = (448.0 * torch.exp2(torch.arange(-32, 32).float())).to(dtype)
    modes = [None] if fmt == "nvfp4" else list(ScaleMode)
    for mode in modes:
        kw = {} if mode is None else {"scale_mode": mode}
        a = ms.quantize(x, fmt, scale_layout="swizzled", **kw)
        b = ms.quantize(x.cuda(), fmt, scale_layout="swizzled", **kw)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8).cpu())
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8).cpu())
        if fmt == "nvfp4":
            assert a.global_scale.item() == b.global_scale.item()
        assert torch.equal(a.dequantize(), b.dequantize().cpu())
