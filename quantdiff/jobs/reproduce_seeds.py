"""The multi-seed part of `quantdiff reproduce`: every seed's arms measured as one set (seed-<s>/stats.json and
seed-<s>/sweep.json in the report directory), then summarised across seeds into seeds.json, report.md, the
sweep charts with error bars and the emergence plot with bands.

`python -m quantdiff.jobs.reproduce_seeds DIR` recomputes seeds.json and report.md of such a directory from the
per-seed JSON it holds (`rebuild`): new statistics over the same measurements, nothing trained or measured. When
the recipe is a confirmatory plan (recipes/confirm-*.toml, byte for byte) and DIR holds the plan_check.json of
scripts/plan_check.py, the report quotes the plan's commit and the check's findings."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from quantdiff.core.atomic import write_json
from quantdiff.core.documents import document_exists, read_document
from quantdiff.report.sweep_report import SweepPoint


def seed_points(doc: dict, task: str) -> list[SweepPoint]:
    """The sweep chart's points of `task` from a seeds document: each arm's mean with its 95% interval."""
    from quantdiff.across_seeds.metrics import CHANGE_PREFIX

    points = []
    for key, block in doc["metrics"].items():
        cell = block.get("cell")
        if cell and cell["task"] == task and not key.startswith(CHANGE_PREFIX):  # the cells themselves, not their changes
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
    from quantdiff.train.recipe import plan_file

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
    doc = seeds_document(recipe.name, kinds, reference["name"] if reference else None, stats, sweeps, series,
                         recipe.analysis.primary_metrics, recipe.analysis.primary_arms, plan_file(recipe))
    write_json(tmp / "seeds.json", doc, indent=1)
    for task in tasks:
        plot_sweep(seed_points(doc, task.name), tmp / f"sweep_{task.name}.png", task.headline,
                   f"{task.name}: {task.headline} vs bits, mean and 95% interval over {len(stats)} seeds")
    if doc["emergence"]:
        plot_emergence(doc["emergence"], tmp / "emergence.png")
    context = setup_context(options, trained, first) | {"tasks": ", ".join(t.name for t in tasks),
                                                        "run time": f"{time.perf_counter() - started:.0f} s"}
    real = [run_real_model(options.real_model, tmp, options.device, console)] if options.real_model else []
    write_seeds_report(tmp / "report.md", doc, context, emergence_markdown(doc["emergence"], len(stats)), real, granularity=recipe.analysis.granularity)


def write_seeds_report(path: Path, doc: dict, context: dict, emergence: str, extra_sections: list[str], force: bool = False,
                       granularity: str = "row") -> None:
    """report.md of a multi-seed run: setup, the across-seed sections, emergence, then `extra_sections` (an
    existing report.md is replaced only with `force`); a warning first when the quantizer's `granularity` was
    not causal."""
    from quantdiff.jobs.measure_arms import granularity_text
    from quantdiff.quant.registry import CAUSAL_GRANULARITIES
    from quantdiff.report import paper
    from quantdiff.report.markdown import write_sections
    from quantdiff.report.seeds_markdown import plan, seeds_sections

    warning = [] if granularity in CAUSAL_GRANULARITIES else [
        f"> **Non-causal quantization.** Every quantized figure here (sweep cells, accuracy under bits) was computed with granularity "
        f"{granularity_text(granularity)}; no inference engine quantizes so. The recipe names `granularity = \"{granularity}\"` so the "
        "figures regenerate exactly; new runs default to causal scales (docs/quantization.md, \"Granularity\")."]
    parts = [
        "# quantdiff report (across seeds)",
        *warning,
        f"Every number is a summary over {len(doc['seeds'])} seeds with its 95% interval; each seed's own stats.json and "
        f"sweep.json are in seed-<s>/, and seeds.json holds every per-seed value. Rows marked **paper** are the numbers "
        f"of {paper.SOURCE}, for comparison only (3B models trained on 350B tokens — ours are far smaller).",
        "## Setup\n\n" + "\n".join(f"- {k}: {v}" for k, v in context.items()),
        *seeds_sections(doc),
        f"## Emergence of outliers during training (across seeds){' (exploratory)' if plan(doc) else ''}\n\n" + emergence,
        *extra_sections,
    ]
    write_sections(path, parts, force)


def _setup(report: Path) -> dict[str, str]:
    """The `- key: value` lines of report.md's Setup section (the run that measured the seeds); {} without one."""
    lines = report.read_text(encoding="utf-8").split("\n") if report.is_file() else []
    start = lines.index("## Setup") + 1 if "## Setup" in lines else len(lines)
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return dict(line[2:].split(": ", 1) for line in lines[start:end] if line.startswith("- ") and ": " in line)


PLAN_CHECK = "plan_check.json"  # scripts/plan_check.py's result, written into the report directory
PLAN_CHECK_KEYS = ("recipe", "plan_commit", "plan_committed_at", "first_model_written_at", "last_model_written_at", "models", "findings", "passed")


