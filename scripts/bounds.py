"""pyproject.toml's dependency ranges against the lock, for `make lock` (scripts/lock.sh).

    python scripts/bounds.py overrides   # each bounded requirement without its upper bound: what to re-resolve
    python scripts/bounds.py raise       # each upper bound moved to the version requirements/main.txt locks

The upper bounds are the newest releases that have passed: `make lock` resolves past them (overrides), runs the
suite and the tested-range check, and only then moves them (raise).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements" / "main.txt"
# "name>=low,<=high" inside a quoted requirement (the only form of bound pyproject.toml uses)
BOUNDED = re.compile(r'"(?P<name>[A-Za-z0-9_.-]+)(?P<low>>=[^",<]+),<=(?P<high>[^",;]+)')


def overrides(text: str) -> list[str]:
    # torch is pinned to its CPU wheel in requirements/main.in and moved by hand: an override would replace the pin
    return [f"{m['name']}{m['low']}" for m in BOUNDED.finditer(text) if m["name"] != "torch"]


def locked_versions(lock: str) -> dict[str, str]:
    """{normalised name: version} of the lock's pins; local versions (torch's "+cpu") dropped."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\+]+)", lock, flags=re.M)
    return {_normalised(name): version for name, version in pins}


def raised(text: str, versions: dict[str, str]) -> str:
    def bound(m: re.Match) -> str:
        version = versions.get(_normalised(m["name"]))
        if version is None:
            raise SystemExit(f"error: {m['name']} is bounded in pyproject.toml but not in {LOCK.name}")
        return f'"{m["name"]}{m["low"]},<={version}'

    return BOUNDED.sub(bound, text)


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str]) -> None:
    text = PYPROJECT.read_text()
    if argv == ["overrides"]:
        print("\n".join(overrides(text)))
    elif argv == ["raise"]:
        PYPROJECT.write_text(raised(text, locked_versions(LOCK.read_text())))
    else:
        raise SystemExit("usage: python scripts/bounds.py overrides|raise")


if __name__ == "__main__":
    main(sys.argv[1:])
