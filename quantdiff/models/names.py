"""Built-in model names: 'tiny' is the pair shipped inside the package, trained by recipes/tiny.toml."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

from quantdiff.core.errors import ConfigError, LoadError
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


def resolve_models(specs: Sequence[str]) -> list[tuple[str, Path]]:
    """(name, directory) for each model argument: a directory, or a built-in name ('tiny' gives two).

    Names are directory names ('standard'), built-in names with their kind ('tiny/diff'), or the whole path
    when two directories share a name.
    """
    from quantdiff.models.loading import check_model_dir

    resolved = []
    for spec in specs:
        built_in = not Path(spec).exists()
        for d in resolve(spec):
            check_model_dir(d)
            resolved.append((f"{spec.split('/')[0]}/{d.name}" if built_in else d.name, d))
    counts = Counter(name for name, _ in resolved)
    out = [(name if counts[name] == 1 else str(path), path) for name, path in resolved]
    if len({name for name, _ in out}) != len(out):
        raise ConfigError("the same model is named twice")
    return out
