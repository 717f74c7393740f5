"""Block-wise Hadamard rotation: orthogonal, exact on float models, recorded in the checkpoint config."""

import pytest
import torch

import microscale as ms
from microscale.quant import hadamard
from microscale.quant.methods import effective_weight, quantize_weight


@pytest.mark.parametrize("n", [1, 2, 4, 16, 32, 64])
def test_hadamard_matrix_is_symmetric_orthogonal_with_entries_pm_inv_sqrt_n(n):
    h = hadamard.hadamard_matrix(n, dtype=torch.float64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-14, rtol=0)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.all(h[0] > 0)  # Sylvester: the first row is all +


@pytest.mark.parametrize("n", [0, 3, 12, 48])
def test_hadamard_matrix_rejects_sizes_that_are_not_powers_of_two(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard_matrix(n)


def _block_diag(k, block):
    h = hadamard.hadamard_matrix(block, dtype=torch.float64)
    return torch.block_diag(*([h] * (k // block)))


@pytest.mark.parametrize("block", [16, 32])
def test_rotate_equals_block_diagonal_matmul_and_is_its_own_inverse(block, seed):
    x = torch.randn(3, 5, 4 * block, dtype=torch.float64)
    r = _block_diag(4 * block, block)
    y = hadamard.rotate(x, block)
    assert torch.allclose(y, x @ r, atol=1e-12, rtol=0)
    assert torch.allclose(hadamard.rotate(y, block), x, atol=1e-12, rtol=0)
    # blocks never mix: each block keeps its norm, a change in one block changes only that block
    assert torch.allclose(y.view(3, 5, 4, block).norm(dim=-1), x.view(3, 5, 4, block).norm(dim=-1), atol=1e-12)
    x2 = x.clone()
    x2[..., :block] += 1
    assert torch.equal(hadamard.rotate(x2, block)[..., block:], y[..., block:])


@pytest.mark.parametrize("block", [16, 32])
def test_rotated_linear_computes_the_same_output(block, seed):
    x, w = torch.randn(7, 3 * block, dtype=torch.float64), torch.randn(11, 3 * block, dtype=torch.float64)
    y = hadamard.rotate(x, block) @ hadamard.rotate(w, block).T
    assert torch.allclose(y, x @ w.T, atol=1e-12, rtol=0)


def test_rotate_hessian_is_the_hessian_of_rotated_inputs(seed):
    x = torch.randn(200, 64, dtype=torch.float64)
    h = x.T @ x
    r = _block_diag(64, 16)
    assert torch.allclose(hadamard.rotate_hessian(h, 16), r.T @ h @ r, atol=1e-10, rtol=0)
    xr = hadamard.rotate(x, 16)
    assert torch.allclose(hadamard.rotate_hessian(h, 16), xr.T @ xr, atol=1e-10, rtol=0)


def test_rotate_rejects_k_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match="K=40 is not a multiple of the rotation block 16"):
        hadamard.rotate(torch.zeros(2, 40), 16)


def test_rotated_model_output_equals_the_original_before_quantization():
    """all-MiniLM-L6-v2 with every Linear's weight rotated (W R) and its input rotated at run time."""
    from microscale.models.eval import load_minilm, sentence_embeddings, wiki_articles

    model, tokenizer = load_minilm()
    sentences = wiki_articles(8)
    ref = sentence_embeddings(model, tokenizer, sentences)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for m in linears:
        m.weight.data = hadamard.rotate(m.weight.data, 32)
        m.register_forward_pre_hook(lambda mod, args: (hadamard.rotate(args[0], 32),))
    out = sentence_embeddings(model, tokenizer, sentences)
    assert len(linears) == 37  # 6 layers x 6, and the pooler
    assert (out - ref).abs().max().item() < 1e-5
    # and rotating only the weights changes the output: the test can fail
    for m in linears:
        m._forward_pre_hooks.clear()
    assert (sentence_embeddings(model, tokenizer, sentences) - ref).abs().max().item() > 0.1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_quantized_rotated_weight_dequantizes_back_in_the_original_basis(fmt, seed):
    spec = ms.get_format(fmt)
    w = torch.randn(48, 4 * spec.block)
    w[:, 3] *= 30  # an outlier column
    q = quantize_weight(w, fmt, method="rtn", rotation_block=spec.block)
    assert torch.equal(q.dequantize(), ms.quantize(hadamard.rotate(w, spec.block), fmt).dequantize())
    back = effective_weight(q, spec.block)
    assert torch.allclose(back.double(), hadamard.rotate(q.dequantize().double(), spec.block), atol=1e-5)
    sqnr = 10 * torch.log10(w.square().sum() / (back - w).square().sum())
    assert sqnr > (25 if spec.elem_bits == 8 else 12)


def test_rotation_config_round_trip_and_unknown_rotations_are_refused():
    cfg = {hadamard.ROTATION_CONFIG_KEY: hadamard.rotation_config(16)}
    assert hadamard.rotation_block_from_config(cfg) == 16
    assert hadamard.rotation_block_from_config({}) is None
    for bad in ({"type": "random_hadamard", "block_size": 16}, {"type": "block_hadamard", "block_size": 24},
                {"type": "block_hadamard"}, "hadamard"):
        with pytest.raises(ValueError, match="unsupported rotation"):
            hadamard.rotation_block_from_config({hadamard.ROTATION_CONFIG_KEY: bad})
