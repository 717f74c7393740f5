"""The Hopper dispatch rule (sm90.choose_kernel, docs/dispatch.md), checked on the CPU: it reads only
the format, M, the weight's shape, the options, the activation dtype and the compute capability."""

import pytest
import torch

from microscale.kernels import sm90


def test_rule_by_m_dtype_and_architecture(monkeypatch):
    monkeypatch.delenv("MICROSCALE_SM90_KERNEL", raising=False)
    assert sm90.choose_kernel("nvfp4", 17, {}) == "decode"
    assert sm90.choose_kernel("nvfp4", sm90.DECODE_MAX_M, {}) == "decode"
    assert sm90.choose_kernel("nvfp4", sm90.DECODE_MAX_M + 1, {}) == "wgmma"
    # M <= 16: the TMA-ring kernel where decode_ws.ring_wins (bf16 x TMA can read, sm_90): wherever it fills the SMs
    assert sm90.choose_kernel("nvfp4", 1, {}, n=28672, k=8192) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 1, {}, n=8192, k=8192) == "decode_ws"
    assert sm90.choose_kernel("mxfp4", 1, {}, n=6144, k=4096) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 16, {}, n=28672, k=8192) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 16, {}, n=28672, k=8192, tma_ready=False) == "decode"
    assert sm90.choose_kernel("nvfp4", 16, {}, n=28672, k=8192, dtype=torch.float16) == "decode"
    assert sm90.choose_kernel("nvfp4", 16, {}, n=28672, k=8192, cc=(8, 0)) == "decode"
    assert sm90.choose_kernel("nvfp4", 4, {}, n=4096, k=14336) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 1, {}, n=4096, k=4096) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 1, {}, n=4096, k=4096, tma_ready=False) == "decode"
    assert sm90.choose_kernel("nvfp4", 1, {}, n=512, k=512) == "decode"  # 4 CTAs: most SMs idle
    assert sm90.choose_kernel("mxfp8", 1, {}, n=6144, k=4096) == "decode_ws"
    assert sm90.choose_kernel("mxfp8", 4, {}, n=28672, k=8192) == "decode_ws"
    assert sm90.choose_kernel("mxfp8", 8, {}, n=28672, k=8192) == "decode_ws"
    assert sm90.choose_kernel("mxfp8", 8, {}, n=28672, k=8192, sms=2048) == "decode"  # too few tiles to fill
    assert sm90.choose_kernel("nvfp4", 4, {"kernel": "decode_ws"}, n=4096, k=14336) == "decode_ws"
    # asked for in a whole model (the variable), it takes the decode steps and leaves the prefill to the rule
    assert sm90.choose_kernel("nvfp4", 17, {"kernel": "decode_ws"}, n=28672, k=8192) == "decode"
    assert sm90.choose_kernel("nvfp4", 512, {"kernel": "decode_ws"}, n=28672, k=8192) == "wgmma_ws"
    # M = 9-32 otherwise: the register-A wgmma on small weights and for MXFP8 at M > 16 with N >= K
    assert sm90.choose_kernel("nvfp4", 9, {}, n=4096, k=4096) == "decode_ws"
    assert sm90.choose_kernel("nvfp4", 9, {}, n=4096, k=4096, tma_ready=False) == "wgmma"
    assert sm90.choose_kernel("nvfp4", 32, {}, n=4096, k=4096) == "wgmma"
    assert sm90.choose_kernel("nvfp4", 32, {}, n=4096, k=4096, dtype=torch.float16) == "decode"
    assert sm90.choose_kernel("nvfp4", 16, {}, n=4096, k=4096, cc=(8, 0)) == "decode"
    assert sm90.choose_kernel("nvfp4", 32, {}, n=28672, k=8192) == "decode"
    assert sm90.choose_kernel("mxfp8", 16, {}, n=28672, k=8192, tma_ready=False) == "decode"
    assert sm90.choose_kernel("mxfp8", 17, {}, n=28672, k=8192) == "wgmma"
    assert sm90.choose_kernel("mxfp8", 32, {}, n=8192, k=8192) == "wgmma"
    assert sm90.choose_kernel("mxfp8", 32, {}, n=4096, k=14336) == "decode"
    assert sm90.choose_kernel("nvfp4", 128, {}, torch.float16) == "dequant"  # wgmma kernel: bf16 only
    assert sm90.choose_kernel("nvfp4", 128, {}, cc=(8, 9)) == "dequant"  # no wgmma before sm_90
    assert sm90.choose_kernel("nvfp4", 1, {}, cc=(8, 0)) == "decode"  # the decode kernel runs on sm_80
    assert sm90.choose_kernel("nvfp4", 64, {}, n=8192) == "wgmma"  # the register-A tile
    assert sm90.choose_kernel("nvfp4", 33, {}, n=28672, k=8192) == "wgmma_ws"  # register A, large weight
    assert sm90.choose_kernel("mxfp8", 64, {}, n=8192, k=28672) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 64, {}, n=28672, k=8192, tma_ready=False) == "wgmma"
    assert sm90.choose_kernel("nvfp4", 65, {}, n=8192) == "wgmma_ws"  # split-K when the tiles are few
    assert sm90.choose_kernel("nvfp4", 128, {}, n=4096, k=4096) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 256, {}, n=28672) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 512, {}, n=2048) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 1024, {}, n=4096) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 128, {}, tma_ready=False) == "wgmma"
    assert sm90.choose_kernel("nvfp4", sm90.WGMMA_MAX_M + 1, {}, tma_ready=False) == "dequant"
    assert sm90.choose_kernel("mxfp4", 2048, {}) == "wgmma_ws"
    assert sm90.choose_kernel("mxfp8", 2048, {}) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 4096, {}) == "wgmma_ws"
    assert sm90.choose_kernel("mxfp8", 4097, {}) == "dequant"
    assert sm90.choose_kernel("nvfp4", 8192, {}) == sm90.choose_kernel("mxfp4", 8192, {}) == "wgmma_ws"
    assert sm90.choose_kernel("nvfp4", 8193, {}) == sm90.choose_kernel("mxfp4", 8193, {}) == "dequant"
    assert sm90.choose_kernel("nvfp4", 1024, {}, torch.float16) == "dequant"
    assert sm90.choose_kernel("nvfp4", 1024, {}, cc=(8, 9)) == "dequant"
    assert sm90.choose_kernel("nvfp4", 1024, {}, cc=(12, 0)) == "dequant"
    assert sm90.choose_kernel("nvfp4", 1024, {}, tma_ready=False) == "dequant"  # x TMA cannot read
    assert sm90.choose_kernel("nvfp4", 512, {}, tma_ready=False) == "wgmma"
    assert sm90.choose_kernel("mxfp4", 4096, {"fp8_activations": True}) == "fp8"
    assert sm90.choose_kernel("mxfp4", sm90.FP8_MIN_M - 1, {"fp8_activations": True}) == "wgmma_ws"
    assert sm90.choose_kernel("mxfp4", 2 * sm90.FP8_MIN_M, {"fp8_activations": True}, cc=(8, 9)) == "fp8"
    assert sm90.choose_kernel("nvfp4", 2048, {"fp8_activations": True}) == "wgmma_ws"  # FP8 path: MX weights only


