"""bench/e2e.py's logic on a tiny model on the CPU: the minimal decode loop against transformers'
forward, and the bench driver end to end (its GPU parts run on the H200 only)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from microscale import quantize_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(ROOT, "bench", "e2e.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module  # torch.compile (dynamo) looks the step's module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def e2e():
    return load_e2e()


def tiny_float32(e2e, fmt):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**e2e.TINY)).eval()
    if fmt is not None:
        quantize_model(model, fmt, progress=False)
    return model


def teacher_forced(dec, ids, step=None):
    """Logits [T, B, V] of feeding ids [B, T] one token at a time through dec's KV cache, with dec.step
    or `step` (a compiled one)."""
    dec.reset(ids[:, :1])
    logits = []
    for t in range(ids.shape[1]):
        dec.tokens.copy_(ids[:, t:t + 1])
        dec.pos.fill_(t)
        logits.append((step or dec.step)(advance=False))
    return torch.stack(logits)


@pytest.mark.parametrize("fmt", [None, "nvfp4"])
def test_static_decoder_matches_transformers_forward(seed, e2e, fmt):
    model = tiny_float32(e2e, fmt)
    ids = torch.randint(0, e2e.TINY["vocab_size"], (3, 10))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    dec = e2e.StaticDecoder(model, batch=3, cache_len=16)
    got = teacher_forced(dec, ids)
    for t in range(10):
        assert (got[t] - want[:, t]).abs().max() <= 1e-5 * want[:, t].abs().max(), t
    # greedy advance: the next token is the argmax and the position moves on
    dec.reset(ids[:, :1], pos=4)
    logits = dec.step()
    assert torch.equal(dec.tokens[:, 0], logits.argmax(-1)) and dec.pos.item() == 5


def test_kernel_classes(e2e):
    assert e2e.kernel_class("decode_gemm_kernel") == "linear"
    assert e2e.kernel_class("nvjet_tst_128x8_64x12_2x1_v_bz_TNT") == "linear"
    assert e2e.kernel_class("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert e2e.kernel_class("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"


def test_driver_tiny_on_cpu(e2e, tmp_path):
    out, md = tmp_path / "e2e.json", tmp_path / "BENCH.md"
    md.write_text("# Benchmarks\n\nthe GEMM section\n")
    common = ["--tiny", "--device", "cpu", "--steps", "3", "--new-tokens", "4", "--out", str(out)]
    e2e.main(common + ["--formats", "bf16", "nvfp4", "--batches", "1", "2", "--ways", "graph", "generate",
                       "--markdown", str(md)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["batch"]) for r in rows] == [("bf16", 1), ("bf16", 2), ("nvfp4", 1), ("nvfp4", 2)]
    for r in rows:
        for how in ("graph", "generate"):
            assert r[how]["ms_per_step"] > 0 and r[how]["speedup_vs_bf16"] > 0
    assert rows[2]["weight_gib"] < rows[0]["weight_gib"] and rows[2]["backend"] == "reference"
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nthe GEMM section\n") and text.count("| nvfp4 |") == 2
    e2e.write_markdown_section(str(md), e2e.MARKERS[0] + "\nnew\n" + e2e.MARKERS[1])  # replaced, not appended
    assert md.read_text().count(e2e.MARKERS[0]) == 1 and "\nnew\n" in md.read_text()

    # --merge: a later run adds its ways to the rows of the same format and batch, keeps the others (and the notes)
    first = json.loads(out.read_text())
    first["env"]["notes"] = ["a note on the rows"]
    out.write_text(json.dumps(first))
    e2e.main(common + ["--formats", "nvfp4", "--batches", "2", "--ways", "graph", "--merge", "--markdown", str(md)])
    merged = json.loads(out.read_text())
    assert merged["env"]["notes"] == ["a note on the rows"] and "\n- a note on the rows\n" in md.read_text()
    assert [(r["format"], r["batch"]) for r in merged["rows"]] == [(r["format"], r["batch"]) for r in rows]
    assert merged["rows"][3]["generate"] == rows[3]["generate"] and merged["rows"][:3] == rows[:3]
    assert merged["rows"][3]["graph"] != rows[3]["graph"] and len(merged["env"]["runs"]) == 2
    with pytest.raises(SystemExit, match="another configuration"):
        e2e.main(common + ["--formats", "bf16", "--batches", "1", "--ways", "graph", "--merge", "--layers", "1"])


def test_formats_in_processes_on_cpu(e2e, tmp_path, monkeypatch):
    """--processes per-format (the default on a GPU): a fresh process of the script measures each format, and
    the parent merges their rows and computes the speed-ups across them."""
    out = tmp_path / "e2e.json"
    argv = ["--tiny", "--device", "cpu", "--steps", "2", "--batches", "1", "--ways", "graph",
            "--processes", "per-format", "--out", str(out)]
    e2e.main(argv + ["--formats", "bf16", "mxfp4"])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["batch"]) for r in rows] == [("bf16", 1), ("mxfp4", 1)]
    bf16, mxfp4 = rows[0]["graph"], rows[1]["graph"]
    assert mxfp4["tokens_equal_eager"] is None and mxfp4["ms_per_step"] > 0  # measured (a CPU loop has no graph)
    assert mxfp4["speedup_vs_bf16"] == pytest.approx(bf16["ms_per_step"] / mxfp4["ms_per_step"])
    assert rows[1]["backend"] == "reference" and rows[1]["weight_gib"] < rows[0]["weight_gib"]
    monkeypatch.setattr(e2e.sys, "executable", "false")  # a process that fails names its format
    with pytest.raises(SystemExit, match="the process measuring nvfp4 exited with 1"):
        e2e.main(argv + ["--formats", "nvfp4"])


def test_compiled_step_matches_eager_on_cpu(seed, e2e):
    """(c) compiled-graph: the compiled step computes what the eager one does (inductor on the CPU here;
    on the H200 the compiled step is then captured as the graph)."""
    model = tiny_float32(e2e, "nvfp4")
    ids = torch.randint(0, e2e.TINY["vocab_size"], (2, 6))
    dec = e2e.StaticDecoder(model, batch=2, cache_len=8)
    want = teacher_forced(dec, ids)
    got = teacher_forced(dec, ids, torch.compile(dec.step, fullgraph=True, dynamic=False))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    timing = e2e.measure_graph_decode(model, batch=2, prompt_len=3, steps=3, compile_step=True)
    assert timing["compiled_step"] and timing["ms_per_step"] > 0


@pytest.mark.parametrize("fmt", [None, "nvfp4"])
def test_fused_projections_compute_what_the_separate_ones_do(seed, e2e, fmt):
    """(d) fused: q/k/v and gate/up as one GEMM each (the latter giving silu(gate) * up) give the unfused step's
    logits (up to summation order), and the separate modules are gone from the model afterwards (the weights are
    held once)."""
    model = tiny_float32(e2e, fmt)
    ids = torch.randint(0, e2e.TINY["vocab_size"], (2, 6))
    want = teacher_forced(e2e.StaticDecoder(model, batch=2, cache_len=8), ids)
    fused = e2e.fuse_projections(model)
    assert not hasattr(model.model.layers[0].self_attn, "q_proj") and not hasattr(model.model.layers[1].mlp, "up_proj")
    qkv, gated = fused[0]
    x = torch.randn(3, e2e.TINY["hidden_size"])
    assert (qkv(x).shape[-1], gated(x).shape[-1]) == (2 * e2e.TINY["hidden_size"], e2e.TINY["intermediate_size"])
    if fmt is not None:
        assert gated.epilogue == "silu_mul"
    got = teacher_forced(e2e.StaticDecoder(model, batch=2, cache_len=8, fused=fused), ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_glue_routed_into_the_layers_computes_the_torch_glue(seed, e2e, monkeypatch):
    """(d) with every norm and residual add handed to the quantized layers (as where their kernel takes them; here
    the reference backend runs them as torch ops inside the op): the same logits as the torch glue, eager and
    compiled, and the decoder records 4 fusions per layer (2 norms, 2 adds)."""
    from microscale.models.linear import QuantizedLinear
    from microscale.kernels import rmsnorm

    model = tiny_float32(e2e, "nvfp4")
    ids = torch.randint(0, e2e.TINY["vocab_size"], (2, 6))
    fused = e2e.fuse_projections(model)
    want = teacher_forced(e2e.StaticDecoder(model, batch=2, cache_len=8, fused=fused), ids)
    monkeypatch.setattr(QuantizedLinear, "fusions", lambda self, m: frozenset(rmsnorm.FUSIONS))
    dec = e2e.StaticDecoder(model, batch=2, cache_len=8, fused=fused)
    assert [sum(map(len, g)) for g in dec.glue] == [8] * e2e.TINY["num_hidden_layers"]
    for step in (None, torch.compile(dec.step, fullgraph=True, dynamic=False)):
        got = teacher_forced(dec, ids, step)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    unglued = e2e.StaticDecoder(model, batch=2, cache_len=8, fused=fused, glue=False)
    assert all(f == frozenset() for g in unglued.glue for f in g)


def test_driver_runs_the_fused_way_last(e2e, tmp_path):
    out = tmp_path / "e2e.json"
    e2e.main(["--tiny", "--device", "cpu", "--steps", "2", "--new-tokens", "2", "--out", str(out), "--formats",
              "nvfp4", "--batches", "1", "--ways", "fused", "graph"])
    row = json.loads(out.read_text())["rows"][0]
    assert row["graph"]["ms_per_step"] > 0 and row["fused"]["ms_per_step"] > 0 and row["fused"]["compiled_step"]


def test_pdl_way_runs_only_where_inductor_launches_programmatically(e2e, tmp_path, monkeypatch):
    """(e) fused-pdl needs Inductor's kernels compiled for programmatic launches (TORCHINDUCTOR_ENABLE_PDL=1 at
    import), the other ways need them not: each process runs its own ways (by default) and refuses the others;
    microscale's switch is set inside the way only."""
    import torch._inductor.config as inductor
    args = ["--tiny", "--device", "cpu", "--steps", "2", "--new-tokens", "2", "--out", str(tmp_path / "e2e.json"),
            "--formats", "nvfp4", "--batches", "1"]
    monkeypatch.delenv("MICROSCALE_PDL", raising=False)
    with inductor.patch({"triton.enable_pdl": False}):  # (monkeypatch's undo would delete the config entry)
        with pytest.raises(SystemExit, match=r"ways \['fused-pdl'\] need TORCHINDUCTOR_ENABLE_PDL=1"):
            e2e.main(args + ["--ways", "fused", "fused-pdl"])
    with inductor.patch({"triton.enable_pdl": True}):
        with pytest.raises(SystemExit, match=r"ways \['graph', 'fused'\] need TORCHINDUCTOR_ENABLE_PDL=0"):
            e2e.main(args + ["--ways", "graph", "fused"])
        results = e2e.main(args)
    assert list(results["rows"][0]) == [k for k in results["rows"][0] if k not in e2e.WAYS] + ["fused-pdl"]
    assert results["rows"][0]["fused-pdl"]["ms_per_step"] > 0 and "MICROSCALE_PDL" not in os.environ
    assert results["env"]["runs"][-1].split("`")[1].startswith("TORCHINDUCTOR_ENABLE_PDL=1 bench/e2e.py --tiny")


