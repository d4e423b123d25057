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
import subprocess
import sys
import tempfile
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


def _child(argv: list[str] | None, code: str | None, cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The child's body: `python -m quantdiff ARGV` or `python -c CODE`, as the interpreter would run it."""
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
            sys.argv = ["-c"]
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


def run(argv: list[str] | None = None, code: str | None = None, *, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `quantdiff ARGV` (argv) or a Python block (code) in a fresh forked process; the result as
    subprocess.run(capture_output=True, text=True) gives it."""
    assert (argv is None) != (code is None)
    with tempfile.TemporaryDirectory() as captured:
        out, err = os.path.join(captured, "stdout"), os.path.join(captured, "stderr")
        for path in (out, err):
            Path(path).touch()
        process = _server().Process(target=_child, args=(argv, code, str(cwd), dict(env), out, err))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv or code, timeout)
        return subprocess.CompletedProcess(argv or code, process.exitcode, Path(out).read_text(errors="replace"),
                                           Path(err).read_text(errors="replace"))
