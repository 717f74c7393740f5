"""quantize_gpu against the reference quantizer, bit for bit (data, scales, global scale).

The CPU tests run the Triton kernel under TRITON_INTERPRET=1 in a subprocess (the variable must be
set before triton is imported) on tiny shapes; the GPU tests run it on the H200 on larger ones.
The interpreter flushes bf16 subnormals when converting to float32, so there subnormals are fed
as float32 only; the GPU tests feed them in every dtype.
NVFP4: bf16 / fp16 x is coded by comparing pairs of elements against per-scale-code breakpoints
(nvfp4_table_kernel; the table is checked against the reference's rounding of every 16-bit
magnitude for every scale code), in PTX on the GPU and by the same steps in Triton under the
interpreter, so the GPU tests add every bf16 and fp16 magnitude under blocks of every scale code.
float32 (and rotated) elements are divided: on the GPU by a per-block reciprocal and one correction
step, under the interpreter (whose tl.fma rounds twice) with div_rn; the GPU tests add inputs aimed
at that division: elements within a few ulp of every E2M1 decision point for many divisors, and
global scales that push the divisors to overflow, to subnormals and the quotients to underflow.
MXFP8 elements go through the hardware float8 conversion on the GPU and integer arithmetic under
the interpreter (whose float8 casts do not round to nearest even).
Inputs: Gaussian data over many binades, zeros, all-zero rows and blocks, subnormals, values near
the format maxima and exact E2M1 rounding ties; ragged M and K.
"""

import os
import subprocess
import sys

import pytest
import torch

from microscale.formats import ScaleMode
from microscale.quant import quantize

CASES = [("nvfp4", ScaleMode.RCEIL)] + [(f, m) for f in ("mxfp4", "mxfp8") for m in ScaleMode]


def make_input(m, k, dtype, seed, device="cpu", subnormals=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g).float())
    x = x.clamp(-torch.finfo(dtype).max / 8, torch.finfo(dtype).max / 8)  # finite in fp16 too
    x[0, : min(k, 7)] = 0.0  # zeros
    if m > 1:
        x[1] = 0.0  # an all-zero row
    if m > 2 and subnormals:
        tiny = torch.finfo(dtype).tiny
        x[2, :8] = torch.tensor([tiny / 4, -tiny / 2, tiny, 3 * tiny, -tiny / 8, tiny / 3, 0.0, tiny])[: min(k, 8)]
    if m > 3 and k >= 16:
        x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.75, -5.0, 3.0, 4.0, 0.5, 1.0])
    if m > 4:
        x[4, : min(k, 4)] = torch.finfo(dtype).max / 2  # huge values
    return x.to(dtype).to(device)


def assert_bit_identical(a, r):
    da, dr = a.data.view(torch.uint8).cpu(), r.data.view(torch.uint8).cpu()
    sa, sr = a.scale.view(torch.uint8).cpu(), r.scale.view(torch.uint8).cpu()
    bad = (da != dr).nonzero()
    assert bad.numel() == 0, f"data differs at {bad[:5].tolist()}"
    bad = (sa != sr).nonzero()
    assert bad.numel() == 0, f"scales differ at {bad[:5].tolist()}"
    if r.global_scale is not None:
        assert torch.equal(a.global_scale.cpu(), r.global_scale.cpu())
    assert a.shape == r.shape and a.scale_layout == r.scale_layout


def _run_cases(device, shapes, dtypes, seed, interpreted=False, cases=CASES):
    from microscale.kernels.quantize import quantize_gpu
    for fmt, mode in cases:
        for dtype in dtypes:
            for m, k in shapes:
                # the interpreter converts bf16 to float32 with subnormals flushed (the GPU does not)
                x = make_input(m, k, dtype, seed, device, subnormals=not (interpreted and dtype == torch.bfloat16))
                kw = {} if fmt == "nvfp4" else {"scale_mode": mode}
                for layout in ("linear", "swizzled"):
                    assert_bit_identical(quantize_gpu(x, fmt, scale_layout=layout, **kw),
                                         quantize(x, fmt, scale_layout=layout, **kw))
                if fmt == "nvfp4":  # a given global scale
                    assert_bit_identical(quantize_gpu(x, fmt, global_scale=3.5), quantize(x, fmt, global_scale=3.5,
                                                                                          scale_layout="swizzled"))


