"""The Bigram-Backcopy task's own accuracy (data.bigram_backcopy): how well a model does what it was trained on.

After a trigger token the next token is a copy of the one before the trigger: deterministic, so greedy
accuracy on those positions is a clean signal (the headline metric, `accuracy`). Every other position is a
draw from a known distribution, so instead of an accuracy (which no model can push to 1) the task reports
`bigram_kl`: the mean KL divergence, in nats, from the true next-token distribution to the model's over those
positions (0 for a perfect model). `backcopy_loss` and `bigram_loss` are the mean next-token losses of the two
kinds of positions. The sequences are the generator's held-out ones (a seed stream no training seed reaches),
BOS first, `context` tokens each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from quantdiff.core.errors import DataError
from quantdiff.data import bigram_backcopy
from quantdiff.eval.scoring import Progress, max_positions, next_token_logits


@dataclass(frozen=True)
class PreparedBB:
    sequences: list[list[int]]

    def __len__(self) -> int:  # progress units: sequences
        return len(self.sequences)


@dataclass
class BBTask:
    """`sequences` held-out sequences of `context` tokens (BOS first); `limit` sets the number instead: the first
    `limit` sequences of the held-out stream (each sequence is the same whatever the count)."""

    sequences: int = 64
    context: int = 64  # the shipped bb models' length (recipes/bb.toml); the authors train on 256
    batch_size: int = 8
    name: str = "bb"
    metrics: tuple[str, ...] = ("accuracy", "bigram_kl", "backcopy_loss", "bigram_loss")
    headline: ClassVar[str] = "accuracy"
    bos_by_construction: ClassVar[bool] = True  # the generator's sequences: BOS first, whatever bos_id says

    def prepare(self, tokenizer, limit: int | None = None, bos_id: int | None = None) -> PreparedBB:
        if self.context < 3 or self.sequences < 1:
            raise DataError(f"task bb needs a context of at least 3 tokens and at least 1 sequence, got {self.context} and {self.sequences}")
        generator = bigram_backcopy.load()
        generator.check_tokenizer(tokenizer)
        count = self.sequences if limit is None else limit
        return PreparedBB(generator.held_out_rows(count, self.context + 1).tolist())

    def evaluate(self, model: nn.Module, prepared: PreparedBB, progress: Progress | None = None) -> dict[str, float]:
        limit = max_positions(model)
        if limit is not None and self.context > limit:
            raise DataError(f"task bb's context of {self.context} tokens exceeds the model's {limit} positions")
        generator = bigram_backcopy.load()
        totals = torch.zeros(5, dtype=torch.float64)  # backcopy: n, correct, nll; bigram: n, kl
        bigram_nll = 0.0
        for start in range(0, len(prepared.sequences), self.batch_size):
            rows = torch.tensor(prepared.sequences[start : start + self.batch_size])
            inputs, targets = rows[:, :-1], rows[:, 1:]
            logprobs = torch.log_softmax(next_token_logits(model, inputs.tolist()), dim=-1).double().cpu()
            nll = -logprobs.gather(-1, targets[..., None])[..., 0]
            copy = generator.backcopy_targets(inputs)
            truth = generator.next_distribution(inputs[~copy])  # (n, V)
            kl = (truth * (truth.clamp_min(1e-300).log() - logprobs[~copy])).where(truth > 0, 0.0).sum(-1)
            correct = (logprobs.argmax(-1) == targets)[copy]
            totals += torch.tensor([copy.sum(), correct.sum(), nll[copy].sum(), (~copy).sum(), kl.sum()], dtype=torch.float64)
            bigram_nll += float(nll[~copy].sum())
            if progress is not None:
                progress(len(rows))
        n_copy, correct, copy_nll, n_bigram, kl = totals.tolist()
        if n_copy == 0 or n_bigram == 0:
            raise DataError("task bb: the sequences hold no backcopy or no bigram position (context too short)")
        return {"accuracy": correct / n_copy, "bigram_kl": kl / n_bigram, "backcopy_loss": copy_nll / n_copy,
                "bigram_loss": bigram_nll / n_bigram, "backcopy_positions": int(n_copy), "bigram_positions": int(n_bigram)}

    def damage_sequences(self, prepared: PreparedBB) -> list[list[int]]:
        """Each sequence's inputs (its first `context` tokens, what the task feeds the model): the damage scores
        every target the task scores but the last, which no input position of the sequence predicts."""
        return [row[:-1] for row in prepared.sequences]

    def pool(self, blocks: list[dict[str, float]]) -> dict[str, float]:
        """The metrics of the union of disjoint blocks of sequences, from each block's metrics (position-weighted)."""
        weight = {"accuracy": "backcopy_positions", "backcopy_loss": "backcopy_positions", "bigram_kl": "bigram_positions", "bigram_loss": "bigram_positions"}
        totals = {count: sum(b[count] for b in blocks) for count in ("backcopy_positions", "bigram_positions")}
        pooled = {m: sum(b[m] * b[count] for b in blocks) / totals[count] for m, count in weight.items()}
        pooled["accuracy"] = round(pooled["accuracy"] * totals["backcopy_positions"]) / totals["backcopy_positions"]  # a count ratio, as unpooled
        return {**pooled, **totals}
