"""`quantdiff reproduce`: the whole analysis of one matched set of models (a pair, or a recipe's arms), written to a report directory.

The models are shipped ones ("tiny", "bb"), or the arms a recipe trains into runs/<recipe>/ (trained first if
missing). The statistics and the accuracy sweep run on the same held-out data: corpus text (the statistics
with a BOS token first when the recipe trained with one), or for a bigram-backcopy recipe the generator's
held-out sequences and its own task `bb`; the report directory holds report.md, stats.json, sweep.json and the
PNG plots (with emergence.png when the train logs carry an outlier series), and — unless turned off — a section on
real pretrained models side by side (`jobs.real_model`, with real_model.json); it appears only once everything in it is
written.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.errors import ConfigError
from quantdiff.train.recipe import Recipe, load_recipe
from quantdiff.core.atomic import write_json
from quantdiff.core.savedir import atomic_dir, check_target

RUNS = Path("runs")
BOS_CORPUS_SOURCE = "builtin:corpus, BOS first (as the pair was trained)"
BB_SOURCE = "bigram-backcopy held-out sequences, BOS first (as the models were trained)"
TEXT_TASKS = ("lm", "choice", "retrieval")
PER_TOKEN_TASKS = ("lm", "bb")  # swept at every site, linear included


@dataclass(frozen=True)
class ReproduceOptions:
    target: str = "tiny"  # a built-in pair name, or a recipe name/path
    out: Path = Path("report")
    stats_tokens: int | None = None  # None: the recipe's [analysis] stats_tokens
    items: int | None = None  # None: the recipe's task sizes; else a cap on items per task (quick runs, tests)
    tasks: tuple[str, ...] | None = None  # None: TEXT_TASKS, or ("bb",) for a bigram-backcopy recipe
    device: str | None = None
    force: bool = False
    real_model: str | None = "smollm2,gemma3"  # real pretrained models measured too, comma-separated (jobs.real_model); None: not run


def find_pair(target: str, console) -> tuple[Recipe, dict[str, Path]]:
    """The recipe and {arm: model dir}: built-in models as shipped, or a recipe's arms (trained if missing)."""
    from quantdiff.train.loop import arms_exist, train_pair
    from quantdiff.models.names import BUILT_IN, resolve

    if target in BUILT_IN:
        dirs = resolve(target)
        return load_recipe(dirs[0] / "recipe.toml"), dict(zip(BUILT_IN[target], dirs))
    recipe = load_recipe(target)
    out = RUNS / recipe.name
    if not arms_exist(out, recipe):
        console.print(f"no trained models in {out}: training them with recipe {recipe.name!r}")
        train_pair(recipe, out, console=console)
    return recipe, {name: out / name for name in recipe.arm_names}


def _tasks(recipe: Recipe, options: ReproduceOptions) -> list:
    from quantdiff.eval.tasks.registry import make_task

    cap = options.items
    sizes = recipe.tasks
    names = options.tasks or (("bb",) if recipe.synthetic else TEXT_TASKS)
    made = {
        "bb": lambda: make_task("bb", sequences=min(sizes.bb_sequences, cap or sizes.bb_sequences), context=recipe.analysis.seq_len),
        "choice": lambda: make_task("choice", cloze_items=min(sizes.choice_items, cap or sizes.choice_items)),
        "lm": lambda: make_task("lm", tokens=min(sizes.lm_tokens, (cap or sizes.lm_tokens) * recipe.analysis.seq_len),
                                context=recipe.analysis.seq_len),
        "retrieval": lambda: make_task(
            "retrieval", context_tokens=sizes.retrieval_contexts[0], n_needles=sizes.retrieval_needles[-1],
            examples=min(sizes.retrieval_examples, cap or sizes.retrieval_examples)),
    }
    unknown = [t for t in names if t not in made]
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(unknown)} (choose from {', '.join(made)})")
    return [made[name]() for name in names]


