"""End-to-end decode: a Llama-3-8B-shaped decoder (random weights), bf16 vs NVFP4 / MXFP4 / MXFP8 weights.

    PYTHONPATH=. python3 bench/e2e.py --out bench/results/e2e_h200.json --markdown BENCHMARKS.md
    PYTHONPATH=. python3 bench/e2e.py --tiny --out /tmp/e2e_tiny.json     # the same code, tiny model, any device

The model is built from a transformers LlamaConfig with Llama-3-8B's shapes and random weights, once
per format (the same seed), quantized with quantize_model (decoder Linears; lm_head and embeddings
stay bf16, its default; a format "<format>+lm_head", e.g. nvfp4+lm_head, quantizes lm_head too, as some
deployments do: at batch 1 the bf16 lm_head is about a tenth of the NVFP4 step). Each format runs in a
process of its own on a GPU (--processes): measured after another format in the same process, a step was
slower (session 31, H200, way (e) batch 1: bf16 4.339 ms alone, 4.483 after NVFP4; NVFP4 1.741 alone, 1.748
after bf16; the cause was not found). Per format and batch size:

(a) generate: what users run. transformers `generate`, greedy, static cache, compiled decode
    (CompileConfig(fullgraph=True, mode="reduce-overhead")). Time per decode step = median gap
    between consecutive tokens reaching a streamer (each step ends in a host sync in generate).
    GPU breakdown: kernel time of one profiled generate call divided by its new tokens (the short
    prompt's prefill counts about as one step), split into Linear GEMMs, attention and other
    kernels by kernel name; host time = step time - GPU time.
(b) graph: a minimal decode loop (StaticDecoder) whose whole step (all layers, rotary, the static
    KV cache update, attention, lm_head, greedy argmax, position increment) is captured in one CUDA
    graph and replayed, so the step time is GPU time. Its first tokens are checked against eager.
    The eager step launches some 30 small kernels per layer (norms, rotary, residuals); at batch 1
    they and the attention took an estimated 2.6-2.9 ms of the bf16 step's 7.1 ms (step time minus
    the 4.2 ms of GEMMs in the profile of (a)), which pulls every format's speed-up toward 1.
(c) compiled-graph: (b) with the step torch.compile'd (fullgraph) before the capture, so the work
    between the GEMMs becomes a few fused kernels.
(d) fused: (c) with q/k/v and gate/up each one GEMM, as inference engines run them: 4 GEMMs per layer
    instead of 7. Quantized layers: fuse_linears for q/k/v and fuse_gated for gate/up, whose GEMM returns
    silu(gate) * up (the decode kernels apply it in their epilogue: no kernel of its own; since session 21);
    quantize_model gives each group one NVFP4 global scale. bf16: one nn.Linear over the concatenated
    weights, then SiLU and the product (Inductor fuses them into one kernel). The separate modules are
    removed (the weights are not held twice), so this way runs after the others of its format. Attention
    (since session 22; --attention sdpa for the former): rotary, cache write and attention in one kernel
    (bench/decode_attention.py) instead of Inductor's rotary kernel and SDPA, for every format alike.
    Quantized layers take the RMSNorm before q/k/v and gate/up and the residual add after o_proj and down
    into their GEMM where its kernel does (QuantizedLinear.fusions: decode_ws, kernels/rmsnorm.py; since
    session 24, --glue torch for the former), which removes Inductor's add + norm kernels between them.
(e) fused-pdl: (d) with programmatic dependent launches for Inductor's kernels and microscale's decode
    kernels ((d) has both off): a kernel starts while the one before it finishes, Inductor's release the
    next kernel after their loads, ours load their first weight tiles before they wait for x; cuBLAS (bf16,
    lm_head) does neither. Inductor reads TORCHINDUCTOR_ENABLE_PDL at import, so (e) is a run of its own,
    the only way such a process runs (and its default):
        TORCHINDUCTOR_ENABLE_PDL=1 PYTHONPATH=. python3 bench/e2e.py --merge --out bench/results/e2e_h200.json
    Kernels overlap, so this way's profile has no per-class split.

Memory: weight bytes = parameters + buffers of the model (storages counted once; whatever is
resident counts: on sm90 only the prepared layout, unless a layer keeps its canonical copy), and
the peak allocated during (b). Results go to --out (JSON; with --merge added to the rows already
there, so formats and ways can be measured in separate runs) and, with --markdown, into the section
between the E2E markers of that file (appended when absent).
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from microscale import fuse_gated, fuse_linears, quantize_model
from microscale.kernels.sm90.launch import device_index, programmatic_launch, programmatic_launches, sm_count

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s modules, also when loaded by path
from decode_attention import attention_splits, decode_attention  # noqa: E402
from microscale.models.linear import QuantizedLinear
from microscale.models.quantize_model import model_bytes

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
FORMATS = ("bf16", "nvfp4", "mxfp4", "mxfp8")
HEAD = "+lm_head"  # a format name ending so quantizes lm_head too (its default exclude keeps it bf16)
ALL_FORMATS = FORMATS + tuple(f + HEAD for f in FORMATS[1:])
WAYS = ("graph", "compiled-graph", "generate", "fused", "fused-pdl")
PDL_WAYS = ("fused-pdl",)  # the ways of a process started with TORCHINDUCTOR_ENABLE_PDL=1, and only those
LINEAR_KERNEL_MARKS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "matmul", "dequant", "_mm_")
ATTENTION_KERNEL_MARKS = ("flash", "fmha", "attention", "sdpa", "attn")
PROFILED_REPLAYS = 20  # graph replays under the profiler for the per-class breakdown of (b)-(d)
MARKERS = ("<!-- e2e:begin (bench/e2e.py writes this section) -->", "<!-- e2e:end -->")
ARGMAX_CHUNK = 1024  # greedy_tokens: vocabulary entries per program of its first reduction


def build_model(config: dict, fmt: str, device, seed: int = 0):
    """Random-weight LlamaForCausalLM in bf16 on `device`, its decoder Linears quantized to fmt (and lm_head,
    for a format named "<format>+lm_head")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: an fp32 8B model would need 32 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(default)
    base, head = fmt.removesuffix(HEAD), fmt.endswith(HEAD)
    report = None if fmt == "bf16" else quantize_model(model, base, exclude=("*embed*",) if head else None,
                                                         progress=False)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return model, report


