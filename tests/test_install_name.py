"""The README's library install line installs this project: pyproject.toml's name, the line as pip reads it, and the
registry's other `quantdiff` (issue 56), which no instruction may name."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import quantdiff

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/install.md")}


def library_install_commands() -> list[list[str]]:
    """The pip install commands of the README's "As a library" paragraph."""
    readme = DOCS["README.md"]
    paragraph = readme[readme.index("**As a library**"):].split("\n\n")[0]
    return [shlex.split(command) for command in re.findall(r"`(pip install [^`]*)`", paragraph)]


def test_the_readme_says_how_to_install_quantdiff_as_a_library():
    assert library_install_commands() == [["pip", "install", "."]]


def test_the_readme_line_installs_this_project(tmp_path):
    """pip itself, reading the README's line in the clone's root, would install pyproject.toml's name and version."""
    (command,) = library_install_commands()
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", *command[:2], "--dry-run", "--no-deps", "--no-index", "--no-build-isolation", "-q",
         "--report", str(report), *command[2:]],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    (installed,) = json.loads(report.read_text())["install"]
    assert installed["metadata"]["name"] == PROJECT["name"] == "quantdiff"
    assert installed["metadata"]["version"] == PROJECT["version"] == quantdiff.__version__
    assert installed["metadata"]["requires_python"] == PROJECT["requires-python"]
    # the import name and the console script stay quantdiff's
    assert PROJECT["scripts"] == {"quantdiff": "quantdiff.cli.app:main"}


def test_no_instruction_installs_the_registrys_quantdiff():
    """`pip install quantdiff` (or quantdiff[...], quantdiff==...) fetches the registry's project of that name, not
    this one: no instruction in the README or docs/install.md may say it."""
    for name, text in DOCS.items():
        for command in re.findall(r"pip install[^`\n#]*", text):
            arguments = [a.strip("'\"") for a in command.split()[2:]]
            registry = [a for a in arguments if re.fullmatch(r"quantdiff(\[[^\]]*\])?([<>=!~].*)?", a)]
            assert not registry, f"{name}: {command!r} installs the registry's quantdiff, another project"


def test_docs_name_the_wheel_pip_builds():
    assert f"dist/quantdiff-{PROJECT['version']}-py3-none-any.whl" in DOCS["docs/install.md"]
