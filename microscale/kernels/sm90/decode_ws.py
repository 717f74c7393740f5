"""Host side of the TMA-ring decode GEMM for M <= 16 (decode_ws.cuh), sm_90a.

The dispatch takes it where ring_wins (docs/dispatch.md). The kernel is CUDA C++ compiled at run time by NVRTC,
after wgmma_ws.cuh's source (its decode routines, TMA and barrier helpers). Its tensor maps are wgmma_ws's
(map_args): x's boxes are one K step by block_m rows (128B swizzle), the weight's `steps` K steps by `groups`
row groups. Beyond y = x W^T + bias a kernel variant may take the gated epilogue (kernels/gated.py), an RMSNorm of
x in front (a norm warp; kernels/rmsnorm.py) and a residual add behind.
"""

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from .. import nvrtc, rmsnorm
from ..gated import PAIR_ROWS
from . import wgmma_ws
from .launch import device_index, programmatic_launch, sm_count
from .layout import K_STEP, ROW_GROUP, padded_shape

SOURCE_PATH = Path(__file__).with_name("decode_ws.cuh")
ARCH = "sm_90a"
MAX_M = 16
SPLITS = (1, 2)  # K parts per tile (a cluster); larger clusters of one CTA per SM do not all fit at once
MIN_FILL = 0.85  # ring_wins: ring_config's tiling must give at least this fraction of the SMs a CTA
MAX_WARPS = 32  # 1024 threads per CTA
MAX_STAGE_BYTES = 48 * 1024
# Up to M = 8 (block_m 8), on calls without the norm, smaller stages: the consumers, about as fast as the stream,
# start on the first stage sooner and free the ring in finer parts (docs/hopper.md: ring_config's rules)
MAX_STAGE_BYTES_M8 = 32 * 1024
MAX_STAGES = 5  # rings of 2-step stages: 5 stages beat 6-8 (docs/hopper.md: ring_config's rules)
# A ring of 4-step stages of LEAD_STAGE_BYTES or more (at M = 9-16, or up to M = 8 on FEW_GROUPS or more row groups
# or on a CTA taking whole rows of at most LONG_K), and a call carrying the norm, keeps FIRST_FILL_LEAD stages of its
# first fill in flight instead of issuing the whole ring at once; up to M = 8 a ring of 2-step stages of
# SHORT_LEAD_STAGE_BYTES or more on FEW_GROUPS or more row groups keeps SHORT_STAGE_LEAD (ring_config's docstring)
LEAD_STAGE_BYTES = 20 * 1024
FIRST_FILL_LEAD = 2
SHORT_LEAD_STAGE_BYTES = 16 * 1024
SHORT_STAGE_LEAD = 3
IN_FLIGHT_BYTES = 128 * 1024  # a CTA's ring (one CTA per SM)
# The L2 rounds a weight box's misses up to 128 bytes, not 256: a row group's K step is 576 bytes (NVFP4), so the
# boxes' rows start off the 256-byte grid. Session 42 (bench/stream_probe.py --probe ws-promotion, run 42a), M = 1:
# NVFP4 28672x8192 34.9 -> 33.5 us (the stream alone 36.0 -> 32.1, the read-only ring's speed), MXFP8 8192x8192
# 20.0 -> 19.2; 64B and none in between.
WEIGHT_L2_PROMOTION = "128B"
MAX_RING_STEPS = 16  # K steps a ring holds at most
# Shared memory asked for under a programmatic dependent launch: two CTAs sharing an SM (the next call's,
# started early) made back-to-back calls of 28672x8192 take 51-52 us instead of 36 (session 19, run 19c)
ONE_CTA_PER_SM_BYTES = 116 * 1024
# The norm warp pays off up to 8 activation rows (block_m 8). In the Llama-8B step (bench/e2e.py way (d), NVFP4,
# profiles of session 25's run 25b against session 22's) it made the gate/up call 20.6 -> 22.0 us at batch 1, less
# than the Inductor norm kernel it removes (step (e) 1.989 / 1.988 -> 1.952 / 1.946 ms, run 25a), but 23.1 -> 33.6
# us at batch 16 (step (d) 2.473 -> 2.738 ms), where the residual add cost nothing measurable (o_proj 7.6 -> 7.7 us).
NORM_MAX_M = 8
# ring_config's consumer warps per row group follow the CTA's row groups and K (padded): below FEW_GROUPS two warps
# per row group; from it, on rows of LONG_K or more, one warp per row group up to M = 8 (FP4) and at M = 9-16 one warp
# per two row groups (two warps per pair, four from QUAD_GROUPS)
FEW_GROUPS = 8
LONG_K = 8192
QUAD_GROUPS = 12


