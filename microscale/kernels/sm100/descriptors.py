"""Host-side encoders for the operands of tcgen05.mma block scaling (PTX ISA 9.x, section 9.7.16).

The hand-written kernel (tcgen05_gemm.cuh) never spells a bit position: it ORs shared-memory
addresses into the descriptors built here and reads its Tensor Memory columns from `TmemPlan`.
Each encoder has a decoder, so the tests can check decode(encode(x)) == x against bit tables
written from the ISA independently of this module.

Sources (facts only): PTX ISA "Instruction descriptor" tables for .kind::mxf8f6f4 and
.kind::mxf4/.kind::mxf4nvf4, "Shared memory descriptor", "Tensor Memory addressing", "Block
Scaling" (scale factor A/B ID); CUTLASS include/cute/arch/mma_sm100_desc.hpp (same fields).
"""

from dataclasses import dataclass

from ...formats.spec import FormatSpec, get_format

# ---- what each format runs as --------------------------------------------------------------------


@dataclass(frozen=True)
class MmaKind:
    """One block-scaled tcgen05.mma flavour.

    kind, scale_vec: the PTX qualifiers (.kind::<kind>.block_scale.scale_vec::<scale_vec>)
    elem_code:       atype/btype field value for the element encoding (ISA idesc tables)
    scale_ue8m0:     bit 23 of the idesc: 1 = UE8M0 scales, 0 = UE4M3
    mma_k:           K elements one instruction consumes (32 bytes of A per row)
    scales_per_mma:  block scales per row one instruction consumes (the "NX" of scale_vec)
    sf_ids:          legal scale-factor IDs (byte offset inside the 32-bit TMEM word)
    """

    kind: str
    scale_vec: str
    elem_code: int
    scale_ue8m0: int
    mma_k: int
    scales_per_mma: int
    sf_ids: tuple


MMA_KINDS = {
    # E2M1 x E2M1, UE4M3 scales per 16: 4 scales per K=64 instruction, SF ID must be 0.
    "nvfp4": MmaKind("mxf4nvf4", "4X", elem_code=1, scale_ue8m0=0, mma_k=64, scales_per_mma=4, sf_ids=(0,)),
    # E2M1 x E2M1, UE8M0 scales per 32: 2 scales per K=64 instruction, SF ID 0 or 2 (half words).
    "mxfp4": MmaKind("mxf4", "2X", elem_code=1, scale_ue8m0=1, mma_k=64, scales_per_mma=2, sf_ids=(0, 2)),
    # E4M3 x E4M3 (kind::mxf8f6f4 code 0), UE8M0 per 32: 1 scale per K=32 instruction, SF ID 0..3.
    "mxfp8": MmaKind("mxf8f6f4", "1X", elem_code=0, scale_ue8m0=1, mma_k=32, scales_per_mma=1, sf_ids=(0, 1, 2, 3)),
}

# atype/btype values of the .kind::mxf8f6f4 table (for decoding and tests); mxf4* only has E2M1 = 1.
MXF8F6F4_CODES = {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}


def mma_kind(fmt) -> MmaKind:
    return MMA_KINDS[get_format(fmt).name]


# ---- instruction descriptor (32 bits) ------------------------------------------------------------


@dataclass(frozen=True)
class InstrDesc:
    """Fields of the block-scaled instruction descriptor (ISA tables for .kind::mxf8f6f4 and
    .kind::mxf4/.kind::mxf4nvf4; CUTLASS UMMA::InstrDescriptorBlockScaled):

    bit  2      sparse       dense = 0
    bits 4-5    b_sf_id      Matrix B scale factor data ID
    bits 7-9    a_format     atype
    bits 10-12  b_format     btype (mxf4*: bits 10-11, bit 12 reserved; E2M1 = 1 fits)
    bit  13/14  negate_a/b
    bit  15/16  transpose_a/b  (K-major = 0; mxf4* allow only 0)
    bits 17-22  n            N >> 3
    bit  23     scale_ue8m0  scale type for both scale_A and scale_B: UE4M3 = 0, UE8M0 = 1
    bits 24-28  m            M >> 4; the ISA writes it as bits 27-28 = M >> 7 with 24-26 zero,
                             the same bits for the only legal M (128, 256)
    bits 29-30  a_sf_id      Matrix A scale factor data ID
    bit  31     k96          mxf4*: 0 = dense K 64, 1 = dense K 96; reserved (0) for mxf8f6f4
    Bits 0-1, 3 and 6 are reserved (0). No D-type field: block scaling accumulates in FP32.
    """

    m: int
    n: int
    a_format: int
    b_format: int
    scale_ue8m0: int
    a_sf_id: int = 0
    b_sf_id: int = 0
    negate_a: int = 0
    negate_b: int = 0
    transpose_a: int = 0
    transpose_b: int = 0
    sparse: int = 0
    k96: int = 0


