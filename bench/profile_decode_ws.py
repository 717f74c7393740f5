"""Four calls of the dispatch's M-row kernel on a fresh weight, for a profiler to take one of (the H200).

    PYTHONPATH=. ncu --clock-control none -k regex:decode_ws --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters -o <report> \
        python3 bench/profile_decode_ws.py nvfp4 28672 8192 [M]

Then `ncu -i <report> --page source --csv --print-source sass` gives the stall samples per SASS instruction
(docs/hopper.md, "ncu of decode_ws at M = 1", session 45).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s modules
from gemm import _weights  # noqa: E402

from microscale.kernels import sm90  # noqa: E402


def main(fmt: str, n: int, k: int, m: int = 1):
    _, q = _weights(n, k, fmt, 0)
    prepared = sm90.prepare(q)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        y = sm90.gemm(x, *prepared, None, fmt=fmt, n=n, k=k, options={})
    torch.cuda.synchronize()
    print(fmt, n, k, m, "mean |y|", y.float().abs().mean().item())


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
