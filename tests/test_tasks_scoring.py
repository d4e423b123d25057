"""Batched scoring: left padding must not change any sequence's scores, quantized or not."""

from __future__ import annotations

import copy

import pytest
import torch

from quantdiff.models.loading import prepare
from quantdiff.quant.sites import parse_config, quantized
from quantdiff.eval.scoring import score_targets


def naive_scores(model, requests):
    """One unpadded forward pass per request over context + targets[:-1] (the last target is never input)."""
    out = []
    for context, targets in requests:
        ids = torch.tensor([list(context) + list(targets)[:-1]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, len(context) - 1 :].float(), dim=-1)
        t = torch.tensor(targets)
        out.append((logprobs.gather(-1, t[:, None]).sum().item(), int((logprobs.argmax(-1) == t).sum())))
    return out


@pytest.mark.parametrize("kind", ["standard", "diff"])
@pytest.mark.parametrize("bits", [None, 3], ids=["unquantized", "bits=3"])
def test_batched_scores_equal_one_by_one(tiny_pair, kind, bits):
    model = prepare(copy.deepcopy(tiny_pair[kind]), tile_size=5)  # several key tiles per row
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(6)  # large logits, so quantization visibly acts
    g = torch.Generator().manual_seed(0)
    requests = [
        (torch.randint(3, 97, (n_ctx,), generator=g).tolist(), torch.randint(3, 97, (n_t,), generator=g).tolist())
        for n_ctx, n_t in [(1, 7), (12, 3), (5, 1), (20, 6), (3, 3)]
    ]
    config = None if bits is None else parse_config("absmax", bits, "logits")
    with quantized(model, config):
        batched = score_targets(model, requests, batch_size=3)
        expected = naive_scores(model, requests)
    for score, (logprob, correct) in zip(batched, expected):
        assert score.logprob == pytest.approx(logprob, abs=1e-4)
        assert score.n_correct == correct
    if bits is not None:  # the quantizer acted: scores differ from the unquantized model's
        plain = naive_scores(model, requests)
        assert max(abs(a[0] - b[0]) for a, b in zip(plain, expected)) > 1e-3


def test_inputs_longer_than_the_model_keep_their_last_tokens(tiny_pair):
    model = prepare(copy.deepcopy(tiny_pair["standard"]))
    limit = model.config.max_position_embeddings
    context, targets = list(range(3, 3 + 90)) * 2, [5, 6, 7]  # 183 tokens > 128 positions
    (score,) = score_targets(model, [(context, targets)])
    whole = context + targets
    (expected,) = naive_scores(model, [(whole[-(limit + 1) : -len(targets)], targets)])
    assert score.logprob == pytest.approx(expected[0], abs=1e-4)
