"""Where a command may write: never onto, into or over what the same command reads.

Every command calls `check_outputs` with all its output paths (--json, --plot, --out) and every path it reads,
options included (model directories and the files given for them, GGUF files, data files, `--real-model`),
before any work. A model directory stands for every file it will load, wherever it lies: the weight shards its
index names may sit outside it. Paths are compared after resolving symlinks, so a `--json` link pointing at a
model's weights is refused like the weights' own path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

from quantdiff.core.atomic import STDOUT, creatable_parent
from quantdiff.core.errors import ConfigError


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _resolved(source: Path) -> list[tuple[Path, Path]]:
    """(as named, real path) of the input and, for a directory, of its symlinked entries (a hub snapshot's
    files are links into a blob store elsewhere) and of the weight files it names."""
    reals = [(source, Path(os.path.realpath(source)))]
    if source.is_dir():
        reals += [(source, Path(os.path.realpath(entry))) for entry in source.iterdir() if entry.is_symlink()]
        reals += [(source / name, Path(os.path.realpath(source / name))) for name in named_weight_files(source)]
    return reals


def _json_object(file: Path) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def named_weight_files(model_dir: Path) -> list[str]:
    """Every file a model directory names as its weights, relative to it: the shards of its `*.index.json`
    weight maps and config.json's `transformers_weights` (any may lie outside the directory). Read leniently:
    the model's own checks report a malformed index; here every name it holds counts as an input."""
    names = []
    for index in model_dir.glob("*.index.json"):
        weight_map = _json_object(index).get("weight_map")
        if isinstance(weight_map, dict):
            names += [value for value in weight_map.values() if isinstance(value, str)]
    explicit = _json_object(model_dir / "config.json").get("transformers_weights")
    if isinstance(explicit, str):
        names.append(explicit)
    return sorted(set(names))


def check_outputs(outputs: Mapping[str, str | Path | None], inputs: Iterable[str | Path], replaced: bool = False) -> None:
    """Refuse an output (flag -> path; None = not given) that resolves to an input, lies inside an input
    directory, or — for a directory the command replaces as a whole (`replaced`) — holds an input; and two
    outputs resolving to the same path, or one whose parent cannot exist. `-` (standard output) is no path, and
    only --json writes there: any other output named `-` would be a file or directory called `-`."""
    stdout = next((flag for flag, path in outputs.items() if path is not None and str(path) == STDOUT and flag != "--json"), None)
    if stdout is not None:
        raise ConfigError(f"{stdout} -: '-' (stdout) is for --json only; name a path")
    given = {flag: Path(path) for flag, path in outputs.items() if path is not None and str(path) != STDOUT}
    sources = [pair for source in inputs for pair in _resolved(Path(source))]
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