# E2M1 decision points: a quotient rounds up past each of these (float32 midpoints next to the
# ties 0.25 .. 5 of codec.e2m1_encode), so dividends near d times them test the division's last bit
E2M1_DECISIONS = [0.25 + 2**-26, 0.75 - 2**-25, 1.25 + 2**-24, 1.75 - 2**-24, 2.5 + 2**-23, 3.5 - 2**-23, 5 + 2**-22]


def near_decisions(rows, g, seed):
    """float32 [rows, 16]: per row (one NVFP4 block) a block maximum and 15 elements within 3 ulp
    of d * (an E2M1 decision point, or an exact tie), d the block's divisor for global scale g,
    computed as the reference does."""
    from microscale.formats import e4m3_encode
    gen = torch.Generator().manual_seed(seed)
    amax = torch.exp2(torch.rand(rows, generator=gen) * 24 - 12) * (1 + torch.rand(rows, generator=gen))
    g = torch.tensor(g, dtype=torch.float32)
    s = e4m3_encode(amax / torch.full_like(amax, 6.0) * g).float()
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    d = s / g
    points = torch.tensor(E2M1_DECISIONS + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    pick = points[torch.randint(0, len(points), (rows, 15), generator=gen)]
    x = (pick * d.double()[:, None]).float()  # the nearest float32 to d * point
    ulps = torch.randint(-3, 4, (rows, 15), generator=gen, dtype=torch.int32)
    x = (x.view(torch.int32) + ulps).view(torch.float32)
    x = torch.where(torch.rand(rows, 15, generator=gen) < 0.5, -x, x)
    return torch.cat([amax[:, None], x], 1)


def extreme_blocks(rows, seed):
    """float32 [rows, 512]: each NVFP4 block spans 2**30 below a block maximum between 2**-135 and
    2**120, and holds a negative element between 2**-149 and 2**-100 (quotients that underflow)."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(-135, 121, (rows, 32, 1), generator=gen).float()
    x = torch.randn(rows, 32, 16, generator=gen) * torch.exp2(top - 30 * torch.rand(rows, 32, 16, generator=gen))
    x[:, :, 1] = -torch.exp2(torch.randint(-149, -99, (rows, 32), generator=gen).float())
    return x.reshape(rows, 512)


DECISION_SCALES = [3.5, 1e-3, 7e5]  # global scales for near_decisions
EXTREME_SCALES = [1e-40, 3e-30, 1.0, 1e30, 3e38]  # for extreme_blocks


def _run_division_cases(device, blocks, rows, seed, near=DECISION_SCALES, extreme=EXTREME_SCALES):
    from microscale.kernels.quantize import quantize_gpu
    for g in near:
        x = near_decisions(blocks, g, seed).reshape(-1, 256)
        assert_bit_identical(quantize_gpu(x.to(device), "nvfp4", global_scale=g),
                             quantize(x, "nvfp4", global_scale=g, scale_layout="swizzled"))
    for g in extreme:
        x = extreme_blocks(rows, seed)
        assert_bit_identical(quantize_gpu(x.to(device), "nvfp4", global_scale=g),
                             quantize(x, "nvfp4", global_scale=g, scale_layout="swizzled"))


def every_magnitude(dtype) -> torch.Tensor:
    """Every finite non-negative value of a 16-bit dtype, ascending, as float32."""
    top = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    return torch.arange(top, dtype=torch.int32).to(torch.int16).view(dtype).float()


def nvfp4_divisors(g: float) -> torch.Tensor:
    """The block divisor d = RN(scale / g) of every E4M3 scale code (code 0: the 0.125 that
    replaces a zero scale; 127 is NaN, never a scale), float32 [128], as the reference computes it."""
    from microscale.formats import e4m3_decode
    s = e4m3_decode(torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn))
    s[0] = 0.125
    return s / torch.tensor(g, dtype=torch.float32)


def breakpoint_table(g: float, dtype, device="cpu") -> torch.Tensor:
    """nvfp4_table_kernel's breakpoints for x of a 16-bit dtype: [128, 8] of that dtype (b_0 .. b_7)."""
    from microscale.kernels.quantize import TABLE_PROGRAMS, TABLE_ROW, X_KIND, nvfp4_table_kernel
    table = torch.full((128, TABLE_ROW.value), -1, dtype=torch.int32, device=device)
    gt = torch.tensor([g], dtype=torch.float32, device=device)
    nvfp4_table_kernel[(TABLE_PROGRAMS.value,)](gt, gt, table, G_FROM_AMAX=False, BREAKPOINTS=True, XK=X_KIND[dtype])
    pairs = table.cpu()
    assert torch.equal(pairs & 0x7FFF7FFF, (pairs & 0x7FFF) * 0x10001), "each breakpoint in both halves"
    assert torch.all(pairs[:, 0] & -0x7FFF8000 == -0x7FFF8000), "-b_0 (0x80008000: both signs)"
    return (pairs & 0x7FFF).to(torch.int16).view(dtype)


def check_breakpoint_table(g: float, dtype):
    """The breakpoints against the reference's rounding of x / d: the code and the sign bit of
    every magnitude of the dtype, for every scale code."""
    from microscale.formats import e2m1_encode
    b, d = breakpoint_table(g, dtype).float(), nvfp4_divisors(g)
    x = every_magnitude(dtype)
    for c in range(127):
        q = (x / d[c]).clamp(-6.0, 6.0)
        reached = (x[:, None] >= b[c, 1:]).sum(1)
        assert torch.equal(reached, e2m1_encode(q).long()), (g, c)
        assert torch.equal(x >= b[c, 0], e2m1_encode(-q) >= 8), (g, c)


BREAKPOINT_SCALES = DECISION_SCALES + EXTREME_SCALES + [2688.0 / 448.0 / 6.0, 2.0**-126, 1.5 * 2.0**100]


_TABLE_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from tests.kernels.test_quantize_kernel import BREAKPOINT_SCALES, check_breakpoint_table
for g in BREAKPOINT_SCALES:
    for dtype in (torch.bfloat16, torch.float16):
        check_breakpoint_table(g, dtype)
print("ok")
"""


def test_nvfp4_breakpoint_table_interpreted():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _TABLE_INTERPRETED.format(root=root)], capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def every_value_blocks(dtype, g: float, seed: int) -> torch.Tensor:
    """[rows, 256] of dtype: NVFP4 blocks whose maximum gives each E4M3 scale code (and the zero
    scale), each code's blocks holding every magnitude of the dtype up to that maximum once, with
    random signs, in random order."""
    gen = torch.Generator().manual_seed(seed)
    x, d = every_magnitude(dtype), nvfp4_divisors(g)
    blocks = []
    for c in range(127):
        top = (6 * d[c] if c else torch.tensor(6 * 2.0**-11 / g)).to(dtype).float()  # code 0: a zero scale
        vals = x[(x <= top) & (x > 0)] if torch.isfinite(top) else x
        vals = vals[torch.randperm(len(vals), generator=gen)]
        n = -(-len(vals) // 15) * 15  # whole blocks: the first values again at the end
        vals = vals.repeat(-(-n // len(vals)))[:n].reshape(-1, 15)
        vals = torch.where(torch.rand(vals.shape, generator=gen) < 0.5, -vals, vals)
        blocks.append(torch.cat([vals.abs().amax(1, keepdim=True), vals], 1))
    blocks = torch.cat(blocks)
    blocks = torch.cat([blocks, blocks[: (-len(blocks)) % 16]])
    return blocks.reshape(-1, 256).to(dtype)


_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from tests.kernels.test_quantize_kernel import _run_cases, _run_division_cases
_run_cases("cpu", [(5, 40), (33, 96)], [torch.bfloat16, torch.float32], {seed}, interpreted=True)
_run_division_cases("cpu", 1 << 10, 16, {seed})
print("ok")
"""


def test_quantize_kernel_interpreted(seed):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED.format(root=root, seed=seed)], capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"{f}-{m.value}" for f, m in CASES])
def test_quantize_kernel_gpu(case, dtype, seed):
    _run_cases("cuda", [(1, 16), (5, 40), (130, 200), (257, 1056)], [dtype], seed, cases=[case])


