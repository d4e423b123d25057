"""The retrieval task on top of the needle generator: token spans, depth, oracle accuracy, and the paper's
attention-to-answer / attention-noise scores against transformers' eager attention maps."""

from __future__ import annotations

import copy
import math
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.models.loading import prepare
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.quant.sites import parse_config, quantized
from quantdiff.eval.tasks.retrieval import RetrievalTask, answer_attention, exact_matches
from quantdiff.data.needles import KEYS, VALUE_WORDS
from quantdiff.models.tokenizer import train_bpe


WORDS = "river mill lantern quiet morning letter sister garden carriage evening window promise walked said".split()


@pytest.fixture(scope="module")
def filler_file(tmp_path_factory):
    rng = random.Random(0)
    sentences = [f"The {' '.join(rng.choices(WORDS, k=rng.randint(4, 9)))}." for _ in range(300)]
    path = tmp_path_factory.mktemp("filler") / "filler.txt"
    path.write_text(" ".join(sentences))
    return path


@pytest.fixture(scope="module")
def tokenizer(filler_file):
    needles = " ".join(f"Remember {k} {v}. Recall {k}" for k, v in zip(KEYS, VALUE_WORDS))
    return train_bpe(filler_file.read_text() + " " + needles, vocab_size=320)


@pytest.fixture(scope="module")
def eager_pair(tokenizer):
    preset = SizePreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256)
    pair = build_pair(preset, seed=0, attn_implementation="eager")
    with torch.no_grad():
        for model in pair.values():
            for module in model.modules():
                if hasattr(module, "q_proj"):
                    module.q_proj.weight.mul_(20)  # sharp attention, so quantizing the logits visibly matters
    return {kind: model.eval() for kind, model in pair.items()}


def make_task(filler_file, **kwargs) -> RetrievalTask:
    return RetrievalTask(**{"context_tokens": 160, "n_needles": 3, "examples": 6, "filler_path": filler_file, "batch_size": 4, **kwargs})


def test_answer_span_tokens_are_the_needle_value(filler_file, tokenizer):
    task = make_task(filler_file)
    examples = task.make_examples(tokenizer)
    for example, item in zip(examples, task.prepare(tokenizer).items):
        key, value = example.needles[example.query_index]
        assert tokenizer.decode([item.prompt_ids[p] for p in item.answer_positions]).strip() == value
        assert tokenizer.decode(item.answer_ids) == example.answer == f" {value}."
        assert f"Remember {key} {value}." in example.prompt and example.prompt.endswith(f"Recall {key}")
        assert len(item.prompt_ids) + len(item.answer_ids) <= 160


def test_depth_places_the_needles(filler_file, tokenizer):
    for example in make_task(filler_file, depth=0.0, n_needles=1).make_examples(tokenizer):
        assert example.needle_spans[0][0] == 0
    for example in make_task(filler_file, depth=1.0, n_needles=1).make_examples(tokenizer):
        assert example.prompt[example.needle_spans[0][1] :] == f" Recall {example.query_key}"
    for example in make_task(filler_file, depth=0.5, n_needles=1).make_examples(tokenizer):
        assert 0.35 < example.needle_spans[0][0] / len(example.prompt) < 0.65


class InductionOracle(nn.Module):
    """Predicts, at the last position, the token that followed the longest earlier match of the current suffix:
    a perfect needle copier that knows nothing about the generator's words."""

    def __init__(self, vocab_size: int, copy: bool = True) -> None:
        super().__init__()
        self.vocab_size, self.copy = vocab_size, copy
        self.device_anchor = nn.Parameter(torch.zeros(()))

    @staticmethod
    def predict(seq: list[int]) -> int:
        best, best_len = seq[-1], 0
        for end in range(len(seq) - 2, -1, -1):
            k = 0
            while k <= end and seq[end - k] == seq[len(seq) - 1 - k]:
                k += 1
            if k > best_len:
                best, best_len = seq[end + 1], k
        return best

    def forward(self, input_ids, attention_mask, position_ids=None):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for b in range(len(input_ids)):
            seq = input_ids[b][attention_mask[b].bool()].tolist()
            logits[b, -1, self.predict(seq) if self.copy else 5] = 1.0
        return SimpleNamespace(logits=logits)


