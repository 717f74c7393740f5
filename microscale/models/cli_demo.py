"""Demo: MiniLM and SmolLM2-135M quantized to NVFP4, MXFP4 and MXFP8 (bytes, error, perplexity, text).

Part 1: all-MiniLM-L6-v2, every Linear weight in each format: bits per weight, bytes, SQNR and
error against float32, and embedding similarity to float32. Part 2: SmolLM2-135M with NVFP4,
MXFP4, MXFP8 weights and NVFP4 weights + activations: perplexity on English Wikipedia text against
float32, a greedy continuation and weight bytes, in one table. On a CPU the text is shortened
(CPU_TOKENS tokens) to finish in a few minutes on 2 cores; on a GPU it is the whole "wiki-200".
"""

import time

import torch

from . import eval as ev

FORMATS = ("nvfp4", "mxfp4", "mxfp8")
CAUSAL_LM_VARIANTS = ev.variants(FORMATS) + [ev.Variant("nvfp4", "nvfp4")]
CPU_TOKENS = 1024
CPU_NEW_TOKENS = 8
GPU_NEW_TOKENS = 32


def add_arguments(parser):
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"score the first N tokens of wiki-200 (default: all on a GPU, {CPU_TOKENS} on a CPU; "
                             f"0 = all)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"greedy tokens generated per variant (default {GPU_NEW_TOKENS} GPU, {CPU_NEW_TOKENS} CPU)")
    parser.add_argument("--part", choices=("all", "minilm", "smollm2"), default="all")


def run(args):
    device = torch.device(args.device or ev.default_device())
    on_cpu = device.type == "cpu"
    tokens = args.tokens if args.tokens is not None else (CPU_TOKENS if on_cpu else 0)
    new_tokens = args.new_tokens or (CPU_NEW_TOKENS if on_cpu else GPU_NEW_TOKENS)
    t0 = time.perf_counter()
    if args.part in ("all", "minilm"):
        print("== Part 1: all-MiniLM-L6-v2, every Linear weight quantized ==")
        ev.run_encoder(FORMATS, device=device)
        print()
    if args.part in ("all", "smollm2"):
        print("== Part 2: SmolLM2-135M-Instruct, decoder Linears quantized ==")
        if on_cpu and tokens:
            print(f"(CPU run: perplexity on a shortened text, the first {tokens} tokens; a GPU run or --tokens 0 "
                  f"uses the whole wiki-200)")
        ev.run_causal_lm(CAUSAL_LM_VARIANTS, device=device, tokens=tokens or None, new_tokens=new_tokens)
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f} s")
