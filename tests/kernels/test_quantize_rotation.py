"""quantize_gpu(x, fmt, rotation=b): the block-wise Hadamard rotation inside the quantize kernel.

The kernel computes x R in float32 in a fixed order (quantize.py's module docstring): log2(b)
butterfly stages of additions and subtractions, then a multiply by float32(1 / sqrt(b)).
`butterfly_rotate` is that order in torch float32 operations. For every case the tests check that
- codes, scales and the NVFP4 global scale are bit-identical to the reference quantizer's of those
  float32 values (the kernel rotates in that order; its global scale is that of the rotated values);
- those values are within the documented bound of the exact x R (float64, `exact_rotate`);
- against the reference quantization of the float64 x R rounded to float32, a code differs only
  where the two rotated values differ, and a block scale only where a value of its block does.
Inputs: Gaussian rows over many binades, zeros (an all-zero row, a zero run), subnormals, one
outlier per run, huge values (as large as the documented range allows), ragged M, and K a
multiple of b but not of the MX block; and inputs aimed at the summation order: rotated values
within 3 ulp of every E2M1 / E4M3 decision point (built in the rotated space and rotated back in
float64), where a rotated value one ulp off changes the code.
CPU: the kernel under TRITON_INTERPRET=1 in a subprocess (bf16 without subnormals there: the
interpreter flushes them); GPU: @pytest.mark.gpu, larger shapes, every input dtype.
"""

import os
import subprocess
import sys

import pytest
import torch
from test_quantize_kernel import assert_bit_identical, near_decisions
from torch import nn

from microscale.formats import ScaleMode, get_format, unpack_fp4
from microscale.formats.codec import E2M1_VALUES
from microscale.formats.tensor import padded_k
from microscale.kernels import ops
from microscale.models.linear import quantized_linear_class
from microscale.quant import hadamard, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMAT_ROTATIONS = [("nvfp4", 16), ("mxfp4", 16), ("mxfp4", 32), ("mxfp8", 16), ("mxfp8", 32)]
U = 2.0**-24  # float32 unit roundoff


