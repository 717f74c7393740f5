"""Evaluation helpers against direct computations, SmolLM2 perplexity per format, the eval CLI."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from microscale import quantize_model
from microscale.__main__ import main
from microscale.models import eval as ev

# SmolLM2-135M perplexity on the first SHORT_TOKENS tokens of wiki-200 (one window). Measured on
# the CPU: float32 14.82; ratios to it NVFP4 1.192, MXFP4 1.533, MXFP8 1.025, NVFP4 weights +
# activations 1.482. Bounds: these with a margin for other BLAS/thread counts, and the order
# MXFP8 < NVFP4 < MXFP4 (finer blocks and scales, smaller error); no format may lower it by > 2%.
SHORT_TOKENS = 256
FLOAT32_PPL_RANGE = (13.0, 17.0)
MAX_PPL_RATIO = {"nvfp4": 1.3, "mxfp4": 1.7, "mxfp8": 1.05, "nvfp4 + nvfp4 act": 1.7}
MIN_PPL_RATIO = 0.98


def test_perplexity_scores_each_token_once(seed):
    model = tiny_llama()
    ids = torch.randint(0, 160, (21,))
    with torch.no_grad():
        whole = F.cross_entropy(model(ids[None]).logits[0, :-1], ids[1:])
    ppl, scored = ev.perplexity(model, ids, window=64, stride=32)
    assert scored == 20 and math.isclose(ppl, whole.exp().item(), rel_tol=1e-5)

    # window 8, stride 3: token t is scored by the first window that reaches past it
    window, stride = 8, 3
    begins = list(range(0, 20, stride))
    nll = 0.0
    with torch.no_grad():
        for t in range(1, 21):
            b = next(b for b in begins if min(b + window, 21) > t)
            logits = model(ids[None, b:min(b + window, 21)]).logits[0]
            nll -= logits[t - 1 - b].log_softmax(-1)[ids[t]].item()
    ppl, scored = ev.perplexity(model, ids, window=window, stride=stride)
    assert scored == 20 and math.isclose(ppl, math.exp(nll / 20), rel_tol=1e-5)


def test_embedding_agreement_and_weight_error(seed):
    ref = F.normalize(torch.randn(10, 16), dim=-1)
    same = ev.embedding_agreement(ref, ref.clone())
    assert same["cos_min"] == pytest.approx(1.0) and same["spearman"] == pytest.approx(1.0)
    noisy = ref + 0.3 * torch.randn(10, 16)
    got = ev.embedding_agreement(ref, noisy)
    cos = [float(ref[i].double() @ noisy[i].double() / noisy[i].double().norm()) for i in range(10)]
    assert got["cos_mean"] == pytest.approx(sum(cos) / 10, rel=1e-5) and got["cos_min"] == pytest.approx(min(cos))
    assert -1.0 <= got["spearman"] < 1.0

    model = torch.nn.Sequential(torch.nn.Linear(48, 8))
    w = model[0].weight.detach().clone()
    quantize_model(model, "mxfp4", progress=False)
    err = ev.weight_error({"0": w}, model)
    wq = model[0].qweight.dequantize().double()
    d = (wq - w.double())
    assert err["sqnr_db"] == pytest.approx(10 * math.log10((w.double() ** 2).sum() / (d ** 2).sum()))
    blocks = [(d[:, 0:32], w[:, 0:32]), (d[:, 32:48], w[:, 32:48])]  # the second block is 16 wide (padded)
    want = max((db.abs().amax(1) / wb.double().abs().amax(1)).max().item() for db, wb in blocks)
    assert err["max_rel_block"] == pytest.approx(want)


def test_wiki_articles_sorted_by_title():
    articles = ev.wiki_articles(200)
    assert len(articles) == 200 and all(len(a) > 20 for a in articles)
    assert ev.wiki_text(3) == "\n\n".join(articles[:3])


@pytest.fixture(scope="module")
def smollm2():
    return ev.load_smollm2()


def test_smollm2_perplexity_per_format(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(ev.wiki_text(200), return_tensors="pt").input_ids[0]
    assert 21_500 <= ids.numel() <= 22_500  # eval-models.md: wiki-200 is 22.0 k tokens
    ids = ids[:SHORT_TOKENS]
    variant_list = ev.variants(("nvfp4", "mxfp4", "mxfp8")) + [ev.Variant("nvfp4", "nvfp4")]
    results = {}
    for v in variant_list:
        m, _ = ev.quantized_copy(model, v, "cpu")
        results[v.label] = ev.perplexity(m, ids, window=SHORT_TOKENS, stride=SHORT_TOKENS)[0]
    base = results.pop("float32")
    print(f"\nSmolLM2-135M perplexity, first {SHORT_TOKENS} tokens of wiki-200: float32 {base:.3f}")
    for label, ppl in results.items():
        print(f"  {label}: {ppl:.3f} (x{ppl / base:.3f})")
    assert FLOAT32_PPL_RANGE[0] <= base <= FLOAT32_PPL_RANGE[1]
    for label, ppl in results.items():
        assert MIN_PPL_RATIO * base <= ppl <= MAX_PPL_RATIO[label] * base, label
    assert results["mxfp8"] < results["nvfp4"] < results["mxfp4"]


def test_cli_eval_minilm(capsys):
    main(["eval", "--model", "minilm", "--format", "nvfp4", "mxfp8", "--sentences", "6", "--device", "cpu"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["nvfp4"], ["mxfp8"])
            and len(line.split()) == 9}
    assert set(rows) == {"nvfp4", "mxfp8"}
    assert rows["nvfp4"][2] == "4.500" and rows["mxfp8"][2] == "8.250"  # bits per weight
    assert float(rows["mxfp8"][6]) > float(rows["nvfp4"][6]) > 0.9  # mean embedding cosine
