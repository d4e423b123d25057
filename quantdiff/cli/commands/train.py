"""`quantdiff train RECIPE`: train the matched standard/Diff pair a recipe describes (resumes if interrupted)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer


def train(
    recipe: Annotated[str, typer.Argument(help="Recipe file, or a recipe name such as 'tiny'.")],
    out: Annotated[Path | None, typer.Option(help="Where the pair goes (OUT/standard, OUT/diff); default runs/<recipe name>.")] = None,
    force: Annotated[bool, typer.Option(help="Retrain from scratch: ignore a checkpoint and replace an existing pair.")] = False,
) -> None:
    """Train both kinds on the same batches in the same order; an interrupted run resumes from its last checkpoint."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting OpenMP threads stall CPU steps for seconds
    from rich.console import Console

    from quantdiff.core.errors import ConfigError
    from quantdiff.core.savedir import check_target
    from quantdiff.models.pairs import KINDS
    from quantdiff.train.loop import train_pair
    from quantdiff.train.recipe import load_recipe

    parsed = load_recipe(recipe)
    out = out or Path("runs") / parsed.name
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out exists and is not a directory: {out}")
    for kind in KINDS:  # the models are written at the end: refuse what they may not replace before training
        check_target(out / kind, force=True, sources=[p for p in [Path(recipe)] if p.is_file()], flag=f"--out's {kind}/", kind="model")
    paths = train_pair(parsed, out, force=force)
    Console().print(f"pair saved: {paths['standard']}  {paths['diff']}")