def test_lm_head_formats_quantize_the_head_too(e2e):
    """'<format>+lm_head' quantizes lm_head as well (the default keeps it bf16); the embeddings stay bf16 in both,
    and the row sorts after the plain formats."""
    from microscale.models.linear import QuantizedLinear

    plain, _ = e2e.build_model(e2e.TINY, "nvfp4", "cpu")
    head, report = e2e.build_model(e2e.TINY, "nvfp4+lm_head", "cpu")
    assert not isinstance(plain.lm_head, QuantizedLinear) and isinstance(head.lm_head, QuantizedLinear)
    assert head.lm_head.fmt.name == "nvfp4" and "lm_head" in [r.name for r in report.quantized]
    assert type(head.model.embed_tokens) is torch.nn.Embedding
    rows = [{"format": "nvfp4+lm_head", "batch": 1}, {"format": "bf16", "batch": 1}, {"format": "nvfp4", "batch": 1}]
    merged = []
    e2e.merge_rows(merged, rows)
    assert [r["format"] for r in merged] == ["bf16", "nvfp4", "nvfp4+lm_head"]


# ---- bench/decode_attention.py: the fused ways' attention kernel ------------------------------------
def attention_cases(device, dtype, seed: int) -> list:
    """(max error against the float64 reference, bound, what) per case: ragged positions (0, inside and at the end
    of a 64-position block, the last slot), groups of 1-4 query heads per KV head, batches 1-3, positions split
    over 1-16 programs per KV head (ranges of whole blocks, ragged last ones, empty ones); the cache row at pos must
    hold the rotated key and the value, every other row must be unchanged. A split case runs twice on the same
    tickets, which must be left zero."""
    if os.path.join(ROOT, "bench") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
    from decode_attention import decode_attention, decode_attention_reference

    gen = torch.Generator().manual_seed(seed)
    results = []
    for batch, heads, kv_heads, head_dim, cache_len, pos, splits in [
            (1, 4, 4, 16, 70, 0, 1), (2, 4, 2, 32, 70, 63, 1), (3, 8, 2, 32, 150, 64, 1), (2, 32, 8, 128, 132, 131, 1),
            (1, 32, 8, 128, 300, 200, 1), (1, 32, 8, 128, 300, 200, 2), (2, 8, 2, 32, 150, 130, 3),
            (3, 4, 4, 16, 70, 5, 4), (1, 4, 2, 32, 300, 0, 3), (1, 8, 2, 64, 700, 699, 16)]:
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen)
        angles = torch.rand(cache_len, head_dim // 2, generator=gen) * 6
        angles = torch.cat([angles, angles], -1)
        k_cache, v_cache = (torch.randn(batch, kv_heads, cache_len, head_dim, generator=gen) for _ in range(2))
        qkv, cos, sin, k_cache, v_cache = (t.to(device, dtype) for t in (qkv, angles.cos(), angles.sin(), k_cache,
                                                                           v_cache))
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want = decode_attention_reference(qkv, cos, sin, pos, want_k, want_v, heads)
        tickets = torch.zeros(batch, kv_heads, dtype=torch.int32, device=device)
        runs = [decode_attention(qkv, cos, sin, torch.tensor(pos, device=device), k_cache, v_cache, tickets, heads,
                                 splits) for _ in range(1 if splits == 1 else 2)]
        what = f"batch {batch}, {heads}/{kv_heads} heads of {head_dim}, pos {pos} of {cache_len}, {splits} splits"
        # The output is a convex combination of values: rounding the weights p (16-bit dtypes: before the
        # p @ V dot) and the output costs eps * max|v|; the rotary in float32 against float64 can move a
        # rounded q or k by an ulp, which moves a score by at most eps * sqrt(head_dim) * max|q_rot| * max|k|
        # (16-bit dtypes: rarely an ulp of a q or k element, inside the factor 2)
        eps, v_max = torch.finfo(dtype).eps, want_v[:, :, :pos + 1].abs().max().item()
        score_err = eps * head_dim ** 0.5 * 2 * qkv.abs().max().item() * want_k.abs().max().item()
        bound = (2 * eps + (4 * score_err if dtype == torch.float32 else 0.0)) * v_max
        for i, got in enumerate(runs):
            results.append(((got.double() - want).abs().max().item(), bound, f"{what}, call {i + 1}"))
        results.append((tickets.abs().max().item(), 0, what + ", tickets"))
        cache_err = max((k_cache.double() - want_k.double()).abs().max().item(),
                        (v_cache.double() - want_v.double()).abs().max().item())
        results.append((cache_err, eps * max(want_k.abs().max().item(), 1.0), what + ", caches"))
    return results


def test_attention_splits(e2e):
    """A split per 256 cache slots, at most 16, and only while sequences x KV heads x splits fit the SMs."""
    cases = [((132, 8, 132), 1), ((256, 8, 132), 1), ((257, 8, 132), 2), ((1160, 8, 132), 5), ((4212, 8, 132), 16),
             ((9000, 8, 132), 16), ((1160, 32, 132), 4), ((1160, 128, 132), 1), ((1160, 256, 132), 1),
             ((1160, 8, None), 5), ((300, 4, None), 2)]
    assert [e2e.attention_splits(*args) for args, _ in cases] == [want for _, want in cases]


_ATTENTION_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from tests.models.test_models_e2e_bench import attention_cases
for err, bound, what in attention_cases("cpu", torch.float32, {seed}):
    assert err <= bound, (err, bound, what)
print("ok")
"""


def test_decode_attention_interpreted(seed):
    """The kernel under Triton's interpreter (float32: the interpreter's dot takes no bf16) against transformers'
    rotary and SDPA in float64."""
    r = subprocess.run([sys.executable, "-c", _ATTENTION_INTERPRETED.format(root=ROOT, seed=seed)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


_DECODER_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from tests.models import test_models_e2e_bench as t
e2e = t.load_e2e()
torch.manual_seed({seed})
model = t.tiny_float32(e2e, "nvfp4")
ids = torch.randint(0, e2e.TINY["vocab_size"], (2, 6))
want = t.teacher_forced(e2e.StaticDecoder(model, batch=2, cache_len=8), ids)
fused = e2e.fuse_projections(model)
for cache_len in (8, 300):  # one program per KV head; two (the second one empty), whose tickets every layer reuses
    dec = e2e.StaticDecoder(model, batch=2, cache_len=cache_len, fused=fused, attention="kernel")
    assert dec.splits == (1 if cache_len == 8 else 2), dec.splits
    for step in (None, torch.compile(dec.step, fullgraph=True, dynamic=False)):
        got = t.teacher_forced(dec, ids, step)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (cache_len, (got - want).abs().max())
    assert not dec.tickets.any()
print("ok")
"""


