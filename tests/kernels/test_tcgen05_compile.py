"""CPU CI for the hand-written tcgen05 kernel: NVRTC compiles every variant for sm_100a, the SASS holds
the intended block-scaled tensor-core, TMEM, TMA and mbarrier instructions, and nothing spills.

No GPU: NVRTC (cuda-python) and Triton's cuobjdump run on the CPU machine. One NVRTC program holds all
variants (a few seconds); the disk cache is pointed at a temporary directory so the compile is real.
"""

import re

import pytest

pytest.importorskip("cuda.core")
pytest.importorskip("triton")

from microscale.kernels import nvrtc  # noqa: E402
from microscale.kernels.sm100 import tcgen05_backend as T  # noqa: E402

# SASS (Blackwell) for each PTX operation the kernel is built from.
MMA_SASS = {"nvfp4": r"UTCOMMA(\.2CTA)?\.4X", "mxfp4": r"UTCOMMA(\.2CTA)?(?!\S*\.4X)", "mxfp8": r"UTCQMMA(\.2CTA)?"}
COMMON_SASS = {
    "tcgen05.cp.32x128b.warpx4": r"UTCCP\.T\.S(\.2CTA)?\.4x32dp128bit",
    "tcgen05.ld.32x32b.x32": r"LDTM\.x32",
    "tcgen05.commit": r"UTCBAR",
    "tcgen05.alloc": r"UTCATOMSWS(\.2CTA)?\.FIND_AND_SET",
    "cp.async.bulk.tensor.2d (A, B)": r"UTMALDG\.2D",
    "cp.async.bulk.tensor.3d (scales)": r"UTMALDG\.3D",
    "prefetch.tensormap": r"UTMACCTL\.PF",
    "mbarrier.init": r"SYNCS\.EXCH\.64",
    "mbarrier.arrive(.expect_tx)": r"SYNCS\.ARRIVE\.TRANS64",
    "mbarrier.try_wait.parity": r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT",
}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MICROSCALE_CACHE_DIR", str(tmp_path_factory.mktemp("nvrtc-cache")))
    T.compiled.cache_clear()
    compiled = T.compiled()
    yield compiled, nvrtc.disassemble(compiled.cubin), nvrtc.resource_usage(compiled.cubin)
    T.compiled.cache_clear()
    mp.undo()


def test_every_variant_compiles_with_nvrtc(build):
    compiled, sass, _ = build
    assert not compiled.from_cache
    assert compiled.arch == "sm_100a"
    for v in T.VARIANTS.values():
        assert compiled.symbols[v.name_expression] in sass, v


@pytest.mark.parametrize("variant", list(T.VARIANTS.values()), ids=lambda v: f"{v.fmt}-cta{v.cta_group}")
def test_sass_holds_the_block_scaled_pipeline(build, variant):
    compiled, sass, _ = build
    code = sass[compiled.symbols[variant.name_expression]]
    mnemonics = set(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]+)", code, re.M))
    mma = {m for m in mnemonics if m.startswith(("UTCOMMA", "UTCQMMA", "UTCHMMA", "UTCIMMA"))}
    assert mma and all(re.fullmatch(MMA_SASS[variant.fmt], m) for m in mma), mma
    for what, pattern in COMMON_SASS.items():
        assert any(re.match(pattern, m) for m in mnemonics), f"{what} ({pattern}) missing in {variant}"
    two_cta = {m for m in mnemonics if ".2CTA" in m}
    if variant.cta_group == 2:
        assert any(m.startswith("UTCBAR.2CTA.MULTICAST") for m in mnemonics)  # commit to both CTAs
        assert {"UTMALDG.2D.2CTA", "UTMALDG.3D.2CTA"} <= mnemonics  # TMA signals the leader's barrier
        assert all(m.startswith(("UTC", "UTMALDG")) for m in two_cta)
    else:
        assert not two_cta


