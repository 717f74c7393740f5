"""The `sm90` backend: Hopper (and Ampere) kernels for NVFP4 / MXFP4 / MXFP8 weights.

Where: sm_90 (H100/H200, where the kernels are tested and measured). On sm_80 to sm_89 and on
sm_120 (consumer Blackwell, which has no tcgen05) the same kernels compile (CI checks sm_80 and
sm_120 builds) but never ran here, so there the backend is available only once the first-use
self-test (microscale.kernels.selftest) has passed on the device.

prepare: one-time re-layout of a canonical QTensor (layout.shuffle_weights): pre-shuffled codes,
    rebased block scales and a per-row float32 factor, returned as (data, scale, row_mult) in the
    place of (data, scale, global_scale). Checkpoints keep the canonical layout.
unprepare: its inverse (layout.unshuffle_weights; bit-exact for what our quantizers write), so
    layers need not keep both layouts.
gemm: picks the kernel from M and the options (docs/dispatch.md):
    "fp8"     options["fp8_activations"] and an MX format and M >= FP8_MIN_M: E4M3 tensor cores
    "decode_ws" bf16 activations, sm_90, M <= 16 where decode_ws.ring_wins (its tiling fills the SMs): a TMA
              producer warp streams weight stages into a shared-memory ring, one or two consumer warps per 16
              rows dequantize into mma.sync (decode_ws.py)
    "decode"  M <= DECODE_MAX_M otherwise, except at M = 9-32 where launch.wgmma_beats_decode: dequantize in
              registers into mma.sync (decode.py)
    "wgmma"   M <= WS_MIN_M - 1 (and M = 9-32 as above), bf16 activations, sm_90: dequantize per K
              step, wgmma with A from those registers or from shared memory (wgmma.py,
              launch.wgmma_config); also up to WGMMA_MAX_M when wgmma_ws cannot run
    "wgmma_ws" bf16 activations, sm_90, WS_MIN_M <= M <= WS_MAX_M[format], and from M = 33 on weights of
              wgmma_ws.RS_MIN_WEIGHT elements or more: the warp-specialized CUDA kernel (wgmma_ws.py: TMA
              producer warp, two decoding warpgroups, split-K over clusters when the tiles are few)
    "dequant" otherwise (larger M, fp16/fp32 activations, other architectures, x that TMA cannot
              read, no cuda-python): dequantize into a workspace, then cuBLAS
  options["kernel"] or the environment variable MICROSCALE_SM90_KERNEL ("decode_ws", "decode", "wgmma",
  "wgmma_ws", "dequant", "fp8") overrides the choice; "decode_ws" asked for above M = 16 leaves the choice to
  the rule (so the variable can ask for it for a whole model, prefill included).
  options["epilogue"] = "silu_mul" (gate/up row pairs, kernels/gated.py): applied in the epilogue by decode_ws and
  by decode with up to 8 activation rows per program (launch.decode_takes_gated), after the GEMM elsewhere.
  options["rms_norm"] = (weight, eps), options["residual"] (kernels/rmsnorm.py): taken by decode_ws (a norm warp
  up to decode_ws.NORM_MAX_M rows; the add in the epilogue), torch ops elsewhere; `fusions` says which a call's
  kernel takes.
"""

import os

import torch

from ...formats.spec import get_format
from ...formats.tensor import QTensor
from .. import gated, rmsnorm
from ..dispatch import Backend, compute_capability, register
from ..selftest import backend_run_fn, selftest_passed
from . import launch as paths
from . import decode_ws, wgmma_ws
from .decode import FMT_CODE
from .layout import K_STEP, ROW_GROUP, check_prepared, clone_prepared, padded_shape, shuffle_weights, unshuffle_weights

