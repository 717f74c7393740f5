"""Host side of the warp-specialized dequantize + wgmma GEMM (wgmma_ws.cuh), for large M on sm_90a.

The kernel is CUDA C++ compiled at run time by NVRTC (kernels/nvrtc.py: cubins cached on disk)
because it needs what Triton's Gluon did not give the kernel of wgmma.py: a producer warp feeding a
shared-memory ring by TMA while two warpgroups decode and keep their wgmmas in flight. The source is
completed here: the decode routines come from decode.py (one PTX text for every kernel) and the
wgmma wrappers, whose 64-128 accumulator operands are tedious to write by hand, are generated.

Tensor maps (128 bytes each, in global memory) are cached per address, shape and box: the weights' are
made once per weight, x's once per activation buffer (_device_maps says how CUDA graphs are served).
"""

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import nvrtc
from . import decode
from .launch import sm_count, split_tickets, split_workspace
from .layout import K_STEP, padded_shape

SOURCE_PATH = Path(__file__).with_name("wgmma_ws.cuh")
ARCH = "sm_90a"
ROWS = 128  # weight rows per CTA
THREADS = 288
SMEM_LIMIT = 227 * 1024


def step_bytes(fmt_code: int) -> tuple:
    """(word bytes, scale bytes) of one row group (16 rows) and K step in the Hopper layout (layout.py):
    the unit of the kernel's weight boxes and ring stages."""
    return (1024 if fmt_code == 2 else 512), (64 if fmt_code == 0 else 32)


@dataclass(frozen=True)
class WsConfig:
    block_m: int = 256  # activation rows per CTA: the wgmma's N (64, 128 or 256)
    stages: int = 4  # ring depth (NVFP4 at M = 2048-4096 on the H200: 4 stages 2-4% faster than 5, 3 slower)
    # CTAs (consecutive row tiles) sharing one load of their activation rows by TMA multicast; alone, 0-17% faster
    # on 34 of 36 format x shape x M cases at M = 512-2048 than pairs (session 11, sweep runs 11c-11d)
    cluster: int = 1
    group_m: int = 0  # m tiles per group of the tile order; 0 = about 16 MB of x (default_group_m)
    split: int = 0  # K splits; 0 = split_for(tiles): enough for about one CTA per SM when tiles are few

    def compiled(self) -> "WsConfig":
        """The config as the kernel is compiled: split and group_m are launch arguments."""
        return replace(self, split=0, group_m=0)

    def smem_bytes(self, fmt_code: int) -> int:
        """Smem<FMT, BM, STAGES>::BYTES of the kernel source: the ring, four A tiles, barriers, alignment slack."""
        data, scale = step_bytes(fmt_code)
        stage = self.block_m * 128 + 8 * data + 8 * scale
        nbytes = self.stages * stage + 4 * 64 * 128 + 16 * self.stages + 1024
        if nbytes > SMEM_LIMIT:
            raise ValueError(f"wgmma_ws: {self} needs {nbytes} bytes of shared memory, more than {SMEM_LIMIT}")
        return nbytes


def _wgmma_wrapper(n: int) -> str:
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(acc[{i}])' for i in range(regs))
    ptx = (f"{{\\n .reg .pred p;\\n setp.ne.b32 p, %{regs + 2}, 0;\\n wgmma.mma_async.sync.aligned.m64n{n}k16"
           f".f32.bf16.bf16 {{{outs}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}")
    return (f"template <> __device__ __forceinline__ void wgmma_bf16<{n}>(float (&acc)[{regs}], u64 a, u64 b,\n"
            f"                                                            u32 accumulate) {{\n"
            f'  asm volatile("{ptx}"\n      : {operands}\n      : "l"(a), "l"(b), "r"(accumulate));\n}}\n')


def _decode_function(name: str, fmt_code: int) -> str:
    outs = 2 if fmt_code == 2 else 4
    operands = {f"o{i}": f"%{i}" for i in range(outs)} | {"w": f"%{outs}", "s": f"%{outs + 1}"}
    ptx = json.dumps(decode.decode_ptx(fmt_code, operands))  # a valid C string literal
    results = ", ".join(f'"=r"(r[{i}])' for i in range(outs))
    return (f"__device__ __forceinline__ void {name}(u32 w, u32 s, u32 (&r)[{outs}]) {{\n"
            f"  asm({ptx}\n      : {results} : \"r\"(w), \"r\"(s));\n}}\n")


