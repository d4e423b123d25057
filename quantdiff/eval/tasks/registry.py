"""Task names → task types, and the interface every task follows.

A task is prepared once per tokenizer (data built and tokenized) and then evaluated once per
quantization cell, so a sweep never rebuilds its data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sized

from torch import nn

from quantdiff.core.errors import ConfigError
from quantdiff.eval.tasks.bb import BBTask
from quantdiff.eval.tasks.choice import ChoiceTask
from quantdiff.eval.tasks.lm import LMTask
from quantdiff.eval.tasks.retrieval import RetrievalTask
from quantdiff.eval.scoring import Progress


class Task(Protocol):
    name: str
    metrics: tuple[str, ...]  # what the task reports
    headline: str  # the one metric plots, Δ columns and report tables show (a class constant of each task)
    bos_by_construction: bool  # its sequences start with BOS whatever `prepare` is told (bb's generator)

    def prepare(self, tokenizer: Any, limit: int | None = None, bos_id: int | None = None) -> Sized:
        """Data for one tokenizer, every sequence opened by `bos_id` when given (a model that expects BOS first);
        `len()` is the number of progress units `evaluate` reports."""

    def evaluate(self, model: nn.Module, prepared: Any, progress: Progress | None = None) -> dict[str, float]:
        """Metrics by name; calls `progress(n)` as units finish."""

    def damage_sequences(self, prepared: Any) -> list[list[int]]:
        """The token sequences a quantized cell's damage is measured on (`eval.cell_damage`, docs/damage.md):
        every position after the first predicts the next token of its sequence."""


TASKS: dict[str, type] = {"lm": LMTask, "choice": ChoiceTask, "retrieval": RetrievalTask, "bb": BBTask}


def make_task(name: str, **options: Any) -> Task:
    """A task by name; options are its dataclass fields (e.g. `path`, `context_tokens`). None = default."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    cls = TASKS[name]
    known = {f.name for f in dataclasses.fields(cls)} - {"name", "metrics"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"task {name!r} has no option(s) {', '.join(unknown)}")
    return cls(**{key: value for key, value in options.items() if value is not None})


def headline_metric(task: str) -> str:
    """The headline metric of a task by name (for results read back from JSON)."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")
    return TASKS[task].headline
