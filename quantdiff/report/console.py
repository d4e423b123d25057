"""Consoles for tables: on a terminal its width; piped or redirected, wide enough for whole rows."""

from __future__ import annotations

import sys

from rich.console import Console


def table_console(*renderables, stderr: bool = False, **kwargs) -> Console:
    """A Console that prints `renderables` without wrapping or cutting rows when the output is not a TTY
    (rich falls back to 80 columns there)."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, **kwargs)
    probe = Console(width=100_000)
    width = max([80, *(probe.measure(r).maximum for r in renderables)])
    return Console(stderr=stderr, width=width, **kwargs)


def line_console(stderr: bool = False, quiet: bool = False) -> Console:
    """A Console for status lines: soft wrap, so that a line is never broken where a pipe or a narrow terminal
    would make rich wrap it (80 columns off a terminal), and no highlighting of numbers and paths; `quiet`
    (--quiet) prints nothing."""
    return Console(stderr=stderr, quiet=quiet, highlight=False, soft_wrap=True)


def warn(text: str) -> None:
    """One `warning:` line on stderr: printed even under --quiet, which silences progress and tables, never
    what makes a number untrustworthy."""
    line_console(stderr=True).print(f"warning: {text}", style="yellow", markup=False)
