"""`quantdiff train RECIPE`: train the matched arms a recipe describes (resumes if interrupted)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer


def train(
    recipe: Annotated[str, typer.Argument(help="Recipe file, or a recipe name such as 'tiny'.")],
    out: Annotated[Path | None, typer.Option(help="Where the models go (OUT/<arm>: OUT/standard, OUT/diff by default); default runs/<recipe name>.")] = None,
    force: Annotated[bool, typer.Option(help="Retrain from scratch: ignore a checkpoint and replace existing models.")] = False,
) -> None:
    """Train every arm (by default standard and Diff) on the same batches in the same order; an interrupted run resumes from its last checkpoint."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting OpenMP threads stall CPU steps for seconds
    from quantdiff.report.console import line_console

    from quantdiff.train.guards import check_out
    from quantdiff.train.loop import train_pair
    from quantdiff.train.recipe import load_recipe

    parsed = load_recipe(recipe)
    out = out or Path("runs") / parsed.name
    # the models are written at the end: refuse what they may not replace before training
    check_out(out, parsed.arm_names, sources=[p for p in [Path(recipe)] if p.is_file()])
    paths = train_pair(parsed, out, force=force)
    line_console().print("models saved: " + "  ".join(str(p) for p in paths.values()))
