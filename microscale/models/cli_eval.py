"""Evaluate a model quantized to chosen formats against float32 (perplexity, or embedding similarity).

smollm2: perplexity on wiki-<articles> (optionally its first --tokens tokens), weight bytes and a
greedy continuation. minilm (an encoder): weight error and the cosine similarity of its sentence
embeddings to float32's.
"""

import torch

from ..quant.hadamard import ROTATION_BLOCKS
from ..quant.methods import METHODS
from . import eval as ev


def add_arguments(parser):
    parser.add_argument("--model", choices=("smollm2", "minilm"), default="smollm2")
    parser.add_argument("--format", nargs="+", default=["nvfp4"], help="nvfp4, mxfp4 and/or mxfp8")
    parser.add_argument("--activations", default=None, help="quantize Linear inputs to this format too")
    parser.add_argument("--method", default="rtn", choices=METHODS,
                        help="weight quantization: rtn (default), search (scale search), gptq (calibrated)")
    parser.add_argument("--rotation", type=int, default=None, choices=ROTATION_BLOCKS,
                        help="block-wise Hadamard rotation of the weights (and, at run time, the inputs)")
    parser.add_argument("--calib-samples", type=int, default=None,
                        help=f"gptq: calibration sequences (default: {ev.CALIBRATION_SIZE})")
    parser.add_argument("--calib-len", type=int, default=None, help="gptq: tokens per calibration sequence")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--articles", type=int, default=200, help="text: the first N Wikipedia summaries")
    parser.add_argument("--tokens", type=int, default=None, help="score only the first N tokens (smollm2)")
    parser.add_argument("--window", type=int, default=1024, help="perplexity window (smollm2)")
    parser.add_argument("--stride", type=int, default=512, help="perplexity stride (smollm2)")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated (smollm2)")
    parser.add_argument("--sentences", type=int, default=64, help="summaries embedded (minilm)")


def run(args):
    device = torch.device(args.device or ev.default_device())
    default_size = ev.CALIBRATION_SIZE[args.model]
    size = (args.calib_samples or default_size[0], args.calib_len or default_size[1])
    if args.model == "minilm":
        ev.run_encoder(args.format, args.activations, device=device, n_sentences=args.sentences, method=args.method,
                       rotation=args.rotation, calibration_size=size)
    else:
        ev.run_causal_lm(ev.variants(args.format, args.activations, args.method, args.rotation), device=device,
                         tokens=args.tokens, articles=args.articles, window=args.window, stride=args.stride,
                         new_tokens=args.new_tokens, calibration_size=size)
