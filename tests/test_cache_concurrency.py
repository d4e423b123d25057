"""The user cache under two processes at once (two pytest-xdist workers, two commands): where it lives (the XDG base
directories), and a GGUF conversion done once, by whichever process takes the entry's lock first, while the other
waits and then reuses it (a second conversion would replace the entry under a reader)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from quantdiff.core.cache import cache_dir, cache_lock
from quantdiff.core.manifest import file_sha256
from tests import forked
from tests.test_gguf import _tiny_llama_gguf

ROOT = Path(__file__).resolve().parent.parent
# Each process: imports, says "ready", waits for the go file, resolves the GGUF file, prints the entry; every
# conversion it starts is appended to the log first.
RESOLVE = """
import sys, time
from pathlib import Path
from quantdiff.models import gguf_model
gguf, go, log = sys.argv[1:]
convert = gguf_model.convert
def counted(*args):
    with open(log, "a") as f:
        f.write("convert\\n")
    return convert(*args)
gguf_model.convert = counted
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.01)
print(gguf_model.gguf_model_dir(gguf), flush=True)
"""


def test_the_cache_follows_quantdiff_cache_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("QUANTDIFF_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "quantdiff"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "quantdiff"
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def _start(gguf: Path, go: Path, log: Path, cache: Path) -> forked.Child:
    """A process of its own (forked from one that has imported quantdiff already: tests/forked.py)."""
    env = {**os.environ, "QUANTDIFF_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    process = forked.start(code=RESOLVE, args=[str(gguf), str(go), str(log)], cwd=ROOT, env=env)
    assert process.readline().strip() == "ready", process.err.read_text()[-2000:]
    return process


def _finish(process: forked.Child) -> str:
    done = process.wait(timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_two_processes_converting_one_file_at_once_convert_it_once(tmp_path):
    gguf, go, log, cache = tmp_path / "tiny.gguf", tmp_path / "go", tmp_path / "conversions", tmp_path / "cache"
    _tiny_llama_gguf(gguf)
    processes = [_start(gguf, go, log, cache) for _ in range(2)]
    go.touch()  # both look at the empty cache at the same moment
    entries = {_finish(p) for p in processes}
    assert entries == {str(cache / "gguf" / file_sha256(gguf))}
    assert log.read_text().splitlines() == ["convert"]  # the second found the first's entry complete
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [file_sha256(gguf)]  # the entry alone: no lock file beside it


def test_a_conversion_waits_while_another_process_holds_the_entry(tmp_path, monkeypatch):
    gguf, go, log, cache = tmp_path / "tiny.gguf", tmp_path / "go", tmp_path / "conversions", tmp_path / "cache"
    monkeypatch.setenv("QUANTDIFF_CACHE", str(cache))  # the same cache, so the same lock, as the process started
    _tiny_llama_gguf(gguf)
    entry = cache / "gguf" / file_sha256(gguf)
    with cache_lock(entry):
        process = _start(gguf, go, log, cache)
        go.touch()
        time.sleep(1.5)
        assert process.poll() is None and not log.exists() and not entry.exists()  # waiting, not converting
    assert _finish(process) == str(entry) and log.read_text().splitlines() == ["convert"]
