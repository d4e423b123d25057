"""Multiple choice in HellaSwag's JSONL format (`ctx`, `endings`, `label`), scored as lm-evaluation-harness does.

Each ending is a continuation `" " + ending` of `ctx` (the harness's default target delimiter), tokenized
by encoding the whole string and cutting at the context's length (`TemplateLM._encode_pair`). `acc` picks
the ending with the largest summed log-likelihood, `acc_norm` the largest log-likelihood divided by the
ending's length in characters (`len(choice)`, without the delimiter) — the harness's `multiple_choice` rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

from torch import nn

from quantdiff.core.errors import DataError
from quantdiff.data.cloze import cloze_set
from quantdiff.data.choice_items import ChoiceItem, read_jsonl
from quantdiff.eval.scoring import Progress, score_targets

TARGET_DELIMITER = " "


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens (the harness's default for causal models)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prefix_token_id(tokenizer) -> int:
    """What conditions an empty context: BOS if the tokenizer has one, else EOS (as the harness's HFLM)."""
    token = tokenizer.bos_token_id if getattr(tokenizer, "bos_token_id", None) is not None else tokenizer.eos_token_id
    if token is None:
        raise DataError("an empty context needs a BOS or EOS token, and the tokenizer has neither")
    return token


def encode_pair(tokenizer, context: str, continuation: str, bos_id: int | None = None) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by the harness's rules: trailing spaces of the context move to the
    continuation; the whole string is encoded and cut at the context's length, so merges across the
    boundary are tokenized as in running text. `bos_id` (a model that expects BOS first) opens the context."""
    prefix = [] if bos_id is None else [bos_id]
    if not context:
        return prefix or [prefix_token_id(tokenizer)], encode(tokenizer, continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return prefix + context_ids, whole[len(context_ids) :]


def choice_metrics(items: Sequence[ChoiceItem], logliks: Sequence[Sequence[float]]) -> dict[str, float]:
    """acc and acc_norm from each item's per-ending log-likelihoods (first maximum wins ties, as np.argmax)."""
    if not items:
        raise DataError("no multiple-choice items to score")
    acc = acc_norm = 0
    for item, lls in zip(items, logliks, strict=True):
        normalised = [ll / len(ending) for ll, ending in zip(lls, item.endings, strict=True)]
        acc += max(range(len(lls)), key=lambda i: (lls[i], -i)) == item.label
        acc_norm += max(range(len(lls)), key=lambda i: (normalised[i], -i)) == item.label
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items), "items": len(items)}


@dataclass(frozen=True)
class PreparedChoice:
    items: list[ChoiceItem]
    requests: list[tuple[list[int], list[int]]]  # one per ending, item by item

    def __len__(self) -> int:  # progress units: requests
        return len(self.requests)


@dataclass
class ChoiceTask:
    """`path`: a HellaSwag-format JSONL file; None = the cloze set cut from the corpus' held-out text."""

    path: Path | None = None
    cloze_items: int = 200
    seed: int = 0
    batch_size: int = 8
    name: str = "choice"
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    headline: ClassVar[str] = "acc_norm"  # length-normalised, as HellaSwag is reported
    bos_by_construction: ClassVar[bool] = False

    def load_items(self) -> list[ChoiceItem]:
        if self.path is not None:
            return read_jsonl(self.path)
        return cloze_set(self.cloze_items, self.seed)

    def prepare(self, tokenizer, limit: int | None = None, bos_id: int | None = None) -> PreparedChoice:
        items = self.load_items()[:limit]
        requests = [
            encode_pair(tokenizer, item.ctx, TARGET_DELIMITER + ending, bos_id) for item in items for ending in item.endings
        ]
        return PreparedChoice(items, requests)

    def damage_sequences(self, prepared: PreparedChoice) -> list[list[int]]:
        """Each item's context followed by its correct ending, as the task tokenizes them: running text, once per
        item (the wrong endings are not text anyone writes, and every ending would repeat the context)."""
        sequences, first = [], 0
        for item in prepared.items:
            context, ending = prepared.requests[first + item.label]
            sequences.append(context + ending)
            first += len(item.endings)
        return sequences

    def evaluate(self, model: nn.Module, prepared: PreparedChoice, progress: Progress | None = None) -> dict[str, float]:
        scores = iter(score_targets(model, prepared.requests, self.batch_size, progress))
        logliks = [[next(scores).logprob for _ in item.endings] for item in prepared.items]
        return choice_metrics(prepared.items, logliks)
