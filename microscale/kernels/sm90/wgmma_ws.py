"""Host side of the warp-specialized dequantize + wgmma GEMM (wgmma_ws.cuh), for large M on sm_90a.

The kernel is CUDA C++ compiled at run time by NVRTC (kernels/nvrtc.py: cubins cached on disk)
because it needs what Triton's Gluon did not give the kernel of wgmma.py: a producer warp feeding a
shared-memory ring by TMA while two warpgroups decode and keep their wgmmas in flight. The source is
completed here: the decode routines come from decode.py (one PTX text for every kernel) and the
wgmma wrappers, whose 64-128 accumulator operands are tedious to write by hand, are generated.

Tensor maps (128 bytes each) are kernel parameters passed by value (nvrtc.pack_params): a captured
CUDA graph holds them in its launch nodes, and nvrtc.encode_tensor_map encodes a weight's once.
"""

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import nvrtc
from . import decode, layout
from .launch import device_index, sm_count
from .layout import K_STEP, RS_K_BITS, padded_shape

SOURCE_PATH = Path(__file__).with_name("wgmma_ws.cuh")
ARCH = "sm_90a"
ROWS = 128  # weight rows per CTA
THREADS = 288
SMEM_LIMIT = 227 * 1024


def step_bytes(fmt_code: int) -> tuple:
    """layout.step_bytes of a format code: the unit of the kernel's weight boxes and ring stages."""
    return layout.step_bytes(decode.FMT_NAME[fmt_code])


@dataclass(frozen=True)
class WsConfig:
    block_m: int = 256  # activation rows per CTA: the wgmma's N (16, 32, 64, 128 or 256)
    stages: int = 4  # ring depth (NVFP4 at M = 2048-4096 on the H200: 4 stages 2-4% faster than 5, 3 slower)
    group_m: int = 0  # m tiles per group of the tile order; 0 = about 16 MB of x (default_group_m)
    # K parts per output tile, the CTAs of one cluster (one of SPLITS); 0 = split_for: as many as fit in one
    # wave when the tiles are few
    split: int = 0
    # the wgmma's A from the decoded registers (x permuted by permute_k) instead of A tiles the consumers store
    # to shared memory and the wgmma reads back: no stores, proxy fence or warpgroup barrier per step, but a
    # warpgroup waits for its own wgmmas before it decodes the next step. Up to 128 rows: with 256 rows'
    # accumulators ptxas serializes the wgmmas (C7512; branch wgmma-ws-rs)
    rs: bool = False

    def __post_init__(self):
        if self.rs and self.block_m > 128:
            raise ValueError(f"wgmma_ws: rs takes block_m up to 128, got {self.block_m}")

    def smem_bytes(self, fmt_code: int) -> int:
        """Smem<FMT, BM, STAGES, RS>::BYTES of the kernel source: the ring, four A tiles (none with rs), barriers,
        alignment slack."""
        data, scale = step_bytes(fmt_code)
        stage = self.block_m * 128 + 8 * data + 8 * scale
        nbytes = self.stages * stage + (0 if self.rs else 4 * 64 * 128) + 16 * self.stages + 1024
        if nbytes > SMEM_LIMIT:
            raise ValueError(f"wgmma_ws: {self} needs {nbytes} bytes of shared memory, more than {SMEM_LIMIT}")
        return nbytes


def _wgmma_wrapper(n: int, rs: bool = False) -> str:
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(acc[{i}])' for i in range(regs))
    a_regs = 4 if rs else 1
    a = "{" + ", ".join(f"%{regs + i}" for i in range(4)) + "}" if rs else f"%{regs}"
    transpose = "0" if rs else "0, 0"
    ptx = (f"{{\\n .reg .pred p;\\n setp.ne.b32 p, %{regs + a_regs + 1}, 0;\\n wgmma.mma_async.sync.aligned."
           f"m64n{n}k16.f32.bf16.bf16 {{{outs}}}, {a}, %{regs + a_regs}, p, 1, 1, {transpose};\\n}}")
    a_param, a_args = ("const u32 (&a)[4]", ", ".join(f'"r"(a[{i}])' for i in range(4))) if rs else ("u64 a", '"l"(a)')
    name = "wgmma_bf16_rs" if rs else "wgmma_bf16"
    return (f"template <> __device__ __forceinline__ void {name}<{n}>(float (&acc)[{regs}], {a_param}, u64 b,\n"
            f"                                                            u32 accumulate) {{\n"
            f'  asm volatile("{ptx}"\n      : {operands}\n      : {a_args}, "l"(b), "r"(accumulate));\n}}\n')