def test_static_decoder_with_the_attention_kernel_interpreted(seed):
    """StaticDecoder(attention="kernel") gives the SDPA step's logits, eager and compiled (the kernel is a custom op
    that writes the caches and its tickets), with one and with two programs per KV head."""
    r = subprocess.run([sys.executable, "-c", _DECODER_INTERPRETED.format(root=ROOT, seed=seed)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def _first_argmax(row: list) -> int:
    """The index argmax's contract names, by a plain loop: the first NaN, else the first of the largest values."""
    nan = [i for i, v in enumerate(row) if v != v]
    if nan:
        return nan[0]
    best = max(row)
    return row.index(best)


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1025, 3000, 128256])
def test_greedy_tokens_is_the_first_argmax(e2e, seed, vocab):
    """Two-stage argmax (chunks of ARGMAX_CHUNK, the last one padded with -inf) against a loop over each row, on
    random logits with planted ties across chunks, a NaN, an all -inf row and rows of one repeated value; eager
    and compiled as the decode step is."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g).to(torch.bfloat16)
    if vocab > 1:
        top = logits[1].max()
        logits[1, vocab - 1] = top  # a tie in a later chunk: the earlier index wins
        logits[1, int(torch.randint(0, vocab - 1, (1,), generator=g))] = top
        logits[2, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
    logits[3] = float("-inf")
    logits[4] = 0.5
    logits[5] = logits[5] * 1e30 if vocab > 1 else logits[5]
    want = torch.tensor([[_first_argmax(row)] for row in logits.float().tolist()])
    assert torch.equal(e2e.greedy_tokens(logits), want)
    if vocab in (1025, 3000):
        assert torch.equal(torch.compile(e2e.greedy_tokens, fullgraph=True, dynamic=False)(logits), want)


@pytest.mark.gpu
@pytest.mark.parametrize("programmatic", [False, True])
def test_glue_in_the_gemms_of_a_llama_8b_layer_gpu(seed, e2e, programmatic):
    """One decoder layer of Llama-3-8B's shapes in NVFP4 at batch 1, the fused way compiled: the GEMMs whose kernel
    takes the norms and residual adds (decode_ws: all four at batch 1, plain or programmatic launches) give the
    torch glue's logits up to the rounding of the normalized x (a bf16 rounding, relative 2**-8
    per element), and the step captured in a graph replays the eager tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(e2e.LLAMA3_8B, num_hidden_layers=1, vocab_size=2048)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).eval()
    quantize_model(model, "nvfp4", progress=False)
    fused = e2e.fuse_projections(model)
    ids = torch.randint(0, config["vocab_size"], (1, 5), device="cuda")
    with e2e.programmatic_launches(programmatic):
        torch_glue = e2e.StaticDecoder(model, batch=1, cache_len=8, fused=fused, glue=False)
        want = teacher_forced(torch_glue, ids, torch.compile(torch_glue.step, fullgraph=True, dynamic=False)).float()
        dec = e2e.StaticDecoder(model, batch=1, cache_len=8, fused=fused)
        assert [len(f) for f in dec.glue[0]] == [2, 2, 2, 2]
        got = teacher_forced(dec, ids, torch.compile(dec.step, fullgraph=True, dynamic=False)).float()
        assert (got - want).abs().max() <= 2.0**-5 * want.abs().max()
        timing = e2e.measure_graph_decode(model, 1, 3, 4, check_tokens=4, compile_step=True, fused=fused,
                                          attention="kernel")
    assert timing["tokens_equal_eager"] and timing["glue_in_gemms"] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_gpu(seed, dtype):
    for err, bound, what in attention_cases("cuda", dtype, seed):
        assert err <= bound, (err, bound, what)