# ---- (b) the whole decode step in one CUDA graph --------------------------------------------------
class StaticDecoder:
    """Greedy decoding of a transformers Llama model on static buffers, one token per step() call.

    Uses the model's own modules (embedding, norms, projections, MLP, rotary tables, lm_head); the
    state (next token, position, KV cache) lives in tensors the step updates in place, so the
    step can be captured once and replayed.
    """

    def __init__(self, model, batch: int, cache_len: int, fused=None, attention: str = "sdpa", glue: bool = True):
        cfg = model.config
        self.model = model
        self.fused = fused  # per layer (qkv, gated) from fuse_projections, or None: the model's own modules
        # with fused projections, per layer the fusions (QuantizedLinear.fusions at this batch) of q/k/v, o_proj,
        # gate/up and down: which of the norms and residual adds around them their kernels take (glue=False: none)
        self.glue = [tuple(linear_fusions(p, batch) if glue else frozenset()
                           for p in (qkv, layer.self_attn.o_proj, gated, layer.mlp.down_proj))
                     for (qkv, gated), layer in zip(fused, model.model.layers)] if fused else None
        if attention not in ("sdpa", "kernel") or (attention == "kernel" and not fused):
            raise ValueError(f"StaticDecoder: attention={attention!r}: 'sdpa', or 'kernel' (decode_attention.py, "
                             "which takes the fused q/k/v projection's output) with fused projections")
        self.attention = attention
        self.heads = cfg.num_attention_heads
        device = model.model.embed_tokens.weight.device
        dtype = model.model.embed_tokens.weight.dtype
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size, self.kv_size = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        shape = (batch, cfg.num_key_value_heads, cache_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        # the attention kernel's programs per KV head, and their tickets
        self.splits = attention_splits(cache_len, batch * cfg.num_key_value_heads,
                                       sm_count(device_index(device)) if device.type == "cuda" else None)
        self.tickets = torch.zeros(batch, cfg.num_key_value_heads, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(cache_len, device=device)
        probe = torch.zeros(1, dtype=dtype, device=device)
        self.cos, self.sin = model.model.rotary_emb(probe, self.slots[None])  # [1, cache_len, head_dim]

    def reset(self, tokens: torch.Tensor, pos: int = 0):
        for t in self.k + self.v:
            t.zero_()
        self.tokens.copy_(tokens)
        self.pos.fill_(pos)

    @torch.no_grad()
    def step(self, advance: bool = True) -> torch.Tensor:
        """Logits [B, V] for self.tokens at self.pos; then (advance) the argmax becomes the next token."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        m = self.model.model
        batch = self.tokens.shape[0]
        p = self.pos.view(1)
        if self.attention == "sdpa":  # the kernel reads the tables and the position itself
            cos, sin = self.cos.index_select(1, p), self.sin.index_select(1, p)
            mask = (self.slots <= self.pos).view(1, 1, 1, -1)
        h = m.embed_tokens(self.tokens)
        for i, (layer, k_cache, v_cache) in enumerate(zip(m.layers, self.k, self.v)):
            a = layer.self_attn
            if self.fused:
                (qkv, gated), glue = self.fused[i], self.glue[i]
                qkv_out = project(qkv, h, glue[0], norm=layer.input_layernorm)
            else:
                x = layer.input_layernorm(h)
            if self.attention == "kernel":
                o = decode_attention(qkv_out.view(batch, -1), self.cos[0], self.sin[0], self.pos, k_cache, v_cache,
                                     self.tickets, self.heads, self.splits, h.is_cuda and programmatic_launch(h.device))
                o = o.view(batch, 1, -1)
            else:
                if self.fused:
                    q, k, v = qkv_out.split([self.q_size, self.kv_size, self.kv_size], -1)
                else:
                    q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
                q, k, v = (t.view(batch, 1, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                k_cache.index_copy_(2, p, k)
                v_cache.index_copy_(2, p, v)
                o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
                o = o.transpose(1, 2).reshape(batch, 1, -1)
            if self.fused:
                h = project(a.o_proj, o, glue[1], residual=h)
                gated_out = project(gated, h, glue[2], norm=layer.post_attention_layernorm)
                h = project(layer.mlp.down_proj, gated_out, glue[3], residual=h)
            else:
                h = h + a.o_proj(o)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(m.norm(h))[:, -1]
        if advance:
            self.tokens.copy_(greedy_tokens(logits))
            self.pos.add_(1)
        return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's argmax [B, 1], as logits.argmax(-1, keepdim=True) gives it (the first of equal
    maxima; NaN above everything), in two reductions. Compiled, argmax over a row of Llama-3's 128256 logits is one
    program per row: 29 us of the NVFP4 batch-1 step on the H200 (bench/e2e.py's profile, session 28). Here the
    maxima of chunks of ARGMAX_CHUNK come first, one program per chunk, then the chunk that holds the largest."""
    b, v = logits.shape
    chunks = -(-v // ARGMAX_CHUNK)
    padded = F.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, where = padded.view(b, chunks, ARGMAX_CHUNK).max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return chunk * ARGMAX_CHUNK + where.gather(-1, chunk)


def linear_fusions(linear, batch: int) -> frozenset:
    """QuantizedLinear.fusions for one decode step's rows; none for bf16 layers (cuBLAS GEMMs)."""
    return linear.fusions(batch) if isinstance(linear, QuantizedLinear) else frozenset()


def project(linear, x, fusions: frozenset, norm=None, residual=None):
    """residual + linear(norm(x)) (each part optional), the norm and the add in the layer's kernel where `fusions`
    holds them (kernels/rmsnorm.py), else as torch ops, which Inductor fuses with their neighbours (the add with the
    next norm, the norm into one kernel)."""
    kwargs = {}
    if norm is not None:
        if "rms_norm" in fusions:
            kwargs["norm"] = norm
        else:
            x = norm(x)
    if residual is not None and "residual" in fusions:
        kwargs["residual"], residual = residual, None
    y = linear(x, **kwargs)
    return y if residual is None else residual + y


class SiluGateUp(torch.nn.Module):
    """bf16 gate/up as one GEMM over the concatenated weights: silu(gate) * up of its output halves."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        gate, up = self.linear(x).chunk(2, -1)
        return F.silu(gate) * up


def fuse_projections(model) -> list:
    """Per decoder layer, (qkv, gated): q/k/v as one module over the concatenated weights, and a module
    giving silu(gate(x)) * up(x) from one GEMM (fuse_linears and fuse_gated for quantized layers; one
    nn.Linear, and SiluGateUp, for bf16 ones). The separate modules are deleted from the layers, so the
    weights are held once; the model's own forward no longer runs."""
    def fuse(parent, names, gated=False):
        parts = [getattr(parent, n) for n in names]
        if isinstance(parts[0], QuantizedLinear):
            fused = fuse_gated(*parts) if gated else fuse_linears(parts)
        elif any(m.bias is not None for m in parts):
            raise ValueError(f"fuse_projections: {names} have a bias (not in Llama; not handled here)")
        else:
            w = torch.cat([m.weight.detach() for m in parts])
            fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            fused.weight = torch.nn.Parameter(w, requires_grad=False)
            fused = SiluGateUp(fused) if gated else fused
        for n in names:
            delattr(parent, n)
        return fused
    return [(fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj")), fuse(layer.mlp, ("gate_proj", "up_proj"), True))
            for layer in model.model.layers]


def measure_graph_decode(model, batch: int, prompt_len: int, steps: int, check_tokens: int = 8,
                         compile_step: bool = False, fused=None, attention: str = "sdpa", glue: bool = True) -> dict:
    """Step time of StaticDecoder replayed as one CUDA graph per step; tokens checked against eager.

    compile_step: the step goes through torch.compile(fullgraph=True) first, so the norms, rotary
    embedding and elementwise work between the GEMMs become a few fused kernels (the eager step
    launches some 30 small kernels per layer); the tokens are then checked against the compiled
    step run without the graph."""
    dec = StaticDecoder(model, batch, prompt_len + steps + check_tokens + 8, fused, attention, glue)
    first = torch.randint(0, model.config.vocab_size, (batch, 1), device=dec.tokens.device)
    step = torch.compile(dec.step, fullgraph=True, dynamic=False) if compile_step else dec.step

    def eager_tokens(n):
        dec.reset(first, prompt_len)
        out = []
        for _ in range(n):
            step()
            out.append(dec.tokens.clone())
        return torch.cat(out, 1)

    eager = eager_tokens(check_tokens)
    if dec.tokens.device.type != "cuda":  # --tiny on a CPU: the eager loop only
        dec.reset(first, prompt_len)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return {"ms_per_step": (time.perf_counter() - t0) * 1e3 / steps, "tokens_equal_eager": None,
                "compiled_step": compile_step}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_tokens(2)  # warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    dec.reset(first, prompt_len)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    dec.reset(first, prompt_len)
    replayed = []
    for _ in range(check_tokens):
        graph.replay()
        replayed.append(dec.tokens.clone())
    same = torch.equal(torch.cat(replayed, 1), eager)

    dec.reset(first, prompt_len)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / steps
    out = {"ms_per_step": ms, "tokens_equal_eager": same, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "compiled_step": compile_step, "attention": attention}
    if fused:  # how many of the norms (before q/k/v, gate/up) and residual adds (after o_proj, down) ran in GEMMs
        out["glue_in_gemms"] = sum(what in f for layer in dec.glue
                                   for f, what in zip(layer, ("rms_norm", "residual", "rms_norm", "residual")))
    # where the step goes: kernel time per class over profiled replays; idle = step - kernel time (the
    # gaps between kernels, which the graph does not remove). From the start position again: the cache
    # holds prompt_len + steps + check_tokens + 8 positions
    dec.reset(first, prompt_len)
    n = min(PROFILED_REPLAYS, steps)
    out.update(gpu_breakdown(lambda: [graph.replay() for _ in range(n)], n))
    out["idle_ms_per_step"] = ms - out["gpu_ms_per_step"]
    del graph
    return out


# ---- (a) transformers generate with a static cache and compiled decode -------------------------------
class StepClock:
    """A generate streamer that records when each new token (and first the prompt) arrives."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def ms_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.times[2:], self.times[3:])]  # skip the prompt and the prefill
        return statistics.median(gaps) * 1e3


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ATTENTION_KERNEL_MARKS):
        return "attention"
    if any(s in low for s in LINEAR_KERNEL_MARKS):
        return "linear"
    return "other"


def gpu_breakdown(run, new_tokens: int) -> dict:
    """Kernel time per new token of one run() under the profiler, by kernel class, plus top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    per_class, per_kernel = {"linear": 0.0, "attention": 0.0, "other": 0.0}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            us = e.device_time
            per_class[kernel_class(e.name)] += us
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
    return {"gpu_ms_per_step": sum(per_class.values()) / 1e3 / new_tokens,
            **{f"{c}_ms_per_step": v / 1e3 / new_tokens for c, v in per_class.items()},
            "top_kernels": [{"name": n[:120], "ms_per_step": v / 1e3 / new_tokens, "class": kernel_class(n)}
                            for n, v in top]}


def measure_generate(model, batch: int, prompt_len: int, new_tokens: int, compile_decode: bool) -> dict:
    from transformers import CompileConfig, GenerationConfig

    device = model.model.embed_tokens.weight.device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           cache_implementation="static", pad_token_id=0, eos_token_id=None)
    if compile_decode:
        cfg.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")

    def run(streamer=None):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, streamer=streamer)

    for _ in range(2):  # compile, record the CUDA graphs
        run()
    clock = StepClock()
    run(clock)
    out = {"ms_per_step": clock.ms_per_step()}
    if device.type == "cuda":
        out.update(gpu_breakdown(run, new_tokens))
        out["host_ms_per_step"] = out["ms_per_step"] - out["gpu_ms_per_step"]
    return out


# ---- driver ----------------------------------------------------------------------------------------
def env(device) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if torch.device(device).type == "cuda":
        import triton

        info.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    return info


def run_format(config, fmt, device, batches, args) -> list:
    model, report = build_model(config, fmt, device)
    backends = sorted({m.backend for m in model.modules() if isinstance(m, QuantizedLinear)}) or ["torch (cuBLAS)"]
    weight_gib = model_bytes(model) / 2**30
    rows = [{"format": fmt, "batch": batch, "backend": ",".join(backends), "weight_gib": weight_gib,
             "quantized_linear_gib": report.bytes_after / 2**30 if report else None} for batch in batches]
    for row in rows:
        if "graph" in args.ways:
            row["graph"] = measure_graph_decode(model, row["batch"], args.prompt, args.steps)
        if "compiled-graph" in args.ways:
            row["compiled-graph"] = measure_graph_decode(model, row["batch"], args.prompt, args.steps,
                                                         compile_step=True)
        if "generate" in args.ways:
            row["generate"] = measure_generate(model, row["batch"], args.prompt, args.new_tokens,
                                               compile_decode=torch.device(device).type == "cuda")
    fused_ways = [how for how in ("fused", "fused-pdl") if how in args.ways]
    if fused_ways:  # last: it takes the separate projections out of the model
        fused = fuse_projections(model)
        attention = args.attention if torch.device(device).type == "cuda" else "sdpa"  # the kernel needs a GPU
        for row in rows:
            for how in fused_ways:
                with programmatic_launches(how in PDL_WAYS):
                    row[how] = measure_graph_decode(model, row["batch"], args.prompt, args.steps, compile_step=True,
                                                    fused=fused, attention=attention, glue=args.glue == "kernel")
        del fused
    for row in rows:
        for how in args.ways:
            row[how]["tokens_per_s"] = row["batch"] * 1e3 / row[how]["ms_per_step"]
        print(f"{fmt:6s} batch {row['batch']:3d}: " + ", ".join(f"{how} {row[how]['ms_per_step']:.3f} ms/step"
                                                                  for how in args.ways)
              + f", weights {weight_gib:.2f} GiB", flush=True)
    del model
    # Compiled code and CUDA-graph pools of this format's generate outlive the model; drop them so
    # the next format's memory figures are its own.
    torch.compiler.reset()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_format_in_process(fmt, args) -> list:
    """run_format in a fresh Python process (this script with the same options, one format), its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--formats", fmt, "--batches", *map(str, args.batches),
               "--ways", *args.ways, "--attention", args.attention, "--glue", args.glue, "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--steps", str(args.steps), "--device", args.device,
               "--processes", "one", "--out", out]
        cmd += (["--layers", str(args.layers)] if args.layers else []) + (["--tiny"] if args.tiny else [])
        done = subprocess.run(cmd)
        if done.returncode:
            raise SystemExit(f"e2e: the process measuring {fmt} exited with {done.returncode}: {' '.join(cmd)}")
        with open(out) as fh:
            return json.load(fh)["rows"]


def merge_rows(rows: list, new: list) -> None:
    """Add the ways measured in `new` to the rows of the same format and batch (a later measurement of
    the same way replaces the earlier one)."""
    for n in new:
        same = [r for r in rows if (r["format"], r["batch"]) == (n["format"], n["batch"])]
        if same:
            same[0].update(n)
        else:
            rows.append(n)
    order = {f: i for i, f in enumerate(ALL_FORMATS)}
    rows.sort(key=lambda r: (order[r["format"]], r["batch"]))


def add_speedups(rows: list) -> None:
    base = {(r["batch"], how): r[how]["tokens_per_s"] for r in rows if r["format"] == "bf16"
            for how in WAYS if how in r}
    for r in rows:
        for how in WAYS:
            if how in r:
                b = base.get((r["batch"], how))
                r[how]["speedup_vs_bf16"] = r[how]["tokens_per_s"] / b if b else None


def markdown(results: dict) -> str:
    e, c = results["env"], results["config"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        MARKERS[0], "", "## End-to-end decode (bench/e2e.py)", "",
        f"{c['name']} (random weights, bf16 activations; {c['layers']} layers), decoder Linears quantized by "
        f"`quantize_model` (lm_head and embeddings bf16; rows '<format>{HEAD}': lm_head in the format too). "
        f"{e.get('gpu', 'CPU')}, torch {e['torch']}, transformers "
        f"{e['transformers']}, {e['date'][:10]}. (a) transformers `generate`, static cache, compiled decode "
        f"(`CompileConfig(fullgraph=True, mode=\"reduce-overhead\")`), {c['new_tokens']} new tokens after a "
        f"{c['prompt']}-token prompt: step time from token arrival times; GPU time from a profile of the same call "
        f"(kernel time / new tokens), host = step - GPU. (b) the whole decode step in one CUDA graph "
        f"(`StaticDecoder`), {c['steps']} replays; (c) the same with the step torch.compile'd before the capture; "
        f"(d) (c) with q/k/v and gate/up each one GEMM over concatenated weights (`fuse_linears` for q/k/v and "
        f"`fuse_gated` for gate/up, whose decode kernels store silu(gate) * up (runs from session 21 on); bf16 too, "
        f"its SiLU and product an Inductor kernel) and rotary, KV cache write and attention as one kernel "
        f"(bench/decode_attention.py, runs from session 22 on; before: Inductor's rotary kernel and SDPA, as in (b), (c); "
        f"releasing o_proj at its start, 8 warps, in runs marked 87ee4a0), "
        f"the RMSNorms and residual adds in the quantized GEMMs whose kernel takes them (`QuantizedLinear.fusions`; "
        f"rows whose run records `glue_in_gemms`, from session 25 on; before and for bf16: Inductor's add + norm "
        f"kernels), its GPU time per class from a profile of {PROFILED_REPLAYS} replays (linear includes lm_head) and idle = step - "
        f"kernel time; (e) (d) with programmatic dependent launches (Inductor's kernels and microscale's decode "
        f"kernels; (d) has them off; cuBLAS uses none); the greedy token by `greedy_tokens`' two-stage argmax in "
        f"runs from session 29 on (before: one argmax reduction per row); "
        f"weights: parameters + buffers resident; peak: allocated during (b)-(e); '-': not measured.",
        "",
        "| format | batch | backend | weights GiB (Linears in format) | (b) graph ms/step | (b) x bf16 "
        "| (c) compiled graph ms/step | (c) tok/s | (c) x bf16 | (d) fused ms/step | (d) tok/s | (d) x bf16 "
        "| (d) GPU ms: linear / attn / other / idle | (e) fused + PDL ms/step | (e) tok/s | (e) x bf16 "
        "| (a) generate ms/step | (a) tok/s | (a) x bf16 | (a) GPU ms: linear / attn / other | (a) host ms "
        "| peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        g, c, d, a = r.get("graph", {}), r.get("compiled-graph", {}), r.get("fused", {}), r.get("generate", {})
        dp = r.get("fused-pdl", {})
        per_class = lambda w, keys, digits: " / ".join(f(w.get(f"{k}_ms_per_step"), digits) for k in keys)  # noqa: E731
        gpu = per_class(a, ("linear", "attention", "other"), 2)
        fused_gpu = per_class(d, ("linear", "attention", "other", "idle"), 3)
        peak = max((w.get("peak_gib") or 0 for w in (g, c, d, dp)), default=0) or None
        lines.append(f"| {r['format']} | {r['batch']} | {r['backend']} | {f(r['weight_gib'])} "
                     f"({f(r['quantized_linear_gib'])}) "
                     f"| {f(g.get('ms_per_step'), 3)} | {f(g.get('speedup_vs_bf16'))} "
                     f"| {f(c.get('ms_per_step'), 3)} | {f(c.get('tokens_per_s'), 0)} | {f(c.get('speedup_vs_bf16'))} "
                     f"| {f(d.get('ms_per_step'), 3)} | {f(d.get('tokens_per_s'), 0)} | {f(d.get('speedup_vs_bf16'))} "
                     f"| {fused_gpu} "
                     f"| {f(dp.get('ms_per_step'), 3)} | {f(dp.get('tokens_per_s'), 0)} | {f(dp.get('speedup_vs_bf16'))} "
                     f"| {f(a.get('ms_per_step'), 3)} | {f(a.get('tokens_per_s'), 0)} | {f(a.get('speedup_vs_bf16'))} "
                     f"| {gpu} | {f(a.get('host_ms_per_step'))} | {f(peak)} |")
    mismatched = [f"{r['format']} b{r['batch']} {how}" for r in results["rows"]
                  for how in ("graph", "compiled-graph", "fused", "fused-pdl") if r.get(how, {}).get("tokens_equal_eager") is False]
    if mismatched:
        lines += ["", f"Graph replay tokens differ from eager for: {', '.join(mismatched)}."]
    notes = [f"- {note}" for note in e.get("notes", [])]  # written into the JSON by hand, kept by --merge
    runs = "; ".join(e.get("runs", [e["date"]]))
    lines += [""] + notes + ([""] if notes else [])
    lines += [f"Runs merged into this table (JSON: `bench/results/e2e_h200.json`): {runs}.", "", MARKERS[1]]
    return "\n".join(lines)


def write_markdown_section(path: str, section: str) -> None:
    text = open(path).read() if os.path.exists(path) else ""
    if MARKERS[0] in text and MARKERS[1] in text:
        head, rest = text.split(MARKERS[0], 1)
        text = head + section + rest.split(MARKERS[1], 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=ALL_FORMATS,
                   help=f"'<format>{HEAD}' quantizes lm_head too (not by default)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    inductor_pdl = torch._inductor.config.triton.enable_pdl
    p.add_argument("--ways", nargs="+", default=[w for w in WAYS if (w in PDL_WAYS) == inductor_pdl], choices=WAYS,
                   help="(b) graph (eager step), (c) compiled-graph (torch.compile'd step), (a) generate, "
                        "(d) fused (c with q/k/v and gate/up fused; runs last), (e) fused-pdl (d with programmatic "
                        "dependent launches)")
    p.add_argument("--attention", default="kernel", choices=("kernel", "sdpa"),
                   help="the fused ways' attention on a GPU: decode_attention.py's kernel, or SDPA as the other ways")
    p.add_argument("--glue", default="kernel", choices=("kernel", "torch"),
                   help="the fused ways' RMSNorms and residual adds: in the quantized GEMMs where their kernel takes "
                        "them (QuantizedLinear.fusions), or all as torch ops (Inductor's kernels)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (a) / start position (b)")
    p.add_argument("--new-tokens", type=int, default=64, help="(a): tokens generated per timed call")
    p.add_argument("--steps", type=int, default=100, help="(b): timed graph replays")
    p.add_argument("--tiny", action="store_true", help="a tiny config: checks the logic on any device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--processes", choices=("per-format", "one"), default=None,
                   help="measure each format in a fresh process (the default on a GPU), or all in this one")
    p.add_argument("--out", default="bench/results/e2e_h200.json")
    p.add_argument("--merge", action="store_true",
                   help="add to the rows of the existing --out file (a run per format or way fits a time limit)")
    p.add_argument("--markdown", default=None, help="write the results section into this file (BENCHMARKS.md)")
    args = p.parse_args(argv)
    wrong = [w for w in args.ways if (w in PDL_WAYS) != inductor_pdl]
    if wrong:  # Inductor reads TORCHINDUCTOR_ENABLE_PDL at import (patching its config later measured no change)
        raise SystemExit(f"ways {wrong} need TORCHINDUCTOR_ENABLE_PDL={'0' if inductor_pdl else '1'} in the "
                         f"environment: run {list(PDL_WAYS)} in a process of their own")

    if torch.device(args.device).type == "cuda":
        torch._logging.set_logs(perf_hints=True)  # e.g. why Inductor skipped CUDA graphs in (a)
    config = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    results = {"env": env(args.device),
               "config": {"name": "tiny Llama" if args.tiny else "Llama-3-8B shape", "layers": config["num_hidden_layers"],
                          "prompt": args.prompt, "new_tokens": args.new_tokens, "steps": args.steps,
                          "llama_config": config},
               "rows": []}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as fh:
            old = json.load(fh)
        if old["config"] != results["config"]:
            raise SystemExit(f"--merge: {args.out} was measured with another configuration: {old['config']}")
        results["rows"] = old["rows"]
        results["env"]["runs"] = old["env"].get("runs", [old["env"]["date"]])
        results["env"]["notes"] = old["env"].get("notes", [])
    command = (("TORCHINDUCTOR_ENABLE_PDL=1 " if inductor_pdl else "") + "bench/e2e.py "
               + " ".join(argv if argv is not None else sys.argv[1:]))
    results["env"]["runs"] = results["env"].get("runs", []) + [f"{results['env']['date'][:19]}: `{command}`"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    processes = args.processes or ("per-format" if torch.device(args.device).type == "cuda" else "one")
    for fmt in args.formats:
        merge_rows(results["rows"], run_format_in_process(fmt, args) if processes == "per-format"
                   else run_format(config, fmt, args.device, args.batches, args))
        add_speedups(results["rows"])
        with open(args.out, "w") as fh:  # after every format: partial results survive a time limit
            json.dump(results, fh, indent=1)
    section = markdown(results)
    print(section)
    if args.markdown:
        write_markdown_section(args.markdown, section)
    return results


if __name__ == "__main__":
    main()
