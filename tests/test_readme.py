"""The README's examples are tests: every Python block runs as written, and every shell command that finishes in
about 20 s runs too (slower ones are marked slow, the rest are skipped for the reason listed here)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from quantdiff.data import corpus

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")

# Commands (by how they start) not run here, and why.
SKIPPED = {
    "make reproduce": "minutes: `quantdiff reproduce` end to end is tested by test_reproduce.py",
    "make test": "runs this very suite",
    "quantdiff stats MY_MODEL": "MY_MODEL stands for the reader's own model",
    "torchrun": "MY_MODEL stands for the reader's own model; needs several processes",
    "quantdiff train": "trains a pair for half an hour; training is tested by test_train.py",
    "quantdiff stats smollm2": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff sweep smollm2": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff quantize smollm2": "the real model (minutes on two cores): its exports are checked by test_real_model.py",
    "quantdiff stats gemma3": "the real model (minutes on two cores): its figures are checked by test_real_model.py",
    "quantdiff sweep gemma3": "the real model (minutes on two cores): its sweep is what `make reproduce` runs",
}
# Commands that run but take longer than ~20 s on two CPU cores; they read the corpus (their default data).
SLOW = ("quantdiff stats tiny", "quantdiff sweep tiny", "quantdiff eval tiny")
NO_CORPUS = pytest.mark.skipif(corpus.find_rdata() is None, reason="corpus not installed (python -m quantdiff.data.corpus --install)")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def shell_commands() -> list[str]:
    """Every command line of the README's bash blocks, its trailing comment removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            command = line.split(" #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_WAIT_POLICY": "PASSIVE"}


def _params() -> list:
    params = []
    for command in shell_commands():
        reason = next((why for start, why in SKIPPED.items() if command.startswith(start)), None)
        marks = [pytest.mark.skip(reason=reason)] if reason else [pytest.mark.slow, NO_CORPUS] if command.startswith(SLOW) else []
        params.append(pytest.param(command, marks=marks, id=command[:60]))
    return params


def test_readme_has_examples():
    assert python_blocks(), "the README lost its Python example"
    assert len(shell_commands()) >= 8


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.splitlines()[0][:40])
def test_python_block_runs(block, tmp_path):
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", _params())
def test_shell_example_runs(command, tmp_path):
    argv = shlex.split(command)
    assert argv[0] == "quantdiff", f"no rule for running {command!r}: list it in SKIPPED"
    result = subprocess.run([sys.executable, "-m", "quantdiff", *argv[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("--json", "--plot", "--out")]
    for output in outputs:  # every file or directory the example names was written
        assert (tmp_path / output).exists(), f"{command!r} did not write {output}"