def _decode_function(name: str, fmt_code: int) -> str:
    outs = 2 if fmt_code == 2 else 4
    operands = {f"o{i}": f"%{i}" for i in range(outs)} | {"w": f"%{outs}", "s": f"%{outs + 1}"}
    ptx = json.dumps(decode.decode_ptx(fmt_code, operands))  # a valid C string literal
    results = ", ".join(f'"=r"(r[{i}])' for i in range(outs))
    return (f"__device__ __forceinline__ void {name}(u32 w, u32 s, u32 (&r)[{outs}]) {{\n"
            f"  asm({ptx}\n      : {results} : \"r\"(w), \"r\"(s));\n}}\n")


def source() -> str:
    generated = ["template <int N>\n"
                 "__device__ __forceinline__ void wgmma_bf16(float (&acc)[N / 2], u64 a, u64 b, u32 accumulate);",
                 "template <int N>\n"
                 "__device__ __forceinline__ void wgmma_bf16_rs(float (&acc)[N / 2], const u32 (&a)[4], u64 b,"
                 " u32 accumulate);"]
    generated += [_wgmma_wrapper(n, rs) for rs in (False, True) for n in (16, 32, 64, 128, 256)]
    generated += [_decode_function(name, code) for name, code in
                  (("decode_nvfp4", 0), ("decode_mxfp4", 1), ("decode_fp8", 2))]
    return SOURCE_PATH.read_text().replace("// @GENERATED@", "\n".join(generated))


def name_expression(fmt_code: int, cfg: WsConfig) -> str:
    if cfg.split not in SPLITS:
        raise ValueError(f"wgmma_ws: a build needs a split of {SPLITS}, not {cfg.split} (0 is chosen at launch)")
    return f"ms90::wgmma_ws_gemm<{fmt_code}, {cfg.block_m}, {cfg.stages}, {cfg.split}, {str(cfg.rs).lower()}>"


@lru_cache(maxsize=None)
def _compiled(variants: tuple) -> nvrtc.CompiledKernels:
    """The kernels of (fmt_code, WsConfig) variants. The launch asks for WsConfig.smem_bytes of shared
    memory, which mirrors the source's Smem<>::BYTES: a static_assert per variant keeps them equal."""
    smem = [(f, c, f"ms90::Smem<{f}, {c.block_m}, {c.stages}, {str(c.rs).lower()}>") for f, c in variants]
    checks = [f"static_assert({t}::BYTES == {c.smem_bytes(f)}, \"WsConfig.smem_bytes differs from {t}::BYTES\");"
              for f, c, t in smem]
    return nvrtc.compile_kernels(tuple(name_expression(f, c) for f, c in variants),
                                 source=source() + "\n" + "\n".join(checks) + "\n", label=SOURCE_PATH.name, arch=ARCH)


def compile_all(fmts=(0, 1, 2), configs=(WsConfig(split=1),)) -> nvrtc.CompiledKernels:
    return _compiled(tuple((f, c) for f in fmts for c in configs))


@lru_cache(maxsize=None)
def _kernel(fmt_code: int, cfg: WsConfig, device_index: int):
    return nvrtc.load_kernel(_compiled(((fmt_code, cfg),)), name_expression(fmt_code, cfg), device_index)


def x_map_spec(x: torch.Tensor, box_rows: int) -> nvrtc.TensorMapSpec:
    """x [M, K] bf16 as (K * 2 bytes, M rows), boxes of one K step (128 bytes) by box_rows rows (a CTA's
    activation rows), 128B swizzle (the wgmma's K-major layout); rows past M and columns past K read as zeros."""
    return nvrtc.TensorMapSpec(address=x.data_ptr(), global_dims=(x.shape[1] * 2, x.shape[0]),
                               global_strides=(x.stride(0) * 2,), box_dims=(128, box_rows), swizzle="128B")


