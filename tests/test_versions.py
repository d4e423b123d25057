"""The warning at import when torch or transformers is newer than the newest release tested (quantdiff.core.versions),
and the newest tested releases it names against the lock and scripts/tested_ranges.sh."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quantdiff.core import versions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bounds  # noqa: E402


@pytest.mark.parametrize(
    "version, expected",
    [("2.15.0", (2, 15, 0)), ("2.15.0+cu132", (2, 15, 0)), ("2.13.0+cpu", (2, 13, 0)), ("2.16.0.dev20261101", (2, 16, 0)),
     ("5.25.0rc1", (5, 25, 0)), ("6", (6,))],
)
def test_release_reads_the_numeric_part(version, expected):
    assert versions.release(version) == expected


@pytest.mark.parametrize(
    "installed, tested, newer",
    [("2.15.0", "2.15.0", False), ("2.15.0+cu132", "2.15.0", False), ("2.14.1", "2.15.0", False),
     ("2.15.1", "2.15.0", True), ("2.16.0.dev20261101", "2.15.0", True), ("3.0", "2.15.0", True),
     ("5.24", "5.24.0", False), ("5.25.0rc1", "5.24.0", True)],
)
def test_newer_compares_releases(installed, tested, newer):
    assert versions.newer(installed, tested) is newer


@pytest.fixture
def fresh(monkeypatch):
    """The check as if quantdiff had not been imported yet in this process."""
    monkeypatch.setattr(versions, "_warned", False)


def test_a_newer_torch_warns_once_naming_both_versions(fresh):
    installed = {"torch": "2.16.0", "transformers": versions.NEWEST_TESTED["transformers"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_untested(installed.get)
        versions.warn_if_untested(installed.get)
    assert len(caught) == 1 and caught[0].category is versions.UntestedVersionWarning
    message = str(caught[0].message)
    assert f"torch 2.16.0 (newest tested: {versions.NEWEST_TESTED['torch']})" in message
    assert "transformers" not in message


def test_both_newer_are_named_in_one_warning(fresh):
    installed = {"torch": "3.0.0", "transformers": "5.25.0"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_if_untested(installed.get)
    assert len(caught) == 1
    assert "torch 3.0.0" in str(caught[0].message) and "transformers 5.25.0" in str(caught[0].message)


@pytest.mark.parametrize("installed", [dict(versions.NEWEST_TESTED), {"torch": "2.13.0+cpu", "transformers": "5.23.0"},
                                       {"torch": None, "transformers": None}])
def test_tested_or_missing_versions_do_not_warn(fresh, installed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested(installed.get)


def test_a_version_that_cannot_be_read_never_stops_the_check(fresh):
    def broken(name):
        raise RuntimeError("unreadable")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested(broken)


def test_installed_version_reads_the_dist_info_beside_the_package(tmp_path):
    shadowed, real = tmp_path / "a", tmp_path / "b"
    (shadowed / "torch-9.0.0.dist-info").mkdir(parents=True)  # a dist-info without its package: not the one imported
    (real / "torch").mkdir(parents=True)
    (real / "torch-2.15.0+cu132.dist-info").mkdir()
    assert versions.installed_version("torch", [str(shadowed), str(real), str(tmp_path / "missing")]) == "2.15.0+cu132"
    assert versions.installed_version("transformers", [str(real)]) is None


@pytest.mark.parametrize("name", ["torch", "transformers"])
def test_installed_version_agrees_with_importlib_metadata(name):
    assert versions.installed_version(name) == importlib.metadata.version(name)


def test_import_quantdiff_warns_once_beside_a_newer_torch(tmp_path):
    """The real import, in a fresh interpreter whose path finds a torch 9.0.0 first (never imported: quantdiff's
    import does not import torch); it still imports, and says which torch it found and which was tested."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch-9.0.0.dist-info").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", "import quantdiff; import quantdiff"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "UntestedVersionWarning" in line]
    assert len(lines) == 1, run.stderr
    assert f"torch 9.0.0 (newest tested: {versions.NEWEST_TESTED['torch']})" in lines[0]


def test_import_quantdiff_is_silent_in_the_locked_environment():
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import quantdiff"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_newest_tested_follows_the_lock_and_the_torch_releases_tested():
    tested = bounds.newest_tested((ROOT / "requirements" / "main.txt").read_text(),
                                  (ROOT / "scripts" / "tested_ranges.sh").read_text())
    assert versions.NEWEST_TESTED == tested
    assert tested["torch"] == "2.15.0"  # TORCH_RELEASES holds 2.14.1 and 2.15.0 beside the lock's 2.13.0