def _field(value: int, width: int, name: str) -> int:
    if not 0 <= value < (1 << width):
        raise ValueError(f"descriptor field {name}={value} does not fit {width} bits")
    return value


def encode_instr_desc(d: InstrDesc) -> int:
    """InstrDesc -> the 32-bit idesc operand of tcgen05.mma (block-scaled kinds)."""
    if d.m not in (128, 256):
        raise ValueError(f"block-scaled tcgen05.mma takes M = 128 (cta_group::1) or 256 (cta_group::2), got {d.m}")
    if d.n % 8 or not 8 <= d.n <= 256:
        raise ValueError(f"tcgen05.mma N must be a multiple of 8 in [8, 256], got {d.n}")
    return (
        _field(d.sparse, 1, "sparse") << 2
        | _field(d.b_sf_id, 2, "b_sf_id") << 4
        | _field(d.a_format, 3, "a_format") << 7
        | _field(d.b_format, 3, "b_format") << 10
        | _field(d.negate_a, 1, "negate_a") << 13
        | _field(d.negate_b, 1, "negate_b") << 14
        | _field(d.transpose_a, 1, "transpose_a") << 15
        | _field(d.transpose_b, 1, "transpose_b") << 16
        | (d.n >> 3) << 17
        | _field(d.scale_ue8m0, 1, "scale_ue8m0") << 23
        | (d.m >> 4) << 24
        | _field(d.a_sf_id, 2, "a_sf_id") << 29
        | _field(d.k96, 1, "k96") << 31
    )


def decode_instr_desc(value: int) -> InstrDesc:
    """The 32-bit idesc -> InstrDesc; reserved bits must be zero."""
    if value >> 32 or value & 0b1001011:
        raise ValueError(f"idesc {value:#010x} has reserved bits (0, 1, 3, 6) set or exceeds 32 bits")

    def bits(lo, width):
        return (value >> lo) & ((1 << width) - 1)

    return InstrDesc(
        m=bits(24, 5) << 4, n=bits(17, 6) << 3, a_format=bits(7, 3), b_format=bits(10, 3),
        scale_ue8m0=bits(23, 1), a_sf_id=bits(29, 2), b_sf_id=bits(4, 2), negate_a=bits(13, 1),
        negate_b=bits(14, 1), transpose_a=bits(15, 1), transpose_b=bits(16, 1), sparse=bits(2, 1),
        k96=bits(31, 1),
    )


def instr_desc_for(fmt, m: int, n: int, sf_id: int = 0) -> int:
    """idesc for format `fmt` (both operands, K-major, dense) with scale factor ID `sf_id` for A and B."""
    kind = mma_kind(fmt)
    if sf_id not in kind.sf_ids:
        raise ValueError(f"{kind.kind}.scale_vec::{kind.scale_vec} takes SF ID in {kind.sf_ids}, got {sf_id}")
    return encode_instr_desc(InstrDesc(m=m, n=n, a_format=kind.elem_code, b_format=kind.elem_code,
                                       scale_ue8m0=kind.scale_ue8m0, a_sf_id=sf_id, b_sf_id=sf_id))


# ---- shared-memory matrix descriptor (64 bits) ---------------------------------------------------

SWIZZLE_MODES = {"none": 0, "128B_base32B": 1, "128B": 2, "64B": 4, "32B": 6}
SWIZZLE_PATTERN_BYTES = {"none": 0, "128B_base32B": 1024, "128B": 1024, "64B": 512, "32B": 256}
DESC_VERSION = 1  # bits 46-48: "fixed constant value of 0b001" (tcgen05; Hopper wgmma had none)


