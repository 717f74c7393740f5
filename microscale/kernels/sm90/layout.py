"""The Hopper weight layout: what `prepare` writes once so the sm90 kernels read it fast.

The decode kernel (decode.py) feeds dequantized weights straight from registers into mma.sync
(m16n8k16, bf16) as the A operand, in Triton's dot-operand layout with k_width=8. In that layout a
thread of a warp holds, for a 16-row group and a 64-wide K step, rows g and g+8 (g = lane // 4) at
32 "logical" k positions (8t .. 8t+7 and 32+8t .. 32+8t+7, t = lane % 4). Which physical K column
a logical position stands for is ours to choose, as long as the activations are read the same way:

    physical k (within a K step of 64) = 16t + 8 i2 + 4 i1 + 2 khi + i0
    for logical k = 32 khi + 8t + 4 i2 + 2 i1 + i0

With that choice a thread's activations are 16 consecutive elements (two 16-byte loads whose
registers pair up exactly as the MMA's B operand wants them) and its 16 weights of one row lie in
one NVFP4 block (16t .. 16t+15). This module stores the 32 weights of a thread next to each other,
so a thread fetches its part of a K step with one 16-byte load (two for MXFP8), a warp 512
contiguous bytes:

    data  [N/16, K/64, 32 lanes, 4 words] int32  (FP4: 8 E2M1 codes per word)
          [N/16, K/64, 32 lanes, 8 words] int32  (MXFP8: 4 E4M3 codes per word)

Word q of a lane holds its elements 8q .. 8q+7 (FP4) or 4q .. 4q+3 (FP8) in register order:
rows g + 8 rsel, logical k = 32 khi + 8t + i (+ 4 k4), q = (khi, rsel[, k4]), last bit fastest.

Bits inside a word are placed so that a few masks, shifts and rotations turn it into bf16x2 registers
(FP4_BITS, FP8_BITS below): an element's sign goes to bf16 bit 15, its exponent and mantissa to the
bf16 exponent's low bits and the mantissa's high bits (E2M1: 8..6, E4M3: 10..4). That is value *
2**-126 (E2M1) or 2**-120 (E4M3), the format's subnormals landing on bf16 subnormals; the factor is
folded into the block scale.

Block scales are rewritten as one byte per block whose bf16x2 multiplier s' the kernel makes with
one integer multiply-add, and the rest goes into a per-row float32 factor (row_mult) applied to
the fp32 accumulator:
    NVFP4: s' = s * 2**118 (exact over the E4M3 range), row_mult = 2**8 / global_scale;
    MX:    s' = 2**(code - 127) with code = b - b_max(row) + 254, row_mult = 2**(b_max + OFF - 254),
           OFF = 126 (E2M1) or 120 (E4M3): a row's largest block sits at the top of the bf16 range
           and every product is exact unless the row's block exponents span more than 126 binades
           (blocks that far below the row's largest lose precision toward zero).
    scale [N/16, K/64, 64 bytes]  NVFP4: per lane (rows g, g+8) of block t
          [N/16, K/64, 32 bytes]  MX: per lane pair (rows g, g+8) of block t // 2
Rows are padded to ROW_ALIGN and K to K_ALIGN with zero weights. The canonical QTensor (and the
checkpoint) keep the format's own layout.

data and scale are the two halves of one buffer [N/16, K/64, STEP] uint8 (step_bytes; prepared_views):
a row group's words of a K step, then its scales, so that a kernel reading a row group's K steps reads
one run of bytes. In two arrays, the scales came in runs of 256 bytes (4 K steps) beside the words'
2 KB, and a read-only TMA ring over an NVFP4 28672x8192 weight took 35-36 us against 31 interleaved
(bench/stream_probe.py --probe ring, bench/results/stream_ring_h200.json).

unshuffle_weights is the inverse: it gives the canonical QTensor back bit for bit for weights
written the way our quantizers write them, so a layer can keep only this layout (models/linear.py).
What prepare does not keep: the NVFP4 global scale (row_mult = 2**8 / g is rounded to float32 and
does not determine g: the caller passes g), the sign of a negative NVFP4 block scale and the value
of a zero one (folded into the elements; the quantizers write neither), and the exponent of an MX
block of zeros (unshuffle gives it exponent 0, as e8m0_from_amax does). The codes of MX blocks far
below their row's largest come back exactly (up to the 253 binades prepare accepts), although the
kernels lose precision on them beyond 126.
"""

