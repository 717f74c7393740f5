"""CPU CI for the warp-specialized sm90 GEMM (kernels/sm90/wgmma_ws.cuh): NVRTC builds every variant the
library and the tests launch for sm_90a, the SASS holds the wgmma/TMA/mbarrier pipeline with nothing
spilled or serialized, and the tensor maps fetch exactly the bytes the consumers read (checked by
gathering each box from its spec the way TMA does, against slices of the Hopper layout).

The kernel's numerics run on the H200: tests/kernels/test_sm90_gemm.py (marked gpu).
"""

import dataclasses
import re

import numpy as np
import pytest
import torch

pytest.importorskip("cuda.core")
pytest.importorskip("triton")

from microscale.kernels import nvrtc  # noqa: E402
from microscale.kernels.sm90 import prepare  # noqa: E402
from microscale.kernels.sm90 import wgmma_ws as W  # noqa: E402
from microscale.kernels.sm90.decode import FMT_CODE  # noqa: E402
from microscale.quant import quantize  # noqa: E402

# what the tests of test_sm90_gemm.py launch: one CTA per tile, split-K over 2- to 4-CTA clusters, the smaller wgmmas,
# A from registers (alone, in 3 parts, with 32 rows)
CONFIGS = (W.WsConfig(split=1), W.WsConfig(split=2), W.WsConfig(block_m=128, split=3), W.WsConfig(block_m=128, split=4),
           W.WsConfig(block_m=64, stages=2, split=1, group_m=3), W.WsConfig(block_m=64, stages=2, split=4),
           W.WsConfig(block_m=64, rs=True, split=1), W.WsConfig(block_m=128, rs=True, split=3, stages=6),
           W.WsConfig(block_m=32, rs=True, split=2))
MAX_REGISTERS = 65536 // W.THREADS // 8 * 8  # one CTA of 288 threads per SM


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("nvrtc-cache")))
    compiled = W.compile_all(configs=CONFIGS)
    yield compiled, nvrtc.disassemble(compiled.cubin), nvrtc.resource_usage(compiled.cubin)
    mp.undo()