@pytest.mark.gpu
@pytest.mark.parametrize("g", DECISION_SCALES)
def test_quantize_kernel_gpu_division_near_decisions(g, seed):
    """NVFP4 elements within 3 ulp of every E2M1 decision point, for 2**18 block divisors."""
    _run_division_cases("cuda", 1 << 18, 0, seed, near=[g], extreme=[])


@pytest.mark.gpu
@pytest.mark.parametrize("g", EXTREME_SCALES)
def test_quantize_kernel_gpu_extreme_global_scale(g, seed):
    """Block divisors that overflow to inf (every x / inf is 0), that are subnormal, and quotients
    that underflow (a negative element whose quotient rounds to -0 gets code 0, not the sign bit)."""
    _run_division_cases("cuda", 0, 256, seed, near=[], extreme=[g])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1.0, 7e-3, 3e4])
def test_quantize_kernel_gpu_every_16bit_value(dtype, g, seed):
    """NVFP4 (the PTX that compares pairs of 16-bit elements) on every magnitude of the dtype under
    blocks of every scale code (37 to 220 thousand blocks, by dtype and g), against the reference
    bit for bit."""
    from microscale.kernels.quantize import quantize_gpu
    x = every_value_blocks(dtype, g, seed).cuda()
    assert_bit_identical(quantize_gpu(x, "nvfp4", global_scale=g),
                         quantize(x, "nvfp4", global_scale=g, scale_layout="swizzled"))


