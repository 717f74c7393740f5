"""bench/stream_probe.py's patched decode_ws sources (probes 4 to 6) on the CPU: every patch point is found once
and each variant builds for sm_90a, so a change to decode_ws.cuh that moves a line breaks here, not on the GPU. Probe
8's weight maps at another L2 promotion: on the CPU the specs, on the GPU the encoded maps and decode_ws's output."""

import dataclasses
import importlib.util
import os
import sys

import pytest
import torch

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
    assert set(sources) == {"full", "stream", "stream-no-x", "stream-evict-normal", "stream-one-arrival", "consume"}
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
        assert "SR_VIRTUALSMID" in code or "SR_SMID" in code  # the CTA's SM
        assert any(op.startswith(("ATOM", "ATOMG")) for op in nvrtc.sass_opcodes(code))


def test_timeline_summary_of_hand_made_records(probe):
    """Two calls of 2 CTAs (SMs 5 and 9), ns: call 0 starts at 1000, call 1 at 9000; SM 9's loop ends 2 us after
    SM 5's in both calls."""
    rows = [(1000, 2000, 5000, 6000, 0, 5), (1100, 2200, 7000, 7500, 1, 9),
            (9000, 10000, 13000, 13500, 0, 9), (9000, 9600, 11000, 11200, 1, 5)]
    summary = probe.timeline_summary(torch.tensor(rows, dtype=torch.float64), calls=2)
    assert summary["ctas"] == 2
    # torch's median of two values is the lower one: per call the medians (1.0, 0.6) us, then 0.6
    assert summary["land_median"] == pytest.approx(0.6)
    assert summary["loop_end_last"] == pytest.approx(4.0)  # per call 6.0 and 4.0
    assert summary["gap_to_next"] == pytest.approx(1.5)  # 9000 - 7500
    # SM 5's loop ends at 4.0 and 2.0 us, SM 9's at 6.0 and 4.0: medians 2.0 and 4.0, both moving by std sqrt(2)
    assert summary["loop_end_by_sm"] == [[5, 2.0, 1.414], [9, 4.0, 1.414]]


def test_a_moved_patch_point_is_named(probe):
    with pytest.raises(RuntimeError, match="patch point"):
        probe._splice("a\nb\n", "c\n", "x")


def test_weight_map_promotion_reaches_decode_ws_weight_maps_only_inside(probe):
    """Probe 8 swaps the L2 promotion of the weight maps decode_ws launches with, for the block only."""
    from microscale.kernels.sm90 import wgmma_ws
    from microscale.kernels.sm90.layout import prepared_views
    packed = torch.zeros(4, 8, 576, dtype=torch.uint8)  # NVFP4: 4 row groups, 8 K steps
    data, scale = prepared_views(packed, "nvfp4")
    with probe._weight_map_promotion("none"):
        inside = wgmma_ws.weight_map_specs(data, scale, 0, 4, 2)
    outside = wgmma_ws.weight_map_specs(data, scale, 0, 4, 2)
    assert [s.l2_promotion for s in inside] == ["none", "none"] and [s.l2_promotion for s in outside] == ["256B"] * 2
    assert [dataclasses.replace(s, l2_promotion="256B") for s in inside] == list(outside)


@pytest.mark.gpu
def test_weight_map_promotion_changes_the_maps_not_the_output(probe, seed):
    """The promotion is encoded into the map (four promotions, four maps) and changes only how the L2 fetches:
    decode_ws's output at every promotion is bit-equal to the default's (its numerics: test_sm90_gemm.py)."""
    from microscale.kernels.sm90 import wgmma_ws
    call, copies, _, _ = probe._ws_case("nvfp4", 1, 1024, 2048)
    data, scale, _ = copies[0]
    maps = {p: nvrtc.encode_tensor_map(dataclasses.replace(wgmma_ws.weight_map_specs(data, scale, 0, 8, 4)[0],
                                                           l2_promotion=p)) for p in nvrtc.L2_PROMOTIONS}
    assert len(set(maps.values())) == len(maps)
    y = call(copies[0])
    for promotion in nvrtc.L2_PROMOTIONS:
        with probe._weight_map_promotion(promotion):
            assert torch.equal(call(copies[0]), y), promotion


def test_queue_kernel_builds_with_bulk_copies_and_claims(probe):
    """Probe 9's read-only ring: the 1-D bulk copies, and the atomics of the dynamic claims and the counters' reset."""
    name = "ms90::ring_queue<4>"
    compiled = nvrtc.compile_kernels((name,), source=probe.queue_source(), label="ring_queue", arch="sm_90a")
    ops = nvrtc.sass_opcodes(nvrtc.disassemble(compiled.cubin)[compiled.symbols[name]])
    assert any(op.startswith("UBLKCP") for op in ops), sorted(set(ops))
    assert sum(op.startswith(("ATOM", "ATOMG", "RED")) for op in ops) >= 4  # two claims, done, two resets


@pytest.mark.gpu
@pytest.mark.parametrize("ctas, dynamic", [(128, 0), (132, 0), (132, 1)])
def test_queue_rings_end_and_reset_their_counters(probe, ctas, dynamic):
    """Both shares of a weight whose bytes are not a whole number of chunks end (the graph timing returns) and leave the
    claim counters at zero for the next call (ring_queue asserts it)."""
    rec = probe.ring_queue(1024, 2048, ctas, 7 * 576 * 4, dynamic)
    assert rec["us"] > 0 and rec["dynamic"] == bool(dynamic)