def test_attention_kernel_needs_fused_projections(e2e):
    model = tiny_float32(e2e, None)
    with pytest.raises(ValueError, match="fused projections"):
        e2e.StaticDecoder(model, batch=1, cache_len=8, attention="kernel")
    tickets = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="qkv"):
        e2e.decode_attention(torch.zeros(1, 5), torch.zeros(8, 32), torch.zeros(8, 32), torch.tensor(0),
                             torch.zeros(1, 2, 8, 32), torch.zeros(1, 2, 8, 32), tickets, 4)
    with pytest.raises(ValueError, match="share a dtype"):
        e2e.decode_attention(torch.zeros(1, 256), torch.zeros(8, 32), torch.zeros(8, 32), torch.tensor(0),
                             torch.zeros(1, 2, 8, 32, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 32), tickets, 4)
    for bad_tickets, splits in ((torch.zeros(1, 2, dtype=torch.int64), 2), (torch.zeros(2, 2, dtype=torch.int32), 2),
                                (tickets, 0), (tickets, 17)):
        with pytest.raises(ValueError, match="tickets"):
            e2e.decode_attention(torch.zeros(1, 256), torch.zeros(8, 32), torch.zeros(8, 32), torch.tensor(0),
                                 torch.zeros(1, 2, 8, 32), torch.zeros(1, 2, 8, 32), bad_tickets, 4, splits)
