"""The CLI's task and output options: which flag sets which task field, and checks worded in flags."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from quantdiff.core.atomic import STDOUT, writable_target
from quantdiff.core.errors import ConfigError
from quantdiff.data.sources import check_data_file
from quantdiff.eval.tasks.registry import Task, make_task

# CLI option -> the field it sets, per task; an option a task has no field for is an error, not ignored.
CLI_FIELDS = {
    "choice": {"data": "path", "seed": "seed"},
    "lm": {"data": "path", "context": "context"},
    "retrieval": {"data": "filler_path", "context": "context_tokens", "needles": "n_needles", "depth": "depth", "seed": "seed"},
    "bb": {"context": "context"},
}


def make_cli_task(name: str, batch_size: int, **given: object) -> Task:
    """A task from the CLI's options (`data`, `context`, `needles`, `depth`, `seed`; None = not given)."""
    if name not in CLI_FIELDS:
        make_task(name)  # raises the unknown-task error
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    data, context, depth, needles = (given.get(k) for k in ("data", "context", "depth", "needles"))
    if data is not None:
        check_data_file(data)
        given["data"] = Path(data)
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


def fit_default_context(task: Task, context: int | None, specs: Sequence[tuple[str, Path]], trust_remote_code: bool = False) -> Task:
    """Tasks lm and retrieval without --context: windows (needle documents) of their default 256 tokens, or of the
    fewest positions among the evaluated models when fewer (docs/reliability.md, "The lm default context"), one
    length for every model so their cells compare; a --context given is kept, and refused beyond a model's
    positions, never cut."""
    import dataclasses

    from quantdiff.eval.tasks.lm import LMTask
    from quantdiff.eval.tasks.retrieval import RetrievalTask
    from quantdiff.models.loading import load_config

    field = {LMTask: "context", RetrievalTask: "context_tokens"}.get(type(task))
    if field is None or context is not None:
        return task
    positions = [getattr(load_config(path, trust_remote_code), "max_position_embeddings", None) for _, path in specs]
    return dataclasses.replace(task, **{field: min([getattr(task, field), *(p for p in positions if isinstance(p, int) and p >= 2)])})


def check_output(path: Path | None, suffixes: Sequence[str] | None, force: bool = False, flag: str = "output") -> None:
    """Fail before any work if an output file cannot be written as asked (`suffixes`: None = any; a `--json`
    of '-' is stdout, which `core.outputs.check_outputs` allows for --json only); an existing file must be
    quantdiff's, or `force` given."""
    if path is None or str(path) == STDOUT:
        return
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{path}: use one of {', '.join(suffixes)}")
    writable_target(path, force, flag)


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be positive, got {limit}")