def weight_map_specs(data: torch.Tensor, scale: torch.Tensor, fmt_code: int, box_groups: int = 8,
                     box_steps: int = 1, l2_promotion: str = nvrtc.DEFAULT_L2_PROMOTION) -> tuple:
    """The words [N/16, K/64, DATA bytes] as (256 bytes, DATA / 256, K steps, row groups) and the scales
    [N/16, K/64, SCALE bytes] as (SCALE bytes, K steps, row groups), both in their buffer's strides
    (layout.prepared_views), boxes of box_steps K steps of box_groups row groups (here one step of a CTA's 128
    rows; decode_ws: a ring stage): one copy each, landing in the order the consumers read (row group by row
    group, each one's steps in K order). l2_promotion: nvrtc.TensorMapSpec's, for both maps."""
    layout.check_prepared(data, scale, decode.FMT_NAME[fmt_code], "sm90 tensor maps")
    data_bytes, scale_bytes = step_bytes(fmt_code)
    groups, kt, step, group = data.shape[0], data.shape[1], data.stride(1), data.stride(0)
    words = nvrtc.TensorMapSpec(address=data.data_ptr(), global_dims=(256, data_bytes // 256, kt, groups),
                                global_strides=(256, step, group),
                                box_dims=(256, data_bytes // 256, box_steps, box_groups), swizzle="none",
                                l2_promotion=l2_promotion)
    scales = nvrtc.TensorMapSpec(address=scale.data_ptr(), global_dims=(scale_bytes, kt, groups),
                                 global_strides=(step, group), box_dims=(scale_bytes, box_steps, box_groups),
                                 swizzle="none", l2_promotion=l2_promotion)
    return words, scales


def map_args(x: torch.Tensor, box_rows: int, data: torch.Tensor, scale: torch.Tensor, fmt_code: int,
             box_groups: int, box_steps: int, l2_promotion: str = nvrtc.DEFAULT_L2_PROMOTION) -> tuple:
    """The kernels' first three parameters, the tensor maps of x, the words and the scales, by value."""
    specs = (x_map_spec(x, box_rows), *weight_map_specs(data, scale, fmt_code, box_groups, box_steps, l2_promotion))
    return tuple(nvrtc.encode_tensor_map(s) for s in specs)


def permute_k(x: torch.Tensor, kp: int) -> torch.Tensor:
    """x [M, K] -> [M, kp] (zeros past K), each K step of 64 permuted for WsConfig(rs=True): column j holds
    x's column layout.rs_physical_k(j), the order in which the consumers take their register fragments."""
    m, k = x.shape
    if k != kp:
        x = torch.nn.functional.pad(x, (0, kp - k))
    k_bits = [32, 16, 8, 4, 2, 1]  # dims 2-7 of the view below
    order = [2 + k_bits.index(RS_K_BITS[b]) for b in reversed(range(6))]
    return x.reshape(m, kp // K_STEP, 2, 2, 2, 2, 2, 2).permute(0, 1, *order).reshape(m, kp)


def default_group_m(block_m: int, kp: int) -> int:
    """m tiles per group of the kernel's tile order: about 16 MB of x (a third of the H200's L2)."""
    return max(1, (16 << 20) // (block_m * kp * 2))


SPLITS = (1, 2, 3, 4)  # cluster sizes the split-K takes (each one is a compiled variant)
MIN_SPLIT_STEPS = 8  # K steps of 64 per part at least: shorter parts spend their time filling the ring


def split_for(tiles: int, kt: int, capacity: dict) -> int:
    """K parts per tile: the largest of SPLITS whose clusters all fit on the GPU at once (capacity: split ->
    clusters the device holds at once) with MIN_SPLIT_STEPS K steps or more per part; 1 when even the
    tiles alone fill a wave. A second wave of clusters costs about as much as the first (H200, session 15:
    4096x4096 M = 128 in 4 parts, 28.0 us as 32 clusters of 4, 19.4 us with 128 CTAs in one wave)."""
    return max(s for s in SPLITS if s == 1 or (tiles <= capacity[s] and kt >= s * MIN_SPLIT_STEPS))


@lru_cache(maxsize=None)
def cluster_capacity(fmt_code: int, cfg: "WsConfig", device_index: int) -> dict:
    """split -> clusters of that many CTAs of the kernel the device holds at once: nvrtc.max_active_clusters
    of cfg's split = 1 build, whose shared memory and registers its split variants share."""
    kernel = _kernel(fmt_code, cfg, device_index)
    sms = sm_count(device_index)
    capacity = {1: sms}
    for s in SPLITS[1:]:
        capacity[s] = nvrtc.max_active_clusters(kernel, cluster=s, block=THREADS,
                                                smem_bytes=cfg.smem_bytes(fmt_code), device_index=device_index,
                                                stream_handle=torch.cuda.current_stream(device_index).cuda_stream)
    return capacity


def supports(x: torch.Tensor) -> bool:
    """bf16 x that TMA can read (16-byte-aligned base and row stride), and cuda-python to launch with."""
    aligned = x.data_ptr() % 16 == 0 and (x.stride(0) * 2) % 16 == 0
    if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and aligned):
        return False
    return have_cuda_python()


@lru_cache(maxsize=None)
def have_cuda_python() -> bool:
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        return False
    return True


RS_MIN_WEIGHT = 1 << 27  # elements: from here A from registers pays at M = 33-128 (28672x8192, 8192x28672)


def ws_config(m: int, n: int, k: int) -> WsConfig:
    """64 activation rows per tile up to M = 64, 128 up to M = 128, else 256; A from registers up to M = 128
    on weights of RS_MIN_WEIGHT elements or more; the split from split_for. From the H200 (session 15,
    bench/results/sweep_h200.json): at M = 96-128 the 128-row tile beat the 256-row one on all 12 weight x
    format cases (run 15e: 8192x8192 M = 128 39.3 against 74.4 us), from M = 192 the 256-row tile is level
    or ahead (28672x8192 M = 384 360.8 against 422.8); register A (runs 15i, 15j) at M = 64 on 28672x8192
    70.6 against 94.5 us (NVFP4; the Gluon wgmma), at M = 128 112.6 against 140.2, level on 8192x8192 and
    slower on the smaller weights (4096x4096 M = 128 21.4 against 18.1: it waits for its own wgmmas, and x
    takes an extra pass)."""
    block_m = 64 if m <= 64 else 128 if m <= 128 else 256
    return WsConfig(block_m=block_m, rs=block_m <= 128 and n * k >= RS_MIN_WEIGHT)


def wgmma_ws_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: WsConfig = None, out=None):
    """y = x @ W^T (+ bias) for bf16 x [M, K] and prepared weights (layout.shuffle_weights)."""
    if not supports(x):
        raise ValueError(f"wgmma_ws: x must be bf16 with unit column stride and 16-byte-aligned rows (and "
                         f"cuda-python installed), got {x.dtype} of shape {tuple(x.shape)}, strides {x.stride()}")
    cfg = cfg or ws_config(x.shape[0], n, k)
    if cfg.split and cfg.split not in SPLITS:
        raise ValueError(f"wgmma_ws: split={cfg.split}; the K parts of a tile are a cluster of {SPLITS} CTAs")
    m = x.shape[0]
    np_, kp = padded_shape(n, k)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device) if out is None else out
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    m_tiles, n_tiles = -(-m // cfg.block_m), np_ // ROWS
    device = device_index(x.device)
    kt = kp // K_STEP
    group_m = cfg.group_m or default_group_m(cfg.block_m, kp)
    cfg = replace(cfg, group_m=0)  # as compiled: group_m is a launch argument
    if not cfg.split:
        cfg = replace(cfg, split=split_for(m_tiles * n_tiles, kt, cluster_capacity(fmt_code, replace(cfg, split=1),
                                                                                    device)))
    if cfg.rs:
        x = permute_k(x, kp)
    args = (*map_args(x, cfg.block_m, data, scale, fmt_code, 8, 1), row_mult.data_ptr(),
            0 if bias is None else bias.data_ptr(), y.data_ptr(),
            np.int32(m), np.int32(n), np.int32(kt), np.int32(y.stride(0)), np.int32(m_tiles),
            np.int32(n_tiles), np.int32(group_m), np.int32(-(-kt // cfg.split)))
    nvrtc.launch(_kernel(fmt_code, cfg, device), clusters=m_tiles * n_tiles, cluster=cfg.split,
                 block=THREADS, smem_bytes=cfg.smem_bytes(fmt_code), device_index=device,
                 stream_handle=torch.cuda.current_stream(x.device).cuda_stream, args=args)
    return y
