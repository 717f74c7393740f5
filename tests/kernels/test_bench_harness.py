"""The benchmark harnesses that time the kernels. On the CPU, bench/ring_ab.py: the variants it times are
ring_config's tiling with the alts' fields replaced, and --compile-only builds each distinct kernel once into the
NVRTC cache (what the GPU machine then only times); bench/fixed_cost.py's line fit and its launch-floor kernels. On
the GPU: ring_ab's rounds, bench/gemm.py's _time_graphs (every contender replayed alike), bench_shape's records and
the tile sweep."""

import dataclasses
import importlib.util
import json
import os

import pytest
import torch

from microscale.kernels import nvrtc
from microscale.kernels.sm90 import decode_ws as D
from microscale.kernels.sm90.decode import FMT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ring_ab():
    return _bench_module("ring_ab")


@pytest.fixture(scope="module")
def gemm():
    return _bench_module("gemm")


def test_fixed_cost_fit_finds_each_series_line(seed):
    """fit(recs, op, n) is the least-squares line through op's records on n rows only: exact points of two lines per
    row count (and another op) give back each line's intercept and rate."""
    fixed_cost = _bench_module("fixed_cost")
    g = torch.Generator().manual_seed(seed)
    lines = {(op, n): (float(torch.rand(1, generator=g)) * 4, 3 + float(torch.rand(1, generator=g)) * 2)
             for op in ("nvfp4", "bf16") for n in (28672, 8192)}
    recs = [{"op": op, "N": n, "MB": mb, "us": fixed + mb / rate}
            for (op, n), (fixed, rate) in lines.items() for mb in (10.0, 33.0, 70.0, 250.0)]
    for (op, n), (fixed, rate) in lines.items():
        got = fixed_cost.fit(recs, op, n)
        assert (got["op"], got["N"]) == (op, n)
        assert got["fixed_us"] == pytest.approx(fixed, abs=1e-9) and got["TBps"] == pytest.approx(rate, rel=1e-9)


def test_fixed_cost_floor_kernels_compile_for_sm90a(tmp_path, monkeypatch):
    """The launch-floor probe builds with no GPU: both kernels, and only the reading one loads from global memory."""
    pytest.importorskip("cuda.core")
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    fixed_cost = _bench_module("fixed_cost")
    compiled = fixed_cost.compile_floor_kernels()
    assert set(compiled.symbols) == set(fixed_cost.FLOOR_KERNELS)
    sass = nvrtc.disassemble(compiled.cubin)
    empty, read = (nvrtc.sass_opcodes(sass[compiled.symbols[name]]) for name in fixed_cost.FLOOR_KERNELS)
    assert not [op for op in empty if op.startswith("LDG")]
    assert [op for op in read if op.startswith("LDG")] == ["LDG.E.128.CONSTANT"]


def test_variants_replace_the_alts_fields_of_ring_configs_tiling(ring_ab):
    base = D.ring_config(16, 8192, 8192, FMT_CODE["nvfp4"])
    got = ring_ab.variants("nvfp4", 8192, 8192, 16, [{"lead": 0}, {"chains": 1, "stages": 3}])
    assert list(got) == ["base", '{"lead": 0}', '{"chains": 1, "stages": 3}']
    assert got["base"] == base and (base.lead, base.chains, base.stages) == (2, 2, 4)
    assert got['{"lead": 0}'] == dataclasses.replace(base, lead=0)
    assert got['{"chains": 1, "stages": 3}'] == dataclasses.replace(base, chains=1, stages=3)
    with pytest.raises(TypeError, match="leed"):
        ring_ab.variants("nvfp4", 8192, 8192, 16, [{"leed": 2}])


def test_compile_only_builds_each_distinct_kernel_once(ring_ab, tmp_path, monkeypatch, capsys):
    pytest.importorskip("cuda.core")
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    D._compiled.cache_clear()
    try:
        # M = 1 and 8 give one tiling (block_m 8), whose lead is already 0 (4096x4096 issues the whole ring): the
        # base and the case's own {"chains": 2} are the two kernels
        cases = [["nvfp4", 4096, 4096, [1, 8], [{"chains": 2}]]]
        ring_ab.main(["--cases", json.dumps(cases), "--alts", json.dumps([{"lead": 0}]), "--compile-only"])
    finally:
        D._compiled.cache_clear()
    assert capsys.readouterr().out.strip() == "built 2 variants"
    assert len(list((tmp_path / "nvrtc").iterdir())) >= 2


@pytest.mark.gpu
def test_ab_case_times_every_variant_and_checks_its_output(ring_ab):
    """One round on a small weight: a lead changes when stages are issued, not the sums (equal to the base's); the
    Triton decode kernel sums in another order (its equal_base is not asserted: it may round alike). Every output's
    error against the float64 product of the exact dequantized weight is bf16 rounding."""
    records = list(ring_ab.ab_case("nvfp4", 4096, 4096, [1, 16], [{"lead": 1}], rounds=1, calls=8, triton=True))
    assert [(r["M"], r["variant"]) for r in records] == [
        (m, v) for m in (1, 16) for v in ("base", '{"lead": 1}', ring_ab.TRITON)]
    for r in records:
        assert r["equal_base"] or r["variant"] == ring_ab.TRITON
        assert (r["cfg"] is None) == (r["variant"] == ring_ab.TRITON)
        assert r["rel_err_vs_f64"] < 2.0**-8
        assert len(r["us"]) == 1 and 0 < r["best"] and 0 < r["pdl"] and 0 < r["bf16"]


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


@pytest.mark.gpu
def test_sweep_checks_each_tile_then_times_them_in_turn(gemm, monkeypatch):
    """wgmma_ws tiles at one M: the two that give the default tile's output are timed by one _time_graphs call (their
    graphs replayed in turn), and a tile that cannot be built (512 rows: more shared memory than an SM has) is
    reported without a time."""
    counted, time_graphs = [], gemm._time_graphs

    def counting(contenders, **reps):
        counted.append(len(contenders))
        return time_graphs(contenders, **reps)
    monkeypatch.setattr(gemm, "_time_graphs", counting)
    records = gemm.sweep_kernel("nvfp4", 1024, 2048, [256], [dict(block_m=128), dict(block_m=256, stages=3),
                                                            dict(block_m=512)], kernel="wgmma_ws")
    assert counted == [2]
    assert [(r["M"], r["block_m"], r["stages"]) for r in records] == [(256, 128, 4), (256, 256, 3), (256, 512, 4)]
    for r in records[:2]:
        assert r["us"] > 0 and r["rel_diff_vs_default"] < 1e-3
    assert records[2]["us"] is None and records[2]["rel_diff_vs_default"] is None
