"""Running tasks on models named on the command line: resolve names, load one model at a time, progress bars,
print and write the cells. The CLI commands and recipes call these; the sweep logic itself is in sweep.py."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.quant.sites import QuantConfig
from quantdiff.eval.sweep import Cell, CellProgress, run_model_cells, sweep_table, write_json
from quantdiff.eval.tasks.registry import Task, make_task

# CLI option -> the field it sets, per task; an option a task has no field for is an error, not ignored.
CLI_FIELDS = {
    "choice": {"data": "path", "seed": "seed"},
    "lm": {"data": "path", "context": "context"},
    "retrieval": {"data": "filler_path", "context": "context_tokens", "needles": "n_needles", "depth": "depth", "seed": "seed"},
}


def make_cli_task(name: str, batch_size: int, **given: object) -> Task:
    """A task from the CLI's options (`data`, `context`, `needles`, `depth`, `seed`; None = not given)."""
    if name not in CLI_FIELDS:
        make_task(name)  # raises the unknown-task error
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    data, context, depth, needles = (given.get(k) for k in ("data", "context", "depth", "needles"))
    if data is not None and not Path(data).is_file():
        raise ConfigError(f"--data file not found: {data}")
    if context is not None and context < 2:
        raise ConfigError(f"--context must be at least 2 tokens, got {context}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ConfigError(f"--depth must be in [0, 1], got {depth}")
    if needles is not None and needles < 1:
        raise ConfigError(f"--needles must be positive, got {needles}")
    fields = CLI_FIELDS[name]
    unused = [f"--{flag}" for flag, value in given.items() if value is not None and flag not in fields]
    if unused:
        raise ConfigError(f"task {name!r} does not take {', '.join(unused)}")
    return make_task(name, batch_size=batch_size, **{fields[flag]: value for flag, value in given.items() if flag in fields})


def resolve_models(specs: Sequence[str]) -> list[tuple[str, Path]]:
    """(name, directory) for each MODEL argument: a directory, or a zoo name ('tiny' gives two).

    Names are directory names ('standard'), zoo names with their kind ('tiny/diff'), or the whole path when
    two directories share a name.
    """
    from quantdiff.models.loading import check_model_dir
    from quantdiff.models.names import resolve

    resolved = []
    for spec in specs:
        from_zoo = not Path(spec).exists()
        for d in resolve(spec):
            check_model_dir(d)
            resolved.append((f"{spec.split('/')[0]}/{d.name}" if from_zoo else d.name, d))
    counts = Counter(name for name, _ in resolved)
    out = [(name if counts[name] == 1 else str(path), path) for name, path in resolved]
    if len({name for name, _ in out}) != len(out):
        raise ConfigError("the same model is named twice")
    return out


def check_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:1)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return parsed


def check_output(path: Path | None, suffixes: Sequence[str] | None) -> None:
    """Fail before any work if an output path cannot be written as asked."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"output path is a directory: {path}")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{path}: use one of {', '.join(suffixes)}")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise ConfigError(f"cannot create {path}: {parent} is not a directory")


@contextlib.contextmanager
def progress_bars(quiet: bool) -> Iterator[CellProgress | None]:
    """A CellProgress showing one bar per running cell (cleared when done), or None when quiet."""
    if quiet:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        current: list[int] = []

        def start(label: str, total: int):
            for task_id in current:
                progress.remove_task(task_id)
            current[:] = [progress.add_task(label, total=total)]
            return lambda n: progress.advance(current[0], n)

        yield start


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
) -> list[Cell]:
    """Load each model in turn (only one in memory) and run its cells; every model's task data is prepared
    (and so checked) before any weights are loaded."""
    from transformers.utils import logging as transformers_logging

    from quantdiff.models.loading import load, load_tokenizer

    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be positive, got {limit}")
    target = check_device(device)
    tokenizers = [load_tokenizer(path) for _, path in specs]
    prepared = [task.prepare(tokenizer, limit) for tokenizer in tokenizers]
    if quiet:
        transformers_logging.disable_progress_bar()  # its "Loading weights" bar
    cells: list[Cell] = []
    with progress_bars(quiet) as progress:
        for (name, path), tokenizer, data in zip(specs, tokenizers, prepared):
            model = load(path, device=target, trust_remote_code=trust_remote_code)
            if len(tokenizer) > model.config.vocab_size:
                raise LoadError(f"{path}: the tokenizer has {len(tokenizer)} tokens, the model only {model.config.vocab_size}")
            cells.extend(run_model_cells(name, model, task, data, configs, progress, include_reference, allow_partial))
            del model
    return cells


def report(cells: Sequence[Cell], task: Task, json_path: Path | None, quiet: bool) -> None:
    """Print the cells as a table; write them as JSON if asked."""
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)  # pipes get whole rows, not 80 columns
    out.print(sweep_table(cells, task.metrics, title=f"task: {task.name}"))
    if json_path is not None:
        write_json(cells, json_path)
        if not quiet:
            out.print(f"json -> {json_path}")
