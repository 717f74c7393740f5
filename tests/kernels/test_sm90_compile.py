"""The sm90 Gluon kernels, compiled for sm_90 on the CPU and checked in their SASS.

Gluon kernels do not run under TRITON_INTERPRET (Triton's interpreter covers only tl.* kernels),
so CI checks what it can without a GPU: the decode, dequantize and wgmma kernels compile,
every `convert_layout(..., assert_trivial=True)` holds (a non-trivial one fails the compile), and
the machine code has what the design relies on: 16-byte weight loads, tensor-core MMAs, packed
bf16x2 scale multiplies, vectorized stores and no local-memory spills. Their numerics are tested
on the GPU (test_sm90_gemm.py) and their layout on the CPU (test_sm90_layout.py).
"""

import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from microscale.kernels.nvrtc import sass_opcodes  # noqa: E402
from microscale.kernels.sm90 import decode  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


DECODE_SIGNATURE = {"X": "*bf16", "W": "*u8", "S": "*u8", "ROW_MULT": "*fp32", "BIAS": "*bf16", "Y": "*bf16",
                    "WS": "*fp32", "TICKETS": "*i32", "M": "i32", "N": "i32", "K": "i32", "KT": "i32",
                    "steps_per_split": "i32", "n_split": "i32", "stride_xm": "i32", "stride_ym": "i32"}
DECODE_ALIGNED = (0, 1, 2, 3, 4, 5, 6, 7, 10, 14, 15)  # pointers and K, strides: multiples of 16 as launched


def _sass(kernel, signature, constexprs, aligned, tmp_path, num_warps=4):
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = GluonASTSource(kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                         constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("reps,parts", [(1, 1), (2, 2)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_decode_kernel_sass(fmt, reps, parts, tmp_path):
    constexprs = dict(FMT=decode.FMT_CODE[fmt], HAS_BIAS=True, SPLIT=True, NW=4, R=reps, U=2, BMX=8, DEPTH=2,
                      FULL_K=False, KP=parts)
    ops = sass_opcodes(_sass(decode.decode_gemm_kernel, DECODE_SIGNATURE, constexprs, DECODE_ALIGNED,
                     tmp_path))
    assert "LDG.E.EF.128" in ops and "LDG.E.128" in ops  # 16-byte loads: weights (evict-first) and activations
    assert any(o.startswith("HMMA.16816.F32.BF16") for o in ops)
    assert any(o.startswith("HMUL2.BF16") for o in ops)  # block scale on bf16x2 pairs
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local memory (spills)"
    if parts > 1:  # the parts meet through lane shuffles; shared memory only broadcasts the ticket (one store)
        assert any(o.startswith("SHFL.BFLY") for o in ops)
        assert sum(o.startswith("STS") for o in ops) == 1


@pytest.mark.parametrize("pdl", [False, True])
def test_decode_kernel_waits_for_the_prior_grid_only_after_its_first_weight_loads(pdl, tmp_path):
    """As a programmatic dependent launch (PDL) the kernel may run beside the kernel that writes x: the first
    weight tiles load before griddepcontrol.wait (SASS ACQBULK), x only after it, and the next kernel is
    released (PREEXIT) before the fix-up's and epilogue's stores. Without PDL neither instruction is there."""
    constexprs = dict(FMT=decode.FMT_CODE["nvfp4"], HAS_BIAS=True, SPLIT=True, NW=4, R=2, U=2, BMX=8, DEPTH=2,
                      FULL_K=True, KP=1, PDL=pdl)
    ops = sass_opcodes(_sass(decode.decode_gemm_kernel, DECODE_SIGNATURE, constexprs, DECODE_ALIGNED, tmp_path))
    if not pdl:
        assert "ACQBULK" not in ops and "PREEXIT" not in ops
        return
    assert ops.count("ACQBULK") == 1 and ops.count("PREEXIT") == 1
    wait, release = ops.index("ACQBULK"), ops.index("PREEXIT")
    assert ops.index("LDG.E.EF.128") < wait < ops.index("LDG.E.128")  # weights, the wait, x
    stores = [i for i, o in enumerate(ops) if o.startswith(("STG", "ATOM", "RED"))]
    assert stores and wait < release < min(stores)


@pytest.mark.parametrize("fmt,reps,parts", [("nvfp4", 1, 1), ("mxfp4", 2, 2), ("mxfp8", 1, 1)])
def test_decode_kernel_gated_epilogue_pairs_rows_in_registers(fmt, reps, parts, tmp_path):
    """GATED (gate/up row pairs, kernels/gated.py): the pair of a thread's accumulator rows g and g + 8 becomes one
    silu(gate) * up; up to 8 activation columns (launch.decode_takes_gated) that needs no shared memory beyond
    the ticket's broadcast, and the K loop is the plain kernel's (same MMAs)."""
    constexprs = dict(FMT=decode.FMT_CODE[fmt], HAS_BIAS=True, SPLIT=True, NW=4, R=reps, U=2, BMX=8, DEPTH=2,
                      FULL_K=False, KP=parts)
    plain, gated = (sass_opcodes(_sass(decode.decode_gemm_kernel, DECODE_SIGNATURE, {**constexprs, "GATED": g},
                                       DECODE_ALIGNED, tmp_path)) for g in (False, True))
    assert "MUFU.EX2" in gated and "MUFU.EX2" not in plain
    assert sum(o.startswith("STS") for o in gated) == 1
    assert sum(o.startswith("HMMA") for o in gated) == sum(o.startswith("HMMA") for o in plain)
    assert not any(o.startswith(("LDL", "STL")) for o in gated), "local memory (spills)"


@pytest.mark.parametrize("cc", [80, 120])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_decode_and_dequant_kernels_build_for_sm80_and_sm120(fmt, cc):
    """The backend also serves sm_80-sm_89 and sm_120 (behind the first-use self-test): the decode
    and dequantize kernels must build there (mma.sync and the bf16x2 decode exist on both)."""
    constexprs = dict(FMT=decode.FMT_CODE[fmt], HAS_BIAS=True, SPLIT=True, NW=4, R=1, U=2, BMX=8, DEPTH=2,
                      FULL_K=True, KP=1)
    signature = {**DECODE_SIGNATURE, **{k: "constexpr" for k in constexprs}}
    src = GluonASTSource(decode.decode_gemm_kernel, signature=signature, constexprs=constexprs)
    assert "mma.sync" in triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4}).asm["ptx"]
    signature = {"W": "*u8", "S": "*u8", "ROW_MULT": "*fp32", "OUT": "*bf16", "INEXACT": "*i32", "KT": "i32",
                 "ld_out": "i32", "factor": "fp32"}
    constexprs = dict(FMT=decode.FMT_CODE[fmt], TO_FP8=False, NW=4, R=1, U=2)
    src = GluonASTSource(decode.dequant_kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                         constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})


