"""bench/gemm.py's timing on the GPU: _time_graphs replays every contender the same number of times, in turn, and
bench_shape's records carry ours, cuBLAS bf16 and FP8 times from the same rounds, decode M and large M alike."""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gemm():
    spec = importlib.util.spec_from_file_location("bench_gemm", os.path.join(ROOT, "bench", "gemm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_time_graphs_runs_each_contender_alike_and_times_it(gemm):
    """A call that counts its runs: warm-up once per copy, the graph replayed once after its capture, then replays
    times; a call moving 32x the bytes takes longer."""
    counts = torch.zeros(2, device="cuda", dtype=torch.int64)
    small = [torch.randn(1 << 16, device="cuda") for _ in range(2)]
    large = [torch.randn(1 << 21, device="cuda") for _ in range(3)]

    def run(i):
        def call(buf):
            counts[i] += 1
            buf.mul_(1.0)
        return call

    t_small, t_large = gemm._time_graphs([(run(0), small), (run(1), large)], replays=7, calls=4)
    per_graph = [max(4, len(small)), max(4, len(large))]
    assert counts.tolist() == [len(c) + n * (1 + 7) for c, n in zip((small, large), per_graph)]
    assert 0 < t_small < t_large


@pytest.mark.gpu
def test_bench_shape_records_decode_and_large_m(gemm):
    """One small weight at a decode M and a large M: every time is measured, the speed-up is the ratio of the
    record's own times, and the backend is the dispatch's choice."""
    from microscale.kernels import sm90
    records = gemm.bench_shape("nvfp4", 4096, 4096, [1, 1024])
    assert [r["M"] for r in records] == [1, 1024]
    for r in records:
        assert r["backend"] == "sm90:" + sm90.choose_kernel("nvfp4", r["M"], {}, n=4096, k=4096)
        assert all(r[key] > 0 for key in ("us", "bf16_us", "fp8_us", "tbps", "tflops"))
        assert r["speedup_vs_bf16"] == pytest.approx(r["bf16_us"] / r["us"])
    assert "pdl_us" in records[0] and "eager_us" in records[0]
    assert "pdl_us" not in records[1] and "eager_us" not in records[1]
