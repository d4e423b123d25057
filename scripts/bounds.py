"""pyproject.toml's dependency ranges against the lock, for `make lock` (scripts/lock.sh) and tests/test_bounds.py.

    python scripts/bounds.py overrides   # each bounded requirement without its upper bound: what to re-resolve
    python scripts/bounds.py widen       # each upper bound the lock reaches moved to the policy's cap past it, and
                                         # quantdiff's newest tested torch and transformers set (newest_tested)
    python scripts/bounds.py check       # each range holds the lock's version and ends at the policy's cap

The policy (docs/install.md, "The ranges"): the lower bound is the oldest release tested, or the floor another
requirement imposes; the upper bound is the next major release after the lock's, or the next minor for a package
that breaks in minor releases (MINOR_BREAKING) and for a 0.x package (as Cargo's and Poetry's caret read 0.x: the
minor is the breaking number). Never today's patch release: the lock, not pyproject.toml, pins exactly.
`make lock` resolves past the upper bounds (overrides), runs the whole suite and the tested-range check, and only
then widens a bound that the new lock reached, to the cap past it; it never lowers one. A release that cannot pass
is excluded by name (`"name>=1.0,<2,!=1.4.0"`) with its reason beside it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LOCK = ROOT / "requirements" / "main.txt"
RANGES = ROOT / "scripts" / "tested_ranges.sh"
VERSIONS = ROOT / "quantdiff" / "core" / "versions.py"
# packages whose minor releases break what quantdiff uses: transformers 5.24 renamed an attention argument
MINOR_BREAKING = {"transformers"}
# "name>=low,<high" (then any ",!=excluded") inside a quoted requirement: the only form of range pyproject.toml uses
BOUNDED = re.compile(r'"(?P<name>[A-Za-z0-9_.-]+)(?P<low>>=[^",<]+),<(?P<high>[0-9][^",;!]*)(?P<excluded>(?:,!=[^",;]+)*)')


def release(version: str) -> tuple[int, ...]:
    """(2, 13, 0) for "2.13.0+cpu"; the numeric part only."""
    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def cap(name: str, version: str) -> str:
    """The policy's upper bound for a range that holds `version`: the next major, or the next minor (see above)."""
    major, minor = (release(version) + (0, 0))[:2]
    if _normalised(name) in MINOR_BREAKING or major == 0:
        return f"{major}.{minor + 1}"
    return f"{major + 1}"


# extras outside the lock: `bench` installs transformers' QuantizedCache backends for benchmarks/kv_cache_bench.py only
UNLOCKED_EXTRAS = ("bench",)


def ranges(text: str) -> list[dict[str, str]]:
    """Each bounded requirement of pyproject.toml (the unlocked extras' lines left out): name, low (without ">="),
    high (without "<"), excluded."""
    locked = "\n".join(line for line in text.splitlines() if not line.startswith(tuple(f"{extra} =" for extra in UNLOCKED_EXTRAS)))
    return [
        {"name": m["name"], "low": m["low"][2:], "high": m["high"], "excluded": m["excluded"]}
        for m in BOUNDED.finditer(locked)
    ]


def overrides(text: str) -> list[str]:
    # torch is pinned to its CPU wheel in requirements/main.in and moved by hand: an override would replace the pin
    return [f"{r['name']}>={r['low']}" for r in ranges(text) if r["name"] != "torch"]


def locked_versions(lock: str) -> dict[str, str]:
    """{normalised name: version} of the lock's pins; local versions (torch's "+cpu") dropped."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\+]+)", lock, flags=re.M)
    return {_normalised(name): version for name, version in pins}


def widened(text: str, versions: dict[str, str]) -> str:
    """pyproject.toml's text with each upper bound that the lock's version reaches moved to the cap past it."""

    def bound(m: re.Match) -> str:
        version = _locked(m["name"], versions)
        high = m["high"]
        if release(version) >= release(high):
            high = cap(m["name"], version)
        return f'"{m["name"]}{m["low"]},<{high}{m["excluded"]}'

    return BOUNDED.sub(bound, text)


def problems(text: str, versions: dict[str, str]) -> list[str]:
    """What breaks the policy: a range that does not hold the lock's version, or an upper bound not at the cap."""
    found = []
    for r in ranges(text):
        version = _locked(r["name"], versions)
        if not release(r["low"]) <= release(version) < release(r["high"]):
            found.append(f"{r['name']}: the lock's {version} is outside >={r['low']},<{r['high']}")
        elif r["high"] != cap(r["name"], version):
            found.append(f"{r['name']}: upper bound <{r['high']}, the policy's is <{cap(r['name'], version)}")
    return found


def newest_tested(lock: str, ranges_script: str) -> dict[str, str]:
    """The newest torch and transformers the suite has run on: the lock's transformers (its newest release when
    `make lock` resolved it) and the newest of the lock's torch and scripts/tested_ranges.sh's TORCH_RELEASES."""
    versions = locked_versions(lock)
    listed = re.search(r"^TORCH_RELEASES=\(([^)]*)\)", ranges_script, flags=re.M)
    torches = [versions["torch"], *(listed.group(1).split() if listed else [])]
    return {"torch": max(torches, key=release), "transformers": versions["transformers"]}


def with_newest_tested(source: str, tested: dict[str, str]) -> str:
    """quantdiff/core/versions.py's text with NEWEST_TESTED set to `tested`."""
    entries = ", ".join(f'"{name}": "{version}"' for name, version in tested.items())
    return re.sub(r"^NEWEST_TESTED = \{[^}]*\}", f"NEWEST_TESTED = {{{entries}}}", source, count=1, flags=re.M)


def _locked(name: str, versions: dict[str, str]) -> str:
    version = versions.get(_normalised(name))
    if version is None:
        raise SystemExit(f"error: {name} is bounded in pyproject.toml but not in {LOCK.name}")
    return version


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str]) -> None:
    text = PYPROJECT.read_text()
    if argv == ["overrides"]:
        print("\n".join(overrides(text)))
    elif argv == ["widen"]:
        PYPROJECT.write_text(widened(text, locked_versions(LOCK.read_text())))
        VERSIONS.write_text(with_newest_tested(VERSIONS.read_text(), newest_tested(LOCK.read_text(), RANGES.read_text())))
    elif argv == ["check"]:
        found = problems(text, locked_versions(LOCK.read_text()))
        if found:
            raise SystemExit("\n".join(["error: pyproject.toml's ranges break the policy:", *found]))
    else:
        raise SystemExit("usage: python scripts/bounds.py overrides|widen|check")


if __name__ == "__main__":
    main(sys.argv[1:])