def source() -> str:
    generated = ["template <int N>\n"
                 "__device__ __forceinline__ void wgmma_bf16(float (&acc)[N / 2], u64 a, u64 b, u32 accumulate);"]
    generated += [_wgmma_wrapper(n) for n in (64, 128, 256)]
    generated += [_decode_function(name, code) for name, code in
                  (("decode_nvfp4", 0), ("decode_mxfp4", 1), ("decode_fp8", 2))]
    return SOURCE_PATH.read_text().replace("// @GENERATED@", "\n".join(generated))


def name_expression(fmt_code: int, cfg: WsConfig) -> str:
    return f"ms90::wgmma_ws_gemm<{fmt_code}, {cfg.block_m}, {cfg.stages}, {cfg.cluster}>"


@lru_cache(maxsize=None)
def _compiled(variants: tuple) -> nvrtc.CompiledKernels:
    """The kernels of (fmt_code, WsConfig) variants. The launch asks for WsConfig.smem_bytes of shared
    memory, which mirrors the source's Smem<>::BYTES: a static_assert per variant keeps them equal."""
    checks = [f"static_assert(ms90::Smem<{f}, {c.block_m}, {c.stages}>::BYTES == {c.smem_bytes(f)}, "
              f"\"WsConfig.smem_bytes differs from Smem<{f}, {c.block_m}, {c.stages}>::BYTES\");" for f, c in variants]
    return nvrtc.compile_kernels(tuple(name_expression(f, c) for f, c in variants),
                                 source=source() + "\n" + "\n".join(checks) + "\n", label=SOURCE_PATH.name, arch=ARCH)


def compile_all(fmts=(0, 1, 2), configs=(WsConfig(),)) -> nvrtc.CompiledKernels:
    return _compiled(tuple((f, c) for f in fmts for c in configs))


@lru_cache(maxsize=None)
def _kernel(fmt_code: int, cfg: WsConfig, device_index: int):
    return nvrtc.load_kernel(_compiled(((fmt_code, cfg),)), name_expression(fmt_code, cfg), device_index)


# Tensor maps in device memory, (specs, device index) -> (pinned host bytes, device copy). Only maps
# made outside graph capture are cached (one made inside is written when the graph replays, so an
# eager call could read it unwritten); every map a captured graph reads is kept for good.
_X_MAPS: OrderedDict = OrderedDict()  # activations: the most recent _X_MAPS_KEPT
_X_MAPS_KEPT = 64
_W_MAPS: dict = {}  # weights: while the weight lives
_GRAPH_MAPS: list = []


def x_map_spec(x: torch.Tensor, box_rows: int) -> nvrtc.TensorMapSpec:
    """x [M, K] bf16 as (K * 2 bytes, M rows), boxes of one K step (128 bytes) by box_rows rows (a CTA's
    share of the cluster's activation rows), 128B swizzle (the wgmma's K-major layout); rows past M and
    columns past K read as zeros."""
    return nvrtc.TensorMapSpec(address=x.data_ptr(), global_dims=(x.shape[1] * 2, x.shape[0]),
                               global_strides=(x.stride(0) * 2,), box_dims=(128, box_rows), swizzle="128B")


def _to_device(maps: bytes, device) -> tuple:
    """(pinned host copy, device copy): from pinned memory the copy is capturable (a graph node)."""
    host = torch.frombuffer(bytearray(maps), dtype=torch.uint8).pin_memory()
    return host, host.to(device, non_blocking=True)


def _device_maps(specs: tuple, device, owner: torch.Tensor = None) -> torch.Tensor:
    """The encoded tensor maps, back to back in device memory. A map depends only on its spec (address,
    shape, box), so the same buffers reuse it; `owner` (a weight) bounds the entry's life, without
    one (activations) the least recently used entries go."""
    key = (specs, device.index)
    cache = _X_MAPS if owner is None else _W_MAPS
    capturing = torch.cuda.is_current_stream_capturing()
    entry = cache.get(key)
    if entry is None:
        entry = _to_device(b"".join(nvrtc.encode_tensor_map(s) for s in specs), device)
        if not capturing:
            cache[key] = entry
            if owner is not None:
                weakref.finalize(owner, _W_MAPS.pop, key, None)
            elif len(_X_MAPS) > _X_MAPS_KEPT:
                _X_MAPS.popitem(last=False)
    elif owner is None:
        _X_MAPS.move_to_end(key)
    if capturing:
        _GRAPH_MAPS.append(entry)
    return entry[1]


