"""The `quantdiff` command line: assembles the typer app and turns every failure into one line.

One error path: whatever exception reaches `main` becomes exactly one `error:` line on stderr and a non-zero
exit code. Expected failures (QuantdiffError, usage errors, OS errors such as a missing permission) print
their message; anything else is a bug or an unforeseen condition and prints
`error: internal error: <Type>: <message> (run with QUANTDIFF_DEBUG=1 for the traceback)`, exit code 3.
With QUANTDIFF_DEBUG=1 the exception propagates with its traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

# Before anything imports torch: with OpenMP's default (active) wait policy, 2-thread torch steps stalled for
# seconds on 2-core machines. Users can still override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer

from quantdiff.core.errors import QuantdiffError

# typer >= 0.24 vendors click: find its ClickException through a public class so both layouts work.
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

# (command name, module under quantdiff.cli.commands, function) — modules hold no logic beyond argument handling.
COMMANDS = [
    ("stats", "stats", "stats"),
    ("sweep", "sweep", "sweep"),
    ("eval", "sweep", "evaluate"),
    ("quantize", "quantize", "quantize"),
    ("train", "train", "train"),
    ("reproduce", "reproduce", "reproduce"),
    ("info", "info", "info"),
    ("pair", "pair", "pair"),
]


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="quantdiff",
        help="Where are a model's activation outliers, and how many bits does it survive? "
        "Differential vs standard Transformers (arXiv 2410.05258).",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    @app.callback()
    def _root() -> None:
        """Keeps sub-commands as sub-commands even while only one is registered."""

    for name, module, function in COMMANDS:
        try:
            command = getattr(importlib.import_module(f"quantdiff.cli.commands.{module}"), function)
        except (ModuleNotFoundError, AttributeError):
            continue  # a command whose module has not landed yet is simply absent
        app.command(name)(command)
    return app


def _quiet_transformers() -> None:
    """transformers' own 'Loading weights' / 'Writing shards' bars would interleave with ours."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


DEBUG_VARIABLE = "QUANTDIFF_DEBUG"
INTERNAL_ERROR_EXIT = 3


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def error_line(exc: BaseException) -> tuple[str, int]:
    """The `error:` line and exit code for an exception that reached the command line."""
    if isinstance(exc, _CLICK_EXCEPTION):
        return f"error: {_one_line(exc.format_message()) or 'no command given (usage above)'}", exc.exit_code
    if isinstance(exc, QuantdiffError):
        return f"error: {_one_line(exc)}", 1
    if isinstance(exc, typer.Abort):
        return "error: aborted", 130
    if isinstance(exc, KeyboardInterrupt):
        return "error: interrupted", 130
    if isinstance(exc, MemoryError):
        return "error: out of memory", 1
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"error: {_one_line(exc.strerror)}{where}", 1
    message = f": {_one_line(exc)}" if str(exc).strip() else ""
    return f"error: internal error: {type(exc).__name__}{message} (run with {DEBUG_VARIABLE}=1 for the traceback)", INTERNAL_ERROR_EXIT


def main(argv: list[str] | None = None) -> None:
    """Entry point: every exception becomes one `error:` line and a non-zero exit (see the module docstring)."""
    _quiet_transformers()
    try:
        build_app()(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except SystemExit:
        raise
    except BaseException as exc:
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        line, code = error_line(exc)
        typer.echo(line, err=True)
        sys.exit(code)
