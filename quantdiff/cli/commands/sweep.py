"""`quantdiff sweep` (every quantization cell, per model) and `quantdiff eval` (one cell)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import MODELS_HELP, BosOpt, DeviceOpt, FileForceOpt, JsonOpt, PartialOpt, QuietOpt, RemoteOpt
from quantdiff.cli.transform_options import CalibrationOpt, CalibrationTokensOpt, KVPlanOpt, RotateOpt, SmoothOpt
from quantdiff.cli.layers_option import LayersOpt
from quantdiff.cli.plan_option import PlanOpt

TASK_HELP = "Task: choice (HellaSwag-format multiple choice), lm (held-out loss/accuracy), retrieval (multi-needle), bb (Bigram-Backcopy accuracy; models trained on it)."
DATA_HELP = "Task data: a HellaSwag JSONL file (choice), a text file (lm; retrieval filler). Default: the corpus' held-out text."

# Options shared by both commands, so their spelling and help never drift apart.
TaskOpt = Annotated[str, typer.Option("--task", "-t", help=TASK_HELP)]
DataOpt = Annotated[Optional[str], typer.Option("--data", help=DATA_HELP)]  # a str: "" stays empty, not "."
LimitOpt = Annotated[Optional[int], typer.Option("--limit", help="Evaluate only the first N items (windows, documents).")]
GroupOpt = Annotated[Optional[int], typer.Option("--group-size", help="absmax weights at site linear in groups of G inputs per output channel (e.g. 32, 64, 128; a width G does not divide ends in a shorter group); default per output channel. At site kv: each token's keys and values per KV head in groups of G channels (llama.cpp's blocks of 32).")]
KV_MODES = ("kivi", "token", "q8_0", "q4_0", "vllm-int8-head", "vllm-int4-head", "vllm-fp8-head", "vllm-fp8-tensor")  # = kv_layout.LAYOUTS (a test checks)
KVModeOpt = Annotated[Optional[str], typer.Option("--kv-mode", help=(
    "At --site kv: the cache layout, quantized with `quantdiff.kv_cache`'s own functions. kivi (the cache's default: keys per channel over "
    "128-token blocks, values per token, zero-points, the last tokens in float; not causal within a block at this site), token (per token and KV head, "
    "symmetric, rounded), or an engine's own codes, exactly: q8_0, q4_0 (llama.cpp, blocks of 32 channels, 8 and 4 bits), vllm-int8-head "
    "(vLLM int8_per_token_head, truncated codes, 8 bits), vllm-int4-head (vLLM int4_per_token_head, asymmetric, 4 bits), vllm-fp8-head "
    "(vLLM fp8_per_token_head, e4m3, 8 bits), vllm-fp8-tensor (vLLM fp8 with --calculate-kv-scales: one scale per layer for keys, amax / 200, "
    "and values, amax / 100, from the whole first forward; not causal at this site). An engine mode refuses other --bits and any --group-size; every mode refuses --granularity tensor."))]
ContextOpt = Annotated[Optional[int], typer.Option("--context", help="Tokens per document (retrieval) or window (lm); default 256, or the fewest positions among the models when fewer; a given value beyond a model's positions is refused.")]
NeedlesOpt = Annotated[Optional[int], typer.Option("--needles", help="Needles per retrieval document.")]
DepthOpt = Annotated[Optional[float], typer.Option("--depth", help="Depth in [0, 1] of every needle (0 = start of the filler, 1 = its end); default: random per needle.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed of the generated data (cloze set, needle documents); default 0.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")]
NoDamageOpt = Annotated[bool, typer.Option("--no-damage", help="Leave out each quantized cell's damage against the model unquantized (mean, p99 and max KL divergence, same top-1, RMS Δp, Δ loss on the task's own sequences; docs/damage.md), which costs one more forward per batch for each cell and one full-precision one per model.")]
GranularityOpt = Annotated[str, typer.Option("--granularity", help="Scales: row (default, causal: one per token for linear inputs and Q/K, per query row for logits, per token and KV head for kv; LLM.int8 outliers per token), tensor (NON-CAUSAL: one per sequence, KIVI over the sequence at kv; the former default, used by the published results up to issue 44) or column (NON-CAUSAL: per channel over the sequence).")]


def sweep(
    models: Annotated[list[str], typer.Argument(help=MODELS_HELP)],
    task: TaskOpt = "choice",
    bits: Annotated[Optional[str], typer.Option("--bits", help="Comma-separated bit widths, each 2–16 (default 16,8,6,4).")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="Comma-separated: absmax (default), llm-int8.")] = None,
    site: Annotated[Optional[str], typer.Option("--site", help="Comma-separated: logits (default), qk, linear, kv (keys and values as a KV cache holds them). Unsupported (method, site) pairs are skipped with a note.")] = None,
    group_size: GroupOpt = None,
    rotate: RotateOpt = None,
    smooth: SmoothOpt = None,
    calibration: CalibrationOpt = None,
    calibration_tokens: CalibrationTokensOpt = None,
    kv_plan: KVPlanOpt = None,
    kv_mode: KVModeOpt = None,
    granularity: GranularityOpt = "row",
    layers: LayersOpt = None,
    plan_file: PlanOpt = None,
    no_damage: NoDamageOpt = False,
    blocks: Annotated[Optional[int], typer.Option("--blocks", help="Also evaluate every cell in N contiguous blocks of the items and record each block's metrics in the JSON (intervals by batch means); the cell's metrics pool them exactly. Tasks lm and bb.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write the Figure-8-style chart (PNG, PDF or SVG).")] = None,
    json_path: JsonOpt = None,
    data: DataOpt = None,
    limit: LimitOpt = None,
    context: ContextOpt = None,
    needles: NeedlesOpt = None,
    depth: DepthOpt = None,
    seed: SeedOpt = None,
    batch_size: BatchOpt = 8,
    device: DeviceOpt = None,
    quiet: QuietOpt = False,
    allow_partial: PartialOpt = False,
    trust_remote_code: RemoteOpt = False,
    force: FileForceOpt = False,
    bos: BosOpt = "auto",
) -> None:
    """How much accuracy does a model lose at each bit width, method and site?

    The paper's Figure 8: the task's metrics unquantized and for every (method, bits, site) cell, models side by
    side, as a table, JSON and a chart."""
    from quantdiff.report.console import line_console

    from quantdiff.cli.task_options import check_limit, check_output, fit_default_context, make_cli_task
    from quantdiff.cli.transform_options import calibration_file, check_kv_plans, load_kv_plans, make_transform
    from quantdiff.cli.layers_option import check_layers, parse_layers
    from quantdiff.cli.plan_option import check_plans_fit, load_precision_plans, refuse_with_plan
    from quantdiff.cli.validate import check_group_option, check_kv_mode, check_list
    from quantdiff.core.device import resolve_device
    from quantdiff.core.errors import ConfigError
    from quantdiff.core.outputs import check_outputs
    from quantdiff.eval.sweep import SweepPlan, plan_sweep
    from quantdiff.jobs.evaluate import prepare_models, report, run_prepared
    from quantdiff.models.bos import check_mode
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.names import resolve_models
    from quantdiff.models.source import model_sources
    from quantdiff.quant.registry import parse_bits, split_names

    refuse_with_plan(plan_file, {"--bits": bits, "--method": method, "--site": site, "--group-size": group_size, "--rotate": rotate, "--smooth": smooth,
                                 "--granularity": None if granularity == "row" else granularity, "--layers": layers, "--kv-mode": kv_mode})
    bits, method, site = bits or "16,8,6,4", method or "absmax", site or "logits"
    for flag, text in (("--bits", bits), ("--method", method), ("--site", site)):
        check_list(text, flag)
    check_group_option(group_size, split_names(site, "sites"))
    check_kv_mode(kv_mode, split_names(site, "sites"), parse_bits(bits), granularity, group_size, kv_plan)
    target = resolve_device(device, "--device")
    transform = make_transform(rotate, smooth, calibration, calibration_tokens, task, data)
    if layers is not None and kv_plan:
        raise ConfigError("--layers chooses layers for --site; a --kv-plan sets its own per layer")
    chosen = parse_layers(layers)
    plan = plan_sweep(split_names(method, "methods"), parse_bits(bits), split_names(site, "sites"), group_size, transform, granularity, chosen, kv_mode)
    if plan_file:  # the plans' cells replace the --bits cells
        plan = SweepPlan(load_precision_plans(plan_file, data), [])
    plan.configs.extend(load_kv_plans(kv_plan, data, granularity))
    the_task = make_cli_task(task, batch_size, data=data, context=context, needles=needles, depth=depth, seed=seed)
    check_limit(limit)
    if blocks is not None and (blocks < 2 or not hasattr(the_task, "pool")):
        raise ConfigError(f"--blocks must be at least 2, with task lm or bb (got {blocks}, task {task})")
    check_mode(bos)
    specs = resolve_models(models)
    the_task = fit_default_context(the_task, context, specs, trust_remote_code)
    check_outputs({"--json": json_path, "--plot": plot}, model_inputs(models, [path for _, path in specs]) + ([data] if data else []) + calibration_file(transform) + (kv_plan or []) + (plan_file or []))
    check_kv_plans(plan.configs, specs, trust_remote_code)
    check_plans_fit(plan.configs, specs, trust_remote_code)
    check_layers(chosen, specs, trust_remote_code)
    check_output(json_path, None, force, "--json")
    check_output(plot, (".png", ".pdf", ".svg"), force, "--plot")
    notes = line_console(stderr=True)
    for line in plan.skipped:
        notes.print(f"[yellow]skipped {line}[/yellow]")
    bars_quiet = quiet or str(json_path) == "-"  # the JSON is stdout's whole content
    prepared = prepare_models(specs, the_task, limit, bos, target, trust_remote_code)
    cells = run_prepared(prepared, the_task, plan.configs, target, bars_quiet, allow_partial=allow_partial, trust_remote_code=trust_remote_code, blocks=blocks,
                          damage=not no_damage)
    report(cells, the_task, json_path, quiet, model_sources(specs), {m.name: m.bos for m in prepared}, force)
    if plot is not None:
        from quantdiff.report.sweep_report import cell_points, plot_sweep

        plot_sweep(cell_points(cells, the_task.headline), plot, the_task.headline, f"{the_task.name}: {the_task.headline} vs bits", force)
        if not quiet:
            notes.print(f"plot -> {plot}")


def evaluate(
    model: Annotated[str, typer.Argument(help="A model directory, GGUF file (dequantized), built-in name (tiny/diff, smollm2, gemma3) or hub id (org/name).")],
    task: TaskOpt = "choice",
    bits: Annotated[Optional[int], typer.Option("--bits", help="Quantize to this many bits (2–16); omit for the unquantized model.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="absmax (default) or llm-int8; needs --bits.")] = None,
    site: Annotated[Optional[str], typer.Option("--site", help="logits (default), qk, linear or kv; needs --bits.")] = None,
    group_size: GroupOpt = None,
    rotate: RotateOpt = None,
    smooth: SmoothOpt = None,
    calibration: CalibrationOpt = None,
    calibration_tokens: CalibrationTokensOpt = None,
    kv_plan: KVPlanOpt = None,
    kv_mode: KVModeOpt = None,
    granularity: GranularityOpt = "row",
    layers: LayersOpt = None,
    plan_file: PlanOpt = None,
    no_damage: NoDamageOpt = False,
    json_path: JsonOpt = None,
    data: DataOpt = None,
    limit: LimitOpt = None,
    context: ContextOpt = None,
    needles: NeedlesOpt = None,
    depth: DepthOpt = None,
    seed: SeedOpt = None,
    batch_size: BatchOpt = 8,
    device: DeviceOpt = None,
    quiet: QuietOpt = False,
    allow_partial: PartialOpt = False,
    trust_remote_code: RemoteOpt = False,
    force: FileForceOpt = False,
    bos: BosOpt = "auto",
) -> None:
    """How well does a model do on a task, unquantized or quantized one way?

    One cell of the sweep: the task's metrics for MODEL, unquantized, or with --bits (and --method, --site), or
    with a mixed-precision --plan."""
    from quantdiff.cli.output import check_json
    from quantdiff.cli.task_options import check_limit, fit_default_context, make_cli_task
    from quantdiff.cli.transform_options import calibration_file, check_kv_plans, load_kv_plans, make_transform
    from quantdiff.cli.layers_option import check_layers, parse_layers
    from quantdiff.cli.plan_option import check_plans_fit, load_precision_plans, refuse_with_plan
    from quantdiff.cli.validate import check_group_option, check_kv_mode
    from quantdiff.core.device import resolve_device
    from quantdiff.core.errors import ConfigError
    from quantdiff.jobs.evaluate import prepare_models, report, run_prepared
    from quantdiff.models.bos import check_mode
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.names import resolve_models
    from quantdiff.models.source import model_sources
    from quantdiff.quant.sites import parse_config

    refuse_with_plan(plan_file, {"--bits": bits, "--method": method, "--site": site, "--group-size": group_size, "--rotate": rotate, "--smooth": smooth,
                                 "--granularity": None if granularity == "row" else granularity, "--layers": layers, "--kv-mode": kv_mode})
    if plan_file and (kv_plan or len(plan_file) > 1):
        raise ConfigError("--plan is one quantization of its own: give one plan, without --kv-plan")
    if bits is None and not kv_plan and not plan_file and (method is not None or site is not None or group_size is not None or rotate is not None or smooth is not None
                                         or granularity != "row" or layers is not None or kv_mode is not None):
        raise ConfigError("--method, --site, --group-size, --granularity, --rotate, --smooth, --layers and --kv-mode choose how to quantize: give --bits too")
    if layers is not None and kv_plan:
        raise ConfigError("--layers chooses layers for --site; a --kv-plan sets its own per layer")
    chosen = parse_layers(layers)
    if kv_plan and (bits is not None or method is not None or site is not None or len(kv_plan) > 1):
        raise ConfigError("--kv-plan is one quantization of its own (site kv, its budget sets the bits): give one plan, without --bits, --method or --site")
    check_group_option(group_size, [site or "logits"])
    check_kv_mode(kv_mode, [site or "logits"], [] if bits is None else [bits], granularity, group_size, kv_plan)
    target = resolve_device(device, "--device")
    transform = make_transform(rotate, smooth, calibration, calibration_tokens, task, data)
    configs = load_kv_plans(kv_plan, data, granularity) if kv_plan else [] if bits is None else [parse_config(method or "absmax", bits, site or "logits", granularity, group_size=group_size, transform=transform, kv_layout=kv_mode, layers=chosen)]
    configs += load_precision_plans(plan_file, data)
    the_task = make_cli_task(task, batch_size, data=data, context=context, needles=needles, depth=depth, seed=seed)
    check_limit(limit)
    check_mode(bos)
    specs = resolve_models([model])
    the_task = fit_default_context(the_task, context, specs, trust_remote_code)
    check_kv_plans(configs, specs, trust_remote_code)
    check_plans_fit(configs, specs, trust_remote_code)
    check_layers(chosen, specs, trust_remote_code)
    check_json(json_path, model_inputs([model], [path for _, path in specs]) + ([data] if data else []) + calibration_file(transform) + (kv_plan or []) + (plan_file or []), force)
    prepared = prepare_models(specs, the_task, limit, bos, target, trust_remote_code)
    cells = run_prepared(
        prepared, the_task, configs, target, quiet or str(json_path) == "-", include_reference=not configs,
        allow_partial=allow_partial, trust_remote_code=trust_remote_code, damage=not no_damage,
    )
    report(cells, the_task, json_path, quiet, model_sources(specs), {m.name: m.bos for m in prepared}, force)
