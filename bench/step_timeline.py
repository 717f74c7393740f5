"""Where the decode step's time goes between its GEMMs: per-CTA %globaltimer stamps of every decode_ws kernel in
bench/e2e.py's way (e) (Llama-3-8B shape, fused projections, attention kernel, glue in the GEMMs, programmatic
launches), one replay of the captured step.

    TORCHINDUCTOR_ENABLE_PDL=1 PYTHONPATH=. python3 bench/step_timeline.py --out bench/results/e2e_timeline_h200.json

A probe, not a benchmark: it builds decode_ws.cuh with stamps spliced in (`stamped_source`: kernel entry, the
producer's return from griddepcontrol.wait, warp 0's first ring stage and K-loop end, the epilogue's end; one slot
of 8 int64 per CTA taken by an atomic counter in a buffer whose address is compiled in) and times the step with
them (a few percent slower). The kernels are told apart by their weight's N and K. Printed and written: per GEMM of
a layer the medians over the layers of when its CTAs start (relative to its first wait's return), how long after
the kernel before it ended the wait returns, the first stage's arrival, the loop, the spread of the loop ends and
the epilogue; the raw per-kernel spreads in the JSON. Only decode_ws calls are stamped: the attention kernel
(Triton) sits between q/k/v's end and o_proj's wait, and where the dispatch takes another kernel for a GEMM (at
larger batches) "the kernel before" is the previous stamped one.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch._inductor.config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402
from microscale.kernels.sm90 import decode_ws, wgmma_ws  # noqa: E402

SLOTS = 1 << 16  # CTA records of 8 int64: (N | KT << 32, CTA | SM << 32, entry, wait, first stage, loop end, done)
STAMPS = ("entry", "wait", "first", "loop", "done")
LLAMA_KINDS = {(6144, 64): "qkv", (4096, 64): "o_proj", (28672, 64): "gate_up", (4096, 224): "down"}  # (N, K / 64)


def _splice(src: str, anchor: str, text: str, before: bool = False) -> str:
    if src.count(anchor) != 1:
        raise RuntimeError(f"step_timeline: decode_ws.cuh no longer has exactly one {anchor.strip()!r}")
    return src.replace(anchor, text + anchor if before else anchor + text)


def stamped_source(buffer_address: int, counter_address: int) -> str:
    """decode_ws's source with the stamps spliced in (the anchors are lines of decode_ws.cuh)."""
    stamp = "MS_STAMPS[8ull * ms_slot + {}] = ms_now();\n"
    src = decode_ws.SOURCE_PATH.read_text()
    src = _splice(src, "  init_ring_barriers(full, empty, STAGES, CONSUMERS);\n",
                  "  __shared__ unsigned ms_slot;\n"
                  "  if (threadIdx.x == 0) {\n"
                  f"    ms_slot = atomicAdd(MS_COUNTER, 1u) % {SLOTS}u;\n"
                  "    MS_STAMPS[8ull * ms_slot] = (unsigned long long)N | ((unsigned long long)KT << 32);\n"
                  "    MS_STAMPS[8ull * ms_slot + 1] = blockIdx.x | ((unsigned long long)ms_smid() << 32);\n"
                  "    " + stamp.format(2) + "  }\n", before=True)
    src = _splice(src, "      for (int i = 0; i < lead; ++i) load_x(i);\n", "      " + stamp.format(3), before=True)
    src = _splice(src, "      mbar_wait((NORM ? ready : full) + 8 * stage, phase);\n",
                  "      if (i == 0 && warp == 0 && lane == 0) " + stamp.format(4))
    src = _splice(src, "  release_dependents();", "  if (warp == 0 && lane == 0) " + stamp.format(5), before=True)
    src = _splice(src, "}\n\n}  // namespace ms90", "  if (warp == 0 && lane == 0) " + stamp.format(6), before=True)
    helpers = f"""
#define MS_STAMPS ((unsigned long long*){buffer_address}ull)
#define MS_COUNTER ((unsigned*){counter_address}ull)
__device__ __forceinline__ unsigned long long ms_now() {{
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }}
__device__ __forceinline__ unsigned ms_smid() {{ unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }}
"""
    return wgmma_ws.source() + "\n" + helpers + src


