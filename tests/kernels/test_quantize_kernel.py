"""quantize_gpu against the reference quantizer, bit for bit (data, scales, global scale).

The CPU tests run the Triton kernel under TRITON_INTERPRET=1 in a subprocess (the variable must be
set before triton is imported) on tiny shapes; the GPU tests run it on the H200 on larger ones.
The interpreter flushes bf16 subnormals when converting to float32, so there subnormals are fed
as float32 only; the GPU tests feed them in every dtype.
The kernel encodes E4M3 with integer arithmetic (not a float8 cast), so the interpreter runs the
very code the GPU runs. Inputs: Gaussian data over many binades, zeros, all-zero rows and blocks,
subnormals, values near the format maxima and exact E2M1 rounding ties; ragged M and K.
"""

import os
import subprocess
import sys

import pytest
import torch

from microscale.formats import ScaleMode
from microscale.quant import quantize

CASES = [("nvfp4", ScaleMode.RCEIL)] + [(f, m) for f in ("mxfp4", "mxfp8") for m in ScaleMode]


def make_input(m, k, dtype, seed, device="cpu", subnormals=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g).float())
    x = x.clamp(-torch.finfo(dtype).max / 8, torch.finfo(dtype).max / 8)  # finite in fp16 too
    x[0, : min(k, 7)] = 0.0  # zeros
    if m > 1:
        x[1] = 0.0  # an all-zero row
    if m > 2 and subnormals:
        tiny = torch.finfo(dtype).tiny
        x[2, :8] = torch.tensor([tiny / 4, -tiny / 2, tiny, 3 * tiny, -tiny / 8, tiny / 3, 0.0, tiny])[: min(k, 8)]
    if m > 3 and k >= 16:
        x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -5.0, 3.0, 4.0, 0.5, 1.0])
    if m > 4:
        x[4, : min(k, 4)] = torch.finfo(dtype).max / 2  # huge values
    return x.to(dtype).to(device)


def assert_bit_identical(a, r):
    da, dr = a.data.view(torch.uint8).cpu(), r.data.view(torch.uint8).cpu()
    sa, sr = a.scale.view(torch.uint8).cpu(), r.scale.view(torch.uint8).cpu()
    bad = (da != dr).nonzero()
    assert bad.numel() == 0, f"data differs at {bad[:5].tolist()}"
    bad = (sa != sr).nonzero()
    assert bad.numel() == 0, f"scales differ at {bad[:5].tolist()}"
    if r.global_scale is not None:
        assert torch.equal(a.global_scale.cpu(), r.global_scale.cpu())
    assert a.shape == r.shape and a.scale_layout == r.scale_layout


def _run_cases(device, shapes, dtypes, seed, interpreted=False):
    from microscale.kernels.quantize import quantize_gpu
    for fmt, mode in CASES:
        for dtype in dtypes:
            for m, k in shapes:
                # the interpreter converts bf16 to float32 with subnormals flushed (the GPU does not)
                x = make_input(m, k, dtype, seed, device, subnormals=not (interpreted and dtype == torch.bfloat16))
                kw = {} if fmt == "nvfp4" else {"scale_mode": mode}
                for layout in ("linear", "swizzled"):
                    assert_bit_identical(quantize_gpu(x, fmt, scale_layout=layout, **kw),
                                         quantize(x, fmt, scale_layout=layout, **kw))
                if fmt == "nvfp4":  # a given global scale
                    assert_bit_identical(quantize_gpu(x, fmt, global_scale=3.5), quantize(x, fmt, global_scale=3.5,
                                                                                          scale_layout="swizzled"))


_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from tests.kernels.test_quantize_kernel import _run_cases
_run_cases("cpu", [(5, 40), (33, 96)], [torch.bfloat16, torch.float32], {seed}, interpreted=True)
print("ok")
"""


def test_quantize_kernel_interpreted(seed):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED.format(root=root, seed=seed)], capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_quantize_kernel_gpu(seed):
    _run_cases("cuda", [(1, 16), (5, 40), (130, 200), (257, 1056)], [torch.bfloat16, torch.float16, torch.float32],
               seed)


@pytest.mark.gpu
def test_quantize_kernel_rejects_bad_input():
    from microscale.kernels.quantize import quantize_gpu
    with pytest.raises(ValueError, match="2-D"):
        quantize_gpu(torch.zeros(4, device="cuda"), "nvfp4")
    with pytest.raises(TypeError, match="dtype"):
        quantize_gpu(torch.zeros(4, 32, device="cuda", dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="no global scale"):
        quantize_gpu(torch.zeros(4, 32, device="cuda"), "mxfp8", global_scale=1.0)