def hadamard64(b: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard [b, b] in float64, as Kronecker powers of [[1, 1], [1, -1]]."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.kron(h2, h)
    return h / b**0.5


def exact_rotate(x: torch.Tensor, b: int) -> torch.Tensor:
    """x R in float64 (exact for float32 x up to float64 rounding, far below float32's)."""
    m, k = x.shape
    return (x.double().reshape(m, k // b, b) @ hadamard64(b)).reshape(m, k)


def butterfly_rotate(x: torch.Tensor, b: int) -> torch.Tensor:
    """The kernel's x R in float32: log2(b) times [v0, v1, v2, v3, ...] -> [v0 + v1, v2 + v3, ...,
    v0 - v1, v2 - v3, ...] per run of b, then times float32(1 / sqrt(b))."""
    m, k = x.shape
    y = x.float().reshape(m, k // b, b)
    for _ in range(b.bit_length() - 1):
        y = torch.cat([y[..., 0::2] + y[..., 1::2], y[..., 0::2] - y[..., 1::2]], -1)
    return (y * torch.tensor(1 / b**0.5, dtype=torch.float32)).reshape(m, k)


def rotation_bound(x: torch.Tensor, b: int) -> torch.Tensor:
    """The documented bound on |kernel x R - exact x R|: (log2(b) + 3) u sum|run| / sqrt(b) + 2**-149."""
    m, k = x.shape
    s = x.double().abs().reshape(m, k // b, b).sum(-1, keepdim=True).expand(m, k // b, b).reshape(m, k)
    return (b.bit_length() - 1 + 3) * U * s / b**0.5 + 2.0**-149


def rotation_input(m, k, b, dtype, seed, subnormals=True):
    """Rows 5 on: Gaussian over many binades. Rows 0-4 (where M has them): a zero run, an all-zero
    row, subnormals, one outlier per run, huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(m, 5), k, generator=g) * torch.exp2(torch.randint(-20, 20, (max(m, 5), 1), generator=g).float())
    x[0, :b] = 0.0
    x[1] = 0.0
    if subnormals:
        tiny = torch.finfo(torch.float32).tiny
        x[2, :8] = torch.tensor([tiny / 4, -tiny / 2, tiny, 3 * tiny, -tiny / 8, tiny / 3, 0.0, tiny])
        x[2, 8:b] = 2.0**-149
    x[3] = torch.where(torch.arange(k) % b == 5, 1e4, 1e-3 * x[3].sign())
    # as large as the documented range allows: the unnormalized sums (up to b max|x|) stay finite
    big = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max) / (2 * b)
    x = x.clamp(-big, big)  # fp16's range too
    x[4, :b] = big * torch.where(torch.rand(b, generator=g) < 0.5, -1.0, 1.0)
    return x[torch.randperm(5, generator=g)[:m] if m < 5 else slice(None)].to(dtype)


def differences_to_float64_reference(q, yk, y32, fmt, kw) -> int:
    """Asserts q (linear layout) differs from the reference quantization of y32 (float64 x R rounded
    to float32) only where the kernel's rotated values yk differ from y32; returns the codes that differ."""
    spec = get_format(fmt)
    r = quantize(y32, fmt, scale_layout="linear", **kw)
    if spec.global_scale and not torch.equal(q.global_scale.cpu(), r.global_scale):
        assert yk.abs().max() != y32.abs().max(), "global scales differ, the rotated amax does not"
        return int(yk.numel())
    m, k = yk.shape
    moved = torch.zeros(m, padded_k(k, spec.block), dtype=torch.bool)
    moved[:, :k] = yk != y32
    scale_differs = q.scale.view(torch.uint8).cpu() != r.scale.view(torch.uint8)
    assert not (scale_differs & ~moved.reshape(m, -1, spec.block).any(-1)).any(), "a scale differs alone"
    codes = (lambda t: unpack_fp4(t.data.cpu())) if spec.packed else (lambda t: t.data.cpu().view(torch.uint8))
    code_differs = codes(q) != codes(r)
    alone = code_differs & ~moved & ~scale_differs.repeat_interleave(spec.block, 1)
    assert not alone.any(), f"codes differ where the rotated values do not: {alone.nonzero()[:5].tolist()}"
    return int(code_differs.sum())


def check_rotated(x, fmt, b, **kw) -> int:
    """quantize_gpu(x, fmt, rotation=b, **kw) against the references (module docstring); returns the
    number of codes that differ from the float64 reference's."""
    from microscale.kernels.quantize import quantize_gpu
    xc = x.cpu()
    yk, y64 = butterfly_rotate(xc, b), exact_rotate(xc, b)
    err = (yk.double() - y64).abs()
    assert (err <= rotation_bound(xc, b)).all(), f"rotation error {err.max().item()} above the bound"
    ref_kw = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = {}
    for layout in ("linear", "swizzled"):
        got[layout] = quantize_gpu(x, fmt, rotation=b, scale_layout=layout, **kw)
        assert_bit_identical(got[layout], quantize(yk, fmt, scale_layout=layout, **ref_kw))
    return differences_to_float64_reference(got["linear"], yk, y64.float(), fmt, ref_kw)


def _format_kwargs(fmt, x, b):
    """NVFP4: the global scale computed, given as a float, and given as a tensor low enough that
    the largest rotated values saturate; MX: RCEIL, and FLOOR for MXFP4."""
    if fmt == "nvfp4":
        amax = exact_rotate(x.cpu().float(), b).abs().max().item()
        if amax == 0:  # an all-zero x (M = 1 may draw the zero row): nothing can saturate
            return [{}, {"global_scale": 3.5}]
        return [{}, {"global_scale": 3.5}, {"global_scale": torch.tensor(2688.0 / (amax / 4), device=x.device)}]
    return [{}] + ([{"scale_mode": ScaleMode.FLOOR}] if fmt == "mxfp4" else [])


def _run_rotation_cases(device, shapes, dtypes, seed, interpreted=False):
    for fmt, b in FORMAT_ROTATIONS:
        for dtype in dtypes:
            for m, k in shapes:
                if k % b:
                    continue
                x = rotation_input(m, k, b, dtype, seed, subnormals=not (interpreted and dtype == torch.bfloat16))
                for kw in _format_kwargs(fmt, x, b):
                    check_rotated(x.to(device), fmt, b, **kw)


def near_mx_decisions(fmt, blocks, seed) -> torch.Tensor:
    """float32 [blocks, 32] for an MX format: per block a maximum of 0.98 * elem_max * 2**s (scale
    2**s in every mode) and 31 elements within 3 ulp of 2**s times a midpoint between neighbouring
    element values (E2M1, or every E4M3 magnitude)."""
    spec = get_format(fmt)
    gen = torch.Generator().manual_seed(seed)
    if spec.packed:
        grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    else:
        grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = (grid[1:] + grid[:-1]) / 2
    s = torch.exp2(torch.randint(-20, 21, (blocks, 1), generator=gen).double())
    y = (mids[torch.randint(0, len(mids), (blocks, 31), generator=gen)] * s).float()
    y = (y.view(torch.int32) + torch.randint(-3, 4, y.shape, generator=gen, dtype=torch.int32)).view(torch.float32)
    y = torch.where(torch.rand(y.shape, generator=gen) < 0.5, -y, y)
    return torch.cat([(0.98 * spec.elem_max * s).float(), y], 1)


def _run_near_decision_cases(device, blocks, seed):
    """The rotated space's blocks near decision points, rotated back (R R = I) in float64."""
    for fmt, b in FORMAT_ROTATIONS:
        kw = {"global_scale": 3.5} if fmt == "nvfp4" else {}
        y = near_decisions(blocks, 3.5, seed) if fmt == "nvfp4" else near_mx_decisions(fmt, blocks, seed)
        x = exact_rotate(y.reshape(-1, 256), b).float()
        flipped = check_rotated(x.to(device), fmt, b, **kw)
        assert flipped > 0, f"{fmt} b={b}: no code moved with the rotation's rounding; the inputs test nothing"


def _check_errors(device):
    from microscale.kernels.quantize import quantize_gpu
    x = torch.ones(4, 64, device=device)
    with pytest.raises(ValueError, match=r"one of \(16, 32\) dividing nvfp4's block of 16; got 32"):
        quantize_gpu(x, "nvfp4", rotation=32)
    with pytest.raises(ValueError, match="mxfp4's block of 32; got 8"):
        quantize_gpu(x, "mxfp4", rotation=8)
    with pytest.raises(ValueError, match="rotation must be the block size b .* got a Tensor"):
        quantize_gpu(x, "mxfp4", rotation=hadamard.hadamard_matrix(16, device=device))
    with pytest.raises(ValueError, match="K=48 of x is not a multiple of the rotation block 32"):
        quantize_gpu(x[:, :48], "mxfp8", rotation=32)


# ---- the rotated layer through the microscale::linear op --------------------------------------------
LAYER_CASES = [  # (weight format, activations, rotation, static input scale)
    ("nvfp4", "nvfp4", 16, False), ("nvfp4", "nvfp4", 16, True), ("mxfp4", "mxfp4", 16, False),
    ("mxfp4", "mxfp4", 32, False), ("mxfp8", "mxfp8", 32, False),
    ("nvfp4", "mxfp8", 32, False),  # 32 divides MXFP8's block: rotated in the kernel
    ("nvfp4", "nvfp4", 32, False),  # 32 does not divide NVFP4's 16: a torch rotation first
]


def _check_layer(fmt, act, b, static, dtype, device, rotate, seed):
    """A rotated layer with quantized activations gives GEMM(dequant(quantize(x R)), W R), x R as
    rotate(x, b) computes it."""
    torch.manual_seed(seed)
    layer = quantized_linear_class(fmt).from_linear(nn.Linear(96, 24), fmt, activations=act, rotation=b)
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(2, 5, 96, device=device).to(dtype)
    x_rot = rotate(x.reshape(-1, 96).float(), b)
    g = None
    if static:
        g = torch.tensor(2688.0 / x_rot.abs().max().item() * 2)  # the largest rotated inputs saturate
        layer.set_input_global_scale(g)
    q = quantize(x_rot.cpu(), act, global_scale=g)
    want = ops.linear(q.dequantize(dtype).to(device), layer.prepared_data, layer.prepared_scale,
                      layer.prepared_global_scale, layer.bias, fmt, 24, 96, layer.backend, None)
    assert torch.equal(layer(x).reshape(-1, 24), want)
    return layer


def recording_quantize_gpu(rotations: list):
    """quantize_gpu, appending the rotation each call asks of it to `rotations`."""
    from microscale.kernels.quantize import quantize_gpu

    def quantizer(x, fmt, **kw):
        rotations.append(kw.get("rotation"))
        return quantize_gpu(x, fmt, **kw)
    return quantizer


def _run_layer_cases(device, rotations: list, seed):
    """Through the kernel (the op's quantizer: recording_quantize_gpu(rotations)): x R as the kernel
    computes it where b divides the activation format's block, else as the torch rotation does."""
    for fmt, act, b, static in LAYER_CASES:
        fused = get_format(act).block % b == 0
        for dtype in (torch.float32, torch.bfloat16):
            rotations.clear()
            _check_layer(fmt, act, b, static, dtype, device, butterfly_rotate if fused else hadamard.rotate, seed)
            assert rotations == [b if fused else None], (fmt, act, b, rotations)


_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests", "kernels")]
import torch
from microscale.kernels import ops
from test_quantize_rotation import (_check_errors, _run_layer_cases, _run_near_decision_cases, _run_rotation_cases,
                                    recording_quantize_gpu)
_run_rotation_cases("cpu", [(5, 48), (5, 64)], [torch.float32, torch.bfloat16], {seed}, interpreted=True)
_run_rotation_cases("cpu", [(17, 1040), (17, 1056)], [torch.float32], {seed})  # several programs each way
_run_near_decision_cases("cpu", 256, {seed})
_check_errors("cpu")
rotations = []
quantizer = recording_quantize_gpu(rotations)
ops.quantizer_for = lambda device: quantizer  # the op's CUDA path, with the interpreted kernel
_run_layer_cases("cpu", rotations, {seed})
print("ok")
"""


def test_quantize_rotation_interpreted(seed):
    r = subprocess.run([sys.executable, "-c", _INTERPRETED.format(root=ROOT, seed=seed)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("fmt,act,b,static", LAYER_CASES)
def test_rotated_layer_through_the_op_cpu(fmt, act, b, static, seed):
    """On the CPU the op rotates with torch in float32 and quantizes with the reference; the
    rotation stays within the kernel's bound (with b terms per sum: BLAS's order is not fixed)."""
    _check_layer(fmt, act, b, static, torch.float32, "cpu", hadamard.rotate, seed)
    x = torch.randn(7, 96)
    err = (hadamard.rotate(x, b).double() - exact_rotate(x, b)).abs()
    assert (err <= rotation_bound(x, b) * b).all()


def test_rotated_op_opcheck_and_compile(seed):
    """The op with its rotation argument traces (fake tensors, AOT dispatch) and compiles whole."""
    layer = quantized_linear_class("nvfp4").from_linear(nn.Linear(64, 16), "nvfp4", activations="nvfp4", rotation=16)
    x = torch.randn(3, 64)
    args = (x, layer.prepared_data, layer.prepared_scale, layer.prepared_global_scale, layer.bias, "nvfp4", 16, 64,
            layer.backend, layer.activations, None, layer.prepared_rotation)
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.microscale.linear.default, args, test_utils=tests)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x))


@pytest.mark.parametrize("fmt,b", FORMAT_ROTATIONS)
def test_quantize_rotation_sass_sm90(fmt, b, tmp_path):
    """The rotated quantize kernel compiled for sm_90 (its ROTATED_TILE, bf16 x): no spills, no
    shared memory at all (whole blocks per thread: the butterflies stay in registers), 16-byte loads."""
    from quantize_compile import compile_quantize_kernel, sass_opcodes

    from microscale.kernels import quantize as qk

    compiled, _ = compile_quantize_kernel(fmt, qk.ROTATED_TILE, rotation=b)
    opcodes = sass_opcodes(compiled, tmp_path)
    assert compiled.metadata.shared == 0 and not any(o.startswith(("BAR", "LDS", "STS")) for o in opcodes)
    assert "LDG.E.128" in opcodes
    if fmt == "mxfp8":
        assert any(o.startswith("F2FP.SATFINITE.E4M3") for o in opcodes)


def test_amax_rotation_sass_sm90(tmp_path):
    """The rotated amax pass compiled for sm_90: no spills, and no more shared memory than the plain
    one (its block reduction's): no layout conversion for the butterflies."""
    from quantize_compile import compile_kernel, sass_opcodes

    from microscale.kernels import quantize as qk

    signature = {"X": "*bf16", "AMAX": "*i32", "M": "i32", "K": "i32", "stride_xm": "i32"}
    shared = {}
    for b in (0, 16, 32):
        constexprs = dict(BLOCK_M=qk.AMAX_BLOCK_M, BLOCK_K=qk.AMAX_BLOCK_K, ROTATION=b)
        compiled = compile_kernel(qk.amax_kernel, signature, constexprs, (0, 1, 3, 4), 8)
        opcodes = sass_opcodes(compiled, tmp_path)
        shared[b] = compiled.metadata.shared
        assert "LDG.E.128" in opcodes
    assert shared[16] <= shared[0] and shared[32] <= shared[0], shared


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rotation_gpu(dtype, seed):
    _run_rotation_cases("cuda", [(1, 32), (5, 48), (130, 208), (257, 1056), (64, 4128)], [dtype], seed)


@pytest.mark.gpu
def test_quantize_rotation_gpu_near_decisions(seed):
    _run_near_decision_cases("cuda", 1 << 14, seed)
    _check_errors("cuda")


@pytest.mark.gpu
def test_rotated_layer_through_the_op_gpu(seed, monkeypatch):
    """The layer on CUDA (its device backend, the fused kernel) against the same backend's GEMM of
    the reference-quantized kernel-rotated activations."""
    rotations = []
    monkeypatch.setattr("microscale.kernels.quantize.quantize_gpu", recording_quantize_gpu(rotations))
    _run_layer_cases("cuda", rotations, seed)
