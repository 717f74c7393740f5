"""Blackwell (sm100) block-scaled GEMM backends: Triton tcgen05 kernels and cuBLAS via torch._scaled_mm.

Importing this package registers "sm100-triton" (when triton is installed) and "sm100-cublas".
Both offer themselves only on a compute-capability-10 GPU, after a first-use self-test
(microscale.kernels.selftest); MICROSCALE_SM100_EMULATE=1 runs the Triton kernels with an
emulated MMA on any sm90+ GPU, for testing.
"""

import importlib.util

from . import cublas_gemm

if importlib.util.find_spec("triton") is not None:
    from . import triton_gemm
