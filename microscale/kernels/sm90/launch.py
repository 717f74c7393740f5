"""Host side of the Hopper kernels: launch configuration and the three GEMM paths.

    decode_gemm    small M: weights dequantized in registers into mma.sync (decode.py)
    wgmma_gemm     larger M (and some M = 9-32, wgmma_beats_decode): weights dequantized per K step in
                   registers, wgmma with them as A or with them stored to shared memory (wgmma.py)
    dequant_gemm   large M: W dequantized to x's dtype, then cuBLAS; large weights chunk by chunk,
                   each chunk's GEMM running while the next chunk is dequantized on a side stream
    fp8_gemm       large M, opt-in (MX formats): weights transcoded to E4M3 with a per-row power of
                   two (once per weight, cached), activations quantized per row to E4M3,
                   torch._scaled_mm (cuBLAS FP8)

All take the tensors `prepare` made (layout.shuffle_weights) and return y [M, N] in x's dtype.
"""

import contextlib
import functools
import math
import os
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...formats.spec import E4M3_MAX
from ..gated import PAIR_ROWS
from ..quantize import _e4m3_bits
from . import decode, wgmma
from .layout import K_STEP, ROW_GROUP, padded_shape

E4M3_LIMIT = tl.constexpr(E4M3_MAX)


@dataclass(frozen=True)
class DecodeConfig:
    num_warps: int = 4
    reps: int = 2  # 16-row groups per warp: a program covers 16 * num_warps * reps rows
    unroll: int = 2  # K steps of 64 per tile
    depth: int = 2  # tiles in flight (loaded ahead of the one being multiplied)
    block_m: int = 16  # the MMA's N side (8, 16 or 32): activation rows per program times parts
    split: int = 0  # K splits; 0 = chosen from the grid size
    ctas_per_sm: int = 4  # target programs per SM when the split is chosen
    # K parts inside a program (dividing reps): a warp's row groups take parts of K, and each part's
    # activation rows take block_m // parts columns of the MMA, so the parts are summed in registers
    # instead of through the split-K workspace
    parts: int = 1

    @property
    def block_n(self) -> int:
        """Weight rows per program."""
        return ROW_GROUP * self.num_warps * self.reps // self.parts

    @property
    def rows_m(self) -> int:
        """Activation rows per program."""
        return self.block_m // self.parts


SMALL_WEIGHT = 4096 * 4096  # elements: at M = 9-16 such a weight runs the M <= 8 tile over 8-row m tiles
WIDE_WEIGHT = 1 << 27  # elements: an FP4 weight this large with N > K keeps one K part per program at M <= 4


def decode_config(m: int, n: int, k: int, fmt_code: int) -> DecodeConfig:
    """Tile choice for the decode kernel, from the sweeps and interleaved A/B runs on the H200
    (bench/gemm.py --sweep, bench/results/sweep_h200.json; us are NVFP4 unless said).

    Up to M = 8 (and M = 9-16 on weights of at most SMALL_WEIGHT elements): the MMA's 8 activation
    columns, 2 K steps per tile. FP4 weights at M <= 4 take two K parts per program (two row groups
    per warp, each in its own half of K, their activation rows in columns 0-3 and 4-7, summed in
    registers): fewer K splits, so less split-K fix-up (session 12, runs 12d/12e: M = 1 8192x28672
    38.0 -> 35.9 us, 4096x14336 13.9 -> 12.7, 8192x8192 14.4 -> 13.8; M = 2-4 4-10% faster), except
    on weights above WIDE_WEIGHT with N > K (28672x8192: 37.4 -> 38.2), where the one-part tile keeps
    twice the bytes in flight. Otherwise one row group per warp; FP4 at M = 1 and 9-16 two tiles in
    flight at about 4 programs per SM, else one tile at 8 per SM (MXFP8 M = 1, session 11: 7-10%
    faster than two tiles at 4; FP4 M = 5-8, session 12: 3-9% faster than two row groups per warp with
    two tiles; but FP4 M = 16 at 4096x4096 took 9.6 us with one tile at 8 per SM against 9.1 with
    two at 4 in the session-12 benchmark).
    At M = 9-16 the small weight's 8-row m tiles run side by side (the second read of a weight tile
    comes from L2): 4096x4096, M = 16, 9.5 / 11.4 us against 11.3 / 13.5 for the 16-column tile
    (NVFP4 / MXFP8, session 11, runs 11a-b); on larger weights the doubled decode made it 20-50% slower.
    M = 9-16 otherwise: 16 columns, two row groups per warp, one tile in flight. Above, 32 columns,
    2 K steps per tile, 2 in flight (M = 17 and 32 sweep, session 5: beat 1 per tile on 23 of 24
    format x shape x M cases, by up to 45%)."""
    if m <= 8 or (m <= 16 and n * k <= SMALL_WEIGHT):
        fp4 = fmt_code != decode.FMT_CODE["mxfp8"]
        kt = padded_shape(n, k)[1] // K_STEP
        if fp4 and m <= 4 and kt % 4 == 0 and not (n * k > WIDE_WEIGHT and n > k):
            return DecodeConfig(num_warps=4, block_m=8, reps=2, parts=2, unroll=2, depth=1, ctas_per_sm=4)
        if fp4 and (m == 1 or m > 8):
            return DecodeConfig(num_warps=4, block_m=8, reps=1, unroll=2, depth=2, ctas_per_sm=4)
        return DecodeConfig(num_warps=4, block_m=8, reps=1, unroll=2, depth=1, ctas_per_sm=8)
    if m <= 16:
        return DecodeConfig(num_warps=4, block_m=16, reps=2, unroll=2, depth=1, ctas_per_sm=4)
    return DecodeConfig(block_m=32, reps=2, unroll=2, depth=2, ctas_per_sm=2)


