"""FP4Linear and FP8Linear: drop-in nn.Linear replacements holding block-scaled weights.

Buffers (all tensors are buffers, so .to(), state_dict() and meta-device loading work):
  weight_data, weight_scale, weight_global_scale (NVFP4 only), bias (optional)
      the canonical checkpoint layout of formats.QTensor (linear scale layout): persistent.
      weight_data and weight_scale are resident only where the backend reads them as they are
      (the reference) or cannot rebuild them: when its prepared tensors are another layout and its
      Backend.unprepare gives this weight back bit for bit (sm90), prepare() sets them to None and
      the prepared copy is the only one. They are rebuilt from it whenever they are needed: qweight,
      state_dict() (the same keys and bits), load_state_dict, .to() and re-preparing.
  input_global_scale (optional, NVFP4 activations only)
      a static encode scale for the activations (2688/amax of calibrated inputs, as
      compressed-tensors stores it): persistent when set (set_input_global_scale); None means the
      activations get a per-call global scale from their own amax.
  prepared_data, prepared_scale, prepared_global_scale
      what the device's backend reads (dispatch's Backend.prepare): non-persistent, rebuilt
      whenever the module changes device or loads a state_dict. For the reference backend they
      are the canonical tensors themselves, so no memory is spent twice either way.
  prepared_rotation (rotated layers only)
      the normalized Hadamard matrix [b, b] of the rotation, float32; rebuilt with the others.

A rotated layer (`rotation` = b, 16 or 32: an attribute, given at construction and recorded in
checkpoints) holds W R, R block-diagonal with one b x b Hadamard matrix per K block
(quant/hadamard.py), and multiplies x R by it: forward passes the Hadamard matrix to the op
(kernels/ops.py), which rotates quantized activations (W4A4, W8A8) inside the activation quantize
kernel on CUDA where b divides their block, and otherwise (float activations: weight-only; the CPU)
with a torch op before the quantizer or the GEMM.

forward() is one call of the `microscale::linear` custom op (kernels/ops.py) on plain tensors,
so torch.compile(fullgraph=True) and CUDA graph capture see no Python objects. Its `norm` and `residual`
arguments put a decoder's RMSNorm in front of the layer and a residual add behind it (kernels/rmsnorm.py):
`fusions(m)` says whether the kernel for m rows takes them; where it does not, the op runs them as torch
ops inside it, out of Inductor's reach, so a caller under torch.compile runs them itself there.

Fused layers (inference only, like the projections engines fuse): fuse_linears gives one layer for q/k/v
(outputs concatenated), fuse_gated one for an MLP's gate and up projections that returns silu(gate) * up,
its weight rows interleaved in pairs (kernels/gated.py; `epilogue` = "silu_mul"). Save the unfused model.
"""

from typing import Optional

import torch
from torch import nn

from ..formats.spec import FormatSpec, get_format
from ..formats.tensor import QTensor, padded_k
from ..kernels import gated, ops, rmsnorm
from ..kernels.dispatch import get_backend
from ..quant import hadamard, quantize

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CANONICAL_BUFFERS = ("weight_data", "weight_scale", "weight_global_scale", "input_global_scale")
PREPARED_BUFFERS = ("prepared_data", "prepared_scale", "prepared_global_scale", "prepared_rotation")
WEIGHT_BUFFERS = ("weight_data", "weight_scale", "weight_global_scale", "prepared_data", "prepared_scale",
                  "prepared_global_scale")


