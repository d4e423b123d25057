"""The newest torch and transformers quantdiff was tested with, and a warning at import when an installed one is newer.

quantdiff's ranges (pyproject.toml) let a newer torch or transformers install, so that quantdiff fits beside the
rest of an environment; this says when the installed one is newer than any release that quantdiff's suite has run
on. It warns, once per process, and never refuses. The newest tested releases are the lock's transformers
(requirements/main.txt, tested by `make lock`) and the newest torch in scripts/tested_ranges.sh's TORCH_RELEASES;
tests/test_versions.py keeps these in step.

The installed versions are read from the environment's `*.dist-info` folder names, not by importing torch (seconds)
or importlib.metadata (about 0.2 s here, ten times the rest of `import quantdiff`).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable

NEWEST_TESTED = {"torch": "2.15.0", "transformers": "5.24.0"}


class UntestedVersionWarning(UserWarning):
    """An installed torch or transformers is newer than the newest release quantdiff was tested with."""


_warned = False


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.15.0+cu132" -> (2, 15, 0), "2.16.0.dev20261101" -> (2, 16, 0)."""
    numbers = []
    for part in version.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() < len(part):  # "0rc1": the release ends here
            break
    return tuple(numbers)


def newer(installed: str, tested: str) -> bool:
    """True when `installed`'s release is past `tested`'s (a pre-release of a newer release counts as newer)."""
    a, b = release(installed), release(tested)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) > b + (0,) * (width - len(b))


def installed_version(name: str, paths: Iterable[str] | None = None) -> str | None:
    """The version of the distribution `name` first found on `paths` (sys.path), from its `.dist-info` folder name;
    None when there is none (not installed, or installed without one)."""
    pattern = re.compile(rf"{re.escape(name)}-([^-]+)\.dist-info", re.IGNORECASE)
    for entry in sys.path if paths is None else paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip file, a missing folder
            continue
        if name not in names and not any(n.lower() == f"{name}.py" for n in names):
            continue  # the package itself is not here: its dist-info, if any, is not the one imported
        for entry_name in names:
            found = pattern.fullmatch(entry_name)
            if found:
                return found.group(1)
    return None


def untested(versions: dict[str, str | None]) -> list[str]:
    """One phrase per package whose installed version is newer than the newest tested one."""
    return [
        f"{name} {version} (newest tested: {NEWEST_TESTED[name]})"
        for name, version in versions.items()
        if version is not None and name in NEWEST_TESTED and newer(version, NEWEST_TESTED[name])
    ]


def warn_if_untested(version_of: Callable[[str], str | None] = installed_version) -> None:
    """Warn once per process when torch or transformers is newer than the newest release tested."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        found = untested({name: version_of(name) for name in NEWEST_TESTED})
    except Exception:  # noqa: BLE001 - a check that cannot read the versions never stops the import
        return
    if found:
        warnings.warn(
            f"quantdiff was not tested with {' or '.join(found)}; it may work: report what breaks",
            UntestedVersionWarning,
            stacklevel=2,
        )