def test_generated_source_is_complete():
    src = W.source()
    assert "// @GENERATED@" not in src
    for fn in ("decode_nvfp4", "decode_mxfp4", "decode_fp8", "wgmma_bf16<64>", "wgmma_bf16<128>", "wgmma_bf16<256>",
               "wgmma_bf16_rs<32>", "wgmma_bf16_rs<64>", "wgmma_bf16_rs<128>"):
        assert fn in src


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bm{c.block_m}-st{c.stages}-split{c.split}{'-rs' * c.rs}")
def test_sass_holds_the_pipeline(build, fmt, cfg):
    compiled, sass, resources = build
    assert "C7515" not in compiled.ptxas_log, "ptxas serialized the wgmmas"
    symbol = compiled.symbols[W.name_expression(FMT_CODE[fmt], cfg)]
    code = sass[symbol]
    assert len(re.findall(rf"HGMMA\.64x{cfg.block_m}x16\.F32\.BF16", code)) == 4  # one per 16 of the K step
    assert "UTMALDG.2D" in code and "UTMALDG.3D" in code and "UTMALDG.4D" in code  # x, scales, words
    assert "UTMACCTL.PF" in code  # the maps (kernel parameters) prefetched
    for op in ("SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "WARPGROUP.DEPBAR.LE"):
        assert op in code, op
    # the consumers store the decoded A tiles to shared memory and meet at a warpgroup barrier (128 threads)
    # before the wgmma reads them, or with rs hand the registers to it (A a register, not a descriptor)
    assert bool(re.search(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x80", code)) != cfg.rs
    assert bool(re.search(rf"HGMMA\.64x{cfg.block_m}x16\.F32\.BF16 R\d+, R\d+, gdesc", code)) == cfg.rs
    if cfg.split > 1:  # partials summed through the cluster's shared memory: generic 16-byte loads, cluster barriers
        assert code.count("UCGABAR_ARV") == 2 and "LD.E.128" in code
    # FP4 without split-K: the output tile goes through shared memory (2-byte stores) to y in 16-byte vectors, the 256
    # consumers meeting at a barrier before and after; otherwise 2-byte stores straight from the registers
    staged = cfg.split == 1 and fmt != "mxfp8"
    assert ("STG.E.128" in code) == ("STS.U16" in code) == staged
    assert bool(re.search(r"BAR\.SYNC\.DEFER_BLOCKING 0x3, 0x100", code)) == (staged or cfg.split > 1)
    res = resources[symbol]
    assert res["REG"] <= MAX_REGISTERS and res.get("LOCAL", 0) == 0, res
    assert cfg.smem_bytes(FMT_CODE[fmt]) <= W.SMEM_LIMIT


def test_rs_takes_at_most_128_rows():
    with pytest.raises(ValueError, match="rs takes block_m up to 128"):
        W.WsConfig(rs=True)


def test_ws_config_follows_m_and_the_weight_size():
    assert W.ws_config(64, 28672, 8192) == W.WsConfig(block_m=64, rs=True)
    assert W.ws_config(33, 8192, 28672) == W.WsConfig(block_m=64, rs=True)
    assert W.ws_config(128, 8192, 8192) == W.WsConfig(block_m=128)
    assert W.ws_config(129, 28672, 8192) == W.WsConfig(block_m=256)


def test_permute_k_puts_each_column_where_the_fragments_expect_it(seed):
    """permute_k against the fragment order spelled out: in every K step of 64, column 16c + 8h + 2t + i0
    (k16 slice c; h = 0 for the fragment's k 2t, 2t + 1, h = 1 for 2t + 8, 2t + 9) holds x's column
    16t + 8 (c & 1) + 4h + 2 (c >> 1) + i0 (thread t's pair P = 4 (c & 1) + 2h + (c >> 1), decode_fragments
    in wgmma_ws.cuh); K = 200 pads to 256 with zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    got = W.permute_k(x, 256)
    want = torch.zeros(3, 256, dtype=torch.bfloat16)
    for step in range(4):
        for c in range(4):
            for h in range(2):
                for t in range(4):
                    for i0 in range(2):
                        src = 64 * step + 16 * t + 8 * (c & 1) + 4 * h + 2 * (c >> 1) + i0
                        if src < 200:
                            want[:, 64 * step + 16 * c + 8 * h + 2 * t + i0] = x[:, src]
    assert torch.equal(got, want)


def test_split_for_takes_the_largest_split_whose_clusters_fit_in_one_wave():
    capacity = {1: 132, 2: 66, 3: 42, 4: 30}  # clusters of each size the H200 holds at once (illustrative)
    assert W.split_for(200, 128, capacity) == 1  # the tiles alone fill a wave
    assert W.split_for(64, 128, capacity) == 2
    assert W.split_for(32, 128, capacity) == 3  # 32 clusters of 4 would take two waves
    assert W.split_for(30, 128, capacity) == 4
    assert W.split_for(30, 31, capacity) == 3  # at least MIN_SPLIT_STEPS K steps per part
    assert W.split_for(30, 8, capacity) == 1


def test_a_split_without_a_build_is_refused():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    if not W.supports(x):
        pytest.skip("wgmma_ws.supports needs cuda-python")
    with pytest.raises(ValueError, match="split=5"):
        W.wgmma_ws_gemm(x, None, None, None, None, 0, 128, 64, W.WsConfig(split=5))


def test_build_checks_the_shared_memory_size_against_the_source(tmp_path, monkeypatch):
    """WsConfig.smem_bytes (what the launch asks for) must equal the source's Smem<>::BYTES: any other
    size fails the build, naming the mismatch."""
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    cfg = W.WsConfig(stages=3, split=1)
    monkeypatch.setattr(W.WsConfig, "smem_bytes", lambda self, fmt_code: W.SMEM_LIMIT - 1)
    with pytest.raises(RuntimeError, match="WsConfig.smem_bytes differs"):
        W._compiled.__wrapped__(((0, cfg),))


def test_config_over_the_shared_memory_limit_is_refused():
    with pytest.raises(ValueError, match="shared memory"):
        W.WsConfig(stages=6).smem_bytes(FMT_CODE["mxfp8"])


def _gather_box(base: torch.Tensor, spec, origin) -> np.ndarray:
    """The bytes TMA copies for a box at `origin` (uint8 elements, dimension 0 fastest), zeros out of
    bounds; addresses relative to `base`, the tensor the spec was made from."""
    flat = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage()).numpy()[
        base.storage_offset() * base.element_size():]  # the bytes from base's first, whatever its strides
    strides = (1,) + tuple(spec.global_strides)
    grids = np.meshgrid(*[np.arange(b) for b in reversed(spec.box_dims)], indexing="ij")
    offset = np.zeros(grids[0].shape, dtype=np.int64)
    inside = np.ones(grids[0].shape, dtype=bool)
    for dim, grid in enumerate(reversed(grids)):
        coord = origin[dim] + grid
        inside &= coord < spec.global_dims[dim]
        offset += coord * strides[dim]
    return np.where(inside, flat[np.where(inside, offset, 0)], 0).reshape(-1)


@pytest.mark.parametrize("fmt", list(FMT_CODE))
@pytest.mark.parametrize("box_groups,box_steps", [(8, 1), (5, 2)])  # wgmma_ws's boxes; a decode_ws stage
def test_weight_boxes_are_the_consumers_bytes(fmt, box_groups, box_steps, seed):
    """Each box lands row group by row group, each one's K steps in order; decode_ws's 5-group tiles run
    past the 24 row groups (the last box reads zeros there)."""
    g = torch.Generator().manual_seed(seed)
    n, k = 384, 640  # 24 row groups, 10 K steps
    data, scale, _ = prepare(quantize(torch.randn(n, k, generator=g), fmt))
    words, scales = W.weight_map_specs(data, scale, FMT_CODE[fmt], box_groups, box_steps)
    for spec in (words, scales):
        spec.validate()
    data_bytes, scale_bytes = data.shape[2], scale.shape[2]
    assert words.box_bytes == box_groups * box_steps * data_bytes
    assert scales.box_bytes == box_groups * box_steps * scale_bytes
    for n_tile in range(-(-24 // box_groups)):
        for kt in (0, 8 - box_steps, 10 - box_steps):
            rows = slice(box_groups * n_tile, box_groups * (n_tile + 1))
            for t, spec, nbytes, origin in ((data, words, data_bytes, (0, 0, kt, box_groups * n_tile)),
                                            (scale, scales, scale_bytes, (0, kt, box_groups * n_tile))):
                want = torch.zeros(box_groups, box_steps, nbytes, dtype=torch.uint8)
                part = t[rows, kt:kt + box_steps]
                want[:part.shape[0]] = part
                np.testing.assert_array_equal(_gather_box(t, spec, origin), want.reshape(-1).numpy())


@pytest.mark.parametrize("promotion", ["128B", "none"])
def test_weight_maps_take_an_l2_promotion(promotion):
    """The promotion reaches both weight maps and changes nothing else of them."""
    data, scale, _ = prepare(quantize(torch.randn(64, 256), "nvfp4"))
    default = W.weight_map_specs(data, scale, FMT_CODE["nvfp4"], 4, 2)
    promoted = W.weight_map_specs(data, scale, FMT_CODE["nvfp4"], 4, 2, promotion)
    assert [s.l2_promotion for s in default] == ["256B"] * 2 and [s.l2_promotion for s in promoted] == [promotion] * 2
    assert [dataclasses.replace(s, l2_promotion="256B") for s in promoted] == list(default)
    for spec in promoted:
        spec.validate()


def test_weight_maps_refuse_arrays_that_are_not_the_prepared_views():
    """The maps address the words and scales in their shared buffer's strides: contiguous copies (the two
    arrays of an older layout) would be read as garbage, so they are refused by name."""
    data, scale, _ = prepare(quantize(torch.randn(32, 128), "nvfp4"))
    with pytest.raises(ValueError, match=r"sm90 tensor maps: prepared weights must be .* \[N/16, K/64, 576\]"):
        W.weight_map_specs(data.contiguous(), scale.contiguous(), FMT_CODE["nvfp4"])


def test_activation_box_is_one_k_step_of_the_share_with_zeros_past_m_and_k(seed):
    g = torch.Generator().manual_seed(seed)
    m, k = 150, 200  # K = 200: the last K step (columns 192..255) is partly past K
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    spec = W.x_map_spec(x, 128)
    spec.validate()
    got = torch.from_numpy(_gather_box(x, spec, (3 * 128, 128)).copy()).view(torch.bfloat16).reshape(128, 64)
    want = torch.zeros(128, 64, dtype=torch.bfloat16)
    want[:m - 128, :k - 192] = x[128:, 192:]
    assert torch.equal(got, want)


def test_x_that_tma_cannot_read_is_refused():
    x = torch.zeros(4, 100, dtype=torch.bfloat16)  # rows of 200 bytes: not 16-byte aligned
    assert not W.supports(x)
    assert not W.supports(torch.zeros(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        W.wgmma_ws_gemm(x, None, None, None, None, 0, 8, 100)
