"""The multi-seed part of `quantdiff reproduce`: every seed's arms measured as one set (seed-<s>/stats.json and
seed-<s>/sweep.json in the report directory), then summarised across seeds into seeds.json, report.md, the
sweep charts with error bars and the emergence plot with bands."""

from __future__ import annotations

import time
from pathlib import Path

from quantdiff.core.atomic import write_json
from quantdiff.report.sweep_report import SweepPoint


def seed_points(doc: dict, task: str) -> list[SweepPoint]:
    """The sweep chart's points of `task` from a seeds document: each arm's mean with its 95% interval."""
    points = []
    for block in doc["metrics"].values():
        cell = block.get("cell")
        if cell and cell["task"] == task:
            points += [SweepPoint(arm, cell["method"], cell["site"], cell["bits"], s["mean"], s["low"], s["high"]) for arm, s in block["arms"].items()]
    return points


def multi_seed_report(trained, tasks: list, options, tmp: Path, scratch: Path, console, started: float) -> None:
    """Measure every seed, then write seeds.json, the plots and report.md into `tmp`."""
    from quantdiff.across_seeds.document import seeds_document
    from quantdiff.eval.sweep import cells_to_json
    from quantdiff.jobs.real_model import run_real_model
    from quantdiff.jobs.measure_arms import measure_arms, setup_context
    from quantdiff.report.emergence import emergence_markdown, plot_emergence, read_series
    from quantdiff.report.markdown import reference_model
    from quantdiff.report.sweep_report import plot_sweep

    recipe = trained.recipe
    stats, sweeps, series = {}, {}, {}
    for number, (seed, dirs) in enumerate(trained.runs.items(), 1):
        console.print(f"seed {seed} ({number} of {len(trained.runs)}): statistics over {options.stats_tokens or recipe.analysis.stats_tokens:,} "
                      "held-out tokens per model, then the sweep")
        stats[str(seed)], cells = measure_arms(recipe, list(dirs.items()), tasks, options, tmp / f"seed-{seed}", scratch, console, plots=False)
        sweeps[str(seed)] = cells_to_json(cells)
        series[str(seed)] = read_series(dirs)
    kinds = {arm.name: arm.kind for arm in recipe.arms}
    first = next(iter(stats.values()))
    reference = reference_model(first, kinds)
    doc = seeds_document(recipe.name, kinds, reference["name"] if reference else None, stats, sweeps, series)
    write_json(tmp / "seeds.json", doc, indent=1)
    for task in tasks:
        plot_sweep(seed_points(doc, task.name), tmp / f"sweep_{task.name}.png", task.headline,
                   f"{task.name}: {task.headline} vs bits, mean and 95% interval over {len(stats)} seeds")
    if doc["emergence"]:
        plot_emergence(doc["emergence"], tmp / "emergence.png")
    context = setup_context(options, trained, first) | {"tasks": ", ".join(t.name for t in tasks),
                                                        "run time": f"{time.perf_counter() - started:.0f} s"}
    real = [run_real_model(options.real_model, tmp, options.device, console)] if options.real_model else []
    write_seeds_report(tmp / "report.md", doc, context, emergence_markdown(doc["emergence"], len(stats)), real)


def write_seeds_report(path: Path, doc: dict, context: dict, emergence: str, extra_sections: list[str]) -> None:
    """report.md of a multi-seed run: setup, the across-seed sections, emergence, then `extra_sections`."""
    from quantdiff.report import paper
    from quantdiff.report.markdown import write_sections
    from quantdiff.report.seeds_markdown import seeds_sections

    parts = [
        "# quantdiff report (across seeds)",
        f"Every number is a summary over {len(doc['seeds'])} seeds with its 95% interval; each seed's own stats.json and "
        f"sweep.json are in seed-<s>/, and seeds.json holds every per-seed value. Rows marked **paper** are the numbers "
        f"of {paper.SOURCE}, for comparison only (3B models trained on 350B tokens — ours are far smaller).",
        "## Setup\n\n" + "\n".join(f"- {k}: {v}" for k, v in context.items()),
        *seeds_sections(doc),
        "## Emergence of outliers during training (across seeds)\n\n" + emergence,
        *extra_sections,
    ]
    write_sections(path, parts)
