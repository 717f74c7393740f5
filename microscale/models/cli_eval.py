"""Evaluate a model quantized to chosen formats against float32 (perplexity, or embedding similarity).

smollm2: perplexity on wiki-<articles> (optionally its first --tokens tokens), weight bytes and a
greedy continuation. minilm (an encoder): weight error and the cosine similarity of its sentence
embeddings to float32's.
"""

import torch

from . import eval as ev


def add_arguments(parser):
    parser.add_argument("--model", choices=("smollm2", "minilm"), default="smollm2")
    parser.add_argument("--format", nargs="+", default=["nvfp4"], help="nvfp4, mxfp4 and/or mxfp8")
    parser.add_argument("--activations", default=None, help="quantize Linear inputs to this format too")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--articles", type=int, default=200, help="text: the first N Wikipedia summaries")
    parser.add_argument("--tokens", type=int, default=None, help="score only the first N tokens (smollm2)")
    parser.add_argument("--window", type=int, default=1024, help="perplexity window (smollm2)")
    parser.add_argument("--stride", type=int, default=512, help="perplexity stride (smollm2)")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated (smollm2)")
    parser.add_argument("--sentences", type=int, default=64, help="summaries embedded (minilm)")


def run(args):
    device = torch.device(args.device or ev.default_device())
    if args.model == "minilm":
        ev.run_encoder(args.format, args.activations, device=device, n_sentences=args.sentences)
    else:
        ev.run_causal_lm(ev.variants(args.format, args.activations), device=device, tokens=args.tokens,
                         articles=args.articles, window=args.window, stride=args.stride,
                         new_tokens=args.new_tokens)
