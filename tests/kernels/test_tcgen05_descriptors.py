"""Descriptor encoders of the hand-written tcgen05 kernel against bit tables written from the PTX ISA.

The tables below are transcribed from the ISA (section 9.7.16.4, "Instruction descriptor" tables for
.kind::mxf8f6f4 and .kind::mxf4/.kind::mxf4nvf4; "Shared memory descriptor"; "Tensor Memory
addressing"), not from descriptors.py: M is taken in the ISA's block-scaled spelling (bits 27-28 =
M >> 7, bits 24-26 reserved), which descriptors.py writes as CUTLASS does (bits 24-28 = M >> 4).
"""

import random

import pytest

from microscale.formats import NVFP4, MXFP4, MXFP8, swizzled_scale_offset
from microscale.kernels.sm100 import descriptors as D

# ---- instruction descriptor: (first bit, width) per field, from the ISA tables -------------------------
IDESC_FIELDS = {
    "sparse": (2, 1),
    "b_sf_id": (4, 2),
    "a_format": (7, 3),
    "b_format": (10, 3),  # mxf4*: bits 10-11 with bit 12 reserved; their only code (E2M1 = 1) fits
    "negate_a": (13, 1),
    "negate_b": (14, 1),
    "transpose_a": (15, 1),
    "transpose_b": (16, 1),
    "n_shr3": (17, 6),
    "scale_type": (23, 1),  # UE4M3 = 0, UE8M0 = 1
    "m_shr7": (27, 2),
    "a_sf_id": (29, 2),
    "k_dim": (31, 1),  # mxf4*: dense K=64 -> 0, K=96 -> 1
}
IDESC_RESERVED_BITS = (0, 1, 3, 6, 24, 25, 26)
ISA_TYPE_CODES = {"mxf8f6f4": {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}, "mxf4": {"e2m1": 1}}


def pack(fields: dict, table: dict) -> int:
    value = 0
    for name, v in fields.items():
        lo, width = table[name]
        assert 0 <= v < 1 << width, (name, v)
        value |= v << lo
    return value


def random_idesc_fields(rng):
    return dict(
        sparse=rng.randint(0, 1), b_sf_id=rng.randint(0, 3), a_format=rng.choice([0, 1, 3, 4, 5]),
        b_format=rng.choice([0, 1, 3, 4, 5]), negate_a=rng.randint(0, 1), negate_b=rng.randint(0, 1),
        transpose_a=rng.randint(0, 1), transpose_b=rng.randint(0, 1), n=8 * rng.randint(1, 32),
        scale_type=rng.randint(0, 1), m=rng.choice([128, 256]), a_sf_id=rng.randint(0, 3), k_dim=rng.randint(0, 1),
    )


def test_instr_desc_matches_isa_table_and_round_trips(seed):
    rng = random.Random(seed)
    for _ in range(500):
        f = random_idesc_fields(rng)
        d = D.InstrDesc(m=f["m"], n=f["n"], a_format=f["a_format"], b_format=f["b_format"],
                        scale_ue8m0=f["scale_type"], a_sf_id=f["a_sf_id"], b_sf_id=f["b_sf_id"],
                        negate_a=f["negate_a"], negate_b=f["negate_b"], transpose_a=f["transpose_a"],
                        transpose_b=f["transpose_b"], sparse=f["sparse"], k96=f["k_dim"])
        table_fields = {k: v for k, v in f.items() if k not in ("m", "n")}
        table_fields.update(n_shr3=f["n"] >> 3, m_shr7=f["m"] >> 7)
        expected = pack(table_fields, IDESC_FIELDS)
        got = D.encode_instr_desc(d)
        assert got == expected, (d, hex(got), hex(expected))
        assert all(not (got >> b) & 1 for b in IDESC_RESERVED_BITS)
        assert D.decode_instr_desc(got) == d


# Worked examples, hand-assembled from the table (hex written out, not computed):
#   NVFP4 128x128: atype=btype=E2M1(1) -> 0x80 | 0x400; N>>3=16 -> 0x200000; UE4M3 -> 0; M>>7=1 -> bit 27.
#   MXFP4 adds UE8M0 (bit 23 = 0x800000); SF ID 2 sets a_sf_id (0x40000000) and b_sf_id (0x20).
#   MXFP8 (kind::mxf8f6f4): E4M3 = 0; SF ID 3 -> 0x60000000 | 0x30. M=256 -> bit 28 instead of 27.
@pytest.mark.parametrize("fmt, m, sf_id, expected", [
    ("nvfp4", 128, 0, 0x08200480),
    ("nvfp4", 256, 0, 0x10200480),
    ("mxfp4", 128, 0, 0x08A00480),
    ("mxfp4", 128, 2, 0x48A004A0),
    ("mxfp8", 128, 0, 0x08A00000),
    ("mxfp8", 128, 3, 0x68A00030),
    ("mxfp8", 256, 1, 0x30A00010),
])
def test_instr_desc_worked_examples(fmt, m, sf_id, expected):
    assert D.instr_desc_for(fmt, m, 128, sf_id) == expected


