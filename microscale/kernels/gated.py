"""Gated projection pairs: silu(x Wg^T) * (x Wu^T) from one GEMM, the product in its epilogue.

Inference engines run an MLP's gate and up projections as one GEMM and apply SiLU and the product to
its output in a second kernel (vLLM's silu_and_mul). Here the decode kernels do it in their epilogue
and store N outputs instead of 2N, so the second kernel is gone from the decode step. For that the
fused weight's rows alternate in blocks of PAIR_ROWS: gate rows 0-7, up rows 0-7, gate rows 8-15, ...
In an mma.sync m16n8 accumulator one thread holds rows g and g + 8 of each 16-row group, so gate row i
and up row i meet in one thread without data movement. The order is a runtime layout of fused layers
(models.linear.fuse_gated); checkpoints keep the separate projections.

Kernels that do not take the epilogue compute the 2N interleaved outputs, and `silu_mul` finishes them.
"""

import torch

PAIR_ROWS = 8
EPILOGUES = ("silu_mul",)


def check_epilogue(epilogue):
    """None (a plain linear) or one of EPILOGUES; anything else raises."""
    if epilogue is not None and epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}; accepted: None, {', '.join(map(repr, EPILOGUES))}")
    return epilogue


def output_features(n: int, epilogue) -> int:
    """Outputs of a GEMM over n weight rows: n, or n / 2 pairs with a gated epilogue."""
    return n if epilogue is None else n // 2


def interleave_index(n: int, device=None) -> torch.Tensor:
    """Row r of the fused [2n, K] weight is row interleave_index(n)[r] of cat([gate, up]) (n gate rows,
    then n up rows); n must be a multiple of PAIR_ROWS."""
    if n % PAIR_ROWS:
        raise ValueError(f"gated pairs: {n} gate rows is not a multiple of {PAIR_ROWS} (the interleave block)")
    rows = torch.arange(n, device=device).view(-1, 1, PAIR_ROWS)
    return torch.cat([rows, rows + n], dim=1).reshape(-1)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """[..., 2n] outputs of the interleaved weight -> silu(gate) * up [..., n], computed in float32 and
    returned in y's dtype."""
    pairs = y.float().unflatten(-1, (-1, 2, PAIR_ROWS))
    gate, up = pairs.unbind(-2)
    return (torch.nn.functional.silu(gate) * up).flatten(-2).to(y.dtype)
