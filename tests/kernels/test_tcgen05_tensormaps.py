"""Tensor maps of the hand-written tcgen05 kernel, on a GPU with TMA (the H200; sm_90 and up).

The GEMM itself needs sm_100a; its tensor maps do not. For every format and variant this encodes the
maps of A, B and both scale tables with cuTensorMapEncodeTiled, checks their box, strides and swizzle
against what the kernel consumes per stage, and then runs them: a probe kernel from the same source
(same TMA and mbarrier code) copies one box into shared memory and back, and the bytes must equal the
128B-swizzled (A, B) or plain (scales) image computed here, zero-filled out of bounds. The probe is also
launched as a 2-CTA cluster through the same launcher the GEMM uses.

CPU-only checks of the same specs run in CI (test_tensor_map_specs_*); the rest is marked gpu.
"""

import dataclasses

import numpy as np
import pytest
import torch

from microscale.formats import get_format
from microscale.kernels.sm100 import descriptors as D
from microscale.kernels.sm100 import tcgen05_backend as T
from microscale.kernels.sm100.operands import pad_codes, prepare_weight
from microscale.quant import quantize

SHAPES = {"m": 300, "n": 136, "k": 544}  # ragged in M, N and in K stages for every format


def operands(fmt, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPES["m"], SHAPES["k"], generator=g)
    w = torch.randn(SHAPES["n"], SHAPES["k"], generator=g)
    qx = quantize(x.to(device), fmt, scale_layout="swizzled")
    b_data, b_scale, _ = prepare_weight(quantize(w.to(device), fmt))
    return tuple(t.view(torch.uint8) for t in (pad_codes(qx.data, qx.fmt), qx.scale, b_data, b_scale))