def test_registers_shared_memory_and_no_spills(build):
    compiled, _, usage = build
    ptxas = nvrtc.ptxas_resources(compiled.ptxas_log)
    rows = []
    for v in T.VARIANTS.values():
        sym = compiled.symbols[v.name_expression]
        res, log = usage[sym], ptxas[sym]
        assert log["spill_stores"] == 0 and log["spill_loads"] == 0, (v, log)
        assert res["LOCAL"] == 0 and res["STACK"] == 0, (v, res)
        assert res["REG"] == log["registers"] <= 255
        assert v.smem_bytes + res["SHARED"] <= T.SMEM_LIMIT  # dynamic + static (the 1 KB ptxas reserves)
        assert v.tmem.used_columns <= v.tmem.alloc_columns <= 512
        rows.append(f"{v.fmt:6} cta_group={v.cta_group} stages={v.stages} regs={res['REG']:3} "
                    f"dyn_smem={v.smem_bytes} static_smem={res['SHARED']} tmem={v.tmem.used_columns}/"
                    f"{v.tmem.alloc_columns} spills={log['spill_stores']}+{log['spill_loads']}")
    print("\n" + "\n".join(rows))


TINY = 'extern "C" __global__ void tiny(int* p) { p[threadIdx.x] = threadIdx.x; }\n'


def test_disk_cache_hits_without_nvrtc_and_publishes_whole_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    first = nvrtc.compile_kernels(["tiny"], source=TINY)
    assert not first.from_cache

    def no_compile(*args):
        raise AssertionError("NVRTC ran although the cubin is cached")

    monkeypatch.setattr(nvrtc, "_nvrtc_compile", no_compile)
    again = nvrtc.compile_kernels(["tiny"], source=TINY)
    assert again.from_cache and again.cubin == first.cubin and again.symbols == first.symbols
    files = sorted(p.name for p in (tmp_path / "nvrtc").iterdir())
    assert len(files) == 2 and not any(f.endswith(".tmp") for f in files)
    # A different source, architecture or NVRTC version is a different key (a miss -> compile).
    with pytest.raises(AssertionError, match="NVRTC ran"):
        nvrtc.compile_kernels(["tiny"], source=TINY + "// changed\n")
    with pytest.raises(AssertionError, match="NVRTC ran"):
        nvrtc.compile_kernels(["tiny"], source=TINY, arch="sm_90a")
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (99, 0))
    with pytest.raises(AssertionError, match="NVRTC ran"):
        nvrtc.compile_kernels(["tiny"], source=TINY)


def test_compile_errors_name_the_source_and_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSCALE_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"broken.cuh for sm_100a"):
        nvrtc.compile_kernels(["broken"], source='extern "C" __global__ void broken() { undeclared(); }',
                              label="broken.cuh")


def test_launch_arguments_follow_the_kernel_signature():
    """Names, order and types of T.KERNEL_PARAMS against the C++ declaration (a swap would go unseen
    until a B200 run otherwise)."""
    src = T.SOURCE_PATH.read_text()
    start = src.index("tcgen05_block_scaled_gemm(") + len("tcgen05_block_scaled_gemm(")
    decl = re.sub(r"//[^\n]*", "", src[start:src.index(") {", start)])
    params = []
    for p in decl.split(","):
        name = re.findall(r"\w+", p)[-1]
        kind = "tmap" if "TensorMap" in p else "ptr" if "*" in p else re.findall(r"\b(int|u32|u64)\b", p)[0]
        params.append((name, kind))
    assert tuple(params) == T.KERNEL_PARAMS
    v = T.VARIANTS[("mxfp4", 2)]
    maps = {f"tmap_{o}": bytes(range(i, i + 128)) for i, o in enumerate(("a", "b", "sfa", "sfb"))}
    args = T.kernel_args(**maps, out=32, bias=0, alpha=0, M=3, N=5, k_stages=2, ldo=8, **T.variant_args(v))
    sizes = [len(a) if isinstance(a, bytes) else 8 if isinstance(a, int) else a.nbytes for a in args]
    assert sizes == [{"tmap": 128, "ptr": 8, "int": 4, "u32": 4, "u64": 8}[k] for _, k in T.KERNEL_PARAMS]
    assert args[:4] == tuple(maps.values())
    with pytest.raises(TypeError, match="do not match"):
        T.kernel_args(tmap_a=bytes(128))


