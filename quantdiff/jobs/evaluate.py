"""Evaluating models on a task: prepare every model's data first (each with its own BOS convention), then load
one model at a time, run its sweep cells, print and write the cells."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from quantdiff.core.atomic import STDOUT, write_json
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.progress import task_bars
from quantdiff.eval.sweep import Cell, cell_label, cells_to_json, run_model_cells, split_blocks
from quantdiff.eval.tasks.registry import Task
from quantdiff.models.bos import BosChoice, check_mode, decide_bos, describe_bos
from quantdiff.quant.precision_plan import PlannedConfig
from quantdiff.quant.sites import QuantConfig


@dataclass(frozen=True)
class PreparedModel:
    """One model's task data, built for its tokenizer and its BOS convention, before any weights load."""

    name: str
    path: Path
    tokenizer: Any
    data: Any
    bos: BosChoice


def prepare_models(
    specs: Sequence[tuple[str, Path]], task: Task, limit: int | None, bos: str = "auto", device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> list[PreparedModel]:
    """Every model's task data, prepared (and so checked) before any weights are loaded; each model opens its
    sequences as it was trained (`models.bos`) unless `bos` says always or never. The task's sizes are checked
    against each model's positions and the memory of `device` first."""
    from quantdiff.eval.bounds import check_task_fits
    from quantdiff.models.loading import load_config, load_tokenizer

    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be positive, got {limit}")
    check_mode(bos)
    if task.bos_by_construction and bos == "never":
        raise ConfigError(f"task {task.name}'s sequences start with BOS by construction: --bos never does not apply")
    target = resolve_device(device)
    for _, path in specs:  # sizes against the model's positions and the machine's memory, before any data is built
        check_task_fits(task, load_config(path, trust_remote_code), target)
    out = []
    for name, path in specs:
        tokenizer = load_tokenizer(path)
        if task.bos_by_construction:
            choice = BosChoice(tokenizer.bos_token_id, tokenizer.bos_token, bos, f"task {task.name}: BOS first by construction")
        else:
            choice = decide_bos(path, tokenizer, bos)
        out.append(PreparedModel(name, path, tokenizer, task.prepare(tokenizer, limit, choice.token_id), choice))
    return out


def run_prepared(
    models: Sequence[PreparedModel],
    task: Task,
    configs: Sequence[QuantConfig | PlannedConfig],
    device: str | torch.device | None,
    quiet: bool,
    include_reference: bool = True,
    allow_partial: bool = False,
    trust_remote_code: bool = False,
    blocks: int | None = None,
    damage: bool = False,
) -> list[Cell]:
    """Load each model in turn (only one in memory) and run its cells on its prepared data. Smoothing
    configurations are calibrated on each model first, its sequences opened as its data is (BOS or not).
    blocks: also evaluate each cell in that many blocks of items (`eval.sweep.split_blocks`). damage: each quantized
    cell also carries its damage against the model unquantized (`eval.sweep.run_model_cells`)."""
    from quantdiff.quant.checkpoint import load
    from quantdiff.quant.transforms import calibrated_configs

    target = resolve_device(device)
    for prepared in models if blocks is not None else []:
        split_blocks(prepared.data, blocks)  # too few items for the blocks: refused before any weights load
    for prepared in models:
        check_recorded_sites(prepared, configs)
    cells: list[Cell] = []
    with task_bars(quiet, transient=True) as progress:
        for prepared in models:
            model = load(prepared.path, device=target, trust_remote_code=trust_remote_code)
            if len(prepared.tokenizer) > model.config.vocab_size:
                raise LoadError(f"{prepared.path}: the tokenizer has {len(prepared.tokenizer)} tokens, the model only {model.config.vocab_size}")
            model_configs = calibrated_configs(configs, model, prepared.tokenizer, prepared.bos.token_id)
            cells.extend(run_model_cells(prepared.name, model, task, prepared.data, model_configs, progress, include_reference, allow_partial, blocks, damage))
            del model
    return cells


def check_recorded_sites(prepared: PreparedModel, configs: Sequence[QuantConfig | PlannedConfig]) -> None:
    """ConfigError, before any weights load, for a configuration at an attention site whose quantizer the model's
    export already records (`checkpoint.recorded_in`): re-applied on load, it holds the site's one slot, and the
    refusal says where it came from rather than that some layer 'already has' a quantizer."""
    from quantdiff.eval.sweep import describe, label
    from quantdiff.quant.checkpoint import recorded_in

    recorded = {r["site"]: r for r in recorded_in(prepared.path) if r["site"] != "linear"}  # linear: input hooks, no slot
    for config in configs:
        site = describe(config)[2]
        if site in recorded:
            held = recorded[site]
            raise ConfigError(f"{prepared.name}: its export records {label(held['method'], held['bits'], site, granularity=held['granularity'])} "
                              f"(config.json quantization_config.attention), which quantdiff re-applies on load: site {site} cannot take another "
                              "quantization; evaluate the model it was exported from")


def report(
    cells: Sequence[Cell], task: Task, json_path: Path | None, quiet: bool, sources: dict[str, dict | None] | None = None,
    bos: dict[str, BosChoice] | None = None, force: bool = False, stderr: bool = False,
) -> None:
    """Print the cells as a table unless `quiet` (a warning on stderr, even when quiet, per invalid cell), with a
    line per model saying what opened its sequences; write them as JSON if asked, with each model's `sources` and
    `bos` records (`-`: to stdout, the table then to stderr, as with `stderr`); an existing JSON file is replaced
    only if quantdiff wrote it, or with `force`."""
    from quantdiff.report.console import table_console
    from quantdiff.report.sweep_report import sweep_table
    from quantdiff.stats.nonfinite import NonFinite, warn_nonfinite

    for cell in cells:
        if not cell.valid:
            warn_nonfinite(f"{cell.model} · {cell_label(cell)}", [NonFinite("scored positions' logits", cell.nonfinite_logits)], "its metrics are null")
    table = sweep_table(cells, task.metrics, task.headline, title=f"task: {task.name}")
    to_stdout = str(json_path) == STDOUT
    out = table_console(table, highlight=False, stderr=to_stdout or stderr, quiet=quiet)  # piped: whole rows, not rich's 80 columns
    out.print(table)
    for name, choice in (bos or {}).items():
        out.print(describe_bos(name, choice.to_dict()), soft_wrap=True, markup=False)  # "[train] bos" is text
    if json_path is not None:
        write_json(json_path, cells_to_json(cells, sources, {name: choice.to_dict() for name, choice in (bos or {}).items()}), indent=2, force=force)
        if not to_stdout:
            out.print(f"json -> {json_path}")
