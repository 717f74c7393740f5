"""QTensor: a quantized 2-D weight [N, K] in one of the block-scaled formats.

A plain dataclass rather than a torch.Tensor subclass: kernels, modules and checkpoint
code take its fields (data, scale, global_scale) explicitly, modules register them as
buffers, and torch.compile sees only ordinary tensors. The class owns the invariants
(dtypes and shapes against the format and scale layout) and the dequantization rule.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .codec import e2m1_decode, e4m3_decode, e8m0_decode
from .packing import unpack_fp4
from .scale_layout import swizzle_scales_128x4, swizzled_scale_shape, unswizzle_scales_128x4
from .spec import FormatSpec, get_format

SCALE_LAYOUTS = ("linear", "swizzled")


def padded_k(k: int, block: int) -> int:
    return (k + block - 1) // block * block


@dataclass
class QTensor:
    """Quantized weight W [N, K] (logical shape), K zero-padded to a whole block.

    data:         uint8 [N, Kp/2] packed E2M1 (low nibble = even K), or float8_e4m3fn [N, Kp]
    scale:        block scales, e4m3 (NVFP4) or uint8 biased E8M0 (MX);
                  "linear" layout [N, Kp/block], "swizzled" layout [ceil128(N), ceil4(Kp/block)]
    global_scale: NVFP4 only: float32 0-d *encode* scale (compressed-tensors convention,
                  448*6/amax for a computed one); dequantized W = q * (scale / global_scale)
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FormatSpec
    shape: tuple
    global_scale: Optional[torch.Tensor] = None
    scale_layout: str = "linear"
    orig_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        self.fmt = get_format(self.fmt)
        self.shape = tuple(int(s) for s in self.shape)
        self._validate()

    # ---- invariants -------------------------------------------------------------------
    def _validate(self):
        f, name = self.fmt, self.fmt.name
        if len(self.shape) != 2 or min(self.shape) < 1:
            raise ValueError(f"QTensor[{name}]: logical shape must be 2-D and non-empty, got {self.shape}")
        n, kp = self.shape[0], padded_k(self.shape[1], f.block)
        want_data = (n, kp // 2) if f.packed else (n, kp)
        if self.data.dtype != f.data_dtype or tuple(self.data.shape) != want_data:
            raise ValueError(
                f"QTensor[{name}]: data must be {f.data_dtype} of shape {list(want_data)} for logical shape "
                f"{list(self.shape)}, got {self.data.dtype} of shape {list(self.data.shape)}"
            )
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(f"QTensor[{name}]: scale_layout {self.scale_layout!r} not in {SCALE_LAYOUTS}")
        cols = kp // f.block
        want_scale = (n, cols) if self.scale_layout == "linear" else swizzled_scale_shape(n, cols)
        if self.scale.dtype != f.scale_dtype or tuple(self.scale.shape) != tuple(want_scale):
            raise ValueError(
                f"QTensor[{name}]: {self.scale_layout} scale must be {f.scale_dtype} of shape {list(want_scale)}, "
                f"got {self.scale.dtype} of shape {list(self.scale.shape)}"
            )
        if f.global_scale:
            g = self.global_scale
            # Only structure is checked here: a value check would synchronize the GPU on every
            # construction. quantize() and the checkpoint loaders check the value.
            if g is None or g.dtype != torch.float32 or g.numel() != 1:
                raise ValueError(f"QTensor[{name}]: global_scale must be a float32 scalar tensor, got {g!r}")
        elif self.global_scale is not None:
            raise ValueError(f"QTensor[{name}]: this format has no global scale")
        if self.data.device != self.scale.device:
            raise ValueError(f"QTensor[{name}]: data on {self.data.device} but scale on {self.scale.device}")

    # ---- views and copies ---------------------------------------------------------------
    def replace(self, **changes) -> "QTensor":
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "QTensor":
        g = None if self.global_scale is None else self.global_scale.to(device)
        return self.replace(data=self.data.to(device), scale=self.scale.to(device), global_scale=g)

    @property
    def scale_cols(self) -> int:
        return padded_k(self.shape[1], self.fmt.block) // self.fmt.block

    def linear_scale(self) -> torch.Tensor:
        """Block scales as [N, Kp/block], whatever the stored layout."""
        if self.scale_layout == "linear":
            return self.scale
        return unswizzle_scales_128x4(self.scale, self.shape[0], self.scale_cols)

    def with_scale_layout(self, layout: str) -> "QTensor":
        if layout == self.scale_layout:
            return self
        scale = self.linear_scale() if layout == "linear" else swizzle_scales_128x4(self.scale)
        return self.replace(scale=scale, scale_layout=layout)

    def same_codes_and_scales(self, other: "QTensor") -> bool:
        """Whether the element codes and the block scales (as stored) are the same bits as other's;
        the global scale is not compared."""
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in ((self.data, other.data), (self.scale, other.scale)))

    @staticmethod
    def concat_rows(tensors) -> "QTensor":
        """One QTensor whose rows are those of `tensors` in order (linear scale layout): the same codes and
        block scales, so it dequantizes to the concatenated weights bit for bit. They must share the
        format, the number of columns and (NVFP4) the global scale, the one scale every element is
        divided by."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("QTensor.concat_rows: no tensors")
        first = tensors[0]
        for i, t in enumerate(tensors[1:], 1):
            if t.fmt != first.fmt or t.shape[1] != first.shape[1]:
                raise ValueError(f"QTensor.concat_rows: tensor {i} is {t.fmt.name} {list(t.shape)}, tensor 0 is "
                                 f"{first.fmt.name} {list(first.shape)}: the format and columns must match")
            if t.data.device != first.data.device:
                raise ValueError(f"QTensor.concat_rows: tensor {i} is on {t.data.device}, "
                                 f"tensor 0 on {first.data.device}")
            if first.global_scale is not None and not torch.equal(t.global_scale, first.global_scale):
                raise ValueError(f"QTensor.concat_rows: tensor {i} has NVFP4 global scale {t.global_scale.item()!r}, "
                                 f"tensor 0 {first.global_scale.item()!r}: rows under different global scales "
                                 f"cannot share one (quantize them with a shared one, as quantize_model does "
                                 f"for fused projections)")

        def cat(parts):  # through bytes: float8 tensors concatenate as their bits
            return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)
        return QTensor(data=cat([t.data for t in tensors]), scale=cat([t.linear_scale() for t in tensors]),
                       fmt=first.fmt, shape=(sum(t.shape[0] for t in tensors), first.shape[1]),
                       global_scale=first.global_scale, orig_dtype=first.orig_dtype)

    def take_rows(self, index: torch.Tensor) -> "QTensor":
        """The rows `index` (a 1-D integer tensor) in that order, linear scale layout: the same codes and block
        scales per row, and the same global scale."""
        index = torch.as_tensor(index, device=self.data.device)
        if index.dim() != 1 or index.dtype.is_floating_point:
            raise ValueError(f"QTensor.take_rows: index must be a 1-D integer tensor, got {index.dtype} of shape "
                             f"{tuple(index.shape)}")

        def take(t):  # through bytes: float8 tensors are indexed as their bits
            return t.view(torch.uint8)[index].view(t.dtype)
        return QTensor(data=take(self.data), scale=take(self.linear_scale()), fmt=self.fmt,
                       shape=(index.numel(), self.shape[1]), global_scale=self.global_scale,
                       orig_dtype=self.orig_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of data plus block scales as stored (swizzle padding included)."""
        return self.data.numel() * self.data.element_size() + self.scale.numel()

    # ---- dequantization ---------------------------------------------------------------
    def codes_as_float(self) -> torch.Tensor:
        """Element values before scaling, float32 [N, Kp]."""
        if self.fmt.packed:
            return e2m1_decode(unpack_fp4(self.data))
        return e4m3_decode(self.data)

    def block_scale_as_float(self) -> torch.Tensor:
        """Effective per-block multiplier, float32 [N, Kp/block] (global scale folded in)."""
        s = self.linear_scale()
        if self.fmt.scale == "e4m3":
            s = e4m3_decode(s)
        else:
            s = e8m0_decode(s)
        if self.fmt.global_scale:
            s = s / self.global_scale
        return s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = self.codes_as_float().view(n, self.scale_cols, self.fmt.block)
        w = (q * self.block_scale_as_float()[..., None]).view(n, -1)
        return w[:, :k].to(dtype)
