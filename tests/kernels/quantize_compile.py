"""The quantize kernels compiled ahead of time on the CPU for a chosen GPU (shared by the SASS tests)."""

import os
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from microscale.formats import get_format
from microscale.kernels import nvrtc, quantize as qk

QUANTIZE_ALIGNED = (0, 1, 2, 3, 4, 6, 8)  # pointers and stride_xm: 16-byte aligned, as quantize_gpu's are


def compile_kernel(kernel, signature, constexprs, aligned, warps, cc=90):
    src = ASTSource(kernel, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})


def compile_quantize_kernel(fmt, tile, hw_e4m3=True, rotation=0, cc=90, fp16=False, pdl=False):
    """quantize_kernel for bf16 (fp16) x with the format's `tile` entry (TILE or ROTATED_TILE): (compiled,
    spread). NVFP4 reads x as words of element pairs where quantize_gpu does: unrotated, and bf16 from
    sm_90 on, fp16 on any GPU; pdl: built to wait for the table kernel (quantize_gpu's NVFP4 from sm_90 on)."""
    spec = get_format(fmt)
    block_m, blocks, warps, spread = tile[spec.name]
    packed = spec.global_scale and not rotation and (cc >= 90 or fp16)
    constexprs = dict(FMT=("nvfp4", "mxfp4", "mxfp8").index(fmt), MODE=1, SWIZZLED=True, NATIVE=True,
                      HW_E4M3=hw_e4m3, BLOCK=spec.block, VEC=8, BLOCK_M=block_m, BLOCKS=blocks, SPREAD=spread,
                      ROTATION=rotation, XK=int(fp16), PACKED=packed, PDL=pdl)
    element = "*fp16" if fp16 else "*bf16"
    signature = {"X": "*i32" if packed else element, "DATA": "*i32" if spec.packed else "*u8", "SCALE": "*u8",
                 "G": "*fp32", "TABLE": "*i32", "M": "i32", "K": "i32", "n_cols": "i32", "stride_xm": "i32",
                 "MASK_WEIGHT": "i32"}
    return compile_kernel(qk.quantize_kernel, signature, constexprs, QUANTIZE_ALIGNED, warps, cc), spread


def sass_instructions(compiled, tmp_path) -> list:
    """The SASS opcodes of a compiled kernel in program order, asserting it uses no local memory (spills)."""
    cubin = tmp_path / f"{compiled.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = nvrtc.sass_opcodes(sass)
    assert not any(o.startswith(("LDL", "STL")) for o in ops), f"{compiled.name}: local memory (spills)"
    return ops


def sass_opcodes(compiled, tmp_path) -> set:
    """The set of SASS opcodes of a compiled kernel (no local memory, as sass_instructions)."""
    return set(sass_instructions(compiled, tmp_path))