NAME = "sm90"
DECODE_MAX_M = 32
WGMMA_MAX_M = 512
FP8_MIN_M = 1024
# wgmma_ws where it measured fastest (bench/results/gemm_h200.json, sessions 10-15): from M = 65, with 128
# activation rows per tile up to M = 128 and split-K over clusters when the tiles are few (session 15,
# sweep run 15e: faster than wgmma on all 12 weight x format cases at M = 96-512, e.g. 8192x8192 M = 128
# 64.1 -> 39.3 us; at M = 64 wgmma's register-A tile stays level or ahead, except on weights of
# wgmma_ws.RS_MIN_WEIGHT elements or more, where wgmma_ws with A from registers takes M = 33-64 too: runs
# 15i/15j, 28672x8192 M = 64 94.5 -> 70.6 us); up to M = 4096 for MXFP8 and 8192 for FP4 (gemm_h200.json, run
# 39b, both kernels in one run: ahead of dequant + cuBLAS in 34 of the 36 format x shape records at M = 1024-4096;
# at M = 8192, where dequant's extra pass over W has shrunk against the GEMM, on 6 of the 8 FP4 records, NVFP4
# 28672x8192 0.97 against 0.94x cuBLAS bf16, and on 1 of MXFP8's 4 by 0.2%: its tiles are not staged, wgmma_ws.cuh)
WS_MIN_M = 65
WS_MAX_M = {"nvfp4": 8192, "mxfp4": 8192, "mxfp8": 4096}
KERNELS = ("decode_ws", "decode", "wgmma", "wgmma_ws", "dequant", "fp8")
FP8_FORMATS = ("mxfp4", "mxfp8")


SELFTEST_PAIRS = (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"))  # (activations, weights)


def _available(device) -> bool:
    cc = compute_capability(device)
    if cc is None or not ((8, 0) <= cc < (10, 0) or cc[0] == 12):
        return False
    return cc[0] == 9 or selftest_passed(NAME, backend_run_fn(BACKEND), device, SELFTEST_PAIRS)


def prepare(w: QTensor):
    return shuffle_weights(w)


def unprepare(prepared, fmt, shape, global_scale=None) -> QTensor:
    return unshuffle_weights(*prepared, fmt, shape, global_scale)


def choose_kernel(fmt: str, m: int, options: dict, dtype=torch.bfloat16, cc=(9, 0), n: int = 8192,
                  tma_ready: bool = True, k: int = 8192, sms: int = 132) -> str:
    """The dispatch rule (docs/dispatch.md); an explicit kernel (option or env var) wins.
    dtype: the activations'; cc: the device's compute capability (wgmma needs sm_90, FP8 sm_89);
    n, k: the weight's shape; tma_ready: whether the TMA kernels can take these activations
    (wgmma_ws.supports); sms: the device's SM count (decode_ws's tiling)."""
    forced = options.get("kernel") or os.environ.get("MICROSCALE_SM90_KERNEL") or None
    wgmma_ready = dtype == torch.bfloat16 and cc[0] == 9
    if forced == "decode_ws" and m > decode_ws.MAX_M:
        forced = None  # a decode kernel: asked for in a model, it leaves the prefill's M to the rule
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"sm90: unknown kernel {forced!r}; accepted: {', '.join(KERNELS)}")
        if forced == "fp8" and fmt not in FP8_FORMATS:
            raise ValueError(f"sm90: the fp8 kernel takes {', '.join(FP8_FORMATS)} weights, not {fmt}")
        if forced in ("wgmma", "wgmma_ws", "decode_ws") and not wgmma_ready:
            raise ValueError(f"sm90: the {forced} kernel takes bf16 activations on sm_90, not {dtype} on "
                             f"sm_{cc[0]}{cc[1]}")
        kernel = forced
    elif options.get("fp8_activations") and fmt in FP8_FORMATS and m >= FP8_MIN_M:
        kernel = "fp8"
    elif wgmma_ready and tma_ready and decode_ws.ring_wins(FMT_CODE[fmt], m, n, k, sms):
        kernel = "decode_ws"
    elif m <= DECODE_MAX_M and not (wgmma_ready and paths.wgmma_beats_decode(FMT_CODE[fmt], m, n, k)):
        kernel = "decode"
    elif wgmma_ready:
        # below WS_MIN_M only where wgmma_ws would take A from registers (ws_config: the largest weights)
        ws_rs = m > DECODE_MAX_M and wgmma_ws.ws_config(m, n, k).rs
        if tma_ready and (WS_MIN_M <= m <= WS_MAX_M[fmt] or ws_rs):
            kernel = "wgmma_ws"
        else:
            kernel = "wgmma" if m <= WGMMA_MAX_M else "dequant"
    else:
        kernel = "dequant"
    if kernel == "fp8" and tuple(cc) < (8, 9):
        raise ValueError(f"sm90: the fp8 kernel needs FP8 tensor cores (sm_89 or later), not sm_{cc[0]}{cc[1]}")
    return kernel