def _split_for(cfg, tiles: int, max_split: int, sms: int, resident_per_sm: int = 0) -> int:
    """K splits for about cfg.ctas_per_sm programs per SM (at most max_split), unless cfg.split fixes it.

    resident_per_sm: how many programs of the kernel fit on an SM at once. When the split would
    launch more than one full wave of them, it is cut to one wave: the few programs of a second,
    partial wave run alone at the end (the M = 16 sweep on the H200 measured 15-25% slower at
    1.02-1.09 waves than at 0.7-0.97, bench/results/sweep_h200.json run 4)."""
    if cfg.split:
        return cfg.split
    split = max(1, min(max_split, math.ceil(cfg.ctas_per_sm * sms / tiles)))
    wave = resident_per_sm * sms
    if resident_per_sm and split > 1 and tiles * split > wave:
        split = max(1, wave // tiles)
    return split


def resident_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props) -> int:
    """Programs of a kernel one SM holds at once, from its registers per thread and shared memory:
    64K registers per SM allocated per warp in units of 256, and 1 KB of shared memory reserved per
    block (CUDA occupancy rules of sm_80 to sm_90)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    by_smem = props.shared_memory_per_multiprocessor // (shared_bytes + 1024)
    return max(1, min(by_regs, by_threads, by_smem, 32))


_RESIDENT: dict = {}


def _resident_programs(kernel, args, constexprs: dict, num_warps: int, device) -> int:
    """resident_per_sm of `kernel` compiled for these arguments (compiled once, cached; the
    split-dependent integer arguments may specialize the launched variant a little differently)."""
    key = (kernel.__name__, tuple(sorted(constexprs.items())), args[0].dtype, args[5].dtype, device)
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **constexprs, num_warps=num_warps)
        compiled._init_handles()  # loads the binary: n_regs is known from here on
        _RESIDENT[key] = resident_per_sm(compiled.n_regs, compiled.metadata.shared, num_warps,
                                         torch.cuda.get_device_properties(device))
    return _RESIDENT[key]


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


PDL_ENV = "MICROSCALE_PDL"


def programmatic_launch(device: torch.device) -> bool:
    """Whether the decode kernels go out as programmatic dependent launches (PDL, sm_90+): such a kernel starts
    while the kernel before it finishes, loads its first weight tiles, and waits for that kernel before it
    touches anything else; it releases the next kernel once its K loop is done. It gains where the kernels
    around it do the same, as Inductor's do with TORCHINDUCTOR_ENABLE_PDL=1 (bench/e2e.py way (e)), so it
    follows Inductor's setting unless MICROSCALE_PDL is 1 or 0. Back to back with itself (bench/gemm.py's pdl_us,
    session 35) decode_ws ran 2-21% faster than as plain launches (NVFP4 M = 1 8192x8192 12.8 -> 11.3 us,
    28672x8192 36.8 -> 34.6); the Triton decode kernel from 4% slower to 7% faster."""
    forced = os.environ.get(PDL_ENV)
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"{PDL_ENV}={forced!r}: 1 (programmatic launches), 0 (plain ones) or unset (as Inductor's)")
    inductor = sys.modules.get("torch._inductor.config")  # not imported: Inductor compiles nothing here
    wanted = forced == "1" if forced in ("0", "1") else inductor is not None and inductor.triton.enable_pdl
    return wanted and torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def programmatic_launches(on: bool):
    """Inside, the decode kernels go out as programmatic dependent launches (on) or plain ones, whatever
    MICROSCALE_PDL said before; after, it says that again (unset if it was)."""
    old = os.environ.get(PDL_ENV)
    os.environ[PDL_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[PDL_ENV]
        else:
            os.environ[PDL_ENV] = old


_TICKETS: dict = {}


def _tickets(device, count: int) -> torch.Tensor:
    """Zeroed per-tile counters for the split-K fix-up; the last program of a tile resets its own."""
    t = _TICKETS.get(device)
    if t is None or t.numel() < count:
        t = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = t
    return t


def split_workspace_elems(tiles: int, split: int, tile_elems: int) -> int:
    """fp32 elements of the split-K workspace: one partial output tile per tile and split."""
    return tiles * split * tile_elems if split > 1 else 1


def _split_workspace(workspace, tiles: int, split: int, tile_elems: int, device) -> torch.Tensor:
    need = split_workspace_elems(tiles, split, tile_elems)
    if workspace is None:
        return torch.empty(need, dtype=torch.float32, device=device)
    if workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(f"split-K workspace: need {need} float32 elements ({tiles} tiles x {split} splits x "
                         f"{tile_elems}), got {workspace.numel()} {workspace.dtype}")
    return workspace


def decode_takes_gated(cfg: DecodeConfig) -> bool:
    """Whether the decode kernel applies the gated epilogue (kernels/gated.py) with this tile: up to 8 activation
    rows per program, whose accumulator keeps the MMA layout, where a gate/up row pair sits in one thread."""
    return cfg.rows_m <= 8


def decode_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: DecodeConfig = None,
                out=None, workspace=None, gated: bool = False):
    """out / workspace: preallocated y [M, N] and fp32 split-K buffer (tests poison them). gated: the
    weight's rows are gate/up pairs and y [M, N / 2] = silu(gate) * up (kernels/gated.py)."""
    m = x.shape[0]
    np_, kp = padded_shape(n, k)
    kt = kp // K_STEP
    cfg = cfg or decode_config(m, n, k, fmt_code)
    if gated and (n % (2 * PAIR_ROWS) or not decode_takes_gated(cfg)):
        raise ValueError(f"decode: the gated epilogue needs N = {n} a multiple of {2 * PAIR_ROWS} and "
                         f"at most 8 activation rows per program, not {cfg.rows_m}")
    if np_ % cfg.block_n:
        raise ValueError(f"decode tile of {cfg.block_n} rows does not divide the {np_} padded weight rows "
                         f"(16 x num_warps x reps / parts must divide layout.ROW_ALIGN)")
    if cfg.reps % cfg.parts or cfg.block_m % cfg.parts:
        raise ValueError(f"DecodeConfig.parts={cfg.parts} must divide reps={cfg.reps} and block_m={cfg.block_m}")
    if kt % (cfg.unroll * cfg.parts):  # else the last steps of K would be skipped
        raise ValueError(f"DecodeConfig.unroll={cfg.unroll}, parts={cfg.parts}: K steps per tile times parts must "
                         f"divide the {kt} steps of {K_STEP} of the padded K={kp}")
    part_steps = kt // cfg.parts
    tiles_n = np_ // cfg.block_n
    tiles_m = triton.cdiv(m, cfg.rows_m)
    y = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device) if out is None else out
    tickets = _tickets(x.device, tiles_n * tiles_m)
    constexprs = dict(FMT=fmt_code, HAS_BIAS=bias is not None, SPLIT=True, NW=cfg.num_warps, R=cfg.reps,
                      U=cfg.unroll, BMX=cfg.block_m, DEPTH=cfg.depth, FULL_K=k == kp, KP=cfg.parts,
                      PDL=programmatic_launch(x.device), GATED=gated)
    # workspace (fp32), steps and split are placeholders until the split is known
    args = [x, data, scale, row_mult, bias if bias is not None else row_mult, y, row_mult, tickets,
            m, n, k, kt, 2, 2, x.stride(0), y.stride(0)]
    kernel = decode.decode_gemm_kernel
    resident = 0 if cfg.split else _resident_programs(kernel, args, constexprs, cfg.num_warps, x.device)
    sms = sm_count(device_index(x.device))
    split = _split_for(cfg, tiles_n * tiles_m, part_steps // cfg.unroll // 4, sms, resident)  # >= 4 loop trips
    steps = triton.cdiv(triton.cdiv(part_steps, split), cfg.unroll) * cfg.unroll
    split = triton.cdiv(part_steps, steps)
    ws = _split_workspace(workspace, tiles_m * tiles_n, split, cfg.block_n * cfg.rows_m, x.device)
    args[6], args[12], args[13] = ws, steps, split
    kernel[(tiles_m, tiles_n, split)](*args, **{**constexprs, "SPLIT": split > 1}, num_warps=cfg.num_warps,
                                      launch_pdl=constexprs["PDL"])
    return y


@dataclass(frozen=True)
class WgmmaConfig:
    num_warps: int = 4  # 16 * reps weight rows per warp
    block_m: int = 128  # activation rows per program (the wgmma's N: 16 to 128)
    depth: int = 3  # weight tiles in flight (registers)
    split: int = 0  # K splits; 0 = chosen from the grid size
    ctas_per_sm: int = 2  # target programs per SM when the split is chosen
    reps: int = 1  # 16-row groups per warp
    # the wgmma's A from the decoded registers (x's columns permuted to match on their way into shared
    # memory) instead of a weight tile stored to shared memory each K step
    rs: bool = False

    @property
    def block_n(self) -> int:
        """Weight rows per program."""
        return ROW_GROUP * self.num_warps * self.reps


# N from which the register-A tile takes two row groups per warp at M = 33-64, and from which (or on weights
# of at most SMALL_WEIGHT elements) it runs about 4 programs per SM at M <= 32
RS_TALL = 16384
RS_MAX_WEIGHT_M128 = 8192 * 8192  # at M = 65-128 the register-A tile on weights below this size


def wgmma_beats_decode(fmt_code: int, m: int, n: int, k: int) -> bool:
    """Whether the wgmma kernel (register-A tile) runs M = 9-32 faster than the decode kernel: on weights
    of at most SMALL_WEIGHT elements, and for MXFP8 at M = 17-32 when N >= K (session 14, runs 14c-14e:
    4096x4096 M = 16 NVFP4 8.7 against 9.6 us, M = 32 10.2 against 11.5; MXFP8 M = 32 28672x8192 81.9
    against 92.4, 8192x8192 27.9 against 30.2; slower on the other weights, by up to 35% at M = 16)."""
    if not 9 <= m <= 32:
        return False
    return n * k <= SMALL_WEIGHT or (fmt_code == decode.FMT_CODE["mxfp8"] and m > 16 and n >= k)


def wgmma_config(m: int, n: int, k: int) -> WgmmaConfig:
    """From the sweeps on the H200 (bench/results/sweep_h200.json; session 14, runs 14d/14e, 7 weights,
    NVFP4 and MXFP8). Up to M = 64, and on weights below RS_MAX_WEIGHT_M128 elements up to M = 128, the
    wgmma takes A from the decoded registers: at M = 64 faster than the shared-memory tile on all 14
    cases (28672x8192 NVFP4 125.9 -> 94.6 us, 8192x8192 36.5 -> 33.5), at M = 128 on those weights by
    15-30% (4096x4096 28.2 -> 19.7), slower on the larger ones (28672x8192 152.6 -> 171.7). One row group
    per warp and three tiles in flight, except two row groups and two tiles for N >= RS_TALL at M > 32;
    about 2 programs per SM, 4 at M <= 32 for N >= RS_TALL or small weights. Otherwise two warpgroups,
    128 activation rows, the decoded tile stored to shared memory (bench/gemm.py --sweep --kernel wgmma)."""
    if m <= 64 or (m <= 128 and n * k < RS_MAX_WEIGHT_M128):
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        if m > 32 and n >= RS_TALL:
            return WgmmaConfig(num_warps=4, block_m=block_m, reps=2, depth=2, ctas_per_sm=2, rs=True)
        ctas = 4 if m <= 32 and (n >= RS_TALL or n * k <= SMALL_WEIGHT) else 2
        return WgmmaConfig(num_warps=4, block_m=block_m, reps=1, depth=3, ctas_per_sm=ctas, rs=True)
    return WgmmaConfig(num_warps=8, block_m=128, depth=3, ctas_per_sm=1)


def wgmma_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, cfg: WgmmaConfig = None, out=None,
               workspace=None):
    m = x.shape[0]
    np_, kp = padded_shape(n, k)
    kt = kp // K_STEP
    cfg = cfg or wgmma_config(m, n, k)
    if np_ % cfg.block_n:
        raise ValueError(f"wgmma tile of {cfg.block_n} rows does not divide the {np_} padded weight rows")
    tiles_m, tiles_n = triton.cdiv(m, cfg.block_m), np_ // cfg.block_n
    sms = sm_count(device_index(x.device))
    split = _split_for(cfg, tiles_m * tiles_n, kt // 8, sms)  # >= 8 K steps per program
    steps = triton.cdiv(kt, split)
    split = triton.cdiv(kt, steps)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    ws = _split_workspace(workspace, tiles_m * tiles_n, split, cfg.block_n * cfg.block_m, x.device)
    wgmma.wgmma_gemm_kernel[(tiles_m, tiles_n, split)](
        x, data, scale, row_mult, bias if bias is not None else row_mult, y, ws, _tickets(x.device, tiles_m * tiles_n),
        m, n, k, kt, steps, split, x.stride(0), y.stride(0),
        FMT=fmt_code, HAS_BIAS=bias is not None, SPLIT=split > 1, NW=cfg.num_warps, BM=cfg.block_m, DEPTH=cfg.depth,
        R=cfg.reps, RS=cfg.rs, num_warps=cfg.num_warps,
    )
    return y


@dataclass(frozen=True)
class DequantConfig:
    """Tile of dequant_kernel: 16 * num_warps * reps rows (dividing layout.ROW_ALIGN) by 64 * unroll K."""
    num_warps: int = 4
    reps: int = 1
    unroll: int = 2


# One tile of 8 warps, 128 rows by 64 K, per program, for every format (bench/dequant_probe.py on the H200:
# FP4 2.3-2.8 TB/s against 1.9-2.1 for 4 warps by 128 K). MXFP8 took 256 x 256 tiles until its words were
# bit-placed (layout.FP8_BITS, session 16): that tile then needed 124 registers instead of 180, ran two
# programs per SM instead of one and took 35% longer; this one takes 4-6% longer than the old 256 x 256
# kernel on the 8192 x 8192 and 28672 x 8192 weights and 3% less on 4096 x 4096 (sweep_h200.json run 16g).
DEQUANT_TILE = DequantConfig(num_warps=8, reps=1, unroll=1)


def dequantize_rows(data, scale, row_mult, fmt_code: int, n0: int, rows: int, kp: int, out: torch.Tensor,
                    cfg: DequantConfig = None):
    """out[:rows, :kp] = W[n0 : n0+rows] in out's dtype (rows a multiple of the tile's)."""
    kt = kp // K_STEP
    cfg = cfg or DEQUANT_TILE
    rg0 = n0 // ROW_GROUP
    tile_rows = ROW_GROUP * cfg.num_warps * cfg.reps
    if rows % tile_rows or kt % cfg.unroll:
        raise ValueError(f"dequantize_rows: a {tile_rows} x {cfg.unroll * K_STEP} tile does not divide the "
                         f"{rows} x {kp} weight")
    decode.dequant_kernel[(rows // tile_rows, kt // cfg.unroll)](
        data[rg0:], scale[rg0:], row_mult[n0:], out, row_mult, kt, out.stride(0), 1.0,
        FMT=fmt_code, TO_FP8=False, NW=cfg.num_warps, R=cfg.reps, U=cfg.unroll, num_warps=cfg.num_warps,
    )


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One extra stream per device, on which dequant_gemm dequantizes the next chunk."""
    index = device_index(device)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def dequant_chunk_rows(m: int, np_: int, kp: int) -> int:
    """Weight rows per chunk for dequant_gemm: about 4M output elements per chunk's GEMM (one wave of
    128 x 256 cuBLAS tiles on 132 SMs), at least 1024 and a multiple of 256; 0 (the whole weight at
    once) for weights under 32M elements or when that makes fewer than 4 chunks. On the H200
    (bench/dequant_probe.py) chunks of 1024-2048 rows of the 8192 x 8192, 28672 x 8192 and
    8192 x 28672 weights run as fast as the whole weight, within run-to-run noise, in a fraction of its
    workspace; the 4096 x 4096 weight measured 4-8% slower in chunks (bench/gemm.py)."""
    rows = max(1024, (1 << 22) // max(m, 1) // 256 * 256)
    return 0 if np_ * kp < (1 << 25) or 4 * rows > np_ else rows


def dequant_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int, chunk_rows: int = None,
                 workspace=None, cfg: DequantConfig = None):
    """y = x @ W^T (+ bias) through cuBLAS on W dequantized to x's dtype.

    chunk_rows = 0 dequantizes all of W into one workspace, then runs one GEMM. Otherwise (None:
    dequant_chunk_rows) W goes chunk_rows rows at a time through two workspaces: chunk i + 1 is
    dequantized on a side stream while the GEMM of chunk i runs, and each chunk's GEMM writes its
    columns of y in place (cuBLAS takes y's row stride). The workspaces take 2 x chunk_rows rows
    instead of all of W (28672 x 8192 at M = 4096: 32 MB instead of 470 MB).
    """
    m = x.shape[0]
    np_, kp = padded_shape(n, k)
    chunk_rows = dequant_chunk_rows(m, np_, kp) if chunk_rows is None else chunk_rows
    if not chunk_rows or chunk_rows >= np_:
        ws = torch.empty(np_, kp, dtype=x.dtype, device=x.device) if workspace is None else workspace
        dequantize_rows(data, scale, row_mult, fmt_code, 0, np_, kp, ws, cfg)
        y = torch.mm(x, ws[:n, :k].t()) if bias is None else torch.addmm(bias.to(x.dtype), x, ws[:n, :k].t())
        return y
    bias = bias.to(x.dtype) if bias is not None else None
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    workspaces = [torch.empty(chunk_rows, kp, dtype=x.dtype, device=x.device) for _ in range(2)]
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    side.wait_stream(main)  # x, W and the workspaces are ready
    read = [None, None]  # the event after the GEMM that last read each workspace
    for i, n0 in enumerate(range(0, n, chunk_rows)):
        ws = workspaces[i % 2]
        with torch.cuda.stream(side):
            if read[i % 2] is not None:
                side.wait_event(read[i % 2])
            dequantize_rows(data, scale, row_mult, fmt_code, n0, min(chunk_rows, np_ - n0), kp, ws, cfg)
            written = torch.cuda.Event()
            written.record(side)
        main.wait_event(written)
        cols = min(chunk_rows, n - n0)
        if bias is None:
            torch.mm(x, ws[:cols, :k].t(), out=y[:, n0:n0 + cols])
        else:
            torch.addmm(bias[n0:n0 + cols], x, ws[:cols, :k].t(), out=y[:, n0:n0 + cols])
        read[i % 2] = torch.cuda.Event()
        read[i % 2].record(main)
    main.wait_stream(side)
    return y


# ---- FP8 path -------------------------------------------------------------------------------------
# decoded register w' -> E4M3 weight: W = w' * row_mult = (w' * F) * (row_mult / F), F = 2**FP8_SHIFT,
# chosen so a row's largest block (code MX_TOP_CODE) lands just under 448 (MXFP4: 12 * 32 = 384;
# MXFP8: 448 * 2**7 * 2**-7); blocks of a row within 2**14 (MXFP4) or of equal exponent (MXFP8) stay exact.
FP8_SHIFT = {1: 5, 2: -7}


def transcode_e4m3(data, scale, row_mult, fmt_code: int, n: int, k: int, inexact: torch.Tensor):
    """MX weights -> (E4M3 [Np, Kp], per-row float32 scale [Np]); adds the count of elements that
    E4M3 could not hold exactly to `inexact` (int32, on the device)."""
    np_, kp = padded_shape(n, k)
    factor = 2.0 ** FP8_SHIFT[fmt_code]
    w8 = torch.empty(np_, kp, dtype=torch.float8_e4m3fn, device=data.device)
    decode.dequant_kernel[(np_ // 64, kp // K_STEP // 2)](
        data, scale, row_mult, w8, inexact, kp // K_STEP, kp, factor,
        FMT=fmt_code, TO_FP8=True, NW=4, R=1, U=2, num_warps=4,
    )
    return w8, row_mult / factor


@triton.jit
def _e4m3_row_bits(v, HW_CVT: tl.constexpr):
    v = tl.minimum(tl.maximum(v, -E4M3_LIMIT), E4M3_LIMIT)
    if HW_CVT:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_bits(v).to(tl.uint8)


@triton.jit
def _rowwise_e4m3_kernel(X, Q, S, K, Kp, stride_xm, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                         HW_CVT: tl.constexpr):
    """Q[row] = e4m3(X[row] * 448 / amax(row)) (zero padded to Kp), S[row] = amax / 448 (1 for a zero row).

    One chunk keeps the row in registers (one read of x); HW_CVT rounds with the GPU's cvt instruction,
    the integer path (_e4m3_bits, same bits) serves the interpreter, whose float8 casts are not RNE.
    """
    row = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    base = X + row.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        x = tl.load(base + c * BLOCK_K + ks, mask=c * BLOCK_K + ks < K, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    amax = tl.max(acc, axis=0)
    scale = tl.where(amax > 0, tl.div_rn(amax, E4M3_LIMIT), 1.0)
    inv = tl.div_rn(tl.full([1], E4M3_LIMIT, tl.float32), tl.where(amax > 0, amax, E4M3_LIMIT))
    for c in tl.static_range(CHUNKS):
        if CHUNKS > 1:
            x = tl.load(base + c * BLOCK_K + ks, mask=c * BLOCK_K + ks < K, other=0.0).to(tl.float32)
        q = _e4m3_row_bits(x * inv, HW_CVT)
        tl.store(Q + row.to(tl.int64) * Kp + c * BLOCK_K + ks, q, mask=c * BLOCK_K + ks < Kp)
    tl.store(S + row, scale)


def quantize_rows_e4m3(x: torch.Tensor, kp: int):
    """Per-row (per-token) E4M3 quantization: (q [M, kp] float8_e4m3fn, scale [M, 1] float32)."""
    m, k = x.shape
    q = torch.empty(m, kp, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(kp), 16384)
    _rowwise_e4m3_kernel[(m,)](x, q, s, k, kp, x.stride(0), BLOCK_K=block, CHUNKS=triton.cdiv(kp, block),
                               HW_CVT=os.environ.get("TRITON_INTERPRET") != "1", num_warps=8)
    return q.view(torch.float8_e4m3fn), s


# transcoded weights, kept while the prepared data tensor lives (the FP8 path is opt-in: its E4M3 copy
# costs one byte per weight on top of the MX tensors)
_E4M3_CACHE: dict = {}  # id(data) -> (weakref to data, key, value); dropped when data is freed


def transcoded(data, scale, row_mult, fmt_code: int, n: int, k: int):
    """(E4M3 weights, per-row scale, inexact count) for prepared MX weights, transcoded once.

    Elements E4M3 cannot hold exactly (a row whose block exponents span more than E4M3 covers) are
    counted; a non-zero count is reported once with a warning."""
    key = (scale.data_ptr(), n, k)
    hit = _E4M3_CACHE.get(id(data))
    if hit is not None and hit[0]() is data and hit[1] == key:
        return hit[2]
    inexact = torch.zeros(1, dtype=torch.int32, device=data.device)
    w8, w_scale = transcode_e4m3(data, scale, row_mult, fmt_code, n, k, inexact)
    count = int(inexact.item())
    if count:
        warnings.warn(f"sm90 fp8 path: {count} of {n * k} weights of a [{n}, {k}] MX tensor are not exact in E4M3 "
                      "(a row's block exponents span more than E4M3 holds); they are rounded")
    _E4M3_CACHE[id(data)] = (weakref.ref(data), key, (w8, w_scale, count))
    weakref.finalize(data, _E4M3_CACHE.pop, id(data), None)
    return w8, w_scale, count


def fp8_gemm(x, data, scale, row_mult, bias, fmt_code: int, n: int, k: int):
    """y ~= x @ W^T with E4M3 activations (per-row scales) and E4M3 weights (per-row powers of two)."""
    np_, kp = padded_shape(n, k)
    w8, w_scale, _ = transcoded(data, scale, row_mult, fmt_code, n, k)
    x8, x_scale = quantize_rows_e4m3(x, kp)
    y = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, np_), out_dtype=torch.bfloat16)
    y = y[:, :n] if np_ != n else y
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)