@pytest.mark.parametrize("cluster,programmatic", [(1, False), (2, False), (1, True), (4, True)])
def test_launch_config_carries_the_cluster_and_programmatic_launch_attributes(cluster, programmatic):
    from cuda.bindings import driver
    ids = driver.CUlaunchAttributeID
    config = nvrtc._launch_config(8 * cluster, cluster, 128, 1024, 0, programmatic)
    assert (config.gridDimX, config.blockDimX, config.sharedMemBytes) == (8 * cluster, 128, 1024)
    attrs = {a.id: a.value for a in config.attrs[:config.numAttrs]} if config.numAttrs else {}
    assert set(attrs) == ({ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION} if cluster > 1 else set()) | (
        {ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION} if programmatic else set())
    if cluster > 1:
        dim = attrs[ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION].clusterDim
        assert (dim.x, dim.y, dim.z) == (cluster, 1, 1)
    if programmatic:
        assert attrs[ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION].programmaticStreamSerializationAllowed == 1


def test_decode_kernels_launch_programmatically_as_inductor_does_unless_told(monkeypatch):
    """MICROSCALE_PDL=1/0 forces it; otherwise the decode kernels are programmatic dependent launches exactly
    when Inductor's kernels are (torch._inductor.config.triton.enable_pdl), and only from sm_90."""
    import torch._inductor.config as inductor
    from microscale.kernels.sm90 import launch
    cc = [(9, 0)]
    monkeypatch.setattr(launch.torch.cuda, "get_device_capability", lambda device: cc[0])
    for env, inductor_pdl, want in [(None, False, False), (None, True, True), ("0", True, False),
                                    ("1", False, True), ("", True, True)]:
        if env is None:
            monkeypatch.delenv(launch.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.PDL_ENV, env)
        with inductor.patch({"triton.enable_pdl": inductor_pdl}):  # (monkeypatch's undo would delete the entry)
            assert launch.programmatic_launch(None) is want, (env, inductor_pdl)
    cc[0] = (8, 9)
    assert launch.programmatic_launch(None) is False
    monkeypatch.setenv(launch.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="MICROSCALE_PDL='yes'"):
        launch.programmatic_launch(None)


@pytest.mark.parametrize("before", [None, "0", "1", ""])
def test_programmatic_launches_switches_inside_and_restores_after(before, monkeypatch):
    """programmatic_launches(on) forces the launches inside the block and leaves MICROSCALE_PDL as it found it,
    unset included, also when the block raises."""
    import os
    from microscale.kernels.sm90 import launch
    monkeypatch.setattr(launch.torch.cuda, "get_device_capability", lambda device: (9, 0))
    if before is None:
        monkeypatch.delenv(launch.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.PDL_ENV, before)
    for on in (True, False):
        with launch.programmatic_launches(on):
            assert launch.programmatic_launch(None) is on
        assert os.environ.get(launch.PDL_ENV) == before
    with pytest.raises(RuntimeError, match="inside"):
        with launch.programmatic_launches(True):
            raise RuntimeError("inside")
    assert os.environ.get(launch.PDL_ENV) == before


def test_pack_params_lays_out_each_argument_by_value():
    """cuLaunchKernelEx reads parameter i from pointer i: a tensor map's 128 bytes, a pointer as 8 bytes,
    numpy scalars at their own width."""
    import ctypes
    import numpy as np
    tmap = bytes(range(7, 135))
    buffers, pointers = nvrtc.pack_params((tmap, 0x1122334455667788, np.int32(-3), np.uint64(2**63 + 5)))
    got = [ctypes.string_at(pointers[i], n) for i, n in enumerate((128, 8, 4, 8))]
    assert got == [tmap, (0x1122334455667788).to_bytes(8, "little"), (-3).to_bytes(4, "little", signed=True),
                   (2**63 + 5).to_bytes(8, "little")]
    for bad in (1.5, True, [1], None):
        with pytest.raises(TypeError, match="kernel argument 1"):
            nvrtc.pack_params((tmap, bad))
