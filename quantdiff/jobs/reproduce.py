"""`quantdiff reproduce`: the whole analysis of matched models (a pair, or a recipe's arms, over every seed the
recipe lists), written to a report directory.

The models are shipped ones ("tiny", "bb"), a training output directory, or the arms a recipe trains into
runs/<recipe>/ (trained first if missing): `jobs.trained_runs`. The statistics and the accuracy sweep run on the
same held-out data (`jobs.measure_arms`): corpus text (with a BOS token first when the recipe trained with one),
or for a bigram-backcopy recipe the generator's held-out sequences and its own task `bb`. The report directory
holds report.md, stats.json, sweep.json and the PNG plots (with emergence.png when the train logs carry an
outlier series) — for several seeds each seed's JSON in seed-<s>/ and the summary seeds.json
(`jobs.reproduce_seeds`) — and, unless turned off, a section on real pretrained models side by side
(`jobs.real_model`, with real_model.json); it appears only once everything in it is written.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from quantdiff.core.savedir import atomic_dir, check_target
from quantdiff.jobs.measure_arms import ReproduceOptions, measure_arms, reproduce_tasks, setup_context


def reproduce(options: ReproduceOptions, console) -> Path:
    """Run stats and the sweep on the trained arms (every seed's) and write the report directory; returns the
    path of report.md."""
    from quantdiff.jobs.real_model import check_real_models
    from quantdiff.jobs.reproduce_seeds import multi_seed_report
    from quantdiff.jobs.trained_runs import find_runs

    read = given_inputs(options)
    check_target(options.out, options.force, read, flag="--out", kind="report")  # before any training or loading
    if options.real_model:
        check_real_models(options.real_model)
    trained = find_runs(options.target, console)
    read += list(trained.dirs)
    check_target(options.out, options.force, read, flag="--out", kind="report")  # never the models being analysed
    tasks = reproduce_tasks(trained.recipe, options)
    started = time.perf_counter()
    with atomic_dir(options.out, force=options.force, kind="report", sources=read, flag="--out") as tmp, tempfile.TemporaryDirectory() as scratch:
        if trained.multi_seed:
            multi_seed_report(trained, tasks, options, tmp, Path(scratch), console, started)
        else:
            _single_seed_report(trained, tasks, options, tmp, Path(scratch), console, started)
    return options.out / "report.md"


def given_inputs(options: ReproduceOptions) -> list[Path]:
    """Every path the run is given to read (a recipe file, a training directory, --real-model's models): inputs
    no output may touch. The trained models it finds are added once found."""
    from quantdiff.models.inputs import given_paths

    real_models = [name.strip() for name in (options.real_model or "").split(",") if name.strip()]
    return given_paths(options.target) + [path for name in real_models for path in given_paths(name)]


def _single_seed_report(trained, tasks: list, options: ReproduceOptions, tmp: Path, scratch: Path, console, started: float) -> None:
    """report.md of one set of arms; a built-in with published multi-seed results shows them beside it."""
    from quantdiff.eval.sweep import cells_to_json
    from quantdiff.jobs.real_model import run_real_model
    from quantdiff.across_seeds.curves import emergence_curves
    from quantdiff.report.emergence import emergence_markdown, plot_emergence, read_series
    from quantdiff.report.markdown import write_report_markdown

    [(seed, dirs)] = trained.runs.items()
    console.print(f"statistics over {options.stats_tokens or trained.recipe.analysis.stats_tokens:,} held-out tokens per model")
    stats_doc, cells = measure_arms(trained.recipe, list(dirs.items()), tasks, options, tmp, scratch, console, plots=True)
    curves = emergence_curves({str(seed): read_series(dirs)})
    if curves:
        plot_emergence(curves, tmp / "emergence.png")
    kinds = {entry["name"]: entry["kind"] for entry in stats_doc["models"]}
    context = setup_context(options, trained, stats_doc) | {"tasks": ", ".join(t.name for t in tasks), "run time": f"{time.perf_counter() - started:.0f} s"}
    sections = [published_section(trained.built_in, seed, stats_doc)] if trained.built_in else []
    granularity = trained.recipe.analysis.granularity  # the real models' cells take the recipe's scales
    sections += [run_real_model(options.real_model, tmp, options.device, console, granularity=granularity)] if options.real_model else []
    write_report_markdown(tmp / "report.md", stats_doc, cells_to_json(cells), kinds, context, emergence_markdown(curves), [s for s in sections if s],
                          lead=provenance_lead(trained.built_in, seed))


def _run_link(seeds_document: Path) -> str:
    run = seeds_document.parent
    return f"`results/{run.name}/{seeds_document.name}`; its plan and family: `results/{run.name}/README.md`"


def provenance_lead(built_in: str | None, seed: int) -> str | None:
    """The report's first words on a built-in's models: one seed of which confirmatory run, and where its family is."""
    from quantdiff.across_seeds.published import PUBLISHED

    path = PUBLISHED.get(built_in) if built_in else None
    if path is None:
        return None
    return (f"**These models are one seed ({seed}) of the confirmatory run `results/{path.parent.name}`**, trained by its "
            f"recipe with only that seed. One seed carries no claim: the run's plan, its family of comparisons over every "
            f"seed and their verdicts are in `results/{path.parent.name}/README.md` (and in the section 'Across seeds' below).")


def published_section(built_in: str, seed: int, stats_doc: dict) -> str | None:
    """For a built-in with a published multi-seed document: the live values of the shipped seed beside the
    published ones, then the published across-seed tables, labelled as published."""
    from quantdiff.across_seeds.metrics import model_values
    from quantdiff.across_seeds.published import published_document
    from quantdiff.report.seeds_markdown import live_beside_published, seeds_sections

    path, doc = published_document(built_in)
    if path is None:
        return None
    heading = "## Across seeds (multi-seed, published)"
    if doc is None:
        return f"{heading}\n\nNot available: no published multi-seed document at `{path}` (it ships in the repository's results/)."
    note = f"The shipped models are seed {seed} of the published run ({_run_link(path)}, {len(doc['seeds'])} seeds: {', '.join(map(str, doc['seeds']))})."
    if seed not in doc["seeds"]:
        note = f"**The shipped seed {seed} is not among the published seeds ({', '.join(map(str, doc['seeds']))}).**"
    body = f"{heading}\n\n{note} Measured live on the shipped seed beside the published values:\n\n" + live_beside_published(doc, model_values(stats_doc), seed)
    return "\n\n".join([body, *seeds_sections(doc, label="multi-seed, published")])