def kernel_spreads(records: torch.Tensor, kinds: dict = LLAMA_KINDS) -> list:
    """records [n, 8] int64 of one step -> per kernel call (a run of one (N, K) in entry order): its CTA count and
    (min, median, max) of each stamp in us from the step's first entry."""
    rows = sorted(records.tolist(), key=lambda r: r[2])
    t0 = rows[0][2]
    calls = []
    for r in rows:
        kind = kinds.get((r[0] & 0xFFFFFFFF, r[0] >> 32), f"{r[0] & 0xFFFFFFFF}x{64 * (r[0] >> 32)}")
        if not calls or calls[-1][0] != kind:
            calls.append((kind, []))
        calls[-1][1].append(r[2:7])
    out = []
    for kind, stamps in calls:
        spread = {}
        for i, name in enumerate(STAMPS):
            v = sorted((s[i] - t0) / 1e3 for s in stamps)
            spread[name] = (round(v[0], 3), round(statistics.median(v), 3), round(v[-1], 3))
        out.append(dict(kind=kind, ctas=len(stamps), **spread))
    return out


def per_kind_medians(calls: list) -> dict:
    """Medians over the calls of each kind (the first call of the step aside: nothing stamped runs before it)."""
    phases = {
        "start_before_wait": lambda c, p: c["wait"][0] - c["entry"][1],
        "wait_after_previous_done": lambda c, p: c["wait"][1] - p["done"][2],
        "first_stage_after_wait": lambda c, p: c["first"][1] - c["wait"][1],
        "loop": lambda c, p: c["loop"][1] - c["first"][1],
        "loop_end_spread": lambda c, p: c["loop"][2] - c["loop"][0],
        "epilogue_after_last_loop": lambda c, p: c["done"][2] - c["loop"][2],
        "since_previous_done": lambda c, p: c["done"][2] - p["done"][2],
    }
    out = {}
    for kind in dict.fromkeys(c["kind"] for c in calls):
        pairs = [(c, p) for p, c in zip(calls, calls[1:]) if c["kind"] == kind]
        out[kind] = {name: round(statistics.median(f(c, p) for c, p in pairs), 2) for name, f in phases.items()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp4"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--samples", type=int, default=3, help="stamped replays, 40 positions apart")
    p.add_argument("--out", default="bench/results/e2e_timeline_h200.json")
    args = p.parse_args()
    if not torch._inductor.config.triton.enable_pdl:
        raise SystemExit("step_timeline: run with TORCHINDUCTOR_ENABLE_PDL=1 (way (e))")
    stamps = torch.zeros(SLOTS * 8, dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    text = stamped_source(stamps.data_ptr(), counter.data_ptr())
    decode_ws.source = lambda: text  # before any decode_ws kernel is built in this process

    model, _ = e2e.build_model(e2e.LLAMA3_8B, args.format, "cuda")
    fused = e2e.fuse_projections(model)
    with e2e.programmatic_launches(True):
        timing = e2e.measure_graph_decode(model, args.batch, args.prompt, 50, compile_step=True, fused=fused,
                                          attention="kernel")
        dec = e2e.StaticDecoder(model, args.batch, args.prompt + 40 * args.samples + 8, fused, "kernel")
        step = torch.compile(dec.step, fullgraph=True, dynamic=False)
        first = torch.randint(0, model.config.vocab_size, (args.batch, 1), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dec.reset(first, args.prompt)
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        samples = []
        for s in range(args.samples):
            dec.reset(first, args.prompt + 40 * s)
            graph.replay()  # warm
            torch.cuda.synchronize()
            counter.zero_()
            graph.replay()
            torch.cuda.synchronize()
            n = int(counter.item())
            if n > SLOTS:
                raise SystemExit(f"step_timeline: {n} CTA records overflow the {SLOTS} slots")
            samples.append(kernel_spreads(stamps.view(SLOTS, 8)[:n].cpu()))
    medians = per_kind_medians(samples[-1])
    print(f"{args.format} batch {args.batch}: stamped step {timing['ms_per_step']:.3f} ms; per GEMM, us (medians over "
          f"the layers):")
    for kind, phases in medians.items():
        print(f"  {kind:8s} " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    result = {"env": dict(e2e.env("cuda"), command="TORCHINDUCTOR_ENABLE_PDL=1 bench/step_timeline.py "
                          + " ".join(sys.argv[1:]), written=datetime.datetime.now().isoformat()),
              "format": args.format, "batch": args.batch, "stamped_ms_per_step": timing["ms_per_step"],
              "medians": medians, "samples": samples}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
