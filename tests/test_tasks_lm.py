"""The lm task: token-weighted loss / perplexity / next-token accuracy against a naive per-window reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from quantdiff.core.errors import DataError
from quantdiff.models.loading import prepare
from quantdiff.eval.tasks.lm import LMTask


class ModTokenizer:
    """Characters to ids below the tiny models' vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 97 for c in text]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "held_out.txt"
    path.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune " * 3)
    return path


@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_metrics_match_naive_reference(tiny_pair, text_file, kind):
    model = prepare(copy.deepcopy(tiny_pair[kind]))
    task = LMTask(path=text_file, context=40, batch_size=3)
    prepared = task.prepare(ModTokenizer())
    n_chars = len(text_file.read_text())  # 270: six full windows and a short one
    assert [len(w) for w in prepared.windows] == [40] * 6 + [n_chars - 240]
    nll = correct = count = 0
    for window in prepared.windows:
        ids = torch.tensor([window])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        targets = ids[0, 1:]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
        count += len(targets)
    metrics = task.evaluate(model, prepared)
    assert metrics["tokens"] == count == n_chars - 7  # each window's first token is not predicted
    assert metrics["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert metrics["accuracy"] == correct / count


def test_token_budget_and_limit(text_file):
    assert len(LMTask(path=text_file, tokens=100, context=40).prepare(ModTokenizer()).windows) == 3  # 40 + 40 + 20 tokens
    assert len(LMTask(path=text_file, context=40).prepare(ModTokenizer(), limit=2)) == 2


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="not found"):
        LMTask(path=tmp_path / "absent.txt").prepare(ModTokenizer())
    (tmp_path / "one.txt").write_text("a")
    with pytest.raises(DataError, match="shorter than two tokens"):
        LMTask(path=tmp_path / "one.txt").prepare(ModTokenizer())
    with pytest.raises(DataError, match="at least 2 tokens"):
        LMTask(path=tmp_path / "one.txt", context=1).prepare(ModTokenizer())
