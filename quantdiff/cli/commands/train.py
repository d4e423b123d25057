"""`quantdiff train RECIPE`: train the matched arms a recipe describes, for each of its seeds (resumes if interrupted)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer


def train(
    recipe: Annotated[str, typer.Argument(help="Recipe file, or a recipe name such as 'tiny'.")],
    out: Annotated[Path | None, typer.Option(help="Where the models go (OUT/<arm>: OUT/standard, OUT/diff by default; a recipe listing seeds: OUT/seed-<s>/<arm>); default runs/<recipe name>.")] = None,
    force: Annotated[bool, typer.Option(help="Retrain from scratch: ignore checkpoints and replace existing models (every seed).")] = False,
    jobs: Annotated[int, typer.Option("--jobs", help="Seeds trained at once, in worker processes sharing the CPU threads (each seed's output in OUT/seed-<s>/train_output.txt).")] = 1,
) -> None:
    """Train every arm (by default standard and Diff) on the same batches in the same order, for each seed of the recipe; an interrupted run resumes from its last checkpoint and leaves finished seeds as they are."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting OpenMP threads stall CPU steps for seconds
    from quantdiff.report.console import line_console

    from quantdiff.cli.validate import check_positive
    from quantdiff.train.guards import check_out
    from quantdiff.train.recipe import load_recipe
    from quantdiff.train.seeds import run_dirs, train_seeds

    check_positive(jobs=jobs)
    parsed = load_recipe(recipe)
    out = out or Path("runs") / parsed.name
    sources = [p for p in [Path(recipe)] if p.is_file()]
    # the models are written at the end: refuse what they may not replace before training
    dirs = run_dirs(parsed, out)
    if out not in dirs.values():
        check_out(out, (), sources)
    for directory in dirs.values():
        check_out(directory, parsed.arm_names, sources)
    runs = train_seeds(parsed, out, force=force, jobs=jobs)
    line_console().print("models saved: " + "  ".join(str(p) for paths in runs.values() for p in paths.values()))