@pytest.mark.gpu
def test_quantize_kernel_rejects_bad_input():
    from microscale.kernels.quantize import quantize_gpu
    with pytest.raises(ValueError, match="2-D"):
        quantize_gpu(torch.zeros(4, device="cuda"), "nvfp4")
    with pytest.raises(TypeError, match="dtype"):
        quantize_gpu(torch.zeros(4, 32, device="cuda", dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="no global scale"):
        quantize_gpu(torch.zeros(4, 32, device="cuda"), "mxfp8", global_scale=1.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_quantize_kernel_sass_sm90(fmt, tmp_path):
    """The kernel compiled for sm_90 on the CPU (the format's TILE, bf16 x, K a multiple of 16)
    keeps the structure its speed rests on: 16-byte loads of x, 8- or 16-byte stores of the codes,
    no local memory; with whole blocks per thread no shared memory (a layout conversion and its
    barrier) at all; MXFP8 converts with the hardware float8 instruction."""
    from quantize_compile import compile_quantize_kernel, sass_opcodes

    from microscale.kernels import quantize as qk

    compiled, spread = compile_quantize_kernel(fmt, qk.TILE)
    ops = sass_opcodes(compiled, tmp_path)
    assert "LDG.E.128" in ops
    assert ops & {"STG.E.64", "STG.E.128"}
    if not spread:
        assert compiled.metadata.shared == 0 and not any(o.startswith(("BAR", "LDS", "STS")) for o in ops)
    if fmt == "mxfp8":
        assert any(o.startswith("F2FP.SATFINITE.E4M3") for o in ops)


def test_nvfp4_quantize_loads_x_before_waiting_for_the_table_sm90(tmp_path):
    """Built for a programmatic dependent launch (quantize_gpu's NVFP4 from sm_90 on), the kernel issues its x loads
    (the thread's 4 16-byte words of bf16 pairs) before griddepcontrol.wait (SASS ACQBULK), and reads the global scale
    and the table, which nvfp4_table_kernel writes, only after it; built without, it has no wait."""
    from quantize_compile import compile_quantize_kernel, sass_instructions

    from microscale.kernels import quantize as qk

    assert "ACQBULK" not in sass_instructions(compile_quantize_kernel("nvfp4", qk.TILE)[0], tmp_path)
    ops = sass_instructions(compile_quantize_kernel("nvfp4", qk.TILE, pdl=True)[0], tmp_path)
    wait = ops.index("ACQBULK")
    assert ops.count("ACQBULK") == 1 and ops[:wait].count("LDG.E.128") == 4
    assert not any(o.startswith("LDG") and o != "LDG.E.128" for o in ops[:wait])  # no G load before the wait
    assert "LDG.E" in ops[wait:] and ops[wait:].count("LDG.E.128") == 4  # G, then 2 table rows per block


# Instructions up to the last EXIT (the hot path, without the cold division subroutine after it) of
# the FP4 tiles compiled for sm_90 (bf16 x): the E2M1 step in inline PTX took them from 745 (NVFP4)
# and 551 (MXFP4) to 676 and 498; NVFP4's breakpoint comparisons to 456, and its mask sums as
# multiply-adds (off the ALU pipe, which then bounded the kernel) to 506.
FP4_HOT_PATH_LIMIT = {"nvfp4": 520, "mxfp4": 510}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_kernel_hot_path_length_sm90(fmt, tmp_path):
    from quantize_compile import compile_quantize_kernel, sass_instructions

    from microscale.kernels import quantize as qk

    ops = sass_instructions(compile_quantize_kernel(fmt, qk.TILE)[0], tmp_path)
    hot = ops[:len(ops) - ops[::-1].index("EXIT")]
    assert len(hot) <= FP4_HOT_PATH_LIMIT[fmt], f"{fmt}: {len(hot)} SASS instructions in the hot path"
    if fmt == "nvfp4":  # 16 words of bf16 pairs per thread, 8 comparisons each; the masks summed by IMAD
        base = [o.split(".")[0] for o in hot]
        assert base.count("HSET2") == 128 and base.count("IADD3") <= 8, (base.count("HSET2"), base.count("IADD3"))


def test_programmatic_launch_only_from_sm90_and_not_interpreted(monkeypatch):
    """NVFP4's quantize kernel follows the table kernel as a programmatic dependent launch only where griddepcontrol
    exists (sm_90 and later) and not under the interpreter."""
    from microscale.kernels import quantize as qk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cc, want in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), (None, False)):
        monkeypatch.setattr(qk, "compute_capability", lambda device, cc=cc: cc)
        assert qk._programmatic(torch.device("cuda")) is want, cc
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert qk._programmatic(torch.device("cuda")) is False


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_quantize_kernel_compiles_for_sm80(fmt, monkeypatch):
    """A100 (sm_80) has no float8 conversion and Triton refuses float8e4nv casts there: quantize_gpu
    asks for the integer E4M3 encoding below sm_89 (the interpreter tests check its bits), and the
    sm_80 build then compiles without any float8 instruction. NVFP4 compares fp16 pairs there too
    (bf16 pairs need sm_90: bf16 x is divided)."""
    from quantize_compile import compile_quantize_kernel

    from microscale.kernels import quantize as qk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for cc, want in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), (None, False)):
        monkeypatch.setattr(qk, "compute_capability", lambda device, cc=cc: cc)
        assert qk._hardware_e4m3(torch.device("cuda")) is want, cc
    compiled, _ = compile_quantize_kernel(fmt, qk.TILE, hw_e4m3=False, cc=80)
    assert "e4m3" not in compiled.asm["ptx"]
    if fmt == "nvfp4":
        assert "bf16x2" not in compiled.asm["ptx"]
        compiled, _ = compile_quantize_kernel(fmt, qk.TILE, hw_e4m3=False, cc=80, fp16=True)
        assert "set.ge.u32.f16x2" in compiled.asm["ptx"] and "e4m3" not in compiled.asm["ptx"]
