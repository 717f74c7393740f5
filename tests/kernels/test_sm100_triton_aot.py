"""Every sm100-triton kernel variant compiled for sm_100a on the CPU, checked in its PTX and SASS.

No Blackwell GPU exists here, so this is the check that the Triton source lowers to what it is meant
to be: the tcgen05 block-scaled MMA of the format pair (never a bf16 upcast), scales copied into
Tensor Memory by tcgen05.cp, and a resource use that fits one SM (227 KB of shared memory, 512 TMEM
columns, no register spills). The expected instruction per pair comes from the PTX ISA
(tcgen05.mma kinds) and its SASS names, not from the code under test. Run with -s to print the
resource table recorded in docs/blackwell.md.
"""

import functools
import os
import re
import subprocess
import tempfile

import pytest
import triton

from microscale.formats import get_format
from microscale.kernels.sm100 import triton_gemm as tg

# (activations, weights) -> (PTX instruction, SASS MMA mnemonic)
EXPECTED_MMA = {
    ("nvfp4", "nvfp4"): ("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X", "UTCOMMA.4X"),
    ("mxfp4", "mxfp4"): ("tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X", "UTCOMMA"),
    ("mxfp8", "mxfp8"): ("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X", "UTCQMMA"),
    ("mxfp8", "mxfp4"): ("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.scale_vec::1X", "UTCQMMA"),
}
SCALE_COPY_PTX = "tcgen05.cp.cta_group::1.warpx4.32x128b"  # a 512-byte 128x4 atom -> 32 lanes, 4 quarters
SCALE_COPY_SASS = "UTCCP.T.S.4x32dp128bit"
UPCAST_MMA_PTX = ("kind::f16", "kind::tf32", "kind::f8f6f4", "wgmma", "mma.sync")  # kind::f8f6f4 = unscaled
SMEM_LIMIT = 232448  # 227 KB opt-in shared memory per block (sm_90 and sm_100)
TMEM_COLUMNS = 512
VARIANTS = ("large", "swap64", "swap32")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@functools.lru_cache(maxsize=None)
def compiled(act: str, wt: str, variant: str, emulate: bool = False, capability: int = 100):
    cfg = tg.all_tile_configs(get_format(act), get_format(wt), emulate)[variant]
    kernel = tg.aot_compile(act, wt, cfg, emulate=emulate, capability=capability)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], check=True, capture_output=True, text=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    resources = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return cfg, kernel, sass, resources


CASES = [(act, wt, variant) for act, wt in EXPECTED_MMA for variant in VARIANTS]


@pytest.mark.parametrize("act, wt, variant", CASES)
def test_ptx_issues_the_block_scaled_mma_with_scales_in_tmem(act, wt, variant):
    _, kernel, _, _ = compiled(act, wt, variant)
    ptx = kernel.asm["ptx"]
    want, _ = EXPECTED_MMA[(act, wt)]
    mmas = re.findall(r"tcgen05\.mma\S*", ptx)
    assert mmas and set(mmas) == {want}, f"{act} x {wt} {variant}: tcgen05.mma forms {sorted(set(mmas))}"
    assert SCALE_COPY_PTX in ptx, "scales do not reach Tensor Memory through tcgen05.cp"
    for upcast in UPCAST_MMA_PTX:
        assert upcast not in ptx, f"{act} x {wt} {variant}: found {upcast!r} (an upcast MMA path)"


@pytest.mark.parametrize("act, wt, variant", CASES)
def test_sass_holds_the_tcgen05_mma_and_scale_copy(act, wt, variant):
    _, _, sass, _ = compiled(act, wt, variant)
    _, want = EXPECTED_MMA[(act, wt)]
    mmas = set(re.findall(r"\b(UTC\w*MMA(?:\.\w+)?)\b", sass))
    assert mmas == {want}, f"{act} x {wt} {variant}: SASS MMA {sorted(mmas)}"
    assert SCALE_COPY_SASS in sass
    assert not re.search(r"\b(HMMA|HGMMA|QGMMA)\b", sass), "a warp-level or wgmma MMA is present"


@pytest.mark.parametrize("act, wt, variant", CASES)
def test_variant_fits_one_sm(act, wt, variant):
    cfg, kernel, _, res = compiled(act, wt, variant)
    row = (f"{act:>5} x {wt:<5} {variant:<6} tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} stages {cfg.num_stages} "
           f"warps {kernel.metadata.num_warps:>2} | smem {kernel.metadata.shared:>6} B | tmem "
           f"{kernel.metadata.tmem_size:>3} cols | regs {res['REG']:>3} | stack {res['STACK']} local {res['LOCAL']}")
    print(row)
    assert kernel.metadata.shared <= SMEM_LIMIT, row
    assert 0 < kernel.metadata.tmem_size <= TMEM_COLUMNS, row
    assert res["REG"] <= 255 and res["STACK"] == 0 and res["LOCAL"] == 0, f"register spills: {row}"


@pytest.mark.parametrize("act, wt", list(EXPECTED_MMA))
def test_emulated_variant_fits_an_h200(act, wt):
    """The EMULATE_MMA build of the large tile (the one with the most shared memory) for sm_90."""
    cfg, kernel, sass, _ = compiled(act, wt, "large", emulate=True, capability=90)
    assert kernel.metadata.shared <= SMEM_LIMIT
    assert "tcgen05" not in kernel.asm["ptx"] and "dot_scaled" not in kernel.asm["ttir"]
    assert "wgmma.mma_async" in kernel.asm["ptx"]  # the emulated MMA is an ordinary bf16 tl.dot
    assert cfg.block_k == tg.all_tile_configs(get_format(act), get_format(wt))["large"].block_k


def test_every_launchable_variant_is_compiled_here():
    """tile_config picks only the variants this file compiles, for every M."""
    for act, wt in tg.FORMAT_PAIRS:
        variants = set(tg.all_tile_configs(get_format(act), get_format(wt)).values())
        for m in (1, 31, 32, 33, 63, 64, 65, 127, 128, 4096):
            assert tg.tile_config(get_format(act), get_format(wt), m) in variants
    assert set(tg.FORMAT_PAIRS) == set(EXPECTED_MMA)