import torch

from ...formats.packing import pack_fp4, unpack_fp4
from ...formats.spec import E8M0_BIAS, E8M0_NAN, FormatSpec, get_format
from ...formats.tensor import QTensor, padded_k

ROW_GROUP = 16  # rows of one warp's mma tile
K_STEP = 64  # K per 16-byte load step of a thread
ROW_ALIGN = 128  # N padding: every decode tile (16 x warps x reps) divides it
K_ALIGN = 128  # K padding: 2 K steps, the default decode tiles' trip (unroll 4 is checked per shape);
# 256 padded SmolLM2's K = 576 to 768 instead of 640

# bf16x2 register j (j = 0..3) of an FP4 word takes element 2j in its low half and 2j+1 in its
# high half. FP4_BITS[i] = word bit positions of (mantissa, exponent lsb, exponent msb, sign) of
# element i (i = 0..7 in register order). Registers 0..2 are rotl(w, 0 | 10 | 13) & 0x81C081C0 (no
# three translates of the pattern and a fourth tile the word, so one register is gathered
# otherwise): register 3 is ((w & 0x001B001B) * 0x1084) & 0x81C081C0, the multiply shifting its bits
# left by 2, 7 and 12 with no carries into the kept bits (all 256 values: test_sm90_layout.py).
FP4_BITS = (
    (6, 7, 8, 15), (22, 23, 24, 31),
    (28, 29, 30, 5), (12, 13, 14, 21),
    (25, 26, 27, 2), (9, 10, 11, 18),
    (4, 0, 1, 3), (20, 16, 17, 19),
)
# E4M3: FP8_BITS[i] = word bit positions of (mantissa 0..2, exponent 0..3, sign) of element i (register
# j = i // 2, low half first). Register 0 is w & 0x87F087F0; register 1 is ((w << 4) & 0x80F080F0) |
# ((w >> 4) & 0x07000700): 5 integer instructions per word where whole bytes took 7.
FP8_BITS = (
    (4, 5, 6, 7, 8, 9, 10, 15), (20, 21, 22, 23, 24, 25, 26, 31),
    (0, 1, 2, 3, 12, 13, 14, 11), (16, 17, 18, 19, 28, 29, 30, 27),
)

# wgmma with A from the decoded registers (wgmma.py RS, wgmma_ws.py rs): bit b of the wgmma's k within a K step
# meets the weight of physical k bit RS_K_BITS[b] (physical k = 16t + 8 i2 + 4 i1 + 2 khi + i0, above), so the
# activations' columns are permuted the same way. The Gluon kernel's register layouts fix this order
# (wgmma._hardware_k_order); the CUDA kernel takes its fragments in the same order.
RS_K_BITS = (1, 16, 32, 4, 8, 2)


def rs_physical_k(j: int) -> int:
    """The physical k (within a K step) at the register-A wgmma's k = j."""
    return sum(bit for b, bit in enumerate(RS_K_BITS) if j >> b & 1)


NVFP4_SCALE_SHIFT = 118  # s' = s * 2**118: e4m3 [2**-9, 448] -> bf16 exponent fields 236 .. 253
NVFP4_SCALE_BASE = 0x7580  # bf16 bits of s' = NVFP4_SCALE_BASE + 16 * code
ELEMENT_BIAS_SHIFT = {"e2m1": 126, "e4m3": 120}  # decoded register = value * 2**-shift
MX_TOP_CODE = 254  # the largest block of a row gets s' = 2**127
# [Np, Kp] viewed as (rg, rsel, g, kt, t, i2, i1, khi, i0) -> a thread's elements in register order
THREAD_ORDER = (0, 3, 2, 4, 7, 1, 5, 6, 8)


def step_bytes(fmt) -> tuple:
    """(word bytes, scale bytes) of one row group (16 rows) and K step: the unit every sm90 kernel reads."""
    fmt = get_format(fmt)
    return (512 if fmt.packed else 1024), K_STEP // fmt.block * 16


def prepared_views(packed: torch.Tensor, fmt) -> tuple:
    """The buffer [N/16, K/64, STEP] -> (data [N/16, K/64, words], scale [N/16, K/64, scales]), views."""
    words = step_bytes(fmt)[0]
    return packed[:, :, :words], packed[:, :, words:]