def test_explicit_kernel_wins_and_is_checked(monkeypatch):
    monkeypatch.delenv("MICROSCALE_SM90_KERNEL", raising=False)
    assert sm90.choose_kernel("nvfp4", 4096, {"kernel": "decode"}) == "decode"
    monkeypatch.setenv("MICROSCALE_SM90_KERNEL", "dequant")
    assert sm90.choose_kernel("nvfp4", 1, {}) == "dequant"
    assert sm90.choose_kernel("nvfp4", 1, {"kernel": "decode"}) == "decode"  # the argument beats the variable
    monkeypatch.setenv("MICROSCALE_SM90_KERNEL", "fastest")
    with pytest.raises(ValueError, match="unknown kernel 'fastest'"):
        sm90.choose_kernel("nvfp4", 1, {})
    monkeypatch.delenv("MICROSCALE_SM90_KERNEL")
    with pytest.raises(ValueError, match="bf16"):
        sm90.choose_kernel("nvfp4", 128, {"kernel": "wgmma"}, torch.float16)
    with pytest.raises(ValueError, match="sm_90"):
        sm90.choose_kernel("nvfp4", 128, {"kernel": "wgmma"}, cc=(8, 9))
    with pytest.raises(ValueError, match="wgmma_ws kernel takes bf16"):
        sm90.choose_kernel("nvfp4", 4096, {"kernel": "wgmma_ws"}, torch.float16)
    with pytest.raises(ValueError, match="decode_ws kernel takes bf16 activations on sm_90, not .* on sm_80"):
        sm90.choose_kernel("nvfp4", 1, {"kernel": "decode_ws"}, cc=(8, 0))
    with pytest.raises(ValueError, match="takes mxfp4, mxfp8 weights, not nvfp4"):
        sm90.choose_kernel("nvfp4", 4096, {"kernel": "fp8"})


@pytest.mark.parametrize("options", [{"kernel": "fp8"}, {"fp8_activations": True}])
def test_fp8_path_needs_sm89(options):
    """A100 has no FP8 tensor cores (torch._scaled_mm and the E4M3 transcode need sm_89): a clear error."""
    with pytest.raises(ValueError, match="needs FP8 tensor cores .sm_89 or later., not sm_80"):
        sm90.choose_kernel("mxfp8", 4096, options, cc=(8, 0))
    assert sm90.choose_kernel("mxfp8", 4096, options, cc=(8, 9)) == "fp8"


@pytest.mark.parametrize("cc,tested", [((9, 0), None), ((8, 0), True), ((8, 6), False), ((8, 9), True),
                                       ((12, 0), True), ((12, 1), False), ((10, 0), None), ((7, 5), None),
                                       (None, None)])
def test_available_where_run_or_self_tested(monkeypatch, cc, tested):
    """sm_90 (tested on the H200): available. sm_80-sm_89 and sm_120: the kernels compile there but
    never ran here, so the first-use self-test decides (its verdict stubbed here; its own tests are
    in test_sm100_triton_selftest.py, the sm90 run in test_sm90_gemm.py). Anything else: not available."""
    calls = []

    def fake_selftest(name, run_fn, device, pairs):
        calls.append((name, tuple(pairs)))
        return tested

    monkeypatch.setattr(sm90, "compute_capability", lambda device: cc)
    monkeypatch.setattr(sm90, "selftest_passed", fake_selftest)
    want = {(9, 0): True}.get(cc, bool(tested))
    assert sm90._available(torch.device("cuda")) is want
    assert calls == ([] if tested is None else [("sm90", sm90.SELFTEST_PAIRS)])


@pytest.mark.parametrize("epilogue,columns", [(None, 32), ("silu_mul", 16)])
def test_no_rows_give_the_output_width(epilogue, columns):
    """M = 0 returns before any kernel: [0, N], or [0, N / 2] for gate/up pairs."""
    y = sm90.gemm(torch.empty(0, 64, dtype=torch.bfloat16), None, None, None, None, fmt="nvfp4", n=32, k=64,
                  options={"epilogue": epilogue})
    assert y.shape == (0, columns)