@dataclass(frozen=True)
class SmemDesc:
    """Fields of the tcgen05 shared memory descriptor (ISA "Shared memory descriptor"):

    bits 0-13   start_address  encode(addr) = (addr & 0x3FFFF) >> 4
    bits 16-29  leading_byte_offset (LBO), encoded the same way
    bits 32-45  stride_byte_offset (SBO), encoded the same way
    bits 46-48  version        fixed 0b001
    bits 49-51  base_offset    (pattern start address >> 7) & 7; 0 when the swizzle pattern
                               starts on its own boundary (1024 B for 128B swizzle)
    bit  52     lbo_absolute   leading dimension stride mode: 0 = relative byte offset
    bits 61-63  swizzle        0 none, 1 128B with 32B atomicity, 2 128B, 4 64B, 6 32B
    Bits 14-15, 30-31 and 53-60 are zero. Byte quantities are given in bytes, multiples of 16.
    """

    start_address: int
    leading_byte_offset: int
    stride_byte_offset: int
    swizzle: str = "none"
    base_offset: int = 0
    lbo_absolute: int = 0
    version: int = DESC_VERSION


def _encode_bytes(x: int, name: str) -> int:
    if x % 16 or not 0 <= x < (1 << 18):
        raise ValueError(f"smem descriptor {name}={x} must be a multiple of 16 below 2^18")
    return x >> 4


def encode_smem_desc(d: SmemDesc) -> int:
    """SmemDesc -> the 64-bit a-desc/b-desc/s-desc operand of tcgen05.mma / tcgen05.cp."""
    if d.swizzle not in SWIZZLE_MODES:
        raise ValueError(f"swizzle {d.swizzle!r} not in {list(SWIZZLE_MODES)}")
    return (
        _encode_bytes(d.start_address, "start_address")
        | _encode_bytes(d.leading_byte_offset, "leading_byte_offset") << 16
        | _encode_bytes(d.stride_byte_offset, "stride_byte_offset") << 32
        | _field(d.version, 3, "version") << 46
        | _field(d.base_offset, 3, "base_offset") << 49
        | _field(d.lbo_absolute, 1, "lbo_absolute") << 52
        | SWIZZLE_MODES[d.swizzle] << 61
    )


def decode_smem_desc(value: int) -> SmemDesc:
    """The 64-bit descriptor -> SmemDesc; the zero-filled bit ranges must be zero."""
    zero_mask = (0b11 << 14) | (0b11 << 30) | (0xFF << 53)
    if value >> 64 or value & zero_mask:
        raise ValueError(f"smem descriptor {value:#018x} has bits set in 14-15, 30-31 or 53-60")
    modes = {v: k for k, v in SWIZZLE_MODES.items()}
    code = value >> 61
    if code not in modes:
        raise ValueError(f"smem descriptor {value:#018x}: invalid swizzle code {code}")

    def bits(lo, width):
        return (value >> lo) & ((1 << width) - 1)

    return SmemDesc(start_address=bits(0, 14) << 4, leading_byte_offset=bits(16, 14) << 4,
                    stride_byte_offset=bits(32, 14) << 4, swizzle=modes[code], base_offset=bits(49, 3),
                    lbo_absolute=bits(52, 1), version=bits(46, 3))


def base_offset_for(address: int, swizzle: str) -> int:
    """Base offset of a descriptor whose swizzle pattern starts at `address` (ISA formula)."""
    period = SWIZZLE_PATTERN_BYTES[swizzle]
    return 0 if period == 0 or address % period == 0 else (address >> 7) & 7


SWIZZLE_ROW_BYTES = 128  # K bytes of one 128B-swizzled row: the TMA box width and a pipeline stage
CORE_ROWS = 8  # rows of one swizzle atom / core matrix group


def operand_desc(start_address: int = 0) -> int:
    """A/B tile: K-major rows of 128 bytes, 128B swizzle (TMA CU_TENSOR_MAP_SWIZZLE_128B).

    SBO = 8 rows x 128 B = 1024 B between 8-row core-matrix groups; LBO is unused for swizzled
    K-major layouts (set to 16 B, the "assumed 1"). The kernel ORs the tile's address >> 4 into
    bits 0-13 and steps 32 B (one MMA's K) inside the 128-byte row, as CUTLASS/DeepGEMM do.
    """
    return encode_smem_desc(SmemDesc(start_address=start_address, leading_byte_offset=16,
                                     stride_byte_offset=CORE_ROWS * SWIZZLE_ROW_BYTES, swizzle="128B",
                                     base_offset=base_offset_for(start_address, "128B")))