def weight_map_specs(data: torch.Tensor, scale: torch.Tensor, fmt_code: int) -> tuple:
    """The words [N/16, K/64 x DATA bytes] as (256 bytes, DATA / 256, K steps, row groups) and the scales
    [N/16, K/64 x SCALE bytes] as (SCALE bytes, K steps, row groups), boxes of one K step of 8 row groups
    (a CTA's 128 rows): one copy each per step, landing in the order the consumers read."""
    data_bytes, scale_bytes = step_bytes(fmt_code)
    groups, kt = data.shape[0], data.shape[1] // data_bytes
    words = nvrtc.TensorMapSpec(address=data.data_ptr(), global_dims=(256, data_bytes // 256, kt, groups),
                                global_strides=(256, data_bytes, kt * data_bytes),
                                box_dims=(256, data_bytes // 256, 1, 8), swizzle="none")
    scales = nvrtc.TensorMapSpec(address=scale.data_ptr(), global_dims=(scale_bytes, kt, groups),
                                 global_strides=(scale_bytes, kt * scale_bytes), box_dims=(scale_bytes, 1, 8),
                                 swizzle="none")
    return words, scales


def default_group_m(block_m: int, kp: int) -> int:
    """m tiles per group of the kernel's tile order: about 16 MB of x (a third of the H200's L2)."""
    return max(1, (16 << 20) // (block_m * kp * 2))


MIN_SPLIT_STEPS = 8  # K steps of 64 per part at least: shorter parts spend their time filling the ring


def split_for(tiles: int, kt: int, sms: int) -> int:
    """K splits so that `tiles` output tiles make about one CTA per SM (one CTA fits on an SM), never more
    than one wave and never fewer than MIN_SPLIT_STEPS K steps per part."""
    split = max(1, min(sms // tiles, kt // MIN_SPLIT_STEPS))
    return split


def supports(x: torch.Tensor) -> bool:
    """bf16 x that TMA can read (16-byte-aligned base and row stride), and cuda-python to launch with."""
    aligned = x.data_ptr() % 16 == 0 and (x.stride(0) * 2) % 16 == 0
    if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and aligned):
        return False
    return _have_cuda_python()


@lru_cache(maxsize=None)
def _have_cuda_python() -> bool:
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        return False
    return True


def wgmma_ws_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: WsConfig = None, out=None,
                  workspace=None):
    """y = x @ W^T (+ bias) for bf16 x [M, K] and prepared weights (layout.shuffle_weights).
    out / workspace: preallocated y [M, N] and fp32 split-K buffer (tests poison them)."""
    if not supports(x):
        raise ValueError(f"wgmma_ws: x must be bf16 with unit column stride and 16-byte-aligned rows (and "
                         f"cuda-python installed), got {x.dtype} of shape {tuple(x.shape)}, strides {x.stride()}")
    cfg = cfg or WsConfig()
    m = x.shape[0]
    np_, kp = padded_shape(n, k)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device) if out is None else out
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    m_tiles, n_tiles = -(-m // cfg.block_m), np_ // ROWS
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kt = kp // K_STEP
    split = cfg.split or split_for(m_tiles * n_tiles, kt, sm_count(device))
    steps = -(-kt // split)
    split = -(-kt // steps)  # no empty parts
    tile_elems = ROWS * cfg.block_m
    ws = split_workspace(workspace, m_tiles * n_tiles, split, tile_elems, x.device)
    tickets = split_tickets(x.device, m_tiles * n_tiles)
    tmap = _device_maps((x_map_spec(x, cfg.block_m // cfg.cluster),), x.device)
    wmaps = _device_maps(weight_map_specs(data, scale, fmt_code), x.device, owner=data)
    args = (tmap.data_ptr(), wmaps.data_ptr(), row_mult.data_ptr(),
            0 if bias is None else bias.data_ptr(), y.data_ptr(), ws.data_ptr(), tickets.data_ptr(),
            np.int32(m), np.int32(n), np.int32(kt), np.int32(y.stride(0)), np.int32(m_tiles),
            np.int32(n_tiles), np.int32(cfg.group_m or default_group_m(cfg.block_m, kp)), np.int32(split),
            np.int32(steps))
    clusters = split * m_tiles * -(-n_tiles // cfg.cluster)
    nvrtc.launch(_kernel(fmt_code, cfg.compiled(), device), clusters=clusters, cluster=cfg.cluster,
                 block=THREADS, smem_bytes=cfg.smem_bytes(fmt_code), device_index=device,
                 stream_handle=torch.cuda.current_stream(x.device).cuda_stream, args=args)
    return y