def test_oracle_gets_every_answer(filler_file, tokenizer):
    items = make_task(filler_file, examples=8).prepare(tokenizer).items
    assert exact_matches(InductionOracle(len(tokenizer)), items, batch_size=3) == [True] * 8
    assert exact_matches(InductionOracle(len(tokenizer), copy=False), items, batch_size=3) == [False] * 8


def lambda_of(module) -> float:
    """The paper's λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit, with λinit = 0.8 − 0.6·exp(−0.3·layer)."""
    init = 0.8 - 0.6 * math.exp(-0.3 * module.layer_idx)
    dot = lambda q, k: float(q.detach() @ k.detach())  # noqa: E731
    return math.exp(dot(module.lambda_q1, module.lambda_k1)) - math.exp(dot(module.lambda_q2, module.lambda_k2)) + init


def reference_scores(eager_model, items) -> tuple[float, float]:
    """Table 3 from transformers' eager attention maps, one unpadded document at a time."""
    answer_scores, noise_scores = [], []
    lambdas = [lambda_of(m) for m in eager_model.modules() if hasattr(m, "lambda_q1")]
    for it in items:
        ids = torch.tensor([it.prompt_ids + it.answer_ids[:-1]])
        with torch.no_grad():
            maps = eager_model(ids, output_attentions=True).attentions  # per layer (1, H, T, T)
        n, p = len(it.answer_ids), len(it.prompt_ids)
        per_layer_ans, per_layer_noise = [], []
        for layer, a in enumerate(maps):
            a = a[0, :, p - 1 : p - 1 + n]  # (H, n, T): rows predicting the answer tokens
            if lambdas:
                h = a.shape[0] // 2
                a = (a[:h] - lambdas[layer] * a[h:]) / (1 - lambdas[layer])
            answer = sorted(it.answer_positions)
            noise = [j for j in range(p) if j not in answer]
            per_layer_ans.append(a[..., answer].sum(-1).mean().item())
            per_layer_noise.append(a[..., noise].sum(-1).mean().item())
        answer_scores.append(sum(per_layer_ans) / len(maps))
        noise_scores.append(sum(per_layer_noise) / len(maps))
    return sum(answer_scores) / len(items), sum(noise_scores) / len(items)


@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_attention_scores_match_eager_maps_and_follow_quantization(filler_file, tokenizer, eager_pair, kind):
    items = make_task(filler_file).prepare(tokenizer).items
    model = prepare(copy.deepcopy(eager_pair[kind]), tile_size=4)  # tiles narrower than the answer rows
    expected = reference_scores(eager_pair[kind], items)
    got = answer_attention(model, items, batch_size=4)  # padded batches of unequal documents
    assert got == pytest.approx(expected, abs=1e-5)
    # One document per batch: no padding mask, so key tiles skip the query rows before their first key.
    assert answer_attention(model, items, batch_size=1) == pytest.approx(expected, abs=1e-5)
    if kind == "standard":  # softmax rows sum to 1; the rest went to earlier answer tokens (neither A nor N)
        assert 0.5 < sum(got) < 1.0
    assert not any(t._forward_hooks for t in attention.taps(model))  # hooks removed
    # The maps are those of the quantized logits: 16 bits changes the scores far less than 2 bits does.
    # (Random weights attend almost uniformly, so even 2 bits moves the *averages* only by ~1e-3.)
    with quantized(model, parse_config("absmax", 16, "logits")):
        at16 = answer_attention(model, items, batch_size=4)
    with quantized(model, parse_config("absmax", 2, "logits")):
        at2 = answer_attention(model, items, batch_size=4)
    assert at16 == pytest.approx(expected, abs=2e-5)
    assert abs(at2[0] - expected[0]) > 1e-4 and abs(at2[0] - expected[0]) > 10 * abs(at16[0] - expected[0])


def test_evaluate_reports_all_metrics(filler_file, tokenizer, eager_pair):
    task = make_task(filler_file, examples=3)
    model = prepare(copy.deepcopy(eager_pair["diff"]))
    metrics = task.evaluate(model, task.prepare(tokenizer))
    assert set(metrics) == {"accuracy", "attention_to_answer", "attention_noise", "examples"}
    assert metrics["examples"] == 3 and 0.0 <= metrics["accuracy"] <= 1.0