SCALE_ATOM_BYTES = 512  # 128 rows x 4 scales: one 128x4 atom (formats.scale_layout)


def scale_atom_desc(start_address: int = 0) -> int:
    """Source of tcgen05.cp.32x128b: one 512-byte scale atom = 32 rows x 16 B, no swizzle.

    Rows of 16 B are contiguous, so each 8-row core matrix is 128 contiguous bytes: SBO = 128 B;
    the copy is one core matrix wide, so LBO never applies (0).
    """
    return encode_smem_desc(SmemDesc(start_address=start_address, leading_byte_offset=0,
                                     stride_byte_offset=CORE_ROWS * 16, swizzle="none"))


# ---- Tensor Memory -------------------------------------------------------------------------------

TMEM_LANES = 128
TMEM_COLUMNS = 512


def tmem_address(lane: int, column: int) -> int:
    """TMEM address (ISA "Tensor Memory addressing"): bits 31-16 lane, bits 15-0 column."""
    if not 0 <= lane < TMEM_LANES or not 0 <= column < TMEM_COLUMNS:
        raise ValueError(f"TMEM lane {lane} / column {column} out of 128 x 512")
    return lane << 16 | column


def decode_tmem_address(address: int) -> tuple:
    return address >> 16, address & 0xFFFF


def tmem_alloc_columns(needed: int) -> int:
    """tcgen05.alloc takes a power of two >= 32 columns (non-exclusive allocation)."""
    if not 0 < needed <= TMEM_COLUMNS:
        raise ValueError(f"{needed} TMEM columns requested; a CTA has {TMEM_COLUMNS}")
    cols = 32
    while cols < needed:
        cols *= 2
    return cols


@dataclass(frozen=True)
class TmemPlan:
    """Column budget of one CTA: two FP32 accumulators, then one scale slot per pipeline stage.

    A scale atom (128 rows x 4 scales) lands through tcgen05.cp.32x128b.warpx4 as 32 lanes x 4
    columns, copied to all four 32-lane quarters: row r's four scales are the 32-bit word at lane
    r % 32, column r // 32 of the atom. A stage holds `atoms` K-atoms for A, then for B; each stage
    has its own slot, because tcgen05.mma -> tcgen05.cp is not an ordered pair in the ISA and a
    slot is refilled only after the MMAs that read it committed (the stage's empty barrier).
    """

    block_n: int
    stages: int
    atoms: int  # scale atoms per stage along K, for each operand

    @property
    def acc_columns(self) -> int:
        return self.block_n  # one FP32 column per output column, 128 lanes = 128 rows

    def acc_column(self, buffer: int) -> int:
        return buffer * self.acc_columns

    @property
    def sf_slot_columns(self) -> int:
        return 2 * 4 * self.atoms  # A atoms then B atoms, 4 columns each

    def sfa_column(self, stage: int) -> int:
        return 2 * self.acc_columns + stage * self.sf_slot_columns

    def sfb_column(self, stage: int) -> int:
        return self.sfa_column(stage) + 4 * self.atoms

    @property
    def used_columns(self) -> int:
        return 2 * self.acc_columns + self.stages * self.sf_slot_columns

    @property
    def alloc_columns(self) -> int:
        return tmem_alloc_columns(self.used_columns)


def scale_atoms_per_stage(spec: FormatSpec) -> int:
    """128x4 scale atoms per 128-byte K stage: NVFP4 16 scales -> 4, MXFP4 8 -> 2, MXFP8 4 -> 1."""
    elems = SWIZZLE_ROW_BYTES * 8 // spec.elem_bits
    return elems // spec.block // 4


def mma_sf_ids(fmt) -> tuple:
    """Scale factor ID of each of the MMAs in one stage (stage = 128 K bytes = 4 MMAs of 32 B).

    The scales of MMA i start at scale column i * scales_per_mma of the stage; within a 128x4
    atom that is byte (i * scales_per_mma) % 4 of the row's 32-bit TMEM word: the SF ID.
    """
    kind = mma_kind(fmt)
    return tuple((i * kind.scales_per_mma) % 4 for i in range(SWIZZLE_ROW_BYTES // 32))
