"""Host-side operand preparation shared by the sm100 backends (Triton tcgen05 and cuBLAS).

Both read K-major codes and the 128x4 swizzled scale tables of microscale.formats as they are;
the only re-layout is zero padding: K to a multiple of K_ALIGN elements (16-byte rows for TMA and
cuBLAS) and, for cuBLAS, rows to what it accepts. Zero codes contribute nothing whatever their
scale, and the swizzled tables are already zero-padded to 128 rows and 4 scale columns.
"""

import torch

from ...formats.spec import FormatSpec, get_format
from ...formats.tensor import QTensor

K_ALIGN = 32  # elements: 16 bytes of E2M1, and a whole MX block


def ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def check_format_pair(act, wt) -> tuple:
    """(activation spec, weight spec); NVFP4 pairs only with NVFP4, the MX formats mix freely."""
    act, wt = get_format(act), get_format(wt)
    if (act.scale == "e4m3") != (wt.scale == "e4m3"):
        raise ValueError(f"sm100 block-scaled GEMM: {act.name} activations cannot pair with {wt.name} weights "
                         "(one tcgen05 MMA takes either E4M3 (NVFP4) or E8M0 (MX) scales)")
    return act, wt


def pad_codes(data: torch.Tensor, fmt: FormatSpec, rows: int = 0) -> torch.Tensor:
    """Zero-pad code bytes [R, K bytes] to K a multiple of K_ALIGN and to at least `rows` rows."""
    r, k_bytes = data.shape
    want_k = ceil_to(k_bytes, K_ALIGN // 2 if fmt.packed else K_ALIGN)
    want_r = max(r, rows)
    if (want_r, want_k) == (r, k_bytes):
        return data.contiguous()
    return torch.nn.functional.pad(data.view(torch.uint8), (0, want_k - k_bytes, 0, want_r - r)).view(data.dtype)


def padded_k_bytes(k: int, fmt: FormatSpec) -> int:
    k = ceil_to(k, K_ALIGN)
    return k // 2 if fmt.packed else k


def prepare_weight(w: QTensor, row_align: int = 1) -> tuple:
    """QTensor -> (codes [ceil(N, row_align), K bytes], swizzled scales, global scale or None); once per weight."""
    w = w.with_scale_layout("swizzled")
    return pad_codes(w.data, w.fmt, ceil_to(w.shape[0], row_align)), w.scale.contiguous(), w.global_scale
