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

    from quantdiff.train.recipe import load_recipe
    from quantdiff.train.loop import train_pair

    parsed = load_recipe(recipe)
    paths = train_pair(parsed, out or Path("runs") / parsed.name, force=force)
    Console().print(f"pair saved: {paths['standard']}  {paths['diff']}")
