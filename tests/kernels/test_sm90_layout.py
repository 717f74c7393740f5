"""The Hopper weight layout (sm90/layout.py) and its inverse, checked on the CPU.

`emulate_decode` replays what one thread of the decode kernel does with its 16-byte word group:
the same integer ops as the kernel's inline PTX (written out here again, from decode.py's asm), the
scale multiply in bf16, the per-row factor, and the logical -> physical K mapping of the layout.
The result must equal the reference dequantization for every element, so the layout, the bit
placement, the scale rebasing and the PTX decode agree with each other. The kernels themselves run
on the GPU (test_sm90_gemm.py).
"""

import pytest
import torch

from microscale.formats import QTensor, ScaleMode, get_format, pack_fp4
from microscale.formats.tensor import padded_k
from microscale.kernels.sm90.layout import padded_shape, shuffle_weights, unshuffle_weights
from microscale.quant import quantize


def _bf16x2(words: torch.Tensor):
    """int32 words -> (low, high) halves as float32 bf16 values."""
    lo = ((words & 0xFFFF) << 16).view(torch.float32)
    hi = (words & ~0xFFFF).view(torch.float32)
    return lo, hi


def _rotl32(w: torch.Tensor, r: int) -> torch.Tensor:
    """shf.l.wrap.b32 of an int32 tensor with itself: rotate left by r."""
    return (w << r) | ((w >> (32 - r)) & ((1 << r) - 1))


def _fp4_registers(w: torch.Tensor):
    """decode.py's _FP4_DECODE without the scale: 4 bf16x2 registers per word (int32 arithmetic wraps
    as the PTX does)."""
    m = 0x81C081C0 - (1 << 32)  # the mask as an int32
    return [w & m, _rotl32(w, 10) & m, _rotl32(w, 13) & m, ((w & 0x001B001B) * 0x1084) & m]


def _fp8_registers(w: torch.Tensor):
    """decode.py's _FP8_DECODE without the scale: 2 bf16x2 registers per word."""
    m = 0x87F087F0 - (1 << 32)
    return [w & m, ((w << 4) & (0x80F080F0 - (1 << 32))) | ((w >> 4) & 0x07000700)]


def _scale_bf16(code: torch.Tensor, fmt: str) -> torch.Tensor:
    """decode.py's s' from a scale code: bf16 bits code*16 + 0x7580 (NVFP4) or code << 7 (MX)."""
    bits = code.to(torch.int32) * 16 + 0x7580 if fmt == "nvfp4" else code.to(torch.int32) << 7
    return (bits << 16).view(torch.float32)


