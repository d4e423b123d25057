"""Fresh processes without the import bill: a command or a Python block runs in a process forked from a server
that has already imported torch, transformers and quantdiff.

A `python -m quantdiff …` started by subprocess spends ~5 s importing before it does anything, which is most of
what the documentation's examples cost. A forked child is still its own process: its own working directory,
environment, exit status, stdout and stderr, and nothing it changes (torch's settings, seeds, globals) reaches
the test worker or the next example. What it shares is only what the imports themselves did.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Imported once by the server, before any child is forked from it.
PRELOAD = ["torch", "transformers", "safetensors.torch", "quantdiff.api", "quantdiff.cli.app"]
_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(argv: list[str] | None, code: str | None, cwd: str, env: dict[str, str], out: str, err: str, args: list[str],
           default_sigint: bool) -> None:
    """The child's body: `python -m quantdiff ARGV` or `python -c CODE ARGS`, as the interpreter would run it."""
    if default_sigint:  # what a fresh interpreter installs when its parent left SIGINT at its default
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # a fresh interpreter's torch reads it when it starts; the preloaded one already has
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    status = 0
    try:
        if argv is not None:
            sys.argv = ["quantdiff", *argv]
            runpy.run_module("quantdiff", run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # what the interpreter prints for an uncaught exception, and its exit status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Child:
    """A forked process started by `start`: what subprocess.Popen offers the tests that talk to one while it runs
    (its pid, signals, a line of its stdout as it is written, its exit)."""

    def __init__(self, process, directory: tempfile.TemporaryDirectory, command):
        self.process, self._directory, self.command = process, directory, command
        self.out, self.err = (Path(directory.name) / name for name in ("stdout", "stderr"))
        self._read = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def readline(self, timeout: float = 300) -> str:
        """The next whole line of its stdout ("" once it has exited without one)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.out.read_text(errors="replace")[self._read:]
            if "\n" in text:
                line = text[: text.index("\n") + 1]
                self._read += len(line)
                return line
            if self.process.exitcode is not None or time.monotonic() > deadline:
                return ""
            time.sleep(0.01)

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """Its exit status, its stdout after the lines `readline` returned, and its stderr, as Popen.communicate
        gives them (killed on timeout); the captured files are removed."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
            self._directory.cleanup()
            raise subprocess.TimeoutExpired(self.command, timeout)
        done = subprocess.CompletedProcess(self.command, self.process.exitcode, self.out.read_text(errors="replace")[self._read:],
                                           self.err.read_text(errors="replace"))
        self._directory.cleanup()
        return done


def start(argv: list[str] | None = None, code: str | None = None, *, cwd: Path, env: dict[str, str], args: list[str] = (),
          default_sigint: bool = False) -> Child:
    """Start `quantdiff ARGV` (argv) or `python -c CODE ARGS` (code) in a fresh forked process; `default_sigint`:
    with SIGINT raising KeyboardInterrupt, as an interpreter started with SIGINT at its default has it (the
    server's children inherit it ignored)."""
    assert (argv is None) != (code is None)
    directory = tempfile.TemporaryDirectory()
    out, err = (os.path.join(directory.name, name) for name in ("stdout", "stderr"))
    for path in (out, err):
        Path(path).touch()
    process = _server().Process(target=_child, args=(argv, code, str(cwd), dict(env), out, err, list(args), default_sigint))
    process.start()
    return Child(process, directory, argv or code)


def run(argv: list[str] | None = None, code: str | None = None, *, cwd: Path, env: dict[str, str], args: list[str] = (),
        default_sigint: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `quantdiff ARGV` (argv) or `python -c CODE ARGS` (code) in a fresh forked process; the result as
    subprocess.run(capture_output=True, text=True) gives it."""
    return start(argv, code, cwd=cwd, env=env, args=args, default_sigint=default_sigint).wait(timeout)