def stats_source(recipe: Recipe, model_dir: Path, scratch: Path) -> str:
    """`builtin:corpus`, or — for a pair trained with BOS — a JSONL of the same held-out windows with BOS first.

    A model trained with BOS at every sequence start is measured the way it runs: its sinks and massive
    activations sit on that token. Models trained on bigram-backcopy are measured on its held-out sequences."""
    if recipe.synthetic:
        from quantdiff.data import bigram_backcopy

        seq_len = recipe.analysis.seq_len
        rows = bigram_backcopy.load().held_out_rows(max(1, recipe.analysis.stats_tokens // seq_len), seq_len).tolist()
        path = scratch / "bigram_backcopy.jsonl"
        path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
        return str(path)
    if not recipe.train.bos:
        return "builtin:corpus"
    from quantdiff.data.sources import load_sequences
    from quantdiff.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    windows = load_sequences("builtin:corpus", tokenize, recipe.analysis.stats_tokens, recipe.analysis.seq_len - 1, len(tokenizer))
    path = scratch / "held_out_bos.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [tokenizer.bos_token_id] + w}) + "\n" for w in windows))
    return str(path)


def arm_line(arm, recipe: Recipe) -> str:
    """`name`: kind, optimizer, peak lr, weight decay — one arm of the report's setup."""
    optimizer = f"SGD (momentum {arm.momentum})" if arm.optimizer == "sgd" else "AdamW"
    return f"`{arm.name}`: {arm.kind}, {optimizer}, lr {arm.peak_lr(recipe.train):g}, weight decay {arm.decay(recipe.train):g}"


def reproduce(options: ReproduceOptions, console) -> Path:
    """Run stats and the sweep on the pair and write the report directory; returns the path of report.md."""
    from quantdiff.jobs.evaluate import prepare_models, run_prepared
    from quantdiff.quant.registry import method_name
    from quantdiff.report.markdown import write_report_markdown
    from quantdiff.jobs.stats import StatsOptions
    from quantdiff.jobs.stats import run as run_stats
    from quantdiff.eval.sweep import Cell, cells_to_json, plan_sweep
    from quantdiff.models.source import model_sources
    from quantdiff.report.emergence import emergence_markdown, plot_emergence, read_series
    from quantdiff.report.sweep_report import plot_sweep
    from quantdiff.jobs.real_model import run_real_model

    check_target(options.out, options.force, flag="--out", kind="report")  # before any training or loading
    recipe, dirs = find_pair(options.target, console)
    check_target(options.out, options.force, list(dirs.values()), flag="--out", kind="report")  # never the pair being analysed
    analysis = recipe.analysis
    tasks = _tasks(recipe, options)
    methods = [method_name(m) for m in analysis.methods]  # recipes may write llm_int8
    plan = plan_sweep(methods, analysis.bits, analysis.sites)
    # Weight/input (linear) quantization is swept on lm (bb) only: the cheap per-token metric, and the paper's
    # question for the other tasks is attention quantization (logits, qk).
    attention_sites = [s for s in analysis.sites if s != "linear"] or analysis.sites
    attention_plan = plan_sweep(methods, analysis.bits, attention_sites)
    specs = list(dirs.items())  # models are named by kind in every table and JSON of the report
    started = time.perf_counter()
    with atomic_dir(options.out, force=options.force, kind="report", sources=list(dirs.values())) as tmp, tempfile.TemporaryDirectory() as scratch:
        console.print(f"statistics over {options.stats_tokens or analysis.stats_tokens:,} held-out tokens per model")
        stats_doc = run_stats(
            StatsOptions(
                models=tuple(str(p) for _, p in specs),
                data=stats_source(recipe, specs[0][1], Path(scratch)),
                tokens=options.stats_tokens or analysis.stats_tokens,
                seq_len=analysis.seq_len,
                device=options.device,
                json_path=tmp / "stats.json",
                plot_dir=tmp,
            ),
            quiet=True,
        )
        if recipe.train.bos:  # name the data, not the scratch file that held it
            stats_doc["data"]["source"] = BB_SOURCE if recipe.synthetic else BOS_CORPUS_SOURCE
            write_json(tmp / "stats.json", stats_doc)
        cells: list[Cell] = []
        bos: dict[str, dict] = {}  # what opened each model's sequences (the same for every text task)
        for task in tasks:
            configs = plan.configs if task.name in PER_TOKEN_TASKS else attention_plan.configs
            console.print(f"sweep: task {task.name}, {len(configs) + 1} cells per model")
            prepared = prepare_models(specs, task, None)
            task_cells = run_prepared(prepared, task, configs, options.device, quiet=False)
            bos.update({model.name: model.bos.to_dict() for model in prepared})
            plot_sweep(task_cells, tmp / f"sweep_{task.name}.png", task.headline)
            cells += task_cells
        sweep_doc = cells_to_json(cells, model_sources(specs), bos)
        write_json(tmp / "sweep.json", sweep_doc, indent=2)
        series = read_series(dirs)
        if series:
            plot_emergence(series, tmp / "emergence.png")
        kinds = {entry["name"]: entry["kind"] for entry in stats_doc["models"]}
        context = {
            "models": f"{options.target} ({', '.join(str(p) for _, p in specs)})",
            "recipe": f"{recipe.name}: {recipe.model.hidden_size} wide, {recipe.model.num_layers} layers, "
            f"{recipe.model.num_heads} heads (Diff: {recipe.model.num_heads // 2} differential heads), "
            f"{recipe.train.tokens:,} training tokens per model, data {', '.join(recipe.data.corpus_names)}",
            "arms (same batches, same initial seed)": "; ".join(arm_line(arm, recipe) for arm in recipe.arms),
            "statistics data": f"{stats_doc['data']['tokens']:,} held-out tokens per model ({stats_doc['data']['source']}), sequences of {analysis.seq_len}",
            "quantization": f"methods {', '.join(analysis.methods)}; bits {', '.join(map(str, analysis.bits))}; "
            f"sites {', '.join(analysis.sites)} (linear on tasks {', '.join(PER_TOKEN_TASKS)} only); skipped: {'; '.join(plan.skipped) or 'none'}",
            "tasks": ", ".join(f"{t.name}" for t in tasks),
            "run time": f"{time.perf_counter() - started:.0f} s",
        }
        real = [run_real_model(options.real_model, tmp, options.device, console)] if options.real_model else []
        write_report_markdown(tmp / "report.md", stats_doc, sweep_doc, kinds, context, emergence_markdown(series), real)
    return options.out / "report.md"
