"""The `quantdiff` command line: assembles the typer app and turns expected failures into one line."""

from __future__ import annotations

import importlib
import os
import sys

# Before anything imports torch: with OpenMP's default (active) wait policy, 2-thread torch steps stalled for
# seconds on 2-core machines (DESIGN.md). Users can still override it.
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


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors and QuantdiffError become `error: <one line>` and exit code 2 / 1."""
    app = build_app()
    _quiet_transformers()
    try:
        app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except _CLICK_EXCEPTION as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except QuantdiffError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except (OSError, MemoryError) as exc:
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
