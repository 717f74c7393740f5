"""First-use self-test gate for GEMM backends that cannot be checked in CI (no Blackwell GPU here).

A backend whose kernels were only compiled, never run, calls

    selftest_passed(backend_name, run_fn, device, format_pairs)

from its `available(device)`. On the first call per (backend, device) it runs a small problem per
(activation format, weight format) pair and per operand order (a decode-sized M and a prefill-sized
M) through `run_fn(x, w, bias, act_fmt) -> y`, compares with float64 math on the dequantized
operands, and caches the verdict. On a mismatch, an exception or a NaN it warns once with the
error figures and returns False, so the dispatcher moves on to the next backend.

The inputs are chosen so that quantizing the activations is lossless in every format (E2M1 codes
times a power of two, with a +-6 in every 16-element block, so the block maximum fixes the scale
exactly): a backend that quantizes activations (W4A4) and one that does not (W4A16) must then both
match float64 to output rounding. Any layout, indexing or scaling bug gives O(1) errors.
"""

import warnings
from typing import Callable, Iterable

import torch

from ..formats.codec import E2M1_VALUES
from ..formats.spec import E2M1_MAX, get_format
from ..formats.tensor import QTensor
from ..quant.reference import quantize

# Small ragged problems: N and K are not multiples of any tile; M covers both operand orders.
SELFTEST_MS = (5, 40, 150)
SELFTEST_N = 264
SELFTEST_K = 320
# bf16 output rounding is 2^-8 relative; allow 2^-7. The accumulation term covers fp32 sums that
# cancel: |error| <= 2^-7 |y| + 2^-14 (|x| @ |w|^T).
REL_TOL = 2.0**-7
ACC_TOL = 2.0**-14

RunFn = Callable[[torch.Tensor, QTensor, torch.Tensor, str], torch.Tensor]
_VERDICTS: dict = {}


def lossless_activations(m: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[m, k] bf16 values that NVFP4, MXFP4 and MXFP8 quantization all represent exactly.

    Each 32-element block is E2M1 values times 2^e (e in [-3, 3]) with +-6 * 2^e at the start
    of both 16-element halves, so every block maximum is 6 * 2^e and the tensor maximum 6 * 8.
    """
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = values[torch.randint(0, len(E2M1_VALUES), (m, k), generator=generator)]
    codes[:, ::16] = E2M1_MAX
    signs = torch.randint(0, 2, (m, k), generator=generator) * 2 - 1
    exponents = torch.randint(-3, 4, (m, (k + 31) // 32), generator=generator)
    exponents[0, 0] = 3  # pin the tensor maximum (48), so the NVFP4 global scale is 2688 / 48 = 56
    exponents = exponents.repeat_interleave(32, 1)[:, :k]
    return (codes * signs * torch.exp2(exponents.float())).to(torch.bfloat16)


def _case(run_fn: RunFn, act: str, wt: str, m: int, device: torch.device, generator: torch.Generator) -> dict:
    x = lossless_activations(m, SELFTEST_K, generator)
    w = quantize(torch.randn(SELFTEST_N, SELFTEST_K, generator=generator), wt).to(device)
    bias = torch.randn(SELFTEST_N, generator=generator).to(torch.bfloat16)
    w64 = w.dequantize().double().cpu()
    want = x.double() @ w64.T + bias.double()
    bound = REL_TOL * want.abs() + ACC_TOL * (x.double().abs() @ w64.abs().T)
    got = run_fn(x.to(device), w, bias.to(device), act).double().cpu()
    if tuple(got.shape) != tuple(want.shape):
        return dict(error=f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    err = (got - want).abs()
    bad = ~(err <= bound)  # NaN counts as bad
    return dict(max_rel_err=float((err.nan_to_num(float("inf")).max() / want.abs().max())),
                bad=int(bad.sum()), nan=int(got.isnan().sum()), total=got.numel())


def run_selftest(run_fn: RunFn, device, format_pairs: Iterable) -> list:
    """[(label, figures)] for every case that failed; empty when all pass. Seeded, device-independent."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(20261129)
    failures = []
    for act, wt in format_pairs:
        act, wt = get_format(act).name, get_format(wt).name
        for m in SELFTEST_MS:
            label = f"{act} x {wt} weights, M={m} N={SELFTEST_N} K={SELFTEST_K}"
            try:
                figures = _case(run_fn, act, wt, m, device, generator)
            except Exception as exc:  # a kernel that fails to compile or launch fails the gate
                figures = dict(error=f"{type(exc).__name__}: {exc}")
            if "error" in figures or figures["bad"]:
                failures.append((label, figures))
    return failures


def selftest_passed(backend_name: str, run_fn: RunFn, device, format_pairs: Iterable) -> bool:
    """Run the self-test once per (backend, device); warn once and return False on any failure."""
    device = torch.device(device)
    key = (backend_name, str(device))
    if key not in _VERDICTS:
        failures = run_selftest(run_fn, device, format_pairs)
        if failures:
            lines = "\n".join(f"  {label}: {figures}" for label, figures in failures)
            warnings.warn(f"microscale: backend {backend_name!r} failed its self-test on {device} and is disabled "
                          f"(the dispatcher falls back to the next backend):\n{lines}", RuntimeWarning, stacklevel=2)
        _VERDICTS[key] = not failures
    return _VERDICTS[key]


def backend_run_fn(backend) -> RunFn:
    """The run_fn for a dispatch Backend: prepare W, then its gemm, asking for quantized activations
    in the pair's activation format when the backend takes that option (else it gets float x)."""

    def run(x: torch.Tensor, w: QTensor, bias: torch.Tensor, act_fmt: str) -> torch.Tensor:
        data, scale, g = backend.prepare(w)
        n, k = w.shape
        options = {"activations": act_fmt} if "activations" in backend.options else {}
        return backend.gemm(x, data, scale, g, bias, fmt=w.fmt.name, n=n, k=k, options=options)

    return run
