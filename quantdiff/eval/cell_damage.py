"""The damage fields of `eval` and `sweep` cells (issue 55): each quantized cell's llama.cpp KL-divergence measures
(`eval.damage`) against the same model unquantized, on the task's own sequences (`Task.damage_sequences`).

One model's configs are measured together: per batch, one full-precision forward, then every config before the next
batch (`eval.damage.damages`), so the full-precision logits are computed once and reused for every cell.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from quantdiff.core.errors import DataError
from quantdiff.data.sources import Batch
from quantdiff.eval.damage import damages
from quantdiff.eval.scoring import batches_within_budget, max_positions
from quantdiff.quant.sites import QuantConfig

# What a cell's console row shows of its damage (the JSON holds every field of `eval.damage.summarize`).
SHOWN = (("kld_mean", "KL mean"), ("same_top1", "same top-1"))


def unpadded_batches(model: nn.Module, sequences: Sequence[Sequence[int]], batch_size: int) -> list[Batch]:
    """Batches of equal-length sequences only, so no row is padded: a per-sequence (non-causal) scale then sees the
    sequence's own tokens alone, as in the tasks' own left-padded batches. A sequence longer than the model's
    positions keeps its last tokens (as `scoring.score_targets`); each batch's logits stay within the tasks' budget
    (`scoring.batches_within_budget`)."""
    limit = max_positions(model)
    rows = [list(s)[-limit:] if limit is not None else list(s) for s in sequences]
    by_length: dict[int, list[list[int]]] = {}
    for row in rows:
        if len(row) >= 2:  # a sequence of one token predicts nothing
            by_length.setdefault(len(row), []).append(row)
    batches = []
    for length, group in sorted(by_length.items()):
        for part in batches_within_budget(model, [length] * len(group), batch_size):
            batches.append(Batch(torch.tensor(group[part], dtype=torch.int64), None, len(batches)))
    return batches


def cell_damages(
    model: nn.Module,
    task: Any,
    prepared: Any,
    configs: Sequence[QuantConfig],
    batch_size: int,
    progress: Callable[[str, int], Callable[[float], None]] | None = None,
    label: str = "",
    allow_partial: bool = False,
) -> list[dict]:
    """The damage fields of each config (`eval.damage.summarize`) on the task's damage sequences."""
    batches = unpadded_batches(model, task.damage_sequences(prepared), batch_size)
    if not batches:
        raise DataError(f"task {task.name}: no sequence of at least two tokens to measure the damage on")
    advance = None if progress is None else progress(f"{label} · damage against full precision", len(batches) * (1 + len(configs)))
    return damages(model, batches, configs, progress=advance, allow_partial=allow_partial)[0]
