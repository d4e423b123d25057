"""Multiple choice in HellaSwag's JSONL format (`ctx`, `endings`, `label`), scored as lm-evaluation-harness does.

Each ending is a continuation `" " + ending` of `ctx` (the harness's default target delimiter), tokenized
by encoding the whole string and cutting at the context's length (`TemplateLM._encode_pair`). `acc` picks
the ending with the largest summed log-likelihood, `acc_norm` the largest log-likelihood divided by the
ending's length in characters (`len(choice)`, without the delimiter) — the harness's `multiple_choice` rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from torch import nn

from ..atomicfile import atomic_file
from ..errors import DataError
from .scoring import Progress, score_targets

TARGET_DELIMITER = " "


@dataclass(frozen=True)
class ChoiceItem:
    ctx: str
    endings: tuple[str, ...]
    label: int

    def to_dict(self) -> dict:
        return {"ctx": self.ctx, "endings": list(self.endings), "label": self.label}


def _item_from_dict(data: object) -> ChoiceItem:
    """One JSONL record; the reason it is unusable as a ValueError."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in ("ctx", "endings", "label") if key not in data]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    ctx, endings, label = data["ctx"], data["endings"], data["label"]
    if not isinstance(ctx, str) or not ctx.strip():
        raise ValueError("'ctx' must be a non-empty string")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise ValueError("'endings' must be a list of at least two non-empty strings")
    if isinstance(label, str) and label.strip().isdigit():  # the HF copy of HellaSwag stores labels as strings
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise ValueError(f"'label' must be an index into the {len(endings)} endings, got {data['label']!r}")
    return ChoiceItem(ctx, tuple(endings), label)


def read_jsonl(path: str | Path) -> list[ChoiceItem]:
    """Items of a HellaSwag-format file; DataError naming the file and line of the first bad record."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            items.append(_item_from_dict(json.loads(line)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise DataError(f"{path}:{number}: bad multiple-choice record: {str(exc).splitlines()[0]}") from None
    if not items:
        raise DataError(f"{path} holds no multiple-choice items")
    return items


def write_jsonl(items: Sequence[ChoiceItem], path: str | Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps(item.to_dict(), ensure_ascii=False) + "\n" for item in items), encoding="utf-8")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens (the harness's default for causal models)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prefix_token_id(tokenizer) -> int:
    """What conditions an empty context: BOS if the tokenizer has one, else EOS (as the harness's HFLM)."""
    token = tokenizer.bos_token_id if getattr(tokenizer, "bos_token_id", None) is not None else tokenizer.eos_token_id
    if token is None:
        raise DataError("an empty context needs a BOS or EOS token, and the tokenizer has neither")
    return token


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by the harness's rules: trailing spaces of the context move to the
    continuation; the whole string is encoded and cut at the context's length, so merges across the
    boundary are tokenized as in running text."""
    if not context:
        return [prefix_token_id(tokenizer)], encode(tokenizer, continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return context_ids, whole[len(context_ids) :]


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

    def load_items(self) -> list[ChoiceItem]:
        if self.path is not None:
            return read_jsonl(self.path)
        from ..cloze import cloze_set

        return cloze_set(self.cloze_items, self.seed)

    def prepare(self, tokenizer, limit: int | None = None) -> PreparedChoice:
        items = self.load_items()[:limit]
        requests = [
            encode_pair(tokenizer, item.ctx, TARGET_DELIMITER + ending) for item in items for ending in item.endings
        ]
        return PreparedChoice(items, requests)

    def evaluate(self, model: nn.Module, prepared: PreparedChoice, progress: Progress | None = None) -> dict[str, float]:
        scores = iter(score_targets(model, prepared.requests, self.batch_size, progress))
        logliks = [[next(scores).logprob for _ in item.endings] for item in prepared.items]
        return choice_metrics(prepared.items, logliks)
