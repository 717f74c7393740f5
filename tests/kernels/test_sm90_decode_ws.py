"""CPU CI for the TMA-ring decode kernel (kernels/sm90/decode_ws.cuh): NVRTC builds the variants the library and
the GPU tests launch for sm_90a, the SASS holds the ring (TMA boxes, mbarriers) and one mma.sync per 16 of K and
8 activation rows with nothing spilled, the fused variants (gated epilogue, norm warp, residual add) what they add,
the shared-memory size the launch asks for is the source's, and the tiling rule (ring_config, ring_wins) gives what
it says.

The kernel's numerics run on the H200: tests/kernels/test_sm90_gemm.py (marked gpu).
"""

import dataclasses
import itertools
import re

import pytest
import torch

pytest.importorskip("cuda.core")

from microscale.kernels import nvrtc  # noqa: E402
from microscale.kernels.sm90 import decode_ws as D  # noqa: E402
from microscale.kernels.sm90.decode import FMT_CODE  # noqa: E402

# tilings of ring_config's for the benchmark's and the Llama decoder's weights (M = 1-16, by _warps' rule) and of
# test_sm90_gemm.py
CONFIGS = (D.RingConfig(groups=14, steps=4, stages=3, split=1, k_warps=2), D.RingConfig(groups=8, split=2, k_warps=2),
           D.RingConfig(block_m=16, groups=14, steps=4, stages=3, split=1),
           D.RingConfig(block_m=16, groups=4, split=1), D.RingConfig(steps=2, stages=2, split=1),
           D.RingConfig(groups=5, steps=2, split=2), D.RingConfig(block_m=16, groups=4, steps=2, stages=3, split=3),
           D.RingConfig(block_m=16, groups=16, steps=2, stages=4, split=1),
           D.RingConfig(groups=3, steps=4, stages=2, split=2, k_warps=4),
           D.RingConfig(groups=5, steps=2, stages=4, split=1, k_warps=2),
           D.RingConfig(block_m=16, groups=14, steps=4, stages=3, split=1, k_warps=2, groups_per_warp=2),
           D.RingConfig(groups=8, split=2, k_warps=2, groups_per_warp=2),
           D.RingConfig(block_m=16, groups=14, steps=4, stages=3, split=1, k_warps=4, groups_per_warp=2),
           D.RingConfig(block_m=16, groups=4, steps=4, stages=4, split=2, k_warps=2),
           D.RingConfig(block_m=16, groups=8, split=2, k_warps=2, groups_per_warp=2, chains=2, lead=2),
           D.RingConfig(groups=5, steps=2, stages=4, split=1, k_warps=2, chains=4, lead=1),
           D.RingConfig(groups=14, steps=2, stages=5, split=1, lead=3),  # 28672x8192 up to M = 8
           D.RingConfig(groups=4, steps=4, stages=4, split=1, k_warps=2, lead=2))  # MXFP8 8192x8192 up to M = 8


NORM_CONFIGS = (CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[6])  # 2 warps: split 1 and 2; 16 rows: split 1 and 3
FUSED = tuple(itertools.product((False, True), repeat=3))  # (gated, norm, residual)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("nvrtc-cache")))
    variants = [D.variant(f, c) for f in FMT_CODE.values() for c in CONFIGS]
    variants += [D.variant(f, c, gated=True) for f in FMT_CODE.values() for c in CONFIGS[:2]]
    variants += [D.variant(f, c, *fused) for f in FMT_CODE.values() for c in NORM_CONFIGS for fused in FUSED]
    compiled = D._compiled(tuple(dict.fromkeys(variants)))
    yield compiled, nvrtc.disassemble(compiled.cubin), nvrtc.resource_usage(compiled.cubin)
    mp.undo()


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bm{c.block_m}-g{c.groups}-kw{c.k_warps}-"
                                                    f"gpw{c.groups_per_warp}-"
                                                    f"s{c.steps}-st{c.stages}-split{c.split}")
