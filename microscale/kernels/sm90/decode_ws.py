"""Host side of the TMA-ring decode GEMM for small M (decode_ws.cuh), sm_90a."""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import nvrtc
from . import wgmma_ws
from .launch import sm_count
from .layout import K_STEP, padded_shape

SOURCE_PATH = Path(__file__).with_name("decode_ws.cuh")
ARCH = "sm_90a"


@dataclass(frozen=True)
class RingConfig:
    block_m: int = 8  # activation rows (8 or 16): the MMA's N side
    groups: int = 8  # row groups (consumer warps) per CTA
    steps: int = 2  # K steps of 64 per stage
    stages: int = 4
    split: int = 0  # K parts per tile, the CTAs of a cluster (1-8); 0 = from the grid

    def smem_bytes(self, fmt_code: int) -> int:
        data, scale = wgmma_ws.step_bytes(fmt_code)
        stage = -(-self.steps * (self.block_m * 128 + self.groups * (data + scale)) // 1024) * 1024
        return self.stages * stage + 16 * self.stages + 1024


def source() -> str:
    return wgmma_ws.source() + "\n" + SOURCE_PATH.read_text()


def name_expression(fmt_code: int, cfg: RingConfig) -> str:
    return f"ms90::decode_ws_gemm<{fmt_code}, {cfg.block_m}, {cfg.groups}, {cfg.steps}, {cfg.stages}, {cfg.split}>"


@lru_cache(maxsize=None)
def _kernel(fmt_code: int, cfg: RingConfig, device_index: int):
    compiled = nvrtc.compile_kernels((name_expression(fmt_code, cfg),), source=source(), label=SOURCE_PATH.name,
                                     arch=ARCH)
    return nvrtc.load_kernel(compiled, name_expression(fmt_code, cfg), device_index)


def weight_map_specs(data: torch.Tensor, scale: torch.Tensor, fmt_code: int, groups: int, steps: int) -> tuple:
    data_bytes, scale_bytes = wgmma_ws.step_bytes(fmt_code)
    n_groups, kt = data.shape[0], data.shape[1] // data_bytes
    words = nvrtc.TensorMapSpec(address=data.data_ptr(), global_dims=(256, data_bytes // 256, kt, n_groups),
                                global_strides=(256, data_bytes, kt * data_bytes),
                                box_dims=(256, data_bytes // 256, steps, groups), swizzle="none")
    scales = nvrtc.TensorMapSpec(address=scale.data_ptr(), global_dims=(scale_bytes, kt, n_groups),
                                 global_strides=(scale_bytes, kt * scale_bytes), box_dims=(scale_bytes, steps, groups),
                                 swizzle="none")
    return words, scales


def split_for(tiles: int, kt: int, cfg: RingConfig, sms: int, per_sm: int) -> int:
    """Largest split of 1..8 that keeps the CTAs within one wave of per_sm per SM, K parts of at least 4 stages."""
    best = 1
    for s in range(1, 9):
        if tiles * s <= sms * per_sm and kt // s >= 4 * cfg.steps:
            best = s
    return best


def decode_ws_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: RingConfig = None, out=None,
                   per_sm: int = 2):
    cfg = cfg or RingConfig()
    m = x.shape[0]
    if m > cfg.block_m or not wgmma_ws.supports(x):
        raise ValueError(f"decode_ws: M={m} > block_m={cfg.block_m} or x not TMA-readable bf16")
    np_, kp = padded_shape(n, k)
    kt = kp // K_STEP
    rows = 16 * cfg.groups
    if np_ % rows or kt % cfg.steps:
        raise ValueError(f"decode_ws: {cfg} does not tile the padded {np_} x {kp} weight")
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device) if out is None else out
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    tiles = np_ // rows
    split = cfg.split or split_for(tiles, kt, cfg, sm_count(device), per_sm)
    cfg = RingConfig(cfg.block_m, cfg.groups, cfg.steps, cfg.stages, split)
    steps = -(-kt // split)
    steps = -(-steps // cfg.steps) * cfg.steps
    tmap = wgmma_ws._device_maps((wgmma_ws.x_map_spec(x, cfg.block_m),), x.device)
    wmaps = wgmma_ws._device_maps(weight_map_specs(data, scale, fmt_code, cfg.groups, cfg.steps), x.device, owner=data)
    args = (tmap.data_ptr(), wmaps.data_ptr(), row_mult.data_ptr(), 0 if bias is None else bias.data_ptr(),
            y.data_ptr(), np.int32(m), np.int32(n), np.int32(kt), np.int32(y.stride(0)), np.int32(steps))
    nvrtc.launch(_kernel(fmt_code, cfg, device), clusters=tiles, cluster=split, block=(cfg.groups + 1) * 32,
                 smem_bytes=cfg.smem_bytes(fmt_code), device_index=device,
                 stream_handle=torch.cuda.current_stream(x.device).cuda_stream, args=args)
    return y
