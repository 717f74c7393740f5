"""Run-time compilation and launch of the hand-written CUDA kernels (sm100/tcgen05_gemm.cuh,
sm90/wgmma_ws.cuh) through cuda-python.

- `compile_kernels`: NVRTC via cuda.core `Program` (no GPU needed), cubins cached on disk under a
  key of source hash + options + name expressions + NVRTC version, published atomically (rename).
- `TensorMapSpec` / `encode_tensor_map`: what cuTensorMapEncodeTiled (cuda.bindings.driver) gets,
  kept as data so tests can compare it with what the kernel expects; encoding needs a driver.
- `load_kernel` / `launch`: cuda.core module loading; cuLaunchKernelEx cluster launches on torch's stream,
  tensor maps passed by value (`pack_params`).
- `disassemble` / `resource_usage`: Triton's cuobjdump on a cubin (SASS and per-kernel resources).

Written against cuda-core 1.2 / cuda-bindings 13.4 and tolerant of older cuda.core (0.2-0.4):
ObjectCode.code/_module, symbol_mapping/_sym_map, Kernel.handle as CUkernel or CUfunction.
"""

import ctypes
import hashlib
import io
import json
import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

COMMON_PATH = Path(__file__).with_name("ptx_common.cuh")  # compiled in front of every kernel source
DEFAULT_ARCH = "sm_100a"
COMPILE_OPTIONS = {"std": "c++17", "ptxas_options": "-v"}  # -v: registers and spills into the log


def cache_dir() -> Path:
    """$MICROSCALE_CACHE_DIR/nvrtc, else ~/.cache/microscale/nvrtc."""
    root = os.environ.get("MICROSCALE_CACHE_DIR") or Path.home() / ".cache" / "microscale"
    return Path(root) / "nvrtc"


def nvrtc_version() -> tuple:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return major, minor


@dataclass(frozen=True)
class CompiledKernels:
    """A cubin and the mangled name of each requested name expression."""

    cubin: bytes
    symbols: dict  # name expression -> mangled symbol (str)
    arch: str
    ptxas_log: str
    from_cache: bool


