"""Built-in model names: 'tiny' is the pair shipped inside the package, trained by recipes/tiny.toml."""

from __future__ import annotations

from pathlib import Path

from quantdiff.core.errors import LoadError
from quantdiff.models.pairs import KINDS

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the package's data: the shipped pair
BUILT_IN = ("tiny",)


def resolve(name_or_path: str | Path) -> list[Path]:
    """'tiny' → [standard, diff] directories; 'tiny/diff' → that one; an existing path → itself."""
    path = Path(name_or_path)
    if path.exists():
        return [path]
    name, _, kind = str(name_or_path).partition("/")
    if name in BUILT_IN and kind in ("", *KINDS):
        dirs = [ASSETS / name / k for k in ((kind,) if kind else KINDS)]
        missing = [d for d in dirs if not (d / "config.json").is_file()]
        if missing:
            raise LoadError(f"built-in model {name_or_path!r} is missing from this install ({missing[0]})")
        return dirs
    built = ", ".join(f"{n}, {n}/{KINDS[0]}, {n}/{KINDS[1]}" for n in BUILT_IN)
    raise LoadError(f"{str(name_or_path)!r} is neither an existing path nor a built-in model ({built})")
