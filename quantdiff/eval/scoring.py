"""Log-likelihood of target tokens given context tokens, in padded batches: the core every task scores with.

Batches are LEFT-padded with explicit position ids. With left padding a padding query row sees no valid key
(it precedes every real token), so it adds nothing to the logits the taps see: per-sequence dynamic
quantization scales, and hence results, do not depend on what else is in the batch or how long it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from quantdiff.core.errors import DataError

Progress = Callable[[int], None]  # called with the number of items just finished
# One batch's float32 logits (rows × tokens × vocabulary): a 262K vocabulary (Gemma 3) at 256 tokens is 268 MB a
# row, so its batches shrink to 2 rows; 50K vocabularies at 256 tokens still take 10.
LOGITS_BUDGET_BYTES = 1 << 29


@dataclass(frozen=True)
class TargetScore:
    """Scores of one request's target tokens."""

    logprob: float  # sum of log p(target_j | everything before it)
    n_tokens: int
    n_correct: int  # targets that were the argmax prediction

    @property
    def greedy(self) -> bool:
        """Greedy decoding would have produced exactly the targets."""
        return self.n_correct == self.n_tokens


@dataclass
class ScoredLogits:
    """How many positions whose logits some metric used held a NaN or ±Inf."""

    nonfinite: int = 0


_scored: ContextVar[ScoredLogits | None] = ContextVar("scored_logits", default=None)


@contextmanager
def counting_scored_logits() -> Iterator[ScoredLogits]:
    """Count, while the block runs, the scored positions (every task scores through this module) whose logits
    are not all finite: an argmax or log-softmax over NaN still yields a plausible-looking number."""
    counter = ScoredLogits()
    token = _scored.set(counter)
    try:
        yield counter
    finally:
        _scored.reset(token)


def note_scored(logits: torch.Tensor) -> None:
    """Record positions (..., V) whose logits a metric uses; only positions scored, never padding."""
    counter = _scored.get()
    if counter is not None:
        counter.nonfinite += int((~torch.isfinite(logits)).any(dim=-1).sum())


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def max_positions(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def left_pad(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (B, T): sequences right-aligned, positions from 0."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # pad id is irrelevant: masked out everywhere
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    positions = (mask.cumsum(dim=-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device)


def batches_within_budget(model: nn.Module, widths: Sequence[int], batch_size: int) -> Iterator[slice]:
    """Consecutive slices of rows (of `widths` tokens each), at most `batch_size` long, whose logits stay within
    LOGITS_BUDGET_BYTES (one row always goes, whatever its size)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 1
    start = 0
    while start < len(widths):
        stop, width = start + 1, widths[start]
        while stop < len(widths) and stop - start < batch_size and (stop - start + 1) * max(width, widths[stop]) * vocab * 4 <= LOGITS_BUDGET_BYTES:
            width = max(width, widths[stop])
            stop += 1
        yield slice(start, stop)
        start = stop


@torch.no_grad()
def next_token_logits(model: nn.Module, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits (B, T, V) of a left-padded batch; row b's last len(seqs[b]) positions are its tokens."""
    ids, mask, positions = left_pad(seqs, model_device(model))
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()


def score_targets(
    model: nn.Module,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int = 8,
    progress: Progress | None = None,
) -> list[TargetScore]:
    """Score each (context, targets) pair: targets are predicted one by one after the context.

    Inputs longer than the model's positions keep their last tokens (as lm-evaluation-harness does); the
    targets are always scored in full. Requests run longest first to waste little padding.
    """
    limit = max_positions(model)
    inputs = []
    for context, targets in requests:
        if not targets:
            raise ValueError("a scoring request needs at least one target token")
        whole = list(context) + list(targets)
        if limit is not None and len(targets) > limit:
            raise DataError(f"{len(targets)} tokens to score do not fit the model's {limit} positions")
        inputs.append(whole[-(limit + 1) :][:-1] if limit is not None else whole[:-1])
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    scores: list[TargetScore | None] = [None] * len(requests)
    for rows in batches_within_budget(model, [len(inputs[i]) for i in order], batch_size):
        chunk = order[rows]
        logits = next_token_logits(model, [inputs[i] for i in chunk])  # (B, T, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, i in enumerate(chunk):
            targets = torch.tensor(list(requests[i][1]), device=logprobs.device)
            note_scored(logits[row, -len(targets) :])
            predicted = logprobs[row, -len(targets) :]  # (n, V): the rows predicting each target
            scores[i] = TargetScore(
                logprob=predicted.gather(-1, targets[:, None]).sum().item(),
                n_tokens=len(targets),
                n_correct=int((predicted.argmax(dim=-1) == targets).sum()),
            )
        if progress is not None:
            progress(len(chunk))
    return scores  # type: ignore[return-value]
