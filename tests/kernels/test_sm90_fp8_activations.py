"""Per-row E4M3 activation quantization of the sm90 FP8 path (launch.quantize_rows_e4m3).

Run under TRITON_INTERPRET=1 in a subprocess on the CPU, where the kernel takes its integer
rounding path (the interpreter's float8 casts are not round-to-nearest-even); on the GPU (marked
test) it takes the hardware cvt path. Both must give torch's RNE E4M3 of x * 448 / amax(row).
"""

import os
import subprocess
import sys

import pytest
import torch

_CHECK = """
import torch
from microscale.kernels.sm90.launch import quantize_rows_e4m3
g = torch.Generator().manual_seed({seed})
for m, k, kp in [(3, 40, 256), (5, 300, 512), (2, 20000, 20224)]:
    x = (torch.randn(m, k, generator=g) * 10).to(torch.bfloat16).to("{device}")
    x[0] = 0  # a zero row
    q, s = quantize_rows_e4m3(x, kp)
    amax = x.float().abs().amax(1, keepdim=True)
    # true divisions: torch evaluates tensor / scalar on CUDA as a multiplication by the reciprocal
    want_s = torch.where(amax > 0, amax / torch.full_like(amax, 448), torch.ones_like(amax))
    inv = torch.full_like(amax, 448) / torch.where(amax > 0, amax, torch.full_like(amax, 448))  # a true division
    want = (x.float() * inv).clamp(-448, 448)
    want = torch.nn.functional.pad(want, (0, kp - k)).to(torch.float8_e4m3fn)
    assert torch.equal(s, want_s), (m, k)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), (m, k)
print("ok")
"""


def test_rowwise_e4m3_interpreted(seed):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", _CHECK.format(seed=seed, device="cpu")], capture_output=True, text=True,
                       timeout=600, cwd=root, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_rowwise_e4m3_gpu(seed):
    exec(_CHECK.format(seed=seed, device="cuda"), {})
