"""Where a command may write: never onto, into or over what the same command reads.

Every command calls `check_outputs` with all its output paths (--json, --plot, --out) and all its inputs (model
directories, data files) before any work. Paths are compared after resolving symlinks, so a `--json` link
pointing at a model's weights is refused like the weights' own path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

from quantdiff.core.atomic import creatable_parent
from quantdiff.core.errors import ConfigError


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _resolved(source: Path) -> list[Path]:
    """The input's real path and, for a directory, the real paths its symlinked entries point at (a hub
    snapshot's files are links into a blob store elsewhere)."""
    reals = [Path(os.path.realpath(source))]
    if source.is_dir():
        reals += [Path(os.path.realpath(entry)) for entry in source.iterdir() if entry.is_symlink()]
    return reals


def check_outputs(outputs: Mapping[str, str | Path | None], inputs: Iterable[str | Path], replaced: bool = False) -> None:
    """Refuse an output (flag -> path; None = not given) that resolves to an input, lies inside an input
    directory, or — for a directory the command replaces as a whole (`replaced`) — holds an input; and two
    outputs resolving to the same path, or one whose parent cannot exist."""
    given = {flag: Path(path) for flag, path in outputs.items() if path is not None}
    sources = [(Path(source), real) for source in inputs for real in _resolved(Path(source))]
    seen: dict[Path, str] = {}
    for flag, path in given.items():
        real = Path(os.path.realpath(path))
        creatable_parent(real, path)
        if real in seen:
            raise ConfigError(f"{flag} and {seen[real]} name the same path {path}: each output needs its own")
        seen[real] = flag
        for source, real_source in sources:
            what = "model" if real_source.is_dir() else "file"
            if real == real_source:
                raise ConfigError(f"{flag} {path} is the input {what} {source}: refusing to write over it")
            if _within(real, real_source):
                raise ConfigError(f"{flag} {path} lies inside the input {what} {source}: refusing to write there")
            if replaced and _within(real_source, real):
                raise ConfigError(f"{flag} {path} contains the input {what} {source}: refusing to replace it")
