"""GEMM/GEMV and quantize kernels per architecture, behind one dispatch.

Importing this package registers every backend; each decides at call time whether it can run
on the device at hand (docs/dispatch.md has the table).
"""

from .dispatch import Backend, backends, linear, register, select_backend
from . import sm100  # noqa: F401,E402  registers sm100-triton and sm100-cublas
from .sm100 import tcgen05_backend  # noqa: F401,E402  registers sm100-nvrtc
from . import sm90  # noqa: F401,E402  registers sm90
