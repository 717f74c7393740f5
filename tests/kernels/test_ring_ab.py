"""bench/ring_ab.py on the CPU: the variants it times are ring_config's tiling with the alts' fields replaced, and
--compile-only builds each distinct kernel once into the NVRTC cache (what the GPU machine then only times)."""

import dataclasses
import importlib.util
import json
import os

import pytest

from microscale.kernels.sm90 import decode_ws as D
from microscale.kernels.sm90.decode import FMT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ring_ab():
    spec = importlib.util.spec_from_file_location("bench_ring_ab", os.path.join(ROOT, "bench", "ring_ab.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    Triton decode kernel sums in another order (its equal_base is not asserted: it may round alike). Every output's error against the float64 product of the exact
    dequantized weight is bf16 rounding."""
    records = list(ring_ab.ab_case("nvfp4", 4096, 4096, [1, 16], [{"lead": 1}], rounds=1, calls=8, triton=True))
    assert [(r["M"], r["variant"]) for r in records] == [
        (m, v) for m in (1, 16) for v in ("base", '{"lead": 1}', ring_ab.TRITON)]
    for r in records:
        assert r["equal_base"] or r["variant"] == ring_ab.TRITON
        assert (r["cfg"] is None) == (r["variant"] == ring_ab.TRITON)
        assert r["rel_err_vs_f64"] < 2.0**-8
        assert len(r["us"]) == 1 and 0 < r["best"] and 0 < r["pdl"] and 0 < r["bf16"]