def _reprepare_after_load(module, incompatible_keys):
    module.prepare()


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + bias with W [out_features, in_features] in a block-scaled format.

    Subclasses fix the element width (FP4Linear: NVFP4/MXFP4, FP8Linear: MXFP8). The constructor
    builds an all-zero layer (like nn.Linear on the meta device, for loading a quantized
    state_dict); from_linear() and from_qtensor() build one from weights. `activations` names a
    format the inputs are quantized to (None: float inputs); `backend` pins a dispatch backend;
    `rotation` (16 or 32) marks weights stored block-wise Hadamard rotated (module docstring).
    """

    elem_bits: int
    default_format: str

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, fmt: Optional[str] = None,
                 activations: Optional[str] = None, backend: Optional[str] = None, device=None,
                 dtype: Optional[torch.dtype] = None, rotation: Optional[int] = None, epilogue: Optional[str] = None):
        super().__init__()
        spec = get_format(fmt or self.default_format)
        if spec.elem_bits != self.elem_bits:
            raise ValueError(f"{type(self).__name__} holds {self.elem_bits}-bit formats; {spec.name} has "
                             f"{spec.elem_bits}-bit elements (use {quantized_linear_class(spec).__name__})")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.fmt: FormatSpec = spec
        self.activations = ops.check_activations(activations)
        if rotation is not None and (rotation not in hadamard.ROTATION_BLOCKS or self.in_features % rotation):
            raise ValueError(f"{type(self).__name__}: rotation={rotation!r} needs a block size in "
                             f"{hadamard.ROTATION_BLOCKS} that divides in_features={self.in_features}")
        self.rotation = rotation
        if gated.check_epilogue(epilogue) and self.out_features % (2 * gated.PAIR_ROWS):
            raise ValueError(f"{type(self).__name__}: epilogue={epilogue!r} needs gate/up row pairs, out_features a "
                             f"multiple of {2 * gated.PAIR_ROWS}, not {self.out_features}")
        self.epilogue = epilogue
        self.backend_override = backend
        self.backend = None  # name of the backend the prepared tensors are for; set by prepare()

        kp = padded_k(self.in_features, spec.block)
        data_cols = kp // 2 if spec.packed else kp
        self.register_buffer("weight_data", torch.zeros(out_features, data_cols, dtype=spec.data_dtype, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, kp // spec.block, dtype=spec.scale_dtype,
                                                         device=device))
        g = torch.ones((), dtype=torch.float32, device=device) if spec.global_scale else None
        self.register_buffer("weight_global_scale", g)
        self.register_buffer("input_global_scale", None)
        b = torch.zeros(out_features, dtype=dtype or torch.float32, device=device) if bias else None
        self.register_buffer("bias", b)
        for name in PREPARED_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self.register_load_state_dict_post_hook(_reprepare_after_load)
        self.prepare()

    # ---- construction from weights -----------------------------------------------------------
    @classmethod
    def from_qtensor(cls, weight: QTensor, bias: Optional[torch.Tensor] = None, *,
                     activations: Optional[str] = None, backend: Optional[str] = None,
                     input_global_scale: Optional[torch.Tensor] = None,
                     rotation: Optional[int] = None, epilogue: Optional[str] = None) -> "QuantizedLinear":
        """A layer holding `weight` (any scale layout; stored linear) and `bias` (kept as given), with a
        static input global scale if one is given (see set_input_global_scale). rotation: the block
        of the Hadamard rotation `weight` was quantized under (it holds W R), or None. epilogue: "silu_mul"
        for a weight of gate/up row pairs (fuse_gated)."""
        out_features, in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"{cls.__name__}.from_qtensor: bias of shape {tuple(bias.shape)} does not match "
                             f"out_features={out_features}")
        layer = cls(in_features, out_features, bias is not None, fmt=weight.fmt, activations=activations,
                    backend=backend, device="meta", rotation=rotation, epilogue=epilogue)
        w = weight.with_scale_layout("linear")
        layer.weight_data, layer.weight_scale, layer.weight_global_scale = w.data, w.scale, w.global_scale
        if bias is not None:
            layer.bias = bias.detach()
        if input_global_scale is not None:
            layer.set_input_global_scale(input_global_scale)  # prepares
        else:
            layer.prepare()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Optional[str] = None, *, activations: Optional[str] = None,
                    global_scale: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                    rotation: Optional[int] = None) -> "QuantizedLinear":
        """Quantize an nn.Linear's weight with the reference quantizer (on the weight's device).

        global_scale: NVFP4 encode scale to use (e.g. one shared by fused projections); computed
        from the weight when None. rotation: quantize W R instead (a rotated layer, module docstring).
        A linear on the meta device gives an all-zero layer of its shape. Other methods than
        round-to-nearest: quantize_model(..., method=...).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.is_meta:
            return cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt,
                       activations=activations, backend=backend, device="meta",
                       dtype=None if linear.bias is None else linear.bias.dtype, rotation=rotation)
        if rotation is not None:
            w = hadamard.rotate(w.float(), rotation)
        q = quantize(w, fmt or cls.default_format, global_scale=global_scale)
        return cls.from_qtensor(q, linear.bias, activations=activations, backend=backend, rotation=rotation)

    # ---- weights and backend ---------------------------------------------------------------
    @property
    def qweight(self) -> QTensor:
        """The canonical weight as a QTensor: sharing storage with the buffers while they are
        resident, else rebuilt from the prepared copy (new tensors each call)."""
        shape = (self.out_features, self.in_features)
        if self.weight_data is None:
            prepared = (self.prepared_data, self.prepared_scale, self.prepared_global_scale)
            return get_backend(self.backend).unprepare(prepared, self.fmt, shape, self.weight_global_scale)
        return QTensor(data=self.weight_data, scale=self.weight_scale, fmt=self.fmt, shape=shape,
                       global_scale=self.weight_global_scale)

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds on its device (bias excluded): the canonical tensors that are
        resident plus the prepared ones that are not those."""
        held = {id(t): t for name in WEIGHT_BUFFERS if (t := self._buffers[name]) is not None}
        return sum(t.numel() * t.element_size() for t in held.values())

    def set_input_global_scale(self, scale) -> None:
        """Quantize the NVFP4 activations with this static encode scale (float32, 2688/amax of the
        calibrated inputs; inputs beyond that amax saturate), or with a per-call one if None."""
        if scale is not None:
            act = None if self.activations is None else get_format(self.activations)
            if act is None or not act.global_scale:
                raise ValueError(f"{type(self).__name__}.set_input_global_scale: a static input global scale needs "
                                 f"NVFP4 activations; this layer has activations={self.activations}")
            held = self.prepared_data if self.weight_data is None else self.weight_data  # where the weight is
            scale = torch.as_tensor(scale, dtype=torch.float32, device=held.device).detach()
            if scale.numel() != 1:
                raise ValueError(f"{type(self).__name__}.set_input_global_scale: expected one value, got shape "
                                 f"{tuple(scale.shape)}")
            scale = scale.reshape(()).clone()
            if not scale.is_meta and not (torch.isfinite(scale) and scale > 0):
                raise ValueError(f"{type(self).__name__}.set_input_global_scale: the scale is {scale.item()}; it "
                                 f"must be finite and > 0")
        self.input_global_scale = scale
        self.prepare()

    def prepare(self) -> None:
        """Select the backend for the weights' device and (re)build its prepared tensors; keep the
        canonical weight_data and weight_scale only if the backend cannot give them back exactly."""
        w = self.qweight
        device = w.data.device
        b = ops.select_linear_backend(self.fmt, device, self.activations, self.backend_override,
                                      static_input=self.input_global_scale is not None)
        prepared = b.prepare(w)
        self.prepared_data, self.prepared_scale, self.prepared_global_scale = prepared
        self.prepared_rotation = None if self.rotation is None else hadamard.hadamard_matrix(
            self.rotation, device=device)
        self.backend = b.name
        # checked on every weight: what the backend's layout does not keep (layout docstrings)
        # is rare in checkpoints, and such a layer simply keeps both copies
        rebuildable = b.unprepare is not None and b.unprepare(prepared, self.fmt, w.shape,
                                                              w.global_scale).same_codes_and_scales(w)
        self.weight_data, self.weight_scale = (None, None) if rebuildable else (w.data, w.scale)

    def _restore_canonical(self) -> None:
        """Make weight_data and weight_scale resident again (rebuilt from the prepared copy)."""
        if self.weight_data is None:
            w = self.qweight
            self.weight_data, self.weight_scale = w.data, w.scale

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        released = self.weight_data is None
        self._restore_canonical()
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if released:
            self.weight_data = self.weight_scale = None

    def _load_from_state_dict(self, *args, **kwargs):
        # the loader checks shapes against (or copies into) the canonical buffers; the
        # post-load hook prepares again
        self._restore_canonical()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        # The format fixes the quantized buffers' dtypes, so fn (a device move, to_empty, a dtype
        # cast from model.to(torch.bfloat16)) is applied to their bytes: it moves them but never
        # casts them. The bias follows fn like any float buffer. Prepared tensors are rebuilt.
        self._restore_canonical()
        for name in PREPARED_BUFFERS:
            self._buffers[name] = None
        kept = {}
        for name in CANONICAL_BUFFERS:
            t = self._buffers[name]
            if t is not None:
                kept[name] = (t.dtype, t.shape)
                self._buffers[name] = t.reshape(-1).view(torch.uint8)
        super()._apply(fn, recurse)
        for name, (dtype, shape) in kept.items():
            raw = self._buffers[name]
            if raw.dtype != torch.uint8:
                raise TypeError(f"{type(self).__name__}.{name}: quantized buffers keep their format's dtype; "
                                f"a conversion tried to make it {raw.dtype}")
            self._buffers[name] = raw.view(dtype).reshape(shape)
        self.prepare()
        return self

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *, norm=None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """self(x); with `norm` (an RMSNorm module or its (weight, eps)) self(norm(x)), with `residual`
        residual + ... (module docstring)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)} does not match "
                             f"in_features={self.in_features}")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"{type(self).__name__}: input dtype {x.dtype} not accepted; accepted: "
                            f"{', '.join(map(str, INPUT_DTYPES))}")
        out_shape = (*x.shape[:-1], gated.output_features(self.out_features, self.epilogue))
        norm_weight, norm_eps = (None, 0.0) if norm is None else rmsnorm.norm_parameters(norm, x.dtype)
        if norm_weight is not None and tuple(norm_weight.shape) != (self.in_features,):
            raise ValueError(f"{type(self).__name__}: norm weight of shape {tuple(norm_weight.shape)} does not match "
                             f"in_features={self.in_features}")
        if residual is not None and tuple(residual.shape) != out_shape:
            raise ValueError(f"{type(self).__name__}: residual of shape {tuple(residual.shape)} does not match the "
                             f"output shape {out_shape}")
        y = torch.ops.microscale.linear(
            x.reshape(-1, self.in_features), self.prepared_data, self.prepared_scale, self.prepared_global_scale,
            self.bias, self.fmt.name, self.out_features, self.in_features, self.backend, self.activations,
            self.input_global_scale, self.prepared_rotation, self.epilogue, norm_weight, norm_eps,
            None if residual is None else residual.reshape(-1, out_shape[-1]))
        return y.reshape(out_shape)

    def fusions(self, m: int) -> frozenset:
        """Which of forward's `norm` and `residual` ("rms_norm", "residual") the kernel for m rows of bf16
        activations applies itself: a host-side query for code that places them (not for tracing)."""
        b = get_backend(self.backend)
        if b.fusions is None or self.activations is not None or self.rotation is not None:
            return frozenset()
        return b.fusions(self.fmt.name, m, self.out_features, self.in_features, self.prepared_data.device,
                         {} if self.epilogue is None else {"epilogue": self.epilogue})

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the quantized weight multiplies: x R for a rotated layer, else x (in torch
        ops and x's dtype; forward leaves the rotation to the op, which fuses it where it can)."""
        return x if self.rotation is None else hadamard.rotate(x, self.rotation, self.prepared_rotation)

    def extra_repr(self) -> str:
        kp = padded_k(self.in_features, self.fmt.block)
        padded = f" (padded to {kp})" if kp != self.in_features else ""
        return (f"in_features={self.in_features}{padded}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fmt={self.fmt.name}, activations={self.activations}"
                f"{' (static input scale)' if self.input_global_scale is not None else ''}, backend={self.backend}"
                f"{'' if self.rotation is None else f', rotation=block_hadamard({self.rotation})'}"
                f"{'' if self.epilogue is None else f', epilogue={self.epilogue} (gate/up row pairs)'}")


class FP4Linear(QuantizedLinear):
    """NVFP4 or MXFP4 weights (E2M1 elements, two per byte)."""

    elem_bits = 4
    default_format = "nvfp4"


class FP8Linear(QuantizedLinear):
    """MXFP8 weights (E4M3 elements)."""

    elem_bits = 8
    default_format = "mxfp8"


def quantized_linear_class(fmt) -> type:
    """FP4Linear or FP8Linear, by the format's element width."""
    spec = get_format(fmt)
    return next(c for c in (FP4Linear, FP8Linear) if c.elem_bits == spec.elem_bits)


def fuse_linears(layers) -> QuantizedLinear:
    """One quantized layer for several that read the same input, as inference engines run q/k/v and
    gate/up: fused(x) = cat([layer(x) for layer in layers], -1), one GEMM instead of len(layers).

    The weights are concatenated along out_features (QTensor.concat_rows: the same codes and scales),
    a missing bias becomes zeros. The layers must share their class, format, in_features,
    activations, rotation, NVFP4 global scale (quantize_model gives fused projections one) and
    static input scale. Outputs equal the separate layers' up to the order of float summation."""
    layers = _fusable(layers, "fuse_linears")
    return _fused_layer(layers[0], *_concat_weights(layers))


def fuse_gated(gate: QuantizedLinear, up: QuantizedLinear) -> QuantizedLinear:
    """One quantized layer for an MLP's gate and up projections: fused(x) = silu(gate(x)) * up(x), as
    Llama-style MLPs compute before their down projection, in one GEMM whose epilogue applies SiLU and the
    product where the kernel can (kernels/gated.py; elsewhere after the GEMM). The weight rows are the two
    layers' interleaved in pairs of PAIR_ROWS; the requirements are fuse_linears', plus equal out_features, a
    multiple of PAIR_ROWS. Outputs equal silu(gate(x)) * up(x) up to float rounding (the fused kernels do
    not round gate(x) and up(x) to x's dtype first)."""
    layers = _fusable([gate, up], "fuse_gated")
    if gate.out_features != up.out_features:
        raise ValueError(f"fuse_gated: gate has out_features={gate.out_features}, up {up.out_features}")
    weight, bias = _concat_weights(layers)
    index = gated.interleave_index(gate.out_features, weight.data.device)
    return _fused_layer(gate, weight.take_rows(index), None if bias is None else bias[index], epilogue="silu_mul")


def _fusable(layers, who: str) -> list:
    """The layers as a list, if they can be one layer: same class, in_features, activations, rotation,
    backend and static input scale (the NVFP4 global scale is QTensor.concat_rows' to check)."""
    layers = list(layers)
    if not layers or not all(isinstance(m, QuantizedLinear) for m in layers):
        raise TypeError(f"{who}: expected quantized layers, got {[type(m).__name__ for m in layers]}")
    if any(m.epilogue is not None for m in layers):
        raise ValueError(f"{who}: a layer of gate/up pairs (fuse_gated's) cannot be fused again")
    first = layers[0]
    for i, m in enumerate(layers[1:], 1):
        for what in ("activations", "rotation", "backend_override"):
            if getattr(m, what) != getattr(first, what):
                raise ValueError(f"{who}: layer {i} has {what}={getattr(m, what)!r}, layer 0 {getattr(first, what)!r}")
        if type(m) is not type(first) or m.in_features != first.in_features:
            raise ValueError(f"{who}: layer {i} is a {type(m).__name__} with in_features={m.in_features}, "
                             f"layer 0 a {type(first).__name__} with {first.in_features}")
        a, b = m.input_global_scale, first.input_global_scale
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            raise ValueError(f"{who}: layer {i} has input_global_scale {a}, layer 0 {b}")
    return layers


def _concat_weights(layers) -> tuple:
    """(weight, bias) of the layers concatenated along out_features; a missing bias becomes zeros."""
    weight = QTensor.concat_rows(m.qweight for m in layers)
    bias = None
    if any(m.bias is not None for m in layers):
        dtype = next(m.bias.dtype for m in layers if m.bias is not None)
        bias = torch.cat([m.bias.to(dtype) if m.bias is not None else
                          torch.zeros(m.out_features, dtype=dtype, device=weight.data.device) for m in layers])
    return weight, bias


def _fused_layer(first: QuantizedLinear, weight: QTensor, bias, epilogue=None) -> QuantizedLinear:
    return type(first).from_qtensor(weight, bias, activations=first.activations, backend=first.backend_override,
                                    input_global_scale=first.input_global_scale, rotation=first.rotation,
                                    epilogue=epilogue)
