"""Quantized modules (FP4Linear, FP8Linear), quantize_model, save/load and CLI commands."""
