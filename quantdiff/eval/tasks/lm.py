"""Language modelling on held-out text: loss, perplexity and next-token accuracy, weighted by token.

The text is tokenized once and cut into consecutive, non-overlapping windows of `context` tokens; in each
window every token after the first is predicted from the ones before it. For a model that expects BOS first
(`models.bos`) each window is BOS + `context` − 1 text tokens, every text token scored. Token-weighted means a short
final window counts for its tokens only, so the result does not depend on how windows are batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from torch import nn

from quantdiff.core.errors import DataError
from quantdiff.data.sources import text_or_held_out
from quantdiff.eval.scoring import Progress, max_positions, score_targets


@dataclass(frozen=True)
class PreparedLM:
    windows: list[list[int]]

    def __len__(self) -> int:  # progress units: windows
        return len(self.windows)


def lm_metrics(total_logprob: float, n_tokens: int, n_correct: int) -> dict[str, float]:
    if n_tokens == 0:
        raise DataError("no tokens to score")
    loss = -total_logprob / n_tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": n_correct / n_tokens, "tokens": n_tokens}


@dataclass
class LMTask:
    """`path`: a UTF-8 text file; None = the corpus' held-out split. `tokens`: how much of it to use."""

    path: Path | None = None
    tokens: int = 65536
    context: int = 256
    batch_size: int = 8
    name: str = "lm"
    metrics: tuple[str, ...] = ("accuracy", "loss", "perplexity")
    headline: ClassVar[str] = "accuracy"
    bos_by_construction: ClassVar[bool] = False

    def prepare(self, tokenizer, limit: int | None = None, bos_id: int | None = None) -> PreparedLM:
        """Windows of the first `tokens` tokens (after `bos_id` when given); `limit` caps the number of windows."""
        if self.context < 2:
            raise DataError(f"an lm window needs at least 2 tokens, got context={self.context}")
        prefix = [] if bos_id is None else [bos_id]
        width = self.context - len(prefix)
        ids = list(tokenizer.encode(text_or_held_out(self.path), add_special_tokens=False))[: self.tokens]
        windows = [prefix + ids[i : i + width] for i in range(0, len(ids), width)]
        windows = [w for w in windows if len(w) >= 2][:limit]
        if not windows:
            raise DataError("the lm text is shorter than two tokens")
        return PreparedLM(windows)

    def evaluate(self, model: nn.Module, prepared: PreparedLM, progress: Progress | None = None) -> dict[str, float]:
        limit = max_positions(model)
        if limit is not None and max(len(w) for w in prepared.windows) > limit:
            raise DataError(f"lm windows of {self.context} tokens exceed the model's {limit} positions: use a context of at most {limit}")
        scores = score_targets(model, [(w[:1], w[1:]) for w in prepared.windows], self.batch_size, progress)
        return lm_metrics(sum(s.logprob for s in scores), sum(s.n_tokens for s in scores), sum(s.n_correct for s in scores))

    def damage_sequences(self, prepared: PreparedLM) -> list[list[int]]:
        """The windows themselves: the damage scores exactly the tokens the task scores."""
        return prepared.windows

    def pool(self, blocks: list[dict[str, float]]) -> dict[str, float]:
        """The metrics of the union of disjoint blocks of windows, from each block's metrics (token-weighted)."""
        tokens = [b["tokens"] for b in blocks]
        return lm_metrics(
            -sum(b["loss"] * n for b, n in zip(blocks, tokens)), sum(tokens), round(sum(b["accuracy"] * n for b, n in zip(blocks, tokens)))
        )