def read_plan_check(directory: Path, plan: str | None) -> dict | None:
    """`directory`'s plan_check.json (the keys the report quotes), None without one; ConfigError when it is
    unreadable, checks another recipe than the plan, or sits beside a recipe that is no plan."""
    from quantdiff.core.errors import ConfigError

    path = directory / PLAN_CHECK
    if not path.is_file():
        return None
    try:
        check = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is unreadable ({type(exc).__name__}): rerun scripts/plan_check.py") from None
    if not isinstance(check, dict) or any(key not in check for key in PLAN_CHECK_KEYS):
        raise ConfigError(f"{path} is not scripts/plan_check.py's output (it needs {', '.join(PLAN_CHECK_KEYS)})")
    if plan is None:
        raise ConfigError(f"{path} checks the plan {check['recipe']}, but the recipe given is not a confirmatory plan (recipes/confirm-*.toml, byte for byte)")
    if check["recipe"] != plan:
        raise ConfigError(f"{path} checks {check['recipe']}, but this report's plan is {plan}")
    return {key: check[key] for key in PLAN_CHECK_KEYS}


def rebuild(directory: Path, recipe_name: str | None = None) -> Path:
    """Recompute `directory`'s seeds.json and report.md (a multi-seed report quantdiff wrote) from its
    seed-<s>/stats.json and sweep.json, the emergence series of train_logs/seed-<s>/<arm>.json (else the
    emergence block of the seeds.json it replaces), and its report.md's Setup list. The recipe (default: the one
    its seeds.json names) gives the primary comparisons. Returns the path of report.md."""
    from quantdiff.across_seeds.document import seeds_document
    from quantdiff.core.errors import ConfigError
    from quantdiff.core.savedir import marked_kind
    from quantdiff.report.emergence import emergence_markdown
    from quantdiff.report.markdown import reference_name
    from quantdiff.train.recipe import load_recipe, plan_file

    if marked_kind(directory) != "report":
        raise ConfigError(f"{directory} is not a report directory quantdiff wrote: refusing to replace its seeds.json and report.md")
    if (directory / "real_model.json").exists():
        raise ConfigError(f"{directory} has a real-model section, which only `quantdiff reproduce` writes: rerun it instead")
    seeds = sorted(int(p.name.removeprefix("seed-")) for p in directory.glob("seed-*") if p.name.removeprefix("seed-").isdigit())
    if not seeds:
        raise ConfigError(f"{directory} holds no seed-<s>/ directories")
    old = read_document(directory / "seeds.json") if document_exists(directory / "seeds.json") else {}
    if not (recipe_name or old.get("recipe")):
        raise ConfigError(f"{directory} has no seeds.json naming its recipe: name it with --recipe")
    recipe = load_recipe(recipe_name or old["recipe"])
    stats = {str(s): read_document(directory / f"seed-{s}" / "stats.json") for s in seeds}
    sweeps = {str(s): read_document(directory / f"seed-{s}" / "sweep.json") for s in seeds}
    kinds = {m["name"]: m["kind"] for m in stats[str(seeds[0])]["models"]}
    logs = {str(s): {arm: directory / "train_logs" / f"seed-{s}" / f"{arm}.json" for arm in kinds} for s in seeds}
    series = {s: {arm: read_document(path).get("outliers") or [] for arm, path in by_arm.items() if document_exists(path)} for s, by_arm in logs.items()}
    plan = plan_file(recipe)
    check = read_plan_check(directory, plan)
    doc = seeds_document(recipe.name, kinds, reference_name(kinds), stats, sweeps, series,
                         recipe.analysis.primary_metrics, recipe.analysis.primary_arms, plan)
    if check is not None:
        doc["primary"]["plan_check"] = check
    if not doc["emergence"]:
        doc["emergence"] = old.get("emergence", {})
    write_json(directory / "seeds.json", doc, indent=1)
    context = _setup(directory / "report.md") | {
        "statistics": f"recomputed from the per-seed JSON by `python -m quantdiff.jobs.reproduce_seeds {directory}` (nothing retrained or re-measured)"}
    write_seeds_report(directory / "report.md", doc, context, emergence_markdown(doc["emergence"], len(seeds)), [], force=True,
                       granularity=recipe.analysis.granularity)
    return directory / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Recompute seeds.json and report.md of a multi-seed report from its per-seed JSON.")
    parser.add_argument("directory", type=Path, help="the report directory (holds seed-<s>/stats.json and sweep.json)")
    parser.add_argument("--recipe", help="recipe name or path giving the primary comparisons (default: the one seeds.json names)")
    args = parser.parse_args(argv)
    from quantdiff.core.errors import QuantdiffError

    try:
        print(rebuild(args.directory, args.recipe))
    except QuantdiffError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