def clone_prepared(data: torch.Tensor, scale: torch.Tensor, row_mult: torch.Tensor) -> tuple:
    """A copy of prepared weights in new memory: the same views of a new buffer (benchmarks rotate copies)."""
    rows, steps, words = data.shape
    packed = data.as_strided((rows, steps, words + scale.shape[2]), data.stride()).clone()
    return packed[:, :, :words], packed[:, :, words:], row_mult.clone()


def check_prepared(data: torch.Tensor, scale: torch.Tensor, fmt, who: str) -> None:
    """Raise unless data and scale are prepared_views of one buffer, as the kernels address them."""
    words, scales = step_bytes(fmt)
    rows, steps = data.shape[:2] if data.dim() == 3 else (0, 0)
    strides = (steps * (words + scales), words + scales, 1)
    if not (data.dim() == scale.dim() == 3 and data.dtype == scale.dtype == torch.uint8
            and tuple(data.shape) == (rows, steps, words) and tuple(scale.shape) == (rows, steps, scales)
            and data.stride() == strides and scale.stride() == strides
            and scale.data_ptr() == data.data_ptr() + words and data.data_ptr() % 16 == 0):
        raise ValueError(f"{who}: prepared weights must be the data and scale views of one uint8 buffer "
                         f"[N/16, K/64, {words + scales}] (layout.prepared_views, as sm90.prepare makes them); got "
                         f"data {data.dtype} {list(data.shape)} strides {data.stride()}, scale {scale.dtype} "
                         f"{list(scale.shape)} strides {scale.stride()}")


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_shape(n: int, k: int) -> tuple:
    return _ceil_to(n, ROW_ALIGN), _ceil_to(k, K_ALIGN)


def _codes(q: QTensor, np_: int, kp: int) -> torch.Tensor:
    """Element codes [Np, Kp] (uint8: E2M1 nibble or E4M3 byte), zero padded."""
    n = q.shape[0]
    c = unpack_fp4(q.data) if q.fmt.packed else q.data.view(torch.uint8)
    out = torch.zeros(np_, kp, dtype=torch.uint8, device=c.device)
    out[:n, : c.shape[1]] = c
    return out


