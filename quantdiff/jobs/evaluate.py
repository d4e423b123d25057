"""Evaluating models on a task: load one model at a time, run its sweep cells, print and write the cells."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from quantdiff.core.atomic import write_json
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.progress import task_bars
from quantdiff.eval.sweep import Cell, cell_label, cells_to_json, run_model_cells, split_blocks
from quantdiff.eval.tasks.registry import Task
from quantdiff.quant.sites import QuantConfig


def run_models(
    specs: Sequence[tuple[str, Path]],
    task: Task,
    configs: Sequence[QuantConfig],
    limit: int | None,
    device: str | torch.device | None,
    quiet: bool,
    include_reference: bool = True,
    allow_partial: bool = False,
    trust_remote_code: bool = False,
    blocks: int | None = None,
) -> list[Cell]:
    """Load each model in turn (only one in memory) and run its cells; every model's task data is prepared
    (and so checked) before any weights are loaded. Smoothing configurations are calibrated on each model first.
    blocks: also evaluate each cell in that many blocks of items (`eval.sweep.split_blocks`)."""
    from transformers.utils import logging as transformers_logging

    from quantdiff.models.loading import load_tokenizer
    from quantdiff.quant.checkpoint import load
    from quantdiff.quant.transforms import calibrated_configs

    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be positive, got {limit}")
    target = resolve_device(device)
    tokenizers = [load_tokenizer(path) for _, path in specs]
    prepared = [task.prepare(tokenizer, limit) for tokenizer in tokenizers]
    for data in prepared if blocks is not None else []:
        split_blocks(data, blocks)  # too few items for the blocks: refused before any weights load
    if quiet:
        transformers_logging.disable_progress_bar()  # its "Loading weights" bar
    cells: list[Cell] = []
    with task_bars(quiet, transient=True) as progress:
        for (name, path), tokenizer, data in zip(specs, tokenizers, prepared):
            model = load(path, device=target, trust_remote_code=trust_remote_code)
            if len(tokenizer) > model.config.vocab_size:
                raise LoadError(f"{path}: the tokenizer has {len(tokenizer)} tokens, the model only {model.config.vocab_size}")
            model_configs = calibrated_configs(configs, model, tokenizer)
            cells.extend(run_model_cells(name, model, task, data, model_configs, progress, include_reference, allow_partial, blocks))
            del model
    return cells


def report(cells: Sequence[Cell], task: Task, json_path: Path | None, quiet: bool, sources: dict[str, dict | None] | None = None) -> None:
    """Print the cells as a table (and a warning on stderr, even when quiet, per invalid cell); write them as
    JSON if asked, with each model's `sources` record."""
    from quantdiff.report.console import table_console, warn
    from quantdiff.report.sweep_report import invalid_reason, sweep_table

    for cell in cells:
        if not cell.valid:
            warn(f"{cell.model} · {cell_label(cell)}: {invalid_reason(cell)}; its metrics are null")
    table = sweep_table(cells, task.metrics, task.headline, title=f"task: {task.name}")
    out = table_console(table, highlight=False)  # piped: whole rows, not rich's 80 columns
    out.print(table)
    if json_path is not None:
        write_json(json_path, cells_to_json(cells, sources), indent=2)
        if not quiet:
            out.print(f"json -> {json_path}")