@dataclass(frozen=True)
class RingConfig:
    block_m: int = 8  # activation rows (8 or 16): the MMA's N side
    groups: int = 8  # row groups of 16 weight rows per CTA, one consumer warp each
    steps: int = 4  # K steps of 64 per ring stage
    stages: int = 4
    split: int = 1  # K parts per tile: the CTAs of a cluster
    k_warps: int = 1  # consumer warps per row group, each taking every k_warps-th K step of a stage
    groups_per_warp: int = 1  # row groups a consumer warp decodes per K step, sharing x's registers (<= k_warps)
    chains: int = 1  # accumulators per row group that a warp's MMAs of a K step alternate between (1, 2 or 4)
    lead: int = 0  # stages of the first fill in flight before the first lands (0: the whole ring at once)

    @property
    def threads(self) -> int:
        return 32 * (self.groups * self.k_warps // self.groups_per_warp + 1)  # + the producer warp

    def stage_bytes(self, fmt_code: int) -> int:
        """x, words and scales of one stage, rounded up to 1024 bytes (x's swizzled boxes stay aligned)."""
        data, scale = wgmma_ws.step_bytes(fmt_code)
        return -(-self.steps * (self.block_m * 128 + self.groups * (data + scale)) // 1024) * 1024

    def smem_bytes(self, fmt_code: int, norm: bool = False) -> int:
        """RingSmem<>::BYTES of the kernel source: the stages, their barriers, alignment slack; with the norm
        warp its ready barriers and block_m row sums (the launch adds its slice of the norm weight); with a split
        the peers' partials (and row sums) that land in this CTA, and their barrier."""
        up16 = lambda b: -(-b // 16) * 16  # noqa: E731
        row_sums = 4 * self.block_m if norm else 0
        end = self.stages * (self.stage_bytes(fmt_code) + 16) + (8 * self.stages + row_sums if norm else 0)
        if self.split > 1:
            owned = -(-self.groups // self.split)
            end = up16(end + 8) + self.split * (owned * 32 * self.block_m * 2 + row_sums)
        return up16(end) + 1024


@lru_cache(maxsize=None)
def ring_config(m: int, n: int, k: int, fmt_code: int, sms: int = 132, norm: bool = False) -> RingConfig:
    """decode_ws's tiling, consumer warps and ring for M rows of an [n, k] weight. Each rule is the fastest of the
    H200 measurements that docs/hopper.md ("ring_config's rules and the runs behind them") lists.
    - Tiling: one CTA per SM. Of 4-16 row groups per CTA and a split of 1 or 2 (a cluster), the tiling whose CTAs
      come closest to the SM count from below; on a tie the groups nearest 8 for FP4 and 4 for MXFP8 (twice the
      bytes per row). Weights of more than 16 row groups per SM take 16 and several waves.
    - Consumer warps: k_warps per row group, each taking every k_warps-th K step of a stage (partials summed through
      shared memory in warp order); groups_per_warp row groups per warp, sharing x's registers. Two warps per row
      group on CTAs of fewer than FEW_GROUPS row groups (one warp per scheduler leaves the decode's latency exposed),
      and up to M = 8 on larger CTAs too, except FP4 on rows of LONG_K or more (one). At M = 9-16 on rows of LONG_K
      or more, where a CTA's FEW_GROUPS or more row groups pair up, a warp takes two row groups and every other K
      step (half the x loads from shared memory): two warps per pair, each row group's MMAs alternating over two
      accumulators (chains), or four from QUAD_GROUPS where the threads fit. Otherwise one warp per row group.
    - Stages: 4 K steps, 2 when K has an odd number of step pairs or a stage would pass MAX_STAGE_BYTES
      (MAX_STAGE_BYTES_M8 up to M = 8 on a call without the norm); as many as IN_FLIGHT_BYTES hold, 2 to MAX_STAGES,
      at most MAX_RING_STEPS K steps in all.
    - First fill: FIRST_FILL_LEAD stages in flight before the first lands (the memory lands the first stage sooner
      than in a whole ring) on a call carrying the norm, and on 4-step stages of LEAD_STAGE_BYTES or more at M = 9-16,
      or up to M = 8 on FEW_GROUPS or more row groups or on a CTA taking whole rows of at most LONG_K; up to M = 8
      SHORT_STAGE_LEAD on 2-step stages of SHORT_LEAD_STAGE_BYTES or more on FEW_GROUPS or more row groups;
      otherwise the whole ring at once."""
    groups_total = padded_shape(n, k)[0] // ROW_GROUP
    kt = padded_shape(n, k)[1] // K_STEP
    prefer = 4 if fmt_code == 2 else 8
    best = None, 16, 1  # more than 16 row groups per SM: 16 per CTA, several waves
    for groups in range(4, 17):
        for split in SPLITS:
            ctas = -(-groups_total // groups) * split
            if ctas <= sms and (best[0] is None or (ctas, -abs(groups - prefer)) > best[0]):
                best = (ctas, -abs(groups - prefer)), groups, split
    _, groups, split = best
    block_m = 8 if m <= 8 else 16
    few, long_k = groups < FEW_GROUPS, kt * K_STEP >= LONG_K
    room = 2 * groups + 1 <= MAX_WARPS  # two warps per row group (four per pair) and the producer fit in a CTA
    pairs = block_m == 16 and not few and long_k and groups % 2 == 0
    if pairs:
        k_warps = 4 if groups >= QUAD_GROUPS and room else 2
    else:
        two = few or block_m == 8 and not (long_k and fmt_code != 2)
        k_warps = 2 if two and room else 1
    cfg = RingConfig(block_m=block_m, groups=groups, steps=4, stages=4, split=split, k_warps=k_warps,
                     groups_per_warp=2 if pairs else 1)
    if kt % 4 or cfg.stage_bytes(fmt_code) > (MAX_STAGE_BYTES_M8 if block_m == 8 and not norm else MAX_STAGE_BYTES):
        cfg = replace(cfg, steps=2, k_warps=min(k_warps, 2))
    stage = cfg.stage_bytes(fmt_code)
    stages = min(MAX_STAGES, MAX_RING_STEPS // cfg.steps, IN_FLIGHT_BYTES // stage)
    one_cta_rows = split == 1 and kt * K_STEP <= LONG_K  # a CTA takes whole rows, at most LONG_K long
    if norm or cfg.steps == 4 and stage >= LEAD_STAGE_BYTES and (block_m == 16 or not few or one_cta_rows):
        lead = FIRST_FILL_LEAD
    else:
        short = cfg.steps == 2 and block_m == 8 and not few and stage >= SHORT_LEAD_STAGE_BYTES
        lead = SHORT_STAGE_LEAD if short else 0
    return replace(cfg, stages=max(2, stages), lead=lead, chains=2 if pairs and cfg.k_warps == 2 else 1)


def fills(cfg: RingConfig, n: int, k: int, sms: int) -> bool:
    """Whether cfg's CTAs occupy at least MIN_FILL of the SMs in one wave."""
    ctas = -(-padded_shape(n, k)[0] // (ROW_GROUP * cfg.groups)) * cfg.split
    return MIN_FILL * sms <= ctas <= sms


def ring_wins(fmt_code: int, m: int, n: int, k: int, sms: int = 132) -> bool:
    """Whether the dispatch gives M <= 16 to this kernel (ring_config's tiling) rather than the Triton decode kernel:
    in every format wherever the tiling gives at least MIN_FILL of the SMs a CTA in one wave (fills), with or without
    the norm (which changes ring_config's stages, not its CTAs). There decode_ws measured faster than the Triton
    kernel with plain and programmatic launches, or level plain and faster programmatic (FP4: session 28; MXFP8:
    sessions 18, 29 and 43); docs/dispatch.md gives the runs."""
    return m <= MAX_M and fills(ring_config(m, n, k, fmt_code, sms), n, k, sms)


def fusions(m: int) -> frozenset:
    """Which of rmsnorm.FUSIONS the dispatch hands this kernel at M rows: the residual add, and the norm up to
    NORM_MAX_M (the kernel takes both at any M; larger M gets the norm as torch ops)."""
    return frozenset(f for f in rmsnorm.FUSIONS if f != "rms_norm" or m <= NORM_MAX_M)


def source() -> str:
    return wgmma_ws.source() + "\n" + SOURCE_PATH.read_text()


def variant(fmt_code: int, cfg: RingConfig, gated: bool = False, norm: bool = False, residual: bool = False) -> tuple:
    """A kernel of the source: the format, the tiling and the fusions it is built with."""
    return fmt_code, cfg, bool(gated), bool(norm), bool(residual)


def name_expression(fmt_code: int, cfg: RingConfig, gated: bool = False, norm: bool = False,
                    residual: bool = False) -> str:
    lead = cfg.lead or cfg.stages
    return (f"ms90::decode_ws_gemm<{fmt_code}, {cfg.block_m}, {cfg.groups}, {cfg.k_warps}, {cfg.groups_per_warp}, "
            f"{cfg.chains}, {lead}, {cfg.steps}, {cfg.stages}, {cfg.split}, {int(gated)}, {int(norm)}, "
            f"{int(residual)}>")


def threads(cfg: RingConfig, norm: bool = False) -> int:
    """The kernel's block: cfg's warps and, with the norm, the norm warp."""
    return cfg.threads + 32 * bool(norm)


@lru_cache(maxsize=None)
def _compiled(variants: tuple) -> nvrtc.CompiledKernels:
    """The kernels of `variant`s; a static_assert per variant keeps smem_bytes equal to the source's
    RingSmem<>::BYTES."""
    checks = [f"static_assert(ms90::RingSmem<{f}, {c.block_m}, {c.groups}, {c.steps}, {c.stages}, {int(norm)}, "
              f"{c.split}>::BYTES == {c.smem_bytes(f, norm)}, \"RingConfig.smem_bytes differs from RingSmem::BYTES\");"
              for f, c, _, norm, _ in variants]
    return nvrtc.compile_kernels(tuple(name_expression(*v) for v in variants),
                                 source=source() + "\n" + "\n".join(checks) + "\n", label=SOURCE_PATH.name, arch=ARCH)


@lru_cache(maxsize=None)
def _kernel(variant: tuple, device_index: int):
    return nvrtc.load_kernel(_compiled((variant,)), name_expression(*variant), device_index)


def supports(x: torch.Tensor) -> bool:
    return x.shape[0] <= MAX_M and wgmma_ws.supports(x)


def decode_ws_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: RingConfig = None, out=None,
                   gated: bool = False, norm: tuple = None, residual: torch.Tensor = None):
    """y = x @ W^T (+ bias) for bf16 x [M <= 16, K] and prepared weights (layout.shuffle_weights); gated: the
    weight's rows are gate/up pairs and y [M, N / 2] = silu(gate) * up (kernels/gated.py); norm = (weight [K],
    eps): the GEMM of rmsnorm(x) * weight; residual [M, N or N / 2]: added to y (kernels/rmsnorm.py)."""
    m = x.shape[0]
    if not supports(x):
        raise ValueError(f"decode_ws: x must be bf16 [M <= {MAX_M}, K] with unit column stride and 16-byte-aligned "
                         f"rows (and cuda-python installed), got {x.dtype} of shape {tuple(x.shape)}, strides "
                         f"{x.stride()}")
    if cfg is None:
        cfg = ring_config(m, n, k, fmt_code, sm_count(device_index(x.device)), norm is not None)
    np_, kp = padded_shape(n, k)
    kt = kp // K_STEP
    if m > cfg.block_m or kt % cfg.steps or cfg.split not in range(1, 9) or cfg.steps % cfg.k_warps:
        raise ValueError(f"decode_ws: {cfg} cannot run M={m} (block_m) on K={kp} ({kt} steps of {K_STEP}), its "
                         f"split is not a cluster size of 1-8, or k_warps does not divide the steps per stage")
    if cfg.groups_per_warp not in (1, 2) or cfg.groups % cfg.groups_per_warp or cfg.groups_per_warp > cfg.k_warps:
        raise ValueError(f"decode_ws: {cfg}: groups_per_warp must be 1 or 2, divide groups and not exceed k_warps")
    if cfg.chains not in (1, 2, 4) or cfg.lead < 0:
        raise ValueError(f"decode_ws: {cfg}: chains must be 1, 2 or 4 (of a K step's 4 MMAs) and lead at least 0")
    if threads(cfg, norm is not None) > 32 * MAX_WARPS:
        raise ValueError(f"decode_ws: {cfg} needs {threads(cfg, norm is not None)} threads (its consumer warps, the "
                         f"producer{', the norm warp' if norm is not None else ''}), more than {32 * MAX_WARPS}")
    if gated and n % (2 * PAIR_ROWS):
        raise ValueError(f"decode_ws: the gated epilogue needs N = {n} a multiple of {2 * PAIR_ROWS}")
    device = device_index(x.device)
    y = torch.empty(m, n // 2 if gated else n, dtype=torch.bfloat16, device=x.device) if out is None else out
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    norm_weight, eps = (None, 0.0) if norm is None else norm
    if norm_weight is not None:
        if tuple(norm_weight.shape) != (k,):
            raise ValueError(f"decode_ws: norm weight of shape {tuple(norm_weight.shape)} does not match K={k}")
        norm_weight = norm_weight.to(torch.bfloat16).contiguous()  # 16-byte loads: a fresh tensor is aligned
        if norm_weight.data_ptr() % 16:
            norm_weight = norm_weight.clone()
    if residual is not None:
        if tuple(residual.shape) != tuple(y.shape) or residual.dtype != torch.bfloat16 or residual.stride(1) != 1:
            raise ValueError(f"decode_ws: residual must be bf16 of the output's shape {tuple(y.shape)} with unit "
                             f"column stride, got {residual.dtype} of shape {tuple(residual.shape)}")
    tiles = -(-np_ // (ROW_GROUP * cfg.groups))  # a last tile past the rows reads zeros (TMA) and stores nothing
    steps = -(-kt // cfg.split // cfg.steps) * cfg.steps  # per K part, whole stages
    maps = wgmma_ws.map_args(x, cfg.block_m, data, scale, fmt_code, cfg.groups, cfg.steps, WEIGHT_L2_PROMOTION)
    args = (*maps, row_mult.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), np.int32(m), np.int32(n),
            np.int32(kt), np.int32(y.stride(0)), np.int32(steps), 0 if norm_weight is None else norm_weight.data_ptr(),
            np.float32(eps), np.int32(k), 0 if residual is None else residual.data_ptr(),
            np.int32(0 if residual is None else residual.stride(0)))
    programmatic = programmatic_launch(x.device)
    fused = variant(fmt_code, cfg, gated, norm_weight is not None, residual is not None)
    smem = cfg.smem_bytes(fmt_code, norm_weight is not None) + (0 if norm_weight is None else steps * 128)
    if programmatic:  # more than half an SM: the next call's CTAs, launched early, never share an SM with these
        smem = max(smem, ONE_CTA_PER_SM_BYTES)
    nvrtc.launch(_kernel(fused, device), clusters=tiles, cluster=cfg.split, block=threads(cfg, norm_weight is not None),
                 smem_bytes=smem, device_index=device, stream_handle=torch.cuda.current_stream(x.device).cuda_stream,
                 args=args, programmatic=programmatic)
    return y