def _nvfp4_scale_codes(q: QTensor, codes: torch.Tensor, np_: int, kp: int):
    """E4M3 block scales -> (codes [Np, Kp/16], row_mult [Np]); fixes codes in place.

    A negative scale flips its block's element signs; a zero scale zeroes its block's elements.
    Both keep W exact while every stored scale is a positive normal s'.
    """
    n, block = q.shape[0], q.fmt.block
    raw = q.linear_scale().view(torch.uint8)
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise ValueError(f"prepare(nvfp4 {list(q.shape)}): block scales contain NaN (E4M3 0x7F/0xFF)")
    bits = torch.zeros(np_, kp // block, dtype=torch.uint8, device=raw.device)
    bits[:n, : raw.shape[1]] = raw
    blocks = codes.view(np_, kp // block, block)
    negative = (bits & 0x80) != 0
    blocks ^= (negative.to(torch.uint8) * 0x8)[..., None]
    zero = (bits & 0x7F) == 0
    blocks.mul_((~zero).to(torch.uint8)[..., None])
    s = (bits & 0x7F).view(torch.float8_e4m3fn).float() * 2.0**NVFP4_SCALE_SHIFT
    bf16_bits = s.view(torch.int32) >> 16
    code = torch.where(zero, torch.full_like(bf16_bits, 8 * 16 + NVFP4_SCALE_BASE), bf16_bits)
    code = (code - NVFP4_SCALE_BASE) >> 4
    g = q.global_scale.to(torch.float32).reshape(())
    rebase = 2.0 ** (ELEMENT_BIAS_SHIFT["e2m1"] - NVFP4_SCALE_SHIFT)  # 2**8: w' = value * s * 2**-8
    row_mult = torch.full((np_,), rebase, dtype=torch.float32, device=raw.device) / g
    return code.to(torch.uint8), row_mult


def _nonzero_blocks(codes: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """[Np, Kp/block] bool: the block has an element of nonzero magnitude."""
    np_, kp = codes.shape
    return (codes.view(np_, kp // fmt.block, fmt.block) & (0x7 if fmt.packed else 0x7F)).amax(-1) != 0


def _mx_scale_codes(q: QTensor, codes: torch.Tensor, np_: int, kp: int):
    """E8M0 block scales -> (codes [Np, Kp/32], row_mult [Np]) with a per-row power-of-two rebase."""
    n, block = q.shape[0], q.fmt.block
    raw = q.linear_scale().view(torch.uint8)
    if bool((raw == E8M0_NAN).any()):
        raise ValueError(f"prepare({q.fmt.name} {list(q.shape)}): block scales contain NaN (E8M0 0xFF)")
    b = torch.zeros(np_, kp // block, dtype=torch.int32, device=raw.device)
    b[:n, : raw.shape[1]] = raw.to(torch.int32)
    nonzero = _nonzero_blocks(codes, q.fmt)
    b_max = torch.where(nonzero, b, torch.full_like(b, -1)).amax(-1)
    b_max = torch.where(b_max < 0, torch.full_like(b_max, E8M0_BIAS), b_max)
    code = torch.where(nonzero, b - b_max[:, None] + MX_TOP_CODE, torch.full_like(b, MX_TOP_CODE))
    if bool((code < 1).any()):
        raise ValueError(
            f"prepare({q.fmt.name} {list(q.shape)}): a row's block exponents span more than 253 binades"
        )
    c = b_max + ELEMENT_BIAS_SHIFT[q.fmt.elem] - MX_TOP_CODE
    row_mult = torch.pow(2.0, c.to(torch.float64)).to(torch.float32)
    return code.to(torch.uint8), row_mult


def _thread_order(codes: torch.Tensor) -> torch.Tensor:
    """[Np, Kp] -> [Np/16, Kp/64, 8 g, 4 t, 2 khi, 2 rsel, 2 i2, 2 i1, 2 i0]: each thread's elements in register order."""
    np_, kp = codes.shape
    c = codes.view(np_ // 16, 2, 8, kp // 64, 4, 2, 2, 2, 2)  # rg, rsel, g, kt, t, i2, i1, khi, i0 (physical k order)
    return c.permute(*THREAD_ORDER)


def _place_bits(codes: torch.Tensor, bits: tuple) -> torch.Tensor:
    """Element codes [..., E] (E = len(bits)) -> int32 words [...], bit b of element i at bits[i][b]."""
    word = torch.zeros(codes.shape[:-1], dtype=torch.int32, device=codes.device)
    c = codes.to(torch.int32)
    for i, positions in enumerate(bits):
        for bit, pos in enumerate(positions):
            word |= ((c[..., i] >> bit) & 1) << pos
    return word


def _gather_bits(word: torch.Tensor, bits: tuple) -> torch.Tensor:
    """The inverse of _place_bits: int32 words [...] -> element codes [..., E] (uint8)."""
    elements = []
    for positions in bits:
        code = torch.zeros_like(word)
        for bit, pos in enumerate(positions):
            code |= ((word >> pos) & 1) << bit
        elements.append(code)
    return torch.stack(elements, dim=-1).to(torch.uint8)


def _shuffle_codes(codes: torch.Tensor, bits: tuple) -> torch.Tensor:
    """Element codes [Np, Kp] -> data [Np/16, Kp/64, 512 | 1024] uint8 (see module docstring)."""
    per_word = len(bits)  # 8 E2M1 or 4 E4M3 codes
    c = _thread_order(codes).reshape(codes.shape[0] // 16, codes.shape[1] // 64, 32, 32 // per_word, per_word)
    return _place_bits(c, bits).reshape(codes.shape[0] // 16, codes.shape[1] // 64, -1).view(torch.uint8)


def _shuffle_scales(code: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """Scale codes [Np, Kp/block] -> [Np/16, Kp/64, 64 | 32] uint8 (see module docstring)."""
    np_, cols = code.shape
    per_step = K_STEP // fmt.block  # blocks per K step: 4 (NVFP4) or 2 (MX)
    c = code.view(np_ // 16, 2, 8, cols // per_step, per_step)  # rg, rsel, g, kt, block
    return c.permute(0, 3, 2, 4, 1).reshape(np_ // 16, cols // per_step, -1)


def shuffle_weights(q: QTensor):
    """Canonical QTensor -> (data, scale, row_mult) in the Hopper layout (module docstring)."""
    n, k = q.shape
    np_, kp = padded_shape(n, k)
    codes = _codes(q, np_, kp)
    if q.fmt.global_scale:
        scale_code, row_mult = _nvfp4_scale_codes(q, codes, np_, kp)
    else:
        if not q.fmt.packed and bool(((codes & 0x7F) == 0x7F).any()):
            raise ValueError(f"prepare(mxfp8 {list(q.shape)}): weights contain NaN (E4M3 0x7F/0xFF)")
        scale_code, row_mult = _mx_scale_codes(q, codes, np_, kp)
    packed = torch.cat([_shuffle_codes(codes, FP4_BITS if q.fmt.packed else FP8_BITS),
                        _shuffle_scales(scale_code, q.fmt)], dim=2)
    return *prepared_views(packed, q.fmt), row_mult


# ---- the inverse --------------------------------------------------------------------------------
def _from_thread_order(c: torch.Tensor, np_: int, kp: int) -> torch.Tensor:
    """Elements in register order (any shape holding them in that order) -> [Np, Kp]."""
    c = c.reshape(np_ // 16, kp // 64, 8, 4, 2, 2, 2, 2, 2)
    return c.permute(*[THREAD_ORDER.index(d) for d in range(9)]).reshape(np_, kp)


def _unshuffle_codes(data: torch.Tensor, bits: tuple, np_: int, kp: int) -> torch.Tensor:
    words_per_lane = 32 // len(bits)
    word = data.contiguous().view(torch.int32).view(np_ // 16, kp // 64, 32, words_per_lane)
    return _from_thread_order(_gather_bits(word, bits), np_, kp)


def _unshuffle_scales(scale: torch.Tensor, fmt: FormatSpec, np_: int, kp: int) -> torch.Tensor:
    c = scale.view(np_ // 16, kp // K_STEP, 8, K_STEP // fmt.block, 2)  # rg, kt, g, block, rsel
    return c.permute(0, 4, 2, 1, 3).reshape(np_, kp // fmt.block)


def _nvfp4_block_scales(code: torch.Tensor) -> torch.Tensor:
    s = ((code.to(torch.int32) * 16 + NVFP4_SCALE_BASE) << 16).view(torch.float32)
    return (s * 2.0**-NVFP4_SCALE_SHIFT).to(torch.float8_e4m3fn)  # exact: s is an E4M3 value


def _mx_block_scales(code: torch.Tensor, codes: torch.Tensor, row_mult: torch.Tensor, fmt: FormatSpec):
    _, e = torch.frexp(row_mult.double())  # row_mult = 2**(e - 1)
    b_max = e.to(torch.int32) - 1 - ELEMENT_BIAS_SHIFT[fmt.elem] + MX_TOP_CODE
    b = code.to(torch.int32) - MX_TOP_CODE + b_max[:, None]
    return torch.where(_nonzero_blocks(codes, fmt), b, torch.zeros_like(b)).to(torch.uint8)


def unshuffle_weights(data: torch.Tensor, scale: torch.Tensor, row_mult: torch.Tensor, fmt, shape,
                      global_scale: torch.Tensor = None) -> QTensor:
    """shuffle_weights' output -> the canonical QTensor [N, K] (linear scales), bit for bit within the
    limits of the module docstring. global_scale: the NVFP4 encode scale the weight was prepared with
    (row_mult does not determine it); None for MX."""
    fmt = get_format(fmt)
    n, k = shape
    np_, kp = padded_shape(n, k)
    words, scales = step_bytes(fmt)
    want_data, want_scale = (np_ // 16, kp // K_STEP, words), (np_ // 16, kp // K_STEP, scales)
    if tuple(data.shape) != want_data or tuple(scale.shape) != want_scale or tuple(row_mult.shape) != (np_,):
        raise ValueError(f"unshuffle_weights({fmt.name} {list(shape)}): expected data {list(want_data)}, scale "
                         f"{list(want_scale)}, row_mult [{np_}]; got {list(data.shape)}, {list(scale.shape)}, "
                         f"{list(row_mult.shape)}")
    codes = _unshuffle_codes(data, FP4_BITS if fmt.packed else FP8_BITS, np_, kp)
    scale_code = _unshuffle_scales(scale, fmt, np_, kp)
    if fmt.global_scale:
        block_scale = _nvfp4_block_scales(scale_code)
    else:
        block_scale = _mx_block_scales(scale_code, codes, row_mult, fmt)
    cols = padded_k(k, fmt.block)
    codes = codes[:n, :cols]
    data = pack_fp4(codes) if fmt.packed else codes.contiguous().view(torch.float8_e4m3fn)
    return QTensor(data=data, scale=block_scale[:n, : cols // fmt.block].contiguous(), fmt=fmt, shape=(n, k),
                   global_scale=global_scale)
