"""Every path that reading a model touches, for the outputs check (`core.outputs.check_outputs`): the model as
named when it names a path (a directory, a GGUF file), the installed wheel files of a wheel model, and the
directories the names resolved to (a GGUF file's dequantized copy; each directory stands for the weight files
it names, wherever they lie)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from quantdiff.core.errors import LoadError
from quantdiff.models.wheels import WHEEL_MODELS, part_files


def given_paths(spec: str | Path) -> list[Path]:
    """The paths a model name itself names, without resolving it (no conversion, no hub): [] for a built-in or
    hub name, or a wheel model whose wheel is not installed."""
    path = Path(spec)
    if path.exists() or path.is_symlink():
        return [path]
    if str(spec) in WHEEL_MODELS:
        try:
            return part_files(str(spec))  # the installed files themselves: naming them joins or hashes nothing
        except LoadError:
            return []
    return []


def model_inputs(specs: Iterable[str | Path], resolved: Iterable[Path] = ()) -> list[Path]:
    """Inputs of a command reading the models `specs`, resolved to the directories `resolved`."""
    return [path for spec in specs for path in given_paths(spec)] + [Path(p) for p in resolved]