def test_sass_holds_the_ring(build, fmt, cfg):
    compiled, sass, resources = build
    code = sass[compiled.symbols[D.name_expression(FMT_CODE[fmt], cfg)]]
    # a consumer warp's stage: steps / k_warps K steps of groups_per_warp row groups, each 4 slices of 16 with
    # block_m / 8 MMAs of 8 activation rows
    mmas = 4 * cfg.steps // cfg.k_warps * cfg.groups_per_warp * cfg.block_m // 8
    assert len(re.findall(r"HMMA\.16816\.F32\.BF16", code)) == mmas
    # partials go through shared memory (16-byte stores) to the warp that stores the row group
    assert ("STS.128" in code) == (cfg.k_warps > 1)
    assert "UTMALDG.2D" in code and "UTMALDG.3D" in code and "UTMALDG.4D" in code  # x, scales, words
    assert "UTMACCTL.PF" in code  # the maps (kernel parameters) prefetched
    for op in ("SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT"):
        assert op in code, op
    if cfg.split > 1:  # partials sent into the peers' shared memory (st.async), one cluster barrier for the init
        assert code.count("UCGABAR_ARV") == 1 and "UCGABAR_WAIT" in code and "STAS.128" in code
        # the receive barrier's wait acquires at cluster scope: an L1 invalidate beside the cluster barrier's
        assert code.count("CCTL.IVALL") >= 2
        assert "LD.E.128" not in code  # nothing read from a peer's shared memory
    else:
        assert "UCGABAR_ARV" not in code and "CCTL.IVALL" not in code
    res = resources[compiled.symbols[D.name_expression(FMT_CODE[fmt], cfg)]]
    assert res.get("LOCAL", 0) == 0 and res["REG"] * cfg.threads <= 65536, res
    # ptxas spills into a stack frame (STACK, not LOCAL) where its occupancy heuristic caps the registers; one CTA
    # per SM (launch bounds' min blocks 1) leaves a stack frame only where the CTA's warps fill the register file
    # (registers come 8 a thread at a time)
    assert res.get("STACK", 0) == 0 or (res["REG"] + 8) * cfg.threads > 65536, res


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"split{c.split}")
def test_sass_waits_for_the_prior_grid_after_the_first_weight_loads(build, cfg):
    """Launched as a programmatic dependent (PDL), the kernel may run beside the kernel that writes x: the
    producer issues the first stages' words and scales, then griddepcontrol.wait (SASS ACQBULK), then x; every
    other thread waits too before the next kernel is released (PREEXIT), and y is stored after that."""
    compiled, sass, _ = build
    ops = nvrtc.sass_opcodes(sass[compiled.symbols[D.name_expression(0, cfg)]])
    waits = [i for i, o in enumerate(ops) if o == "ACQBULK"]
    assert len(waits) == 3  # the producer thread, its warp's other lanes, the consumers
    first_words, first_x = ops.index("UTMALDG.4D"), ops.index("UTMALDG.2D")
    assert any(first_words < w < first_x for w in waits)
    release = ops.index("PREEXIT")
    assert max(waits) < release < min(i for i, o in enumerate(ops) if o.startswith("STG"))


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"split{c.split}")
def test_gated_epilogue_stores_half_the_columns(build, fmt, cfg):
    """With GATED (gate/up row pairs, kernels/gated.py) a thread's two accumulator rows become one silu(gate) * up
    output: half the y stores of the plain kernel, an exponential per output, and the same K loop (MMAs)."""
    compiled, sass, resources = build
    plain, gated = (nvrtc.sass_opcodes(sass[compiled.symbols[D.name_expression(FMT_CODE[fmt], cfg, g)]])
                    for g in (False, True))
    stores = [sum(o.startswith("STG") for o in ops) for ops in (plain, gated)]
    assert stores[1] * 2 == stores[0] and stores[1] > 0
    assert "MUFU.EX2" in gated and "MUFU.EX2" not in plain
    assert sum(o.startswith("HMMA") for o in gated) == sum(o.startswith("HMMA") for o in plain)
    res = resources[compiled.symbols[D.name_expression(FMT_CODE[fmt], cfg, True)]]
    assert res.get("LOCAL", 0) == 0