@pytest.mark.parametrize("variant", list(T.VARIANTS.values()), ids=lambda v: f"{v.fmt}-cta{v.cta_group}")
def test_tensor_map_specs_match_the_kernel_stage(variant, seed):
    """CPU: box sizes add up to the kernel's per-stage transaction bytes and shared-memory layout."""
    a_data, a_scale, b_data, b_scale = operands(variant.fmt, "cpu", seed)
    specs = T.tensor_map_specs(variant, a_data, a_scale, b_data, b_scale)
    atoms = D.scale_atoms_per_stage(get_format(variant.fmt))
    assert [s.box_bytes for s in specs] == [T.BLOCK_M * 128, variant.b_rows * 128, atoms * 512, atoms * 512]
    assert [s.swizzle for s in specs] == ["128B", "128B", "none", "none"]
    stage_bytes = sum(s.box_bytes for s in specs)  # one arrive.expect_tx per CTA per stage
    barriers = 8 * (2 * variant.stages + 4) + 16
    assert variant.smem_bytes == variant.stages * stage_bytes + barriers + T.SMEM_ALIGN_SLACK
    a, b, sfa, sfb = specs
    assert a.global_dims == (a_data.shape[1], SHAPES["m"]) and a.global_strides == (a_data.stride(0),)
    assert b.global_dims == (b_data.shape[1], SHAPES["n"]) and b.box_dims == (128, variant.b_rows)
    for spec, table in ((sfa, a_scale), (sfb, b_scale)):
        rp, cp = table.shape
        assert spec.global_dims == (256, cp // 2, rp // 128) and spec.global_strides == (256, cp * 128)
        assert spec.box_dims == (256, 2 * atoms, 1)
        spec.validate()
    # One stage is 128 K bytes for A and B and `atoms` 128x4 atoms of scales: both walk K together.
    assert atoms * 4 * get_format(variant.fmt).block * get_format(variant.fmt).elem_bits == 128 * 8


def test_tensor_map_spec_validation_names_the_problem():
    bad = T.nvrtc.TensorMapSpec(address=0x1008, global_dims=(40, 4), global_strides=(40,), box_dims=(128, 4),
                                swizzle="128B")
    with pytest.raises(ValueError, match="not 16-byte aligned.*not multiples of 16"):
        bad.validate()
    good = T.nvrtc.TensorMapSpec(address=0x1000, global_dims=(64, 4), global_strides=(64,), box_dims=(64, 4),
                                 swizzle="none")
    assert good.l2_promotion == "256B"
    good.validate()
    with pytest.raises(ValueError, match="l2_promotion '512B' is none of"):
        dataclasses.replace(good, l2_promotion="512B").validate()


# ---- on the GPU -------------------------------------------------------------------------------------------


def expected_operand_box(data, x0, row0, box_rows):
    """TMA 128B swizzle: 16-byte chunk j of box row r lands at chunk j ^ (r % 8) of that 128-byte row."""
    rows, k_bytes = data.shape
    tile = torch.zeros(box_rows, 128, dtype=torch.uint8)
    r1, c1 = min(rows, row0 + box_rows), min(k_bytes, x0 + 128)
    if r1 > row0 and c1 > x0:
        tile[: r1 - row0, : c1 - x0] = data[row0:r1, x0:c1].cpu()
    r = torch.arange(box_rows)[:, None]
    c = torch.arange(128)[None, :]
    out = torch.empty(box_rows * 128, dtype=torch.uint8)
    out[(r * 128 + ((c // 16) ^ (r % 8)) * 16 + c % 16).flatten()] = tile.flatten()
    return out


def expected_scale_box(table, half_atom0, row_block, atoms):
    rp, cp = table.shape
    flat = table.contiguous().view(-1).cpu()
    out = torch.zeros(atoms * 512, dtype=torch.uint8)
    for h in range(2 * atoms):
        idx = half_atom0 + h
        if idx < cp // 2 and row_block < rp // 128:
            start = row_block * cp * 128 + idx * 256
            out[h * 256:(h + 1) * 256] = flat[start:start + 256]
    return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cuda.core")
    pytest.importorskip("cuda.bindings")
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip("TMA needs compute capability 9.0 or newer")
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("nvrtc-cache")))
    compiled = T.compile_source(T.PROBE_NAMES, arch=f"sm_{major}{minor}a")
    torch.cuda.init()
    index = torch.cuda.current_device()
    kernels = {rank: T.nvrtc.load_kernel(compiled, name, index) for rank, name in zip((2, 3), T.PROBE_NAMES)}
    yield kernels
    mp.undo()


def run_probe(kernels, spec, coords, cluster=1):
    device = torch.device("cuda", torch.cuda.current_device())
    dst = torch.full((spec.box_bytes,), 0xA5, dtype=torch.uint8, device=device)  # poison
    info = torch.zeros(16, dtype=torch.int32, device=device)  # room for a launcher that launches too many
    x, y, z = (*coords, 0)[:3]
    smem = spec.box_bytes + 1024 + 32
    T.nvrtc.launch(kernels[spec.rank], clusters=1, cluster=cluster, block=128, smem_bytes=smem,
                   device_index=device.index, stream_handle=torch.cuda.current_stream(device).cuda_stream,
                   args=(T.nvrtc.encode_tensor_map(spec), dst.data_ptr(), info.data_ptr(), np.uint32(spec.box_bytes),
                         np.int32(x), np.int32(y), np.int32(z)))
    torch.cuda.synchronize()
    return dst.cpu(), info.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(T.VARIANTS.values()), ids=lambda v: f"{v.fmt}-cta{v.cta_group}")
def test_tensor_maps_encode_and_move_the_boxes_the_kernel_expects(probe, variant, seed):
    a_data, a_scale, b_data, b_scale = operands(variant.fmt, "cuda", seed)
    specs = T.tensor_map_specs(variant, a_data, a_scale, b_data, b_scale)
    for spec in specs:
        raw = T.nvrtc.encode_tensor_map(spec)
        assert len(raw) == 128 and any(raw)
    a, b, sfa, sfb = specs
    atoms = D.scale_atoms_per_stage(get_format(variant.fmt))
    last_stage = -(-a_data.shape[1] // 128) - 1  # partly out of bounds along K
    for k in (0, last_stage):
        for row0 in (0, (SHAPES["m"] // 128) * 128):  # the last M block runs past M
            got, _ = run_probe(probe, a, (k * 128, row0))
            assert torch.equal(got, expected_operand_box(a_data, k * 128, row0, 128)), ("A", k, row0)
        for row0 in (variant.b_rows, (SHAPES["n"] // variant.b_rows) * variant.b_rows):
            got, _ = run_probe(probe, b, (k * 128, row0))
            assert torch.equal(got, expected_operand_box(b_data, k * 128, row0, variant.b_rows)), ("B", k, row0)
        for spec, table in ((sfa, a_scale), (sfb, b_scale)):
            for block in range(table.shape[0] // 128 + 1):  # the last one is wholly out of bounds
                got, _ = run_probe(probe, spec, (0, k * 2 * atoms, block))
                assert torch.equal(got, expected_scale_box(table, k * 2 * atoms, block, atoms)), (k, block)


@pytest.mark.gpu
def test_cluster_launch_through_the_gemm_launcher(probe, seed):
    a_data, _, _, _ = operands("mxfp8", "cuda", seed)
    spec = T.operand_map(a_data, 128)
    got, info = run_probe(probe, spec, (0, 0), cluster=2)
    assert info.tolist() == [2, 2, 2, 2] + [0] * 12  # two CTAs in the grid, each in a cluster of two
    assert torch.equal(got, expected_operand_box(a_data, 0, 0, 128))
