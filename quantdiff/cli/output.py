"""What a command prints and the `--json` result it writes, the same way for every command.

Human-readable lines go to stdout, or to stderr when `--json -` makes stdout the JSON's; `--quiet` silences them
(warnings still reach stderr: `report.console.warn`). A result document is `{"schema": "quantdiff.<command>",
"version": 1, ...}`, so that a later run recognises the file as one it may replace (`core.owned`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from rich.console import Console

from quantdiff.core.atomic import STDOUT
from quantdiff.core.errors import ConfigError

RESULT_VERSION = 1


def to_stdout(json_path: Path | None) -> bool:
    return str(json_path) == STDOUT


def result_console(json_path: Path | None, quiet: bool) -> Console:
    """The console for a command's status lines and tables: silent under --quiet, on stderr with `--json -`."""
    from quantdiff.report.console import line_console

    return line_console(stderr=to_stdout(json_path), quiet=quiet)


def check_json(json_path: Path | None, inputs: Iterable[str | Path], force: bool, replaced: Iterable[tuple[str, Path]] = ()) -> None:
    """Before any work: `--json` may not be an input or lie in one, may replace an existing file only if quantdiff
    wrote it (or with `force`), and may be neither an output the command replaces nor lie inside one (`replaced`:
    (what it is, its path) pairs)."""
    from quantdiff.cli.task_options import check_output
    from quantdiff.core.outputs import check_outputs

    if json_path is None or to_stdout(json_path):
        return
    check_outputs({"--json": json_path}, inputs)
    check_output(json_path, None, force, "--json")
    target = json_path.resolve()
    for what, path in replaced:
        if target == path.resolve() or path.resolve() in target.parents:
            raise ConfigError(f"--json {json_path} would be written into {what} {path}, which this command replaces: write it elsewhere")


def write_result(json_path: Path | None, command: str, fields: dict[str, Any], force: bool = False) -> None:
    """Write the command's result document to `json_path` (nothing when None; '-': stdout)."""
    from quantdiff.core.atomic import write_json

    if json_path is not None:
        write_json(json_path, {"schema": f"quantdiff.{command}", "version": RESULT_VERSION, **fields}, indent=2, force=force)
