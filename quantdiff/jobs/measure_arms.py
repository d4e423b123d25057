"""One set of arms measured for `quantdiff reproduce`: what the run was asked for (ReproduceOptions), the tasks
and statistics data a recipe's models are measured on, the statistics and the accuracy sweep of the arms of one
seed (stats.json, sweep.json, optionally their plots), and the report's Setup list."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.atomic import write_json
from quantdiff.core.errors import ConfigError
from quantdiff.train.recipe import TEXT_TASKS, Recipe

BOS_CORPUS_SOURCE = "builtin:corpus, BOS first (as the pair was trained)"
BB_SOURCE = "bigram-backcopy held-out sequences, BOS first (as the models were trained)"
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


def reproduce_tasks(recipe: Recipe, options: ReproduceOptions) -> list:
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


def measure_arms(recipe: Recipe, specs: list[tuple[str, Path]], tasks: list, options: ReproduceOptions, out: Path, scratch: Path,
                 console, plots: bool) -> tuple[dict, list]:
    """Statistics and the accuracy sweep of one set of arms (one seed): out/stats.json and out/sweep.json, and
    with `plots` the statistics' plots and one sweep chart per task; returns (stats document, sweep cells)."""
    from quantdiff.eval.sweep import Cell, cells_to_json, plan_sweep
    from quantdiff.jobs.evaluate import prepare_models, run_prepared
    from quantdiff.jobs.stats import StatsOptions
    from quantdiff.jobs.stats import run as run_stats
    from quantdiff.models.source import model_sources
    from quantdiff.quant.registry import method_name
    from quantdiff.report.sweep_report import cell_points, plot_sweep

    analysis = recipe.analysis
    methods = [method_name(m) for m in analysis.methods]  # recipes may write llm_int8
    plan = plan_sweep(methods, analysis.bits, analysis.sites, scales=analysis.granularity)
    # Weight/input (linear) quantization is swept on lm (bb) only: the cheap per-token metric, and the paper's
    # question for the other tasks is attention quantization (logits, qk).
    attention_plan = plan_sweep(methods, analysis.bits, [s for s in analysis.sites if s != "linear"] or analysis.sites, scales=analysis.granularity)
    out.mkdir(parents=True, exist_ok=True)
    stats_doc = run_stats(
        StatsOptions(
            models=tuple(str(p) for _, p in specs),
            data=stats_source(recipe, specs[0][1], scratch),
            tokens=options.stats_tokens or analysis.stats_tokens,
            seq_len=analysis.seq_len,
            device=options.device,
            json_path=out / "stats.json",
            plot_dir=out if plots else None,
        ),
        quiet=True,
    )
    if recipe.train.bos:  # name the data, not the scratch file that held it
        stats_doc["data"]["source"] = BB_SOURCE if recipe.synthetic else BOS_CORPUS_SOURCE
        write_json(out / "stats.json", stats_doc)
    cells: list[Cell] = []
    bos: dict[str, dict] = {}  # what opened each model's sequences (the same for every text task)
    for task in tasks:
        configs = plan.configs if task.name in PER_TOKEN_TASKS else attention_plan.configs
        console.print(f"sweep: task {task.name}, {len(configs) + 1} cells per model")
        prepared = prepare_models(specs, task, None, device=options.device)
        task_cells = run_prepared(prepared, task, configs, options.device, quiet=console.quiet)  # --quiet: no bars
        bos.update({model.name: model.bos.to_dict() for model in prepared})
        if plots:
            plot_sweep(cell_points(task_cells, task.headline), out / f"sweep_{task.name}.png", task.headline, f"{task.name}: {task.headline} vs bits")
        cells += task_cells
    write_json(out / "sweep.json", cells_to_json(cells, model_sources(specs), bos), indent=2)
    return stats_doc, cells


def setup_context(options: ReproduceOptions, trained, stats_doc: dict) -> dict:
    """The report's Setup list: what was run on what."""
    from quantdiff.eval.sweep import plan_sweep
    from quantdiff.quant.registry import method_name

    recipe, analysis = trained.recipe, trained.recipe.analysis
    skipped = plan_sweep([method_name(m) for m in analysis.methods], analysis.bits, analysis.sites, scales=analysis.granularity).skipped
    seeds = list(trained.runs)
    return {
        "models": (f"{options.target} ({len(trained.dirs)} model directories, {trained.dirs[0].parent.parent}/seed-<s>/<arm>)" if trained.multi_seed
                   else f"{options.target} ({', '.join(str(p) for p in trained.dirs)})"),
        "recipe": f"{recipe.name}: {recipe.model.hidden_size} wide, {recipe.model.num_layers} layers, "
        f"{recipe.model.num_heads} heads (Diff: {recipe.model.num_heads // 2} differential heads), "
        f"{recipe.train.tokens:,} training tokens per model, data {', '.join(recipe.data.corpus_names)}",
        "seeds": (f"{len(seeds)} ({', '.join(map(str, seeds))}), each training every arm" if trained.multi_seed
                  else f"{seeds[0]}" + (" (the seed of the shipped models)" if trained.built_in else "")),
        "arms (same batches, same initial seed)": "; ".join(arm_line(arm, recipe) for arm in recipe.arms),
        "statistics data": f"{stats_doc['data']['tokens']:,} held-out tokens per model ({stats_doc['data']['source']}), sequences of {analysis.seq_len}",
        "quantization": f"methods {', '.join(analysis.methods)}; bits {', '.join(map(str, analysis.bits))}; "
        f"sites {', '.join(analysis.sites)} (linear on tasks {', '.join(PER_TOKEN_TASKS)} only); granularity {granularity_text(analysis.granularity)}; "
        f"skipped: {'; '.join(skipped) or 'none'}",
        "kernels": kernels_line(options.device),
    }


def granularity_text(name: str) -> str:
    """'row (causal)' or 'tensor (non-causal: one scale per sequence)': a report never shows a non-causal cell unlabelled."""
    from quantdiff.quant.registry import CAUSAL_GRANULARITIES

    return f"{name} (causal)" if name in CAUSAL_GRANULARITIES else f"{name} (non-causal: later tokens set earlier tokens' scales)"


def kernels_line(device: str | None = None) -> str:
    """The kernels the numbers were computed with: a quantized cell moves with them (docs/results.md). On an
    accelerator the CPU's pinning says nothing about them, so the line names the accelerator instead."""
    import torch

    from quantdiff.core.device import resolve_device
    from quantdiff.train.determinism import CPU_CAPABILITY, ENVIRONMENT, settings

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return (f"CUDA, {torch.cuda.get_device_name(resolved)}, torch {torch.__version__}, CUDA {torch.version.cuda} "
                "(GPU kernels are not pinned: numbers may differ in last bits on another GPU, driver or torch)")
    if resolved.type != "cpu":
        return f"{resolved.type.upper()}, torch {torch.__version__} (kernels not pinned: numbers may differ in last bits elsewhere)"
    current = settings()
    pinned = current["cpu_capability"] == CPU_CAPABILITY and current["mkl_cbwr"] == ENVIRONMENT["MKL_CBWR"]
    return (f"{current['cpu_capability']}, MKL_CBWR={current['mkl_cbwr']}, {current['threads']} thread(s), torch {current['torch']}, {current['cpu_vendor']}"
            + (f" (pinned, as training pins them: any {current['cpu_vendor']} x86-64 CPU with AVX2 computes with the same kernels)" if pinned
               else " (not pinned: numbers may differ in other CPUs' last bits)"))


