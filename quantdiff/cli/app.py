"""The `quantdiff` command line: assembles the typer app and turns every failure into one line.

One error path: whatever exception reaches `main` becomes exactly one `error:` line on stderr and a non-zero
exit code. Expected failures (QuantdiffError, usage errors, OS errors such as a missing permission) print
their message; anything else is a bug or an unforeseen condition and prints
`error: internal error: <Type>: <message> (run with QUANTDIFF_DEBUG=1 for the traceback)`, exit code 3.
With QUANTDIFF_DEBUG=1 the exception propagates with its traceback instead.

Signals take the same path: SIGINT, SIGTERM and SIGHUP raise `Interrupted` wherever the program is (imports,
loading, a measurement), so context managers discard partial outputs, and the run ends with one line and exit
code 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). typer is imported only after the handlers are in
place, so even a Ctrl-C during start-up takes this path. Once the command has returned (its outputs written) a
signal is recorded instead of raised, and reported the same way. The process's own run (`main()` without argv)
then ignores the signals while it exits, so a later one never kills it with the default action (status -15).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

# Before anything imports torch: with OpenMP's default (active) wait policy, 2-thread torch steps stalled for
# seconds on 2-core machines. Users can still override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from quantdiff.core.errors import QuantdiffError

if TYPE_CHECKING:  # imported for real only after the signal handlers are in place
    import typer

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A handled signal arrived. A KeyboardInterrupt, so no `except Exception` swallows it and cleanup written
    for Ctrl-C runs for SIGTERM too; click turns it into a bare exit code, which `main` replaces by its line."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # signals seen by this process: a library that swallows Interrupted cannot hide one
_settled = False  # the command has returned: a signal is recorded (and reported by main), no longer raised


def _raise_interrupted(signum: int, _frame: object) -> None:
    _received.append(signum)
    if not _settled:
        raise Interrupted(signum)


@contextmanager
def _signals_raise_interrupted(restore: bool = True) -> Iterator[None]:
    """Install the handler for the run, then restore the caller's (tests call main in-process) when `restore`,
    else ignore the signals: the process's own run is exiting with the status main is about to decide, which the
    default action (status -15) would replace, and ignored signals stay ignored through the interpreter's exit.

    A signal the parent set to be ignored (nohup, a background job) stays ignored. Python runs handlers in the
    main thread only, so main() called from another thread leaves them alone."""
    global _settled
    _received.clear()
    _settled = False
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _raise_interrupted)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if restore else signal.SIG_IGN)

# (command name, module under quantdiff.cli.commands, function) — modules hold no logic beyond argument handling.
COMMANDS = [
    ("stats", "stats", "stats"),
    ("sweep", "sweep", "sweep"),
    ("eval", "sweep", "evaluate"),
    ("quantize", "quantize", "quantize"),
    ("kv-plan", "kv_plan", "kv_plan"),
    ("sensitivity", "sensitivity", "sensitivity"),
    ("train", "train", "train"),
    ("reproduce", "reproduce", "reproduce"),
    ("info", "info", "info"),
    ("pair", "pair", "pair"),
]


def build_app() -> "typer.Typer":
    import typer

    app = typer.Typer(
        name="quantdiff",
        help="Where are a model's activation outliers, and how many bits does it survive?\n\n"
        "Differential Transformers (arXiv 2410.05258) and standard ones side by side; each command's --help says what "
        "it answers and every option it takes.",
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


def _click_exception() -> type:
    """typer >= 0.24 vendors click: find its ClickException through a public class so both layouts work."""
    import typer

    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def interrupted_line(signum: int) -> tuple[str, int]:
    verb = "interrupted" if signum == signal.SIGINT else "terminated"
    return f"error: {verb} by {signal.Signals(signum).name}", 128 + signum


def error_line(exc: BaseException) -> tuple[str, int]:
    """The `error:` line and exit code for an exception that reached the command line."""
    import typer

    if _received:  # whatever the signal became on its way up (transformers re-raises import failures)
        return interrupted_line(_received[0])
    if isinstance(exc, _click_exception()):
        return f"error: {_one_line(exc.format_message()) or 'no command given (usage above)'}", exc.exit_code
    if isinstance(exc, QuantdiffError):
        return f"error: {_one_line(exc)}", 1
    if isinstance(exc, typer.Abort):
        return "error: aborted", 130
    if isinstance(exc, KeyboardInterrupt):  # raised by hand, or a handler other than ours
        return interrupted_line(signal.SIGINT)
    if isinstance(exc, MemoryError):
        return "error: out of memory", 1
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"error: {_one_line(exc.strerror)}{where}", 1
    message = f": {_one_line(exc)}" if str(exc).strip() else ""
    return f"error: internal error: {type(exc).__name__}{message} (run with {DEBUG_VARIABLE}=1 for the traceback)", INTERNAL_ERROR_EXIT


def main(argv: list[str] | None = None) -> None:
    """Entry point: every exception becomes one `error:` line and a non-zero exit (see the module docstring).
    Without `argv` this is the process's own run (sys.argv; the `quantdiff` script, `python -m quantdiff`),
    which exits with it: once its status is decided, the handled signals are ignored until the process is gone."""
    with _signals_raise_interrupted(restore=argv is not None):
        _quiet_transformers()
        line, code = _outcome(argv)
    if _received:  # a signal that some library swallowed, or one after the command returned: still interrupted
        line, code = interrupted_line(_received[0])
    if line is not None:
        _fail(line, code)
    if code != 0:
        sys.exit(code)


def _outcome(argv: list[str] | None) -> tuple[str | None, int]:
    """(the `error:` line or None, the exit code) of the command; from its return on, signals are only recorded."""
    global _settled
    try:
        try:
            # Outside standalone mode click returns, rather than raises, the code of a typer.Exit.
            code = build_app()(args=argv, standalone_mode=False)
        finally:
            _settled = True
    except SystemExit:
        raise
    except BaseException as exc:
        _settled = True  # when the signal came before the assignment above
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        return error_line(exc)
    return None, code if isinstance(code, int) else 0


def _fail(line: str, code: int) -> None:
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)
