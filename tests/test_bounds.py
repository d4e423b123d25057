"""pyproject.toml's ranges against the policy (scripts/bounds.py, docs/install.md "The ranges"): lower bounds that the
lock satisfies, upper bounds at the next major or minor release and never at a patch release, a Python floor equal
to the strictest requirement's; and `make lock`'s widening, which moves a bound only up and only to the policy's cap."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bounds  # noqa: E402

PYPROJECT = (ROOT / "pyproject.toml").read_text()
PROJECT = tomllib.loads(PYPROJECT)["project"]
LOCKED = bounds.locked_versions((ROOT / "requirements" / "main.txt").read_text())
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"]] + [
    Requirement(r) for extra in PROJECT["optional-dependencies"].values() for r in extra
]
# what the lock resolves: every requirement but the extras outside it (bounds.UNLOCKED_EXTRAS)
UNLOCKED = {Requirement(r).name for extra in bounds.UNLOCKED_EXTRAS for r in PROJECT["optional-dependencies"][extra]}
LOCKED_REQUIREMENTS = [r for r in REQUIREMENTS if r.name not in UNLOCKED]


def test_the_ranges_hold_the_lock_and_end_at_the_policys_cap():
    assert bounds.problems(PYPROJECT, LOCKED) == []


@pytest.mark.parametrize("requirement", REQUIREMENTS, ids=str)
def test_each_requirement_has_a_range_and_no_patch_cap(requirement):
    operators = {s.operator for s in requirement.specifier}
    assert operators - {"!="} == {">=", "<"}, f"{requirement}: a lower and an upper bound, nothing else"
    (upper,) = [s.version for s in requirement.specifier if s.operator == "<"]
    assert len(upper.split(".")) <= 2, f"{requirement}: capped at a patch release"
    assert not requirement.marker, f"{requirement}: a marker (requires-python already excludes what it guarded)"
    # the regex scripts/bounds.py edits with sees every requirement
    assert requirement.name in UNLOCKED or requirement.name in {r["name"] for r in bounds.ranges(PYPROJECT)}


def test_requires_python_is_the_strictest_requirements_floor():
    # transformers >= 5.21 requires Python 3.11 (so do numpy >= 2.3 and compressed-tensors 0.20): every release
    # pyproject allows, down to the lowest, needs 3.11
    assert PROJECT["requires-python"] == ">=3.11"
    assert SpecifierSet(importlib.metadata.metadata("transformers")["Requires-Python"]).contains("3.11")
    assert not SpecifierSet(importlib.metadata.metadata("transformers")["Requires-Python"]).contains("3.10.13")


@pytest.mark.parametrize(
    "name, version, cap",
    [("torch", "2.13.0", "3"), ("numpy", "2.4.6", "3"), ("transformers", "5.24.0", "5.25"), ("gguf", "0.19.0", "0.20"),
     ("compressed-tensors", "0.20.1", "0.21"), ("Transformers", "6.0.0", "6.1")],
)
def test_cap_is_the_next_major_or_minor(name, version, cap):
    assert bounds.cap(name, version) == cap


def test_widening_moves_a_reached_bound_to_the_cap_and_never_lowers_one():
    text = '"transformers>=5.23,<5.25",\n"numpy>=1.24,<3",\n"gguf>=0.10,<0.20,!=0.19.1",'
    widened = bounds.widened(text, {"transformers": "5.25.0", "numpy": "2.4.6", "gguf": "0.20.0"})
    assert widened == '"transformers>=5.23,<5.26",\n"numpy>=1.24,<3",\n"gguf>=0.10,<0.21,!=0.19.1",'
    assert bounds.widened(text, {"transformers": "5.23.0", "numpy": "1.24.0", "gguf": "0.10.0"}) == text


def test_problems_name_a_patch_cap_and_a_lock_outside_its_range():
    found = bounds.problems('"numpy>=1.24,<2.4.7",\n"gguf>=0.10,<0.20",', {"numpy": "2.4.6", "gguf": "0.20.0"})
    assert found == ["numpy: upper bound <2.4.7, the policy's is <3", "gguf: the lock's 0.20.0 is outside >=0.10,<0.20"]


def test_make_lock_resolves_past_every_upper_bound_but_torchs():
    overrides = bounds.overrides(PYPROJECT)
    assert "transformers>=5.23" in overrides and not any(o.startswith("torch>") for o in overrides)
    assert len(overrides) == len(LOCKED_REQUIREMENTS) - 1