def _device_kernel(fmt: str, m: int, n: int, k: int, options: dict, dtype, device, tma_ready: bool) -> str:
    """choose_kernel with the device's compute capability and SM count."""
    return choose_kernel(fmt, m, options, dtype, compute_capability(device), n, tma_ready, k,
                         paths.sm_count(paths.device_index(device)))


def _kernel_fusions(kernel: str, m: int) -> frozenset:
    return decode_ws.fusions(m) if kernel == "decode_ws" else frozenset()


def fusions(fmt: str, m: int, n: int, k: int, device, options: dict = None) -> frozenset:
    """Which of rmsnorm.FUSIONS the kernel for bf16 x [m, k] (contiguous) and an [n, k] weight applies itself."""
    tma_ready = (k * 2) % 16 == 0 and wgmma_ws.have_cuda_python()
    kernel = _device_kernel(get_format(fmt).name, m, n, k, options or {}, torch.bfloat16, torch.device(device),
                            tma_ready)
    return _kernel_fusions(kernel, m)


def gemm(x2d, data, scale, row_mult, bias, *, fmt, n, k, options):
    """y [M, N] = x2d [M, K] @ dequant(W).T (+ bias) in x2d's dtype; the options of the module docstring."""
    fmt = get_format(fmt).name
    if x2d.dim() != 2 or x2d.shape[1] != k:
        raise ValueError(f"sm90 gemm: x of shape {tuple(x2d.shape)} does not match weight [{n}, {k}]")
    if x2d.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"sm90 gemm: x dtype {x2d.dtype} not supported (bf16, fp16, fp32)")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"sm90 gemm: bias of shape {tuple(bias.shape)} does not match N={n}")
    m = x2d.shape[0]
    options = options or {}
    epilogue = gated.check_epilogue(options.get("epilogue"))
    if m == 0:
        return x2d.new_empty(0, gated.output_features(n, epilogue))
    check_prepared(data, scale, fmt, "sm90 gemm")
    np_, kp = padded_shape(n, k)
    if tuple(data.shape[:2]) != (np_ // ROW_GROUP, kp // K_STEP) or tuple(row_mult.shape) != (np_,):
        raise ValueError(f"sm90 gemm: prepared weights of {list(data.shape[:2])} row groups x K steps and row_mult "
                         f"{list(row_mult.shape)} do not match weight [{n}, {k}] (padded [{np_}, {kp}])")
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    kernel = _device_kernel(fmt, m, n, k, options, x2d.dtype, x2d.device, wgmma_ws.supports(x2d))
    run = {"decode_ws": decode_ws.decode_ws_gemm, "decode": paths.decode_gemm, "wgmma": paths.wgmma_gemm,
           "wgmma_ws": wgmma_ws.wgmma_ws_gemm, "dequant": paths.dequant_gemm, "fp8": paths.fp8_gemm}[kernel]
    norm, residual = options.get("rms_norm"), options.get("residual")
    if norm is not None and "rms_norm" not in _kernel_fusions(kernel, m):
        x2d, norm = rmsnorm.rms_norm(x2d, *norm), None
    if kernel == "decode_ws":
        if residual is not None:
            residual = residual.to(torch.bfloat16).contiguous()
        return run(x2d, data, scale, row_mult, bias, FMT_CODE[fmt], n, k, gated=epilogue is not None, norm=norm,
                   residual=residual)
    args = (x2d, data, scale, row_mult, bias, FMT_CODE[fmt], n, k)
    if epilogue is None:
        y = run(*args)
    elif kernel == "decode" and paths.decode_takes_gated(cfg := paths.decode_config(m, n, k, FMT_CODE[fmt])):
        y = run(*args, cfg, gated=True)
    else:
        y = gated.silu_mul(run(*args))
    return y if residual is None else rmsnorm.add_residual(y, residual)


BACKEND = Backend(
    name=NAME,
    formats=frozenset(FMT_CODE),
    available=_available,
    prepare=prepare,
    gemm=gemm,
    options=frozenset({"fp8_activations", "kernel", "epilogue", "rms_norm", "residual"}),
    unprepare=unprepare,
    fusions=fusions,
)
register(BACKEND)