def _opcodes(build, fmt, cfg, gated=False, norm=False, residual=False):
    compiled, sass, resources = build
    symbol = compiled.symbols[D.name_expression(FMT_CODE[fmt], cfg, gated, norm, residual)]
    return nvrtc.sass_opcodes(sass[symbol]), resources[symbol]


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("cfg", NORM_CONFIGS, ids=lambda c: f"bm{c.block_m}-kw{c.k_warps}-split{c.split}")
def test_norm_warp_scales_each_stage_in_place(build, fmt, gated, cfg):
    """With the norm (kernels/rmsnorm.py) one more warp: it copies its slice of the norm weight into shared memory
    (LDGSTS) before griddepcontrol.wait, then takes each stage after its full barrier: per K step and x row of its
    lane (block_m / 4 of them) it loads 16 bytes, adds their squares (2 FFMA per bf16 pair), multiplies them by the
    norm weight (one HMUL2.BF16 per pair, 4 per chunk) and stores them back; each stage then a fence against the next
    TMA write into it and an arrive on the stage's ready barrier. The consumers' MMAs are the plain kernel's; the
    epilogue takes one rsqrt per output row. Nothing spills in 64K registers with the extra warp."""
    plain, _ = _opcodes(build, fmt, cfg, gated)
    norm, res = _opcodes(build, fmt, cfg, gated, norm=True)
    count = lambda ops, name: sum(o.startswith(name) for o in ops)  # noqa: E731
    per_stage = cfg.steps * cfg.block_m // 4 * 4  # pairs' HMUL2 = chunks x 4 words
    assert count(norm, "HMUL2.BF16") - count(plain, "HMUL2.BF16") == per_stage
    assert count(norm, "FFMA") - count(plain, "FFMA") >= 2 * per_stage
    assert count(norm, "FENCE.VIEW.ASYNC.S") - count(plain, "FENCE.VIEW.ASYNC.S") == 1
    copies = [i for i, o in enumerate(norm) if o.startswith("LDGSTS.E.BYPASS.128")]
    waits = [i for i, o in enumerate(norm) if o == "ACQBULK"]  # the norm warp's one wait follows its copies
    assert copies and len(waits) == count(plain, "ACQBULK") + 1 and any(w > max(copies) for w in waits)
    assert count(norm, "HMMA") == count(plain, "HMMA")
    assert count(norm, "MUFU.RSQ") > count(plain, "MUFU.RSQ")
    shuffles = count(norm, "SHFL.BFLY") - count(plain, "SHFL.BFLY")  # 3 per row sum over 8 lanes (code may repeat)
    assert shuffles > 0 and shuffles % (3 * cfg.block_m // 4) == 0
    assert res.get("LOCAL", 0) == 0 and res["REG"] * D.threads(cfg, norm=True) <= 65536, res
    assert D.threads(cfg, norm=True) == cfg.threads + 32


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("cfg", NORM_CONFIGS[:2], ids=lambda c: f"split{c.split}")
def test_residual_is_loaded_once_per_stored_output(build, fmt, gated, cfg):
    """With the residual each y store has one 2-byte residual load before it (besides the bias's), with or without
    the norm; the K loop is the plain kernel's."""
    plain, _ = _opcodes(build, fmt, cfg, gated)
    for norm in (False, True):
        fused, res = _opcodes(build, fmt, cfg, gated, norm, residual=True)
        base, _ = _opcodes(build, fmt, cfg, gated, norm)
        loads = [sum(o.startswith("LDG.E.U16") for o in ops) for ops in (base, fused)]
        stores = sum(o.startswith("STG.E.U16") for o in fused)
        assert loads[1] - loads[0] == stores > 0
        assert sum(o.startswith("HMMA") for o in fused) == sum(o.startswith("HMMA") for o in plain)
        assert res.get("LOCAL", 0) == 0


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("cfg", NORM_CONFIGS, ids=lambda c: f"bm{c.block_m}-kw{c.k_warps}-split{c.split}")
def test_epilogue_operands_load_before_the_k_loop(build, fmt, cfg):
    """Every global load of the kernel (the rows' factors and bias; the residual) comes before its first MMA, so the
    kernel's tail has no memory round trip but its stores; the factors and bias before griddepcontrol.wait (they are
    constants), the residual after it (a kernel's output), one load per stored output."""
    for gated, norm, residual in FUSED:
        ops, _ = _opcodes(build, fmt, cfg, gated, norm, residual)
        loads = [i for i, o in enumerate(ops) if o.startswith("LDG.")]  # not the norm warp's LDGSTS
        first_wait = ops.index("ACQBULK")
        assert loads and max(loads) < min(i for i, o in enumerate(ops) if o.startswith("HMMA"))
        assert sum(i < first_wait for i in loads) >= 4  # 2 factors (LDG.E), 2 bias values (LDG.E.U16)
        stores = sum(o.startswith("STG") for o in ops)
        assert sum(i > first_wait for i in loads) == (stores if residual else 0)


def test_norm_adds_its_barriers_and_row_sums_to_the_shared_memory():
    for cfg in NORM_CONFIGS:
        for f in FMT_CODE.values():
            extra = cfg.smem_bytes(f, norm=True) - cfg.smem_bytes(f)
            # ready barriers, the row sums, and with a split the peers' row sums received
            need = 8 * cfg.stages + 4 * cfg.block_m * (1 + (cfg.split if cfg.split > 1 else 0))
            assert abs(extra - need) < 16 and extra % 16 == 0  # each region padded to 16 bytes


def test_split_adds_the_peers_partials_to_the_shared_memory():
    """A CTA of a split receives, per rank, the partials of the row groups it stores: ceil(groups / split) warps of
    32 lanes x block_m / 2 floats, and their barrier."""
    for cfg in CONFIGS + NORM_CONFIGS:
        if cfg.split == 1:
            continue
        for f in FMT_CODE.values():
            extra = cfg.smem_bytes(f) - dataclasses.replace(cfg, split=1).smem_bytes(f)
            need = 8 + cfg.split * -(-cfg.groups // cfg.split) * 32 * cfg.block_m // 2 * 4
            assert abs(extra - need) < 16 and extra % 16 == 0


def test_build_checks_the_shared_memory_size_against_the_source(tmp_path, monkeypatch):
    """RingConfig.smem_bytes (what the launch asks for) must equal the source's RingSmem<>::BYTES."""
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(D.RingConfig, "smem_bytes", lambda self, fmt_code, norm=False: 4096)
    with pytest.raises(RuntimeError, match="RingConfig.smem_bytes differs"):
        D._compiled.__wrapped__((D.variant(0, D.RingConfig()),))


@pytest.mark.parametrize("n,k,fmt,want", [
    (28672, 8192, "nvfp4", D.RingConfig(groups=14, steps=2, stages=5, split=1)),  # 128 tiles of 14 row groups
    (8192, 28672, "nvfp4", D.RingConfig(groups=8, steps=4, stages=4, split=2)),  # 64 tiles x 2 parts
    (8192, 8192, "mxfp8", D.RingConfig(groups=4, steps=4, stages=4, split=1)),  # the tie goes to 4 groups
    (6144, 4096, "mxfp8", D.RingConfig(groups=6, steps=4, stages=4, split=2)),
    (28672, 8192, "mxfp8", D.RingConfig(groups=14, steps=2, stages=4, split=1)),  # 4 steps: a 62 KB stage
    (4096, 4096 + 128, "nvfp4", D.RingConfig(groups=4, steps=2, stages=5, split=2)),  # 66 steps: 2 per stage
])
def test_ring_config_fills_the_sms_with_one_cta_each(n, k, fmt, want):
    """want: the tiling at M = 1 but for its consumer warps (_warps below), at M = 1, 8 and 16; at M = 16 also the
    tiling of one more row group per CTA."""
    for m in (1, 8):
        cfg = D.ring_config(m, n, k, FMT_CODE[fmt])
        assert dataclasses.replace(cfg, k_warps=1, lead=0, chains=1) == want
        assert (cfg.k_warps, cfg.groups_per_warp) == _warps(8, want.groups, D.padded_shape(n, k)[1], cfg.steps, fmt)
    for groups in (want.groups, want.groups + 1):
        sms = -(-D.padded_shape(n, k)[0] // (16 * groups)) * want.split  # the tiling that fills them: groups
        wide = D.ring_config(16, n, k, FMT_CODE[fmt], sms)
        assert (wide.block_m, wide.groups, wide.split) == (16, groups, want.split)
        assert (wide.k_warps, wide.groups_per_warp) == _warps(16, groups, D.padded_shape(n, k)[1], wide.steps, fmt)


@pytest.mark.parametrize("m,norm,want", [(1, False, (2, 5)), (8, False, (2, 5)), (1, True, (4, 3)), (8, True, (4, 3)),
                                         (9, False, (4, 3)), (16, True, (4, 3))])
def test_ring_config_stage_size_follows_m_and_the_norm(m, norm, want):
    """NVFP4 28672x4096, 14 row groups per CTA. Per K step a row group holds 16 x 64 / 2 bytes of words and 16 x 4
    scales (576), x block_m x 128 bytes: 4 steps at block_m 8 are 4 x (1024 + 14 x 576) = 36352 bytes, 36 KB rounded,
    over MAX_STAGE_BYTES_M8 (32 KB), so up to M = 8 a stage takes 2 steps (18 KB) and the ring MAX_STAGES of them;
    with the norm, or at M = 9-16 (40 KB under MAX_STAGE_BYTES), 4 steps and the 3 stages 128 KB hold."""
    cfg = D.ring_config(m, 28672, 4096, FMT_CODE["nvfp4"], norm=norm)
    assert (cfg.steps, cfg.stages) == want
    assert cfg.stage_bytes(FMT_CODE["nvfp4"]) == {(2, 8): 18432, (4, 8): 36864, (4, 16): 40960}[cfg.steps, cfg.block_m]


@pytest.mark.parametrize("fmt,n,k,m,norm,stage,lead,chains", [
    ("nvfp4", 8192, 8192, 1, False, 4 * (8 * 128 + 8 * 576), 2, 1),  # 22528: a 4-step stage of 20 KB or more
    ("mxfp4", 8192, 8192, 1, False, 4 * (8 * 128 + 8 * 544), 2, 1),  # 21504 (16 x 2 E8M0 scales per step)
    ("nvfp4", 8192, 8192, 16, False, 4 * (16 * 128 + 8 * 576), 2, 2),  # pairs of row groups, two warps each
    ("nvfp4", 4096, 4096, 1, False, 4 * (8 * 128 + 4 * 576), 0, 1),  # 13312: the whole ring at once
    ("nvfp4", 4096, 4096, 16, False, 4 * (16 * 128 + 4 * 576), 0, 1),  # 17408
    ("nvfp4", 4096, 4096, 1, True, 4 * (8 * 128 + 4 * 576), 2, 1),  # the norm: always 2 ahead
    ("nvfp4", 28672, 8192, 1, False, 18432, 3, 1),  # 2 x (1024 + 14 x 576) rounded up: 2-step stages, 3 ahead
    ("mxfp4", 28672, 4096, 8, False, 17408, 3, 1),  # 2 x (1024 + 14 x 544) rounded up
    ("mxfp8", 28672, 8192, 1, False, 31744, 3, 1),  # 2 x (1024 + 14 x 1056) rounded up
    ("nvfp4", 8192, 4160, 1, False, 2 * (8 * 128 + 8 * 576), 0, 1),  # 11264: odd pairs of K steps, small stages
    ("nvfp4", 28672, 8192, 16, False, 40960, 2, 1),  # 4 steps, 40448 rounded up; four warps per pair
    ("mxfp8", 28672, 8192, 16, False, 33792, 0, 2),  # 2 x (2048 + 14 x 1056) rounded up; 2 steps, 2 warps a pair
    ("mxfp8", 4096, 4096, 1, False, 21504, 0, 1),  # 4 x (1024 + 4 x 1056) rounded up, but 4 row groups at M <= 8
    ("mxfp8", 8192, 8192, 1, False, 21504, 2, 1),  # ... unless a CTA takes whole rows (split 1) of at most 8192
    ("mxfp8", 8192, 28672, 1, False, 21504, 0, 1),  # ... longer rows: the whole ring at once
    ("mxfp8", 4096, 4096, 16, False, 25600, 2, 1),  # 4 x (2048 + 4 x 1056) rounded up, at M = 16
])
def test_ring_config_first_fill_and_accumulators(fmt, n, k, m, norm, stage, lead, chains):
    """The first fill runs FIRST_FILL_LEAD stages ahead on 4-step stages of LEAD_STAGE_BYTES (20 KB) or more (up to
    M = 8 on FEW_GROUPS or more row groups, or on a CTA taking whole rows of at most LONG_K) and on calls carrying the
    norm, SHORT_STAGE_LEAD (3) on 2-step stages of
    16 KB or more on FEW_GROUPS or more row groups up to M = 8; 2 accumulators per row group where a warp
    takes a pair of row groups with one other warp (the stage bytes computed by hand: x's block_m rows of 128 bytes
    and the row groups' 512 bytes of words plus 64 (NVFP4) or 32 (MX) of scales, or MXFP8's 1024 + 32, per K step)."""
    cfg = D.ring_config(m, n, k, FMT_CODE[fmt], norm=norm)
    assert cfg.stage_bytes(FMT_CODE[fmt]) == stage
    assert (cfg.lead, cfg.chains) == (lead, chains)
    assert D.name_expression(FMT_CODE[fmt], cfg).count(f", {chains}, {lead or cfg.stages}, {cfg.steps}, ") == 1


def _warps(block_m, groups, k_padded, steps, fmt):
    """(k_warps, groups_per_warp) by the rule in ring_config's docstring (runs 33b, 34b-34h), for at most 15 groups."""
    if groups < 8:
        return 2, 1  # few row groups: two warps each
    if k_padded < 8192:
        return (2 if block_m == 8 else 1), 1
    if block_m == 8:
        return (2 if fmt == "mxfp8" else 1), 1
    if groups % 2 == 0:  # pairs of row groups
        return (4 if groups >= 12 and steps % 4 == 0 else 2), 2
    return 1, 1


@pytest.mark.parametrize("n,k,fmt,groups,warps,warps_m8", [
    (4096, 14336, "nvfp4", 4, (2, 1), (2, 1)), (6144, 4096, "mxfp4", 6, (2, 1), (2, 1)),
    (8192, 8192, "mxfp8", 4, (2, 1), (2, 1)), (8192, 8192, "nvfp4", 8, (2, 2), (1, 1)),
    (8192, 4096, "nvfp4", 8, (1, 1), (2, 1)),  # K = 4096: no pairs, two warps up to M = 8
    (25344, 8192, "nvfp4", 12, (4, 2), (1, 1)), (26624, 8192, "nvfp4", 13, (1, 1), (1, 1)),  # 12 x 132, 13 x 128
    (28672, 8192, "mxfp4", 14, (4, 2), (1, 1)), (28672, 4096, "nvfp4", 14, (1, 1), (2, 1)),
    (28672, 8192, "mxfp8", 14, (2, 2), (2, 1)),  # 2 steps per stage (a 4-step stage passes MAX_STAGE_BYTES)
])
def test_ring_config_consumer_warps(n, k, fmt, groups, warps, warps_m8):
    """The consumer warps follow the CTA's row groups, K and M (sweep_h200.json runs 34b-34h), written out by hand
    here and checked against _warps."""
    for m, want in ((1, warps_m8), (8, warps_m8), (9, warps), (16, warps)):
        cfg = D.ring_config(m, n, k, FMT_CODE[fmt])
        assert (cfg.groups, (cfg.k_warps, cfg.groups_per_warp)) == (groups, want), m
        assert want == _warps(cfg.block_m, groups, D.padded_shape(n, k)[1], cfg.steps, fmt)


def test_ring_config_never_launches_more_ctas_than_sms(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(200):
        n, k = (int(v) * 64 for v in torch.randint(1, 600, (2,), generator=g))
        fmt_code = int(torch.randint(0, 3, (1,), generator=g))
        groups = D.padded_shape(n, k)[0] // 16
        for m in (1, 16):
            cfg = D.ring_config(m, n, k, fmt_code)
            if groups <= 16 * 132:
                assert -(-groups // cfg.groups) * cfg.split <= 132 and 4 <= cfg.groups <= 16 and cfg.split in D.SPLITS
            else:  # taller than 16 row groups per SM: several waves, and ring_wins leaves it to the Triton kernel
                assert (cfg.groups, cfg.split) == (16, 1) and not D.ring_wins(fmt_code, m, n, k)
                assert cfg.k_warps == (2 if m == 16 and cfg.groups_per_warp == 2 else 1)  # 32 warps and the producer
            assert D.threads(cfg, norm=m <= D.NORM_MAX_M) <= 1024 and cfg.smem_bytes(fmt_code) <= 227 * 1024
            assert (D.padded_shape(n, k)[1] // 64) % cfg.steps == 0 and cfg.steps % cfg.k_warps == 0


def test_ring_wins_where_measured():
    # every format at M <= 16 wherever the tiling fills the SMs (MXFP8 below M = 8 since session 43, run 43b)
    for f in ("nvfp4", "mxfp4", "mxfp8"):
        for n, k in ((28672, 8192), (8192, 28672), (8192, 8192), (4096, 4096), (4096, 14336), (6144, 4096)):
            assert all(D.ring_wins(FMT_CODE[f], m, n, k) for m in (1, 2, 4, 8, 9, 16)), (f, n, k)
    assert not D.ring_wins(FMT_CODE["nvfp4"], 17, 28672, 8192)  # M <= 16 only
    assert not D.ring_wins(FMT_CODE["nvfp4"], 16, 512, 512)  # 4 CTAs: most SMs idle
    assert not D.ring_wins(FMT_CODE["mxfp8"], 16, 28672, 8192, sms=2048)  # at most 896 CTAs (4 groups, split 2)


def test_x_it_cannot_take_is_refused():
    if not D.supports(torch.zeros(1, 64, dtype=torch.bfloat16)):
        pytest.skip("decode_ws.supports needs cuda-python")
    for x in (torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(4, 64, dtype=torch.float16),
              torch.zeros(4, 100, dtype=torch.bfloat16)):
        assert not D.supports(x)
        with pytest.raises(ValueError, match="decode_ws: x must be bf16"):
            D.decode_ws_gemm(x, None, None, None, None, 0, 128, x.shape[1])
    with pytest.raises(ValueError, match="k_warps does not divide"):
        D.decode_ws_gemm(torch.zeros(1, 256, dtype=torch.bfloat16), None, None, None, None, 0, 128, 256,
                         D.RingConfig(steps=2, k_warps=4))
    with pytest.raises(ValueError, match="cannot run M=9"):
        D.decode_ws_gemm(torch.zeros(9, 64, dtype=torch.bfloat16), None, None, None, None, 0, 128, 64,
                         D.RingConfig(block_m=8))
    for cfg in (D.RingConfig(groups_per_warp=2), D.RingConfig(groups=5, k_warps=2, groups_per_warp=2),
                D.RingConfig(k_warps=4, groups_per_warp=4)):  # more groups than warps per group; odd groups; 4
        with pytest.raises(ValueError, match="groups_per_warp must be 1 or 2"):
            D.decode_ws_gemm(torch.zeros(1, 256, dtype=torch.bfloat16), None, None, None, None, 0, 128, 256, cfg)
    # 14 x 4 consumer warps and the producer: 1824 threads, which the launch would refuse with an opaque error
    with pytest.raises(ValueError, match="needs 1824 threads"):
        D.decode_ws_gemm(torch.zeros(1, 256, dtype=torch.bfloat16), None, None, None, None, 0, 128, 256,
                         D.RingConfig(groups=14, k_warps=4))