def emulate_decode(data, scale, row_mult, fmt: str, n: int, k: int) -> torch.Tensor:
    """W [n, k] float32 as the decode kernel computes it from the prepared tensors."""
    np_, kp = padded_shape(n, k)
    fp8 = fmt == "mxfp8"
    words = data.view(torch.int32).view(np_ // 16, kp // 64, 8, 4, 8 if fp8 else 4)  # rg, kt, g, t, q
    regs = _fp8_registers(words) if fp8 else _fp4_registers(words)
    halves = []
    for r in regs:
        lo, hi = _bf16x2(r)
        halves += [lo, hi]
    elem = torch.stack(halves, dim=-1)  # rg, kt, g, t, q, i: element 8q+i (FP4) or 4q+i (FP8)
    elem = elem.reshape(np_ // 16, kp // 64, 8, 4, 2, 2, 8)  # rg, kt, g, t, khi, rsel, i
    # scales: NVFP4 per (g, t, rsel), MX per (g, t // 2, rsel)
    per_step = 4 if fmt == "nvfp4" else 2
    sc = _scale_bf16(scale.view(np_ // 16, kp // 64, 8, per_step, 2), fmt)
    sc = sc.repeat_interleave(4 // per_step, dim=3)  # rg, kt, g, t, rsel
    # the kernel multiplies in bf16 (products exact unless a row spans more than 126 binades)
    w = (elem * sc[:, :, :, :, None, :, None]).to(torch.bfloat16).float()
    # registers -> (row, physical k): row = 16 rg + 8 rsel + g, k = 16t + 8 i2 + 4 i1 + 2 khi + i0
    w = w.view(np_ // 16, kp // 64, 8, 4, 2, 2, 2, 2, 2)  # rg, kt, g, t, khi, rsel, i2, i1, i0
    w = w.permute(0, 5, 2, 1, 3, 6, 7, 4, 8).reshape(np_, kp)
    return (w * row_mult[:, None])[:n, :k]


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_word_decodes_every_code_pair_exactly(fmt, seed):
    """Every (code, code) pair of every bf16x2 register of a word, the word's other elements random: the
    register halves are the element values times 2**-126 (E2M1) or 2**-120 (E4M3); whatever gathers a
    register (shifts, rotations, FP4's multiply) must carry no other element's bits into the kept ones."""
    from microscale.formats.codec import e2m1_decode
    from microscale.kernels.sm90.layout import FP4_BITS, FP8_BITS, _place_bits

    fp8 = fmt == "e4m3"
    codes_per_word, n_codes = (4, 256) if fp8 else (8, 16)
    g = torch.Generator().manual_seed(seed)
    pairs = torch.cartesian_prod(torch.arange(n_codes), torch.arange(n_codes))
    if fp8:
        value = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        pairs = pairs[~(value[pairs].isnan().any(-1))]  # 0x7F / 0xFF: the kernels never see NaN weights
        want = value[pairs] * 2.0**-120
    else:
        want = e2m1_decode(pairs.to(torch.uint8)).float() * 2.0**-126
    for j in range(codes_per_word // 2):
        codes = torch.randint(0, n_codes, (len(pairs), codes_per_word), generator=g)
        codes[:, 2 * j], codes[:, 2 * j + 1] = pairs[:, 0], pairs[:, 1]
        word = _place_bits(codes, FP8_BITS if fp8 else FP4_BITS)
        lo, hi = _bf16x2((_fp8_registers if fp8 else _fp4_registers)(word)[j])
        assert torch.equal(lo, want[:, 0]) and torch.equal(hi, want[:, 1]), f"register {j}"


def test_register_a_k_order_is_the_gluon_wgmmas():
    """layout.RS_K_BITS (which wgmma_ws's fragments and permute_k follow) is the order the Gluon wgmma's
    register layouts impose: wgmma._hardware_k_order relabels the decoded tile's logical K (the reshape and
    permute written out here again) and layout.py maps logical k = 32 khi + 8t + 4 i2 + 2 i1 + i0 to
    physical 16t + 8 i2 + 4 i1 + 2 khi + i0."""
    from microscale.kernels.sm90.layout import rs_physical_k

    logical = torch.arange(64).reshape(2, 2, 2, 2, 2, 2).permute(0, 3, 4, 1, 2, 5).reshape(64)
    khi, t, i2, i1, i0 = logical >> 5, (logical >> 3) & 3, (logical >> 2) & 1, (logical >> 1) & 1, logical & 1
    physical = 16 * t + 8 * i2 + 4 * i1 + 2 * khi + i0
    assert physical.tolist() == [rs_physical_k(j) for j in range(64)]
    assert sorted(physical.tolist()) == list(range(64))


def _weights(n, k, kind, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    if kind == "wide":  # block exponents spread over ~60 binades within rows
        w = w * torch.exp2(torch.randint(-30, 30, (n, k // 32 + 1), generator=g).repeat_interleave(32, 1)[:, :k])
    if kind == "edges":
        w[0] = 0  # an all-zero row
        w[1, :16] = 0  # a zero block
        w[2, :5] = torch.tensor([1e-30, -1e-30, 3e30, -2.0, 0.5])  # tiny and huge in one row
    return w


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(16, 64), (50, 200), (130, 96)])
@pytest.mark.parametrize("kind", ["normal", "wide", "edges"])
def test_prepared_layout_decodes_to_reference(fmt, shape, kind, seed):
    n, k = shape
    w = _weights(n, k, kind, seed)
    q = quantize(w, fmt, scale_mode=ScaleMode.RCEIL)
    data, scale, row_mult = shuffle_weights(q)
    got = emulate_decode(data, scale, row_mult, fmt, n, k)
    want = q.dequantize()
    assert torch.equal(got.isnan(), want.isnan())
    # the per-row factor is one rounding of row_mult (NVFP4: 2**8 / g): relative 2**-23 at most
    torch.testing.assert_close(got, want, rtol=2.0**-22, atol=0.0)


@pytest.mark.parametrize("fmt,step", [("nvfp4", 512 + 64), ("mxfp4", 512 + 32), ("mxfp8", 1024 + 32)])
def test_words_and_scales_of_a_k_step_sit_side_by_side(fmt, step, seed):
    """data and scale are the halves of one buffer: row group rg's K step kt is bytes (rg KT + kt) STEP of it,
    its words first, then its scales, so a row group's K steps are one run of bytes."""
    from microscale.kernels.sm90.layout import check_prepared

    g = torch.Generator().manual_seed(seed)
    n, k = 48, 320  # padded to 128 x 384: 8 row groups, 6 K steps
    data, scale, _ = shuffle_weights(quantize(torch.randn(n, k, generator=g), fmt))
    check_prepared(data, scale, fmt, "test")
    words = data.shape[2]
    buffer = torch.empty(0, dtype=torch.uint8).set_(data.untyped_storage())
    assert buffer.numel() == 8 * 6 * step and data.storage_offset() == 0
    for rg in range(8):
        for kt in range(6):
            at = (rg * 6 + kt) * step
            assert torch.equal(buffer[at:at + words], data[rg, kt])
            assert torch.equal(buffer[at + words:at + step], scale[rg, kt])


def test_clone_prepared_is_the_same_views_of_new_memory():
    from microscale.kernels.sm90.layout import check_prepared, clone_prepared

    data, scale, row_mult = shuffle_weights(quantize(torch.randn(40, 200), "mxfp4"))
    d2, s2, r2 = clone_prepared(data, scale, row_mult)
    check_prepared(d2, s2, "mxfp4", "test")
    assert torch.equal(d2, data) and torch.equal(s2, scale) and torch.equal(r2, row_mult)
    assert d2.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()


def test_gemm_refuses_weights_not_in_the_prepared_layout():
    from microscale.kernels import sm90

    data, scale, row_mult = shuffle_weights(quantize(torch.randn(32, 128), "nvfp4"))
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"sm90 gemm: prepared weights must be the data and scale views"):
        sm90.gemm(x, data.contiguous(), scale.contiguous(), row_mult, None, fmt="nvfp4", n=32, k=128, options={})
    with pytest.raises(ValueError, match=r"sm90 gemm: prepared weights must be"):  # another format's step
        sm90.gemm(x, data, scale, row_mult, None, fmt="mxfp4", n=32, k=128, options={})
    with pytest.raises(ValueError, match=r"do not match weight \[192, 128\]"):
        sm90.gemm(x, data, scale, row_mult, None, fmt="nvfp4", n=64 * 3, k=128, options={})


def test_nvfp4_negative_and_zero_block_scales_stay_exact(seed):
    w = torch.randn(32, 64)
    q = quantize(w, "nvfp4")
    before = q.dequantize()
    s = q.scale.view(torch.uint8).clone()
    s[0, 0] |= 0x80  # a negative block scale
    s[1, 1] = 0  # a zero block scale
    q = q.replace(scale=s.view(torch.float8_e4m3fn))
    data, scale, row_mult = shuffle_weights(q)
    got = emulate_decode(data, scale, row_mult, "nvfp4", 32, 64)
    want = q.dequantize()
    assert torch.equal(want[0, :16], -before[0, :16]) and torch.all(got[1, 16:32] == 0)
    torch.testing.assert_close(got, want, rtol=2.0**-22, atol=0.0)


def test_nan_block_scale_is_rejected():
    q = quantize(torch.randn(16, 64), "mxfp4")
    s = q.scale.clone()
    s[3, 1] = 0xFF
    with pytest.raises(ValueError, match="NaN"):
        shuffle_weights(q.replace(scale=s))


# ---- unshuffle_weights: the inverse, bit for bit ----------------------------------------------
def _assert_same_bits(got: QTensor, want: QTensor):
    assert got.shape == want.shape and got.scale_layout == "linear"
    assert got.data.dtype == want.data.dtype and got.scale.dtype == want.scale.dtype
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
    assert got.global_scale is want.global_scale


def _roundtrip(q: QTensor) -> QTensor:
    data, scale, row_mult = shuffle_weights(q)
    return unshuffle_weights(data, scale, row_mult, q.fmt.name, q.shape, q.global_scale)


def _random_qtensor(fmt: str, n: int, k: int, g: torch.Generator) -> QTensor:
    """Every element code (E4M3 NaN excluded), blocks of signed zeros, and block scales over the
    whole range our quantizers write: NVFP4 positive E4M3 (subnormals to 448) and a global scale
    from 2**-40 to 2**40; MX E8M0 spread over up to 253 binades within a row (prepare's limit),
    exponent 0 for a block of zeros (as e8m0_from_amax writes it)."""
    spec = get_format(fmt)
    kp = padded_k(k, spec.block)
    cols = kp // spec.block
    codes = torch.randint(0, 16 if spec.packed else 256, (n, kp), generator=g, dtype=torch.uint8)
    if not spec.packed:
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # E4M3 NaN -> 0x7E / 0xFE
    codes[:, k:] = 0  # the block padding the quantizers write
    zero = torch.rand(n, cols, generator=g) < 0.2
    sign = 0x8 if spec.packed else 0x80
    zeros = torch.randint(0, 2, (n, kp), generator=g, dtype=torch.uint8) * sign  # +0 and -0
    codes = torch.where(zero.repeat_interleave(spec.block, 1), zeros, codes)
    data = pack_fp4(codes) if spec.packed else codes.view(torch.float8_e4m3fn)
    if spec.global_scale:
        scale = torch.randint(0x01, 0x7F, (n, cols), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        gs = torch.exp2(torch.empty((), dtype=torch.float64).uniform_(-40, 40, generator=g)).float()
        return QTensor(data=data, scale=scale, fmt=spec, shape=(n, k), global_scale=gs)
    top = torch.randint(0, 255, (n, 1), generator=g)
    span = torch.randint(0, 254, (n, 1), generator=g)  # a row's exponents lie in [top - span, top]
    b = top - (torch.rand(n, cols, generator=g) * (span + 1)).long().clamp(max=span)
    b = b.clamp(min=0)
    scale = torch.where(zero, torch.zeros_like(b), b).to(torch.uint8)
    return QTensor(data=data, scale=scale, fmt=spec, shape=(n, k))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(1, 16), (16, 64), (50, 200), (130, 96), (129, 300), (7, 520)])
def test_unshuffle_inverts_shuffle_on_random_codes(fmt, shape, seed):
    q = _random_qtensor(fmt, *shape, torch.Generator().manual_seed(seed))
    _assert_same_bits(_roundtrip(q), q)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(16, 64), (50, 200), (130, 96)])
@pytest.mark.parametrize("kind", ["normal", "wide", "edges"])
def test_unshuffle_inverts_shuffle_on_quantized_weights(fmt, shape, kind, seed):
    q = quantize(_weights(*shape, kind, seed), fmt, scale_mode=ScaleMode.RCEIL)
    _assert_same_bits(_roundtrip(q), q)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_exponent_span_limits(fmt, seed):
    """Codes come back exactly over the 253 binades prepare accepts (the kernels are exact over
    126 only: emulate_decode above); a span of 254 is refused."""
    q = _random_qtensor(fmt, 16, 128, torch.Generator().manual_seed(seed))
    data = torch.zeros_like(q.data.view(torch.uint8)) | (0x11 if q.fmt.packed else 0x38)  # every block nonzero
    data = data.view(q.data.dtype)
    scale = torch.full_like(q.scale, 100)
    scale[0, 0], scale[0, 1] = 254, 1  # 253 binades apart
    scale[1, 2], scale[1, 3] = 0, 253
    wide = q.replace(data=data, scale=scale)
    _assert_same_bits(_roundtrip(wide), wide)
    scale = scale.clone()
    scale[2, 0], scale[2, 1] = 254, 0  # 254 binades apart
    with pytest.raises(ValueError, match="span more than 253 binades"):
        shuffle_weights(q.replace(data=data, scale=scale))


def test_what_shuffle_does_not_keep(seed):
    """Layers check the round trip and keep the canonical tensors when it fails (models/linear.py)."""
    q = quantize(torch.randn(32, 64), "nvfp4")
    s = q.scale.view(torch.uint8).clone()
    s[0, 0] |= 0x80  # a negative block scale: its sign moves into the elements
    s[1, 1] = 0  # a zero block scale: its elements become zero, its scale the smallest
    odd = q.replace(scale=s.view(torch.float8_e4m3fn))
    back = _roundtrip(odd)
    assert torch.equal(back.dequantize(), odd.dequantize())  # the same weight ...
    assert back.scale.view(torch.uint8)[0, 0] == s[0, 0] & 0x7F and back.scale.view(torch.uint8)[1, 1] == 0x01
    # ... an MX block of zeros comes back with exponent 0, and the NVFP4 global scale is the caller's
    m = quantize(torch.randn(32, 64), "mxfp4")
    d = m.data.clone()
    d[3, :16] = 0
    ms = m.scale.clone()
    ms[3, 0] = 120
    back = _roundtrip(m.replace(data=d, scale=ms))
    assert back.scale[3, 0] == 0 and torch.equal(back.data, d)
    with pytest.raises(ValueError, match="global_scale must be a float32 scalar"):
        unshuffle_weights(*shuffle_weights(q), "nvfp4", q.shape)
    data, scale, row_mult = shuffle_weights(q)
    with pytest.raises(ValueError, match=r"unshuffle_weights\(nvfp4 \[32, 300\]\): expected data"):
        unshuffle_weights(data, scale, row_mult, "nvfp4", (32, 300), q.global_scale)


def test_decode_tile_must_divide_the_padded_rows():
    """A decode tile taller than layout.ROW_ALIGN would leave rows unwritten: refused before any launch."""
    from microscale.kernels.sm90 import launch
    from microscale.kernels.sm90.layout import ROW_ALIGN

    cfg = launch.DecodeConfig(num_warps=4, reps=4)
    assert ROW_ALIGN % cfg.block_n  # the case under test
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"tile of {cfg.block_n} rows does not divide the {ROW_ALIGN} padded"):
        launch.decode_gemm(x, None, None, None, None, 0, 100, 256, cfg)


@pytest.mark.parametrize("unroll,k", [(3, 256), (8, 256), (4, 576)])
def test_decode_unroll_must_divide_the_padded_k(unroll, k):
    """An unroll that does not divide the K steps of the padded K would skip the last steps of K
    (K = 576 pads to 640: 10 steps of 64)."""
    from microscale.kernels.sm90 import launch
    from microscale.kernels.sm90.layout import padded_shape

    kp = padded_shape(100, k)[1]
    with pytest.raises(ValueError, match=f"unroll={unroll}, parts=1: K steps per tile times parts must divide the "
                                         f"{kp // 64} steps of 64 of the padded K={kp}"):
        launch.decode_gemm(torch.zeros(1, k, dtype=torch.bfloat16), None, None, None, None, 0, 100, k,
                           launch.DecodeConfig(unroll=unroll))


def test_decode_parts_must_divide_the_tile_and_k():
    """K parts come out of a warp's row groups and the MMA's columns, and each part takes an equal
    share of the padded K in whole tiles (K = 576 pads to 640: 10 steps, not 4 parts of 2 x 64)."""
    from microscale.kernels.sm90 import launch

    x = torch.zeros(1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="parts=2 must divide reps=1 and block_m=8"):
        launch.decode_gemm(x, None, None, None, None, 0, 100, 576, launch.DecodeConfig(reps=1, block_m=8, parts=2))
    with pytest.raises(ValueError, match="parts=4 must divide reps=4 and block_m=2"):
        launch.decode_gemm(x, None, None, None, None, 0, 100, 576, launch.DecodeConfig(reps=4, block_m=2, parts=4))
    with pytest.raises(ValueError, match="unroll=1, parts=4: K steps per tile times parts must divide the 10 steps"):
        launch.decode_gemm(x, None, None, None, None, 0, 100, 576,
                           launch.DecodeConfig(num_warps=2, reps=4, block_m=8, unroll=1, parts=4))
    cfg = launch.DecodeConfig(num_warps=4, reps=4, block_m=8, parts=4)
    assert (cfg.block_n, cfg.rows_m) == (64, 2)


def test_dequantize_tile_must_divide_the_weight():
    from microscale.kernels.sm90 import launch

    out = torch.empty(128, 256)
    with pytest.raises(ValueError, match="a 256 x 128 tile does not divide the 128 x 256 weight"):
        launch.dequantize_rows(None, None, None, 0, 0, 128, 256, out, launch.DequantConfig(reps=4))
    with pytest.raises(ValueError, match="a 64 x 256 tile does not divide the 128 x 192 weight"):
        launch.dequantize_rows(None, None, None, 0, 0, 128, 192, out, launch.DequantConfig(unroll=4))


def test_resident_programs_per_sm_by_hand():
    """CUDA occupancy rules (sm_90: 64K registers, 2048 threads, 228 KB shared memory per SM), worked by hand."""
    from types import SimpleNamespace

    from microscale.kernels.sm90.launch import resident_per_sm

    h100 = SimpleNamespace(max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=228 * 1024)
    assert resident_per_sm(96, 1024, 4, h100) == 5  # 96*32 = 3072 regs per warp, 65536 // 12288
    assert resident_per_sm(142, 1024, 4, h100) == 3  # 4544 -> 4608 per warp (units of 256), // 18432
    assert resident_per_sm(72, 1024, 2, h100) == 14  # 2304 per warp, 65536 // 4608
    assert resident_per_sm(16, 0, 4, h100) == 16  # thread limit: 2048 // 128
    assert resident_per_sm(16, 100 * 1024, 4, h100) == 2  # shared memory: 233472 // (102400 + 1024)
    assert resident_per_sm(16, 0, 1, h100) == 32  # block limit


def test_split_stops_at_one_full_wave():
    from microscale.kernels.sm90.launch import DecodeConfig, _split_for

    cfg = DecodeConfig(ctas_per_sm=4)
    # 224 row tiles on 132 SMs: 4 per SM asks for ceil(528 / 224) = 3 splits = 672 programs; with 5
    # resident per SM one wave is 660, so 3 would leave 12 programs for a second wave: 2 splits
    assert _split_for(cfg, 224, 16, 132) == 3
    assert _split_for(cfg, 224, 16, 132, resident_per_sm=6) == 3  # 672 <= 792: one wave
    assert _split_for(cfg, 224, 16, 132, resident_per_sm=5) == 2
    assert _split_for(cfg, 64, 16, 132, resident_per_sm=5) == 9  # 576 <= 660
    assert _split_for(cfg, 900, 16, 132, resident_per_sm=1) == 1  # never below one split
    assert _split_for(DecodeConfig(split=7), 224, 16, 132, resident_per_sm=5) == 7  # a fixed split is kept


def test_split_workspace_size_is_checked():
    """One [block_m, block_n] fp32 partial per output tile and split; a given workspace that is smaller
    or not fp32 is refused by name (the kernels would write past it)."""
    from microscale.kernels.sm90.launch import _split_workspace, split_workspace_elems

    assert split_workspace_elems(tiles=448, split=2, tile_elems=64 * 8) == 448 * 2 * 512
    assert split_workspace_elems(tiles=448, split=1, tile_elems=64 * 8) == 1  # no split: not read
    ws = torch.empty(448 * 2 * 512)
    assert _split_workspace(ws, 448, 2, 512, "cpu") is ws
    assert _split_workspace(None, 448, 2, 512, "cpu").numel() == 448 * 2 * 512
    with pytest.raises(ValueError, match=r"split-K workspace: need 458752 float32 elements \(448 tiles x 2 "
                                         r"splits x 512\), got 458751 torch.float32"):
        _split_workspace(ws[1:], 448, 2, 512, "cpu")
    with pytest.raises(ValueError, match="got 458752 torch.float16"):
        _split_workspace(ws.half(), 448, 2, 512, "cpu")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_decode_config_tiles_fit_the_padded_rows(fmt):
    """Every tile decode_config picks divides the row padding and K (else decode_gemm refuses the
    weight), and each tile goes where the sweeps measured it (decode_config's docstring): two K parts
    for FP4 at M <= 4 unless the weight is wide and large (28672 x 8192) or its padded K is not a
    multiple of 4 steps of 64; else the FP4 tile with two tiles in flight at M = 1 and (small weights)
    M = 9-16; one tile in flight at 8 programs per SM for the rest up to M = 8 and MXFP8 M = 9-16 on
    small weights."""
    from microscale.kernels.sm90.decode import FMT_CODE
    from microscale.kernels.sm90.launch import DecodeConfig, decode_config
    from microscale.kernels.sm90.layout import ROW_ALIGN, padded_shape

    fp4 = fmt != "mxfp8"
    parts_tile = DecodeConfig(num_warps=4, block_m=8, reps=2, parts=2, unroll=2, depth=1, ctas_per_sm=4)
    m1_tile = DecodeConfig(num_warps=4, block_m=8, reps=1, unroll=2, depth=2, ctas_per_sm=4)
    small_tile = DecodeConfig(num_warps=4, block_m=8, reps=1, unroll=2, depth=1, ctas_per_sm=8)
    for m in range(1, 65):
        for n, k in ((128, 256), (4096, 4096), (4096, 4160), (8192, 8192), (8192, 28672), (28672, 8192), (28672, 4096)):
            cfg = decode_config(m, n, k, FMT_CODE[fmt])
            kt = padded_shape(n, k)[1] // 64
            assert ROW_ALIGN % cfg.block_n == 0 and kt % (cfg.unroll * cfg.parts) == 0, (m, n, k, cfg)
            wide = (n, k) == (28672, 8192)
            if fp4 and m <= 4 and not wide and k != 4160:  # 4160 pads to 4224: 66 steps
                assert cfg == parts_tile, (m, n, k, cfg)
            elif fp4 and (m == 1 or (8 < m <= 16 and n * k <= 4096 * 4096)):
                assert cfg == m1_tile, (m, n, k, cfg)
            elif m <= 8 or (m <= 16 and n * k <= 4096 * 4096):
                assert cfg == small_tile, (m, n, k, cfg)
            else:
                assert cfg.parts == 1 and cfg.block_m >= min(m, 32), (m, n, k, cfg)


def test_dequant_chunk_rows_rule():
    from microscale.kernels.sm90.launch import dequant_chunk_rows

    # about 4M outputs per chunk's GEMM, 1024 rows at least, in multiples of 256, at least 4 chunks
    assert dequant_chunk_rows(2048, 8192, 8192) == 2048 and dequant_chunk_rows(4096, 28672, 8192) == 1024
    assert dequant_chunk_rows(3000, 8192, 8192) == 1280 and dequant_chunk_rows(100000, 8192, 8192) == 1024
    assert dequant_chunk_rows(1024, 8192, 8192) == 0  # 2 chunks
    assert dequant_chunk_rows(4096, 4096, 4096) == 0 and dequant_chunk_rows(4096, 8192, 2048) == 0  # < 32M elements