def _cache_key(source: str, arch: str, names: tuple) -> str:
    h = hashlib.sha256()
    for part in (source, arch, json.dumps(COMPILE_OPTIONS, sort_keys=True), "\n".join(names),
                 "nvrtc %d.%d" % nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a torn write
    except BaseException:
        os.unlink(tmp)
        raise


def _nvrtc_compile(source: str, arch: str, names: tuple, label: str) -> tuple:
    from cuda.core import Program, ProgramOptions

    program = Program(source, "c++", options=ProgramOptions(arch=arch, **COMPILE_OPTIONS))
    log = io.StringIO()
    try:
        obj = program.compile("cubin", name_expressions=names, logs=log)
    except Exception as e:
        raise RuntimeError(f"NVRTC failed to compile {label} for {arch}: {e}\n{log.getvalue()}") from e
    cubin = obj.code if hasattr(obj, "code") else obj._module
    mapping = getattr(obj, "symbol_mapping", None) or getattr(obj, "_sym_map", {})
    symbols = {n: (s.decode() if isinstance(s, bytes) else s) for n, s in mapping.items()}
    return bytes(cubin), symbols, log.getvalue().replace("\x00", "")


def compile_kernels(names, *, source: str, label: str = "kernel source",
                    arch: str = DEFAULT_ARCH) -> CompiledKernels:
    """Compile the template instantiations `names` (C++ name expressions) of `source`, after
    ptx_common.cuh (`label` names the source in errors)."""
    source = COMMON_PATH.read_text() + "\n" + source
    names = tuple(names)
    key = _cache_key(source, arch, names)
    directory = cache_dir()
    cubin_path, meta_path = directory / f"{key}.cubin", directory / f"{key}.json"
    if cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return CompiledKernels(cubin_path.read_bytes(), meta["symbols"], arch, meta["ptxas_log"], True)
    cubin, symbols, log = _nvrtc_compile(source, arch, names, label)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(cubin_path, cubin)
    _atomic_write(meta_path, json.dumps({"symbols": symbols, "ptxas_log": log, "arch": arch}).encode())
    return CompiledKernels(cubin, symbols, arch, log, False)


def ptxas_resources(log: str) -> dict:
    """Per mangled kernel: registers, stack bytes, spill stores/loads, from a `ptxas -v` log."""
    out, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
    return out


# ---- disassembly (CPU) -----------------------------------------------------------------------------


def cuobjdump_path() -> Path:
    """The cuobjdump Triton's wheel carries (the CUDA install here has none)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"cuobjdump not found at {path}")
    return path


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump_path()), flag, f.name], check=True, capture_output=True,
                              text=True).stdout


def disassemble(cubin: bytes) -> dict:
    """SASS per mangled kernel name."""
    text = _cuobjdump(cubin, "-sass")
    parts = re.split(r"\n\s*Function : (\S+)\n", text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def sass_opcodes(sass: str) -> list:
    """The opcode of each instruction of cuobjdump SASS text, in program order (predicates dropped)."""
    return re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)


def resource_usage(cubin: bytes) -> dict:
    """cuobjdump -res-usage per mangled kernel: REG, STACK, SHARED, LOCAL, ... as ints."""
    out, current = {}, None
    for line in _cuobjdump(cubin, "-res-usage").splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = out.setdefault(m.group(1), {})
        elif current is not None:
            current.update({k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)})
    return out


# ---- tensor maps -----------------------------------------------------------------------------------


L2_PROMOTIONS = {"none": "CU_TENSOR_MAP_L2_PROMOTION_NONE", "64B": "CU_TENSOR_MAP_L2_PROMOTION_L2_64B",
                 "128B": "CU_TENSOR_MAP_L2_PROMOTION_L2_128B", "256B": "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"}
DEFAULT_L2_PROMOTION = "256B"


@dataclass(frozen=True)
class TensorMapSpec:
    """Arguments of cuTensorMapEncodeTiled for a uint8 tensor, dimensions innermost first.

    global_strides are in bytes for dimensions 1.. (dimension 0 is contiguous); a box is copied to
    shared memory densely in dimension order; swizzle is "128B" or "none"; out-of-bounds elements
    read as zero (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE); l2_promotion is the size the L2 rounds the copy's
    misses up to ("none", "64B", "128B" or "256B").
    """

    address: int
    global_dims: tuple
    global_strides: tuple
    box_dims: tuple
    swizzle: str
    l2_promotion: str = DEFAULT_L2_PROMOTION

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    @property
    def box_bytes(self) -> int:
        n = 1
        for d in self.box_dims:
            n *= d
        return n

    def validate(self) -> None:
        """The driver's rules that matter here, checked with names and values in the message."""
        problems = []
        if self.address % 16:
            problems.append(f"address {self.address:#x} not 16-byte aligned")
        if any(s % 16 for s in self.global_strides):
            problems.append(f"global strides {self.global_strides} not multiples of 16 bytes")
        if any(not 1 <= b <= 256 for b in self.box_dims):
            problems.append(f"box {self.box_dims} has a dimension outside 1..256")
        if self.swizzle == "128B" and self.box_dims[0] > 128:
            problems.append(f"128B swizzle needs an inner box of at most 128 bytes, got {self.box_dims[0]}")
        if self.box_dims[0] % 16:
            problems.append(f"inner box {self.box_dims[0]} bytes is not a multiple of 16")
        if self.l2_promotion not in L2_PROMOTIONS:
            problems.append(f"l2_promotion {self.l2_promotion!r} is none of {tuple(L2_PROMOTIONS)}")
        if problems:
            raise ValueError(f"tensor map {self}: " + "; ".join(problems))


def _tensor_map_bytes(tmap) -> bytes:
    opaque = getattr(tmap, "opaque", None)
    if opaque is not None:
        return struct.pack("<16Q", *[int(v) for v in opaque])
    return ctypes.string_at(tmap.getPtr(), 128)


@lru_cache(maxsize=1024)
def encode_tensor_map(spec: TensorMapSpec) -> bytes:
    """cuTensorMapEncodeTiled -> the 128-byte CUtensorMap (needs a CUDA driver, not a GPU context). A map
    depends on its spec alone (the address included), so a weight's is encoded once."""
    from cuda.bindings import driver

    spec.validate()
    swizzle = {"128B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
               "none": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}[spec.swizzle]
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, spec.rank, spec.address,
        [u64(d) for d in spec.global_dims], [u64(s) for s in spec.global_strides],
        [u32(b) for b in spec.box_dims], [u32(1)] * spec.rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        getattr(driver.CUtensorMapL2promotion, L2_PROMOTIONS[spec.l2_promotion]),
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(err) != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for {spec}")
    return _tensor_map_bytes(tmap)


# ---- loading and launching (GPU) ------------------------------------------------------------------


def load_kernel(compiled: CompiledKernels, name: str, device_index: int):
    """cuda.core Kernel for name expression `name`, loaded on device `device_index`."""
    from cuda.core import Device, ObjectCode

    Device(device_index).set_current()
    mapping = {n: s.encode() for n, s in compiled.symbols.items()}  # cuLibraryGetKernel takes bytes
    if hasattr(ObjectCode, "from_cubin"):
        obj = ObjectCode.from_cubin(compiled.cubin, symbol_mapping=mapping)
    else:  # cuda.core <= 0.2
        obj = ObjectCode(compiled.cubin, "cubin", symbol_mapping=mapping)
    return obj.get_kernel(name)


def set_max_dynamic_smem(kernel, nbytes: int, device_index: int) -> None:
    """Opt the kernel into more than 48 KB of dynamic shared memory."""
    from cuda.bindings import driver

    handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, driver.CUdevice(device_index))
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if int(err) != 0:
        raise RuntimeError(f"setting {nbytes} bytes of dynamic shared memory failed: {err}")


_SMEM_SET: dict = {}  # (id(kernel), device) -> (kernel, the most dynamic shared memory the driver allows it)


