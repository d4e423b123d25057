"""`quantdiff reproduce`: the main job — statistics and the accuracy sweep on a matched pair, as one report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def reproduce(
    target: Annotated[str, typer.Argument(help="'tiny' or 'bb' (shipped models), a recipe name/path (its arms, every seed, are trained into runs/ if missing), or a training output directory.")] = "tiny",
    out: Annotated[Path, typer.Option("--out", help="Report directory (report.md, JSON, PNG plots).")] = Path("report"),
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated tasks to sweep: lm, choice, retrieval, bb (the linear site is swept on lm and bb only); default lm,choice,retrieval, or bb for bigram-backcopy models.")] = None,
    stats_tokens: Annotated[Optional[int], typer.Option("--stats-tokens", help="Held-out tokens per model for the statistics (default: the recipe's).")] = None,
    items: Annotated[Optional[int], typer.Option("--items", help="Cap on items per task (quick runs); default: the recipe's sizes.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, … (default: CUDA if available).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it holds an earlier report (never anything else).")] = False,
    real_model: Annotated[str, typer.Option("--real-model", help="Real pretrained models measured too, side by side, comma-separated (built-in names or model directories): statistics, lm sweep at linear and qk, weight-only formats. 'none' skips them.")] = "smollm2,gemma3",
) -> None:
    """Reproduce the paper's Table 5 and Figure 8 analyses on matched models (a standard/Diff pair or a recipe's arms; over several seeds, with 95% intervals), beside the paper's numbers."""
    from quantdiff.report.console import line_console

    from quantdiff.cli.validate import check_list, check_positive
    from quantdiff.core.device import resolve_device
    from quantdiff.jobs.reproduce import ReproduceOptions, reproduce as run

    check_positive(stats_tokens=stats_tokens, items=items)
    if tasks is not None:
        check_list(tasks, "--tasks")
    if real_model != "none":
        check_list(real_model, "--real-model")
    if device is not None:
        resolve_device(device, "--device")
    console = line_console(stderr=True)
    names = None if tasks is None else tuple(t.strip() for t in tasks.split(",") if t.strip())
    report = run(ReproduceOptions(target, out, stats_tokens, items, names, device, force, None if real_model == "none" else real_model), console)
    line_console().print(f"report -> {report}")
