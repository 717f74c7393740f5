"""bench/step_timeline.py on the CPU: the stamped decode_ws source builds for sm_90a with its five %globaltimer
reads and one slot ticket per kernel, and the per-call spreads and per-kind medians from hand-made records."""

import importlib.util
import os
import sys

import pytest
import torch

from microscale.kernels import nvrtc
from microscale.kernels.sm90 import decode_ws as D

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def timeline():
    path = os.path.join(ROOT, "bench", "step_timeline.py")
    spec = importlib.util.spec_from_file_location("bench_step_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_step_timeline"] = module
    spec.loader.exec_module(module)
    return module


def test_stamped_source_builds_with_five_stamps_per_kernel(timeline, monkeypatch):
    """The Llama-8B step's decode_ws variants at M = 1 (norm in q/k/v and gate/up, residual in o_proj and down)."""
    pytest.importorskip("cuda.bindings")
    variants = [D.variant(0, D.ring_config(1, 6144, 4096, 0), norm=True),
                D.variant(0, D.ring_config(1, 4096, 4096, 0), residual=True),
                D.variant(0, D.ring_config(1, 28672, 4096, 0), gated=True, norm=True),
                D.variant(0, D.ring_config(1, 4096, 14336, 0), residual=True)]
    text = timeline.stamped_source(0x7F0000000000, 0x7F0000100000)
    monkeypatch.setattr(D, "source", lambda: text)
    D._compiled.cache_clear()
    try:
        compiled = D._compiled(tuple(dict.fromkeys(variants)))
    finally:
        D._compiled.cache_clear()  # later tests build the kernels unstamped
    sass = nvrtc.disassemble(compiled.cubin)
    for v in dict.fromkeys(variants):
        code = sass[compiled.symbols[D.name_expression(*v)]]
        assert code.count("GLOBALTIMER") == 5, D.name_expression(*v)
        assert [op for op in nvrtc.sass_opcodes(code) if op.startswith(("ATOM", "RED"))] == ["ATOM.E.ADD.STRONG.GPU"]


def test_splice_needs_exactly_one_anchor(timeline):
    """A decode_ws.cuh edit that moves an anchor line stops the probe with the line's text."""
    assert timeline._splice("a\nb\n", "b\n", "x\n", before=True) == "a\nx\nb\n"
    for src in ("a\na\n", "c\n"):
        with pytest.raises(RuntimeError, match="exactly one 'a'"):
            timeline._splice(src, "a\n", "x\n")


def test_kernel_spreads_and_medians(timeline):
    """Two layers of hand-made stamps (ns): calls split at each change of (N, K), spreads in us from the first
    entry, medians over the calls after the first."""
    records = []
    t = 0
    for layer in range(2):
        for n, kt, span in ((6144, 64, 8000), (4096, 64, 5000), (28672, 64, 20000), (4096, 224, 12000)):
            for cta in range(2):
                entry = t + 100 * cta
                records.append([n | kt << 32, cta | 7 << 32, entry, entry + 500, entry + 1500, entry + span - 1000,
                                entry + span, 0])
            t += span + 1000
    calls = timeline.kernel_spreads(torch.tensor(records))
    assert [c["kind"] for c in calls] == ["qkv", "o_proj", "gate_up", "down"] * 2
    assert calls[0]["entry"] == (0.0, 0.05, 0.1) and calls[0]["done"] == (8.0, 8.05, 8.1)
    assert calls[1]["wait"] == (9.5, 9.55, 9.6)
    medians = timeline.per_kind_medians(calls)
    # o_proj: its median wait returns at 9.55 us, q/k/v's last CTA was done at 8.1
    assert medians["o_proj"]["wait_after_previous_done"] == pytest.approx(1.45)
    assert medians["gate_up"]["loop"] == pytest.approx(17.5)
    assert medians["down"]["loop_end_spread"] == pytest.approx(0.1)
    assert medians["qkv"]["since_previous_done"] == pytest.approx(9.0)  # layer 2's q/k/v after layer 1's down
