"""bench/stream_probe.py's patched decode_ws sources (probes 4 to 7) on the CPU: every patch point is found once
and each variant builds for sm_90a, so a change to decode_ws.cuh that moves a line breaks here, not on the GPU."""

import importlib.util
import os
import sys

import pytest

from microscale.kernels import nvrtc
from microscale.kernels.sm90 import decode_ws as D

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def probe():
    pytest.importorskip("cuda.bindings")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location("bench_stream_probe", os.path.join(ROOT, "bench", "stream_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# M = 1 NVFP4 at 28672x8192 (14 row groups, split 1) and the Llama-8B step's q/k/v (norm, split 2) and gate/up
VARIANTS = [D.variant(0, D.ring_config(1, 28672, 8192, 0)), D.variant(0, D.ring_config(1, 6144, 4096, 0), norm=True),
            D.variant(0, D.ring_config(1, 28672, 4096, 0), gated=True, norm=True)]


def _build(text):
    D._compiled.cache_clear()
    try:
        original, D.source = D.source, lambda: text
        return D._compiled(tuple(VARIANTS))
    finally:
        D.source = original
        D._compiled.cache_clear()  # later tests build the kernels unpatched


def test_bounds_sources_build(probe):
    sources = probe._ws_sources()
    assert set(sources) == {"full", "stream", "consume"}
    for text in sources.values():
        _build(text)


def test_waits_source_builds_with_clock_reads_and_four_adds(probe):
    compiled = _build(probe.waits_source(0x7F0000000000))
    sass = nvrtc.disassemble(compiled.cubin)
    for v in VARIANTS:
        code = sass[compiled.symbols[D.name_expression(*v)]]
        assert code.count("SR_CLOCKLO") >= 6, D.name_expression(*v)  # t0, around two waits, the span
        assert code.count("SR_GLOBALTIMERLO") >= 2, D.name_expression(*v)  # the producer's start and end
        # the consumers' four sums (a generic address: ptxas adds a shared-memory path beside each global add)
        adds = [op for op in nvrtc.sass_opcodes(code) if op.startswith(("ATOM.E.ADD", "RED.E.ADD"))]
        assert len(adds) == 4, adds


def test_timeline_source_stamps_four_times_and_appends_by_an_atomic(probe):
    compiled = _build(probe.timeline_source(0x7F0000000000))
    sass = nvrtc.disassemble(compiled.cubin)
    for v in VARIANTS:
        code = sass[compiled.symbols[D.name_expression(*v)]]
        assert code.count("SR_GLOBALTIMERLO") >= 4, D.name_expression(*v)  # start, first stage, loop end, end
        assert any(op.startswith(("ATOM", "ATOMG")) for op in nvrtc.sass_opcodes(code))


@pytest.mark.parametrize("lead", [1, 2])
def test_fill_source_waits_for_the_first_stages_before_the_rest(probe, lead):
    text = probe.fill_source(lead)
    assert f"lead = min(first, {lead});" in text
    _build(text)


def test_a_moved_patch_point_is_named(probe):
    with pytest.raises(RuntimeError, match="patch point"):
        probe._splice("a\nb\n", "c\n", "x")