@pytest.mark.parametrize("to_fp8", [False, True])
def test_dequant_kernel_sass(to_fp8, tmp_path):
    signature = {"W": "*u8", "S": "*u8", "ROW_MULT": "*fp32", "OUT": "*fp8e4nv" if to_fp8 else "*bf16",
                 "INEXACT": "*i32", "KT": "i32", "ld_out": "i32", "factor": "fp32"}
    constexprs = dict(FMT=1, TO_FP8=to_fp8, NW=4, R=1, U=2)
    ops = sass_opcodes(_sass(decode.dequant_kernel, signature, constexprs, (0, 1, 2, 3, 4, 6), tmp_path))
    assert any(o.startswith("LDG.E.EF.128") for o in ops) and "STG.E.128" in ops  # evict-first weight loads
    assert not any(o.startswith(("LDL", "STL")) for o in ops)


@pytest.mark.parametrize("fmt,nw,bm,reps,rs", [("nvfp4", 4, 64, 1, False), ("mxfp4", 8, 128, 1, False),
                                               ("mxfp8", 8, 128, 1, False), ("nvfp4", 4, 16, 2, True),
                                               ("mxfp8", 8, 32, 1, True)])
def test_wgmma_kernel_sass(fmt, nw, bm, reps, rs, tmp_path):
    from microscale.kernels.sm90 import wgmma
    constexprs = dict(FMT=decode.FMT_CODE[fmt], HAS_BIAS=True, SPLIT=True, NW=nw, BM=bm, DEPTH=3, R=reps, RS=rs)
    sass = _sass(wgmma.wgmma_gemm_kernel, DECODE_SIGNATURE, constexprs, DECODE_ALIGNED, tmp_path, num_warps=nw)
    ops = sass_opcodes(sass)
    # wgmma m64 x bm x k16; A from registers (rs) or, like B, from shared memory
    a_operand = "R" if rs else "gdesc"
    assert re.search(rf"HGMMA\.64x{bm}x16\.F32\.BF16 R\d+, {a_operand}", sass)
    assert any(o.startswith("LDGSTS") for o in ops)  # activations by cp.async
    assert any(o.startswith("LDG.E.EF.128") for o in ops)  # weights in 16-byte evict-first loads
    # in the K loop (first to last wgmma) the decoded weight tile is stored 16 bytes at a time, or (rs) not at all;
    # the epilogue's layout change stores through shared memory either way
    wgmmas = [i for i, o in enumerate(ops) if o.startswith("HGMMA")]
    loop = ops[wgmmas[0]:wgmmas[-1]]
    assert not any(o.startswith("STS") for o in loop) if rs else "STS.128" in loop
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local memory (spills)"