def test_mma_kinds_use_the_isa_type_codes():
    assert D.MMA_KINDS["mxfp8"].elem_code == ISA_TYPE_CODES["mxf8f6f4"]["e4m3"]
    assert D.MMA_KINDS["nvfp4"].elem_code == ISA_TYPE_CODES["mxf4"]["e2m1"]
    assert D.MMA_KINDS["mxfp4"].elem_code == ISA_TYPE_CODES["mxf4"]["e2m1"]
    assert D.MXF8F6F4_CODES == ISA_TYPE_CODES["mxf8f6f4"]
    # scale_vec::NX consumes N scales per row per instruction: K per MMA / elements per scale
    for spec in (NVFP4, MXFP4, MXFP8):
        kind = D.mma_kind(spec)
        assert kind.mma_k * spec.elem_bits == 32 * 8  # every block-scaled MMA reads 32 bytes of K
        assert kind.scales_per_mma == kind.mma_k // spec.block
        assert kind.scale_vec == f"{kind.scales_per_mma}X"
        assert kind.scale_ue8m0 == (spec.scale == "e8m0")


@pytest.mark.parametrize("bad", [
    dict(m=64), dict(m=192), dict(n=12), dict(n=264), dict(a_sf_id=4), dict(a_format=8),
])
def test_instr_desc_rejects_illegal_fields(bad):
    fields = dict(m=128, n=128, a_format=1, b_format=1, scale_ue8m0=0)
    fields.update(bad)
    with pytest.raises(ValueError):
        D.encode_instr_desc(D.InstrDesc(**fields))


@pytest.mark.parametrize("fmt, bad_id", [("nvfp4", 2), ("mxfp4", 1), ("mxfp4", 3), ("mxfp8", 4)])
def test_instr_desc_rejects_scale_ids_the_kind_does_not_allow(fmt, bad_id):
    with pytest.raises(ValueError, match="SF ID"):
        D.instr_desc_for(fmt, 128, 128, bad_id)


def test_decode_rejects_reserved_bits():
    good = D.instr_desc_for("nvfp4", 128, 128)
    for bit in (0, 1, 3, 6):
        with pytest.raises(ValueError):
            D.decode_instr_desc(good | 1 << bit)


# ---- shared memory descriptor ----------------------------------------------------------------------------
SMEM_FIELDS = {"start": (0, 14), "lbo": (16, 14), "sbo": (32, 14), "fixed_001": (46, 3), "base_offset": (49, 3),
               "lbo_mode": (52, 1), "swizzle": (61, 3)}
SMEM_ZERO_BITS = (14, 15, 30, 31, *range(53, 61))
ISA_SWIZZLE_CODES = {"none": 0, "128B_base32B": 1, "128B": 2, "64B": 4, "32B": 6}


def isa_encode(x: int) -> int:
    return (x & 0x3FFFF) >> 4  # matrix-descriptor-encode(x)


def test_smem_desc_matches_isa_table_and_round_trips(seed):
    rng = random.Random(seed)
    for _ in range(500):
        start, lbo, sbo = (16 * rng.randrange(1 << 14) for _ in range(3))
        swizzle = rng.choice(list(ISA_SWIZZLE_CODES))
        base, mode = rng.randrange(8), rng.randint(0, 1)
        d = D.SmemDesc(start_address=start, leading_byte_offset=lbo, stride_byte_offset=sbo, swizzle=swizzle,
                       base_offset=base, lbo_absolute=mode)
        expected = pack(dict(start=isa_encode(start), lbo=isa_encode(lbo), sbo=isa_encode(sbo), fixed_001=0b001,
                             base_offset=base, lbo_mode=mode, swizzle=ISA_SWIZZLE_CODES[swizzle]), SMEM_FIELDS)
        got = D.encode_smem_desc(d)
        assert got == expected
        assert all(not (got >> b) & 1 for b in SMEM_ZERO_BITS)
        assert D.decode_smem_desc(got) == d