def _allow_smem(kernel, nbytes: int, device_index: int) -> None:
    """set_max_dynamic_smem once per kernel and larger size (a launch may ask for less than allowed)."""
    key = (id(kernel), device_index)
    if _SMEM_SET.get(key, (None, -1))[1] < nbytes:
        set_max_dynamic_smem(kernel, nbytes, device_index)
        _SMEM_SET[key] = (kernel, nbytes)  # the kernel kept alive: its id stays its own


def _function(kernel, device_index: int):
    """The CUfunction of a cuda.core Kernel in the current context (its handle is a CUkernel in cuda.core
    >= 0.2, a CUfunction before)."""
    from cuda.bindings import driver

    handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
    if isinstance(handle, driver.CUkernel):
        err, handle = driver.cuKernelGetFunction(handle)
        if int(err) != 0:
            raise RuntimeError(f"cuKernelGetFunction failed ({err}) on device {device_index}")
    return handle


@lru_cache(maxsize=256)
def _launch_config(grid: int, cluster: int, block: int, smem_bytes: int, stream_handle: int,
                   programmatic: bool = False):
    """A CUlaunchConfig of `grid` CTAs in clusters of `cluster` (1: no cluster attribute); programmatic: a
    programmatic dependent launch (the kernel may start before the one before it in the stream ends, and
    orders itself after it with griddepcontrol.wait)."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = smem_bytes
    config.hStream = driver.CUstream(stream_handle)
    attrs = []
    if cluster > 1:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    if programmatic:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if attrs:
        config.attrs = attrs
        config.numAttrs = len(attrs)
    return config


_U64 = struct.Struct("<Q")


def pack_params(args) -> tuple:
    """(buffer, void* array) for cuLaunchKernelEx: each argument's bytes as the kernel takes it by value.
    Python ints are 64-bit pointers, numpy scalars their own type, bytes a struct passed by value (the
    128-byte tensor maps, `const __grid_constant__ TensorMap` in the source: graph capture copies them into
    the launch node, so nothing the kernel reads lives in memory the host must keep written)."""
    parts = []
    for i, a in enumerate(args):
        if isinstance(a, bool) or not isinstance(a, (int, bytes, np.generic)):
            raise TypeError(f"kernel argument {i}: {type(a).__name__} is not a pointer (int), a numpy scalar "
                            f"or a by-value struct (bytes)")
        parts.append(a if isinstance(a, bytes) else a.tobytes() if isinstance(a, np.generic) else _U64.pack(a))
    # one buffer for all of them (the driver copies each parameter's bytes, whatever their alignment here):
    # a buffer per argument took 17 us per launch of decode_ws's 11 arguments, this 7 (timeit, CPU machine)
    buffer = ctypes.create_string_buffer(b"".join(parts))
    base, offset, addresses = ctypes.addressof(buffer), 0, []
    for part in parts:
        addresses.append(base + offset)
        offset += len(part)
    return buffer, (ctypes.c_void_p * len(parts))(*addresses)


def max_active_clusters(kernel, *, cluster: int, block: int, smem_bytes: int, device_index: int,
                        stream_handle: int) -> int:
    """Clusters of `cluster` CTAs of `kernel` that the device holds at once, from the driver's occupancy
    calculator (shared memory, registers, and how the SMs group into GPCs: on the H200, fewer 4-CTA
    clusters of one CTA per SM fit than 132 / 4)."""
    from cuda.bindings import driver
    from cuda.core import Device

    Device(device_index).set_current()
    _allow_smem(kernel, smem_bytes, device_index)
    config = _launch_config(cluster, cluster, block, smem_bytes, stream_handle)
    err, clusters = driver.cuOccupancyMaxActiveClusters(_function(kernel, device_index), config)
    if int(err) != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed ({err}) for clusters of {cluster} CTAs of "
                           f"{block} threads and {smem_bytes} bytes of shared memory")
    return int(clusters)


def launch(kernel, *, clusters: int, cluster: int, block: int, smem_bytes: int, device_index: int,
           stream_handle: int, args, programmatic: bool = False) -> None:
    """Launch `clusters` clusters of `cluster` CTAs (cluster 1: plain CTAs) on a CUstream handle, args as
    pack_params takes them; programmatic: a programmatic dependent launch (_launch_config). What does not
    change between calls (the shared-memory attribute, the launch config) is made once: at decode sizes the
    host time of a launch shows."""
    from cuda.bindings import driver
    from cuda.core import Device

    Device(device_index).set_current()
    _allow_smem(kernel, smem_bytes, device_index)
    config = _launch_config(clusters * cluster, cluster, block, smem_bytes, stream_handle, programmatic)
    buffer, pointers = pack_params(args)  # buffer: alive until the launch has read it
    (err,) = driver.cuLaunchKernelEx(config, _function(kernel, device_index), ctypes.addressof(pointers), 0)
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed ({err}): {clusters} clusters of {cluster} CTAs of {block} "
                           f"threads, {smem_bytes} bytes of shared memory")
