"""kernels/gated.py: the gate/up row-pair order of fused gated layers and the unfused epilogue, against
hand-written indices and float64."""

import pytest
import torch

from microscale.kernels import gated


def test_interleave_index_alternates_blocks_of_eight():
    # n = 16 gate rows (rows 0-15 of cat([gate, up])) and 16 up rows (16-31)
    want = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert gated.interleave_index(16).tolist() == want
    assert sorted(gated.interleave_index(40).tolist()) == list(range(80))  # a permutation
    with pytest.raises(ValueError, match="12 gate rows is not a multiple of 8"):
        gated.interleave_index(12)


def test_silu_mul_pairs_gate_and_up_rows(seed):
    n = 24
    gate, up = torch.randn(3, n, dtype=torch.float64) * 4, torch.randn(3, n, dtype=torch.float64)
    fused = torch.cat([gate, up], -1)[:, gated.interleave_index(n)]  # the fused weight's output order
    got = gated.silu_mul(fused.float())
    want = gate / (1 + torch.exp(-gate)) * up  # float64
    assert got.dtype == torch.float32 and got.shape == (3, n)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7)
    # bf16 in, bf16 out: computed in float32, rounded once
    assert gated.silu_mul(fused.bfloat16()).dtype == torch.bfloat16
    edge = torch.tensor([[0.0] * 8 + [5.0] * 8, [-100.0] * 8 + [3.0] * 8, [100.0] * 8 + [-2.0] * 8])
    assert gated.silu_mul(edge).tolist() == [[0.0] * 8, [-0.0] * 8, [-200.0] * 8]


def test_epilogue_names():
    assert gated.check_epilogue(None) is None and gated.check_epilogue("silu_mul") == "silu_mul"
    assert gated.output_features(64, None) == 64 and gated.output_features(64, "silu_mul") == 32
    with pytest.raises(ValueError, match="unknown epilogue 'gelu_mul'"):
        gated.check_epilogue("gelu_mul")