def test_smem_desc_worked_examples():
    # A/B stage tile at 0x400, 128B swizzle: start 0x40, LBO 16 B -> 1 at bit 16, SBO 1024 B -> 64 at
    # bit 32, 0b001 at bit 46, swizzle code 2 at bit 61.
    assert D.operand_desc(0x400) == 0x4000_4040_0001_0040
    # The kernel ORs (address >> 4) into a start-0 template; MMA i of a stage starts 32*i bytes in.
    template = D.operand_desc()
    for i in range(4):
        assert template | ((0x400 + 32 * i) >> 4) == D.encode_smem_desc(
            D.SmemDesc(0x400 + 32 * i, 16, 1024, "128B", base_offset=0))
    # A 512-byte scale atom: no swizzle, SBO 128 B (8 rows x 16 B) -> 8 at bit 32, LBO 0.
    assert D.scale_atom_desc() == 0x0000_4008_0000_0000
    assert D.scale_atom_desc(0x1A000) == 0x0000_4008_0000_1A00


def test_base_offset_formula():
    assert D.base_offset_for(0x400, "128B") == 0  # 1024-byte aligned pattern
    assert D.base_offset_for(0x480, "128B") == 1  # (0x480 >> 7) & 7
    assert D.base_offset_for(0x300, "64B") == (0x300 >> 7) & 7
    assert D.base_offset_for(0x200, "64B") == 0
    assert D.base_offset_for(0x480, "none") == 0


@pytest.mark.parametrize("bad", [dict(start_address=8), dict(stride_byte_offset=1 << 18), dict(swizzle="16B"),
                                 dict(base_offset=8)])
def test_smem_desc_rejects_bad_fields(bad):
    fields = dict(start_address=0, leading_byte_offset=16, stride_byte_offset=1024)
    fields.update(bad)
    with pytest.raises(ValueError):
        D.encode_smem_desc(D.SmemDesc(**fields))


# ---- Tensor Memory --------------------------------------------------------------------------------------
def test_tmem_address_lane_high_column_low():
    assert D.tmem_address(0, 0) == 0
    assert D.tmem_address(32, 260) == 0x0020_0104
    assert D.tmem_address(127, 511) == 0x007F_01FF
    assert D.decode_tmem_address(0x0040_0010) == (64, 16)
    with pytest.raises(ValueError):
        D.tmem_address(128, 0)
    with pytest.raises(ValueError):
        D.tmem_address(0, 512)


@pytest.mark.parametrize("needed, cols", [(1, 32), (32, 32), (33, 64), (300, 512), (512, 512)])
def test_tmem_alloc_is_a_power_of_two_of_at_least_32(needed, cols):
    assert D.tmem_alloc_columns(needed) == cols


def test_tmem_plan_columns():
    plan = D.TmemPlan(block_n=128, stages=6, atoms=4)  # NVFP4, one CTA
    assert (plan.acc_column(0), plan.acc_column(1)) == (0, 128)
    assert plan.sf_slot_columns == 32
    assert (plan.sfa_column(0), plan.sfb_column(0), plan.sfa_column(1)) == (256, 272, 288)
    assert plan.used_columns == 448 and plan.alloc_columns == 512
    with pytest.raises(ValueError):
        D.TmemPlan(block_n=128, stages=9, atoms=4).alloc_columns  # 544 columns do not exist


@pytest.mark.parametrize("spec, atoms, ids", [(NVFP4, 4, (0, 0, 0, 0)), (MXFP4, 2, (0, 2, 0, 2)),
                                              (MXFP8, 1, (0, 1, 2, 3))])
def test_scale_ids_address_the_128x4_layout(spec, atoms, ids):
    """Follow one stage's scales from global memory to the bytes each MMA reads.

    Model (ISA): tcgen05.cp.32x128b gives TMEM lane d the 16 bytes at d*16 of a 512-byte atom, column q
    holding bytes 4q..4q+3; scale_vec::NX reads N consecutive bytes of the 32-bit word from byte SF ID,
    at lane r % 32 and column r // 32 of the atom for row r. The kernel picks atom i * N // 4 for MMA i.
    The byte reached must be scale column i * N + j of row r in the swizzled layout of formats.
    """
    n = D.mma_kind(spec).scales_per_mma
    assert D.scale_atoms_per_stage(spec) == atoms and D.mma_sf_ids(spec) == ids
    cols = 4 * atoms  # scale columns in one stage
    for i, sf in enumerate(ids):
        atom = i * n // 4
        for j in range(n):
            for r in range(128):
                lane, column, byte = r % 32, r // 32, sf + j
                atom_offset = lane * 16 + column * 4 + byte  # what tcgen05.cp put there
                assert atom * D.SCALE_ATOM_BYTES + atom_offset == swizzled_scale_offset(r, i * n + j, cols)
