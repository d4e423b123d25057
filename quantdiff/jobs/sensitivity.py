"""`quantdiff sensitivity`: load one model and its data, run the per-layer sensitivity map, write JSON and plot;
with --plan-budget, a mixed-precision plan from the map (`quant.precision_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from quantdiff.core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from quantdiff.data.sources import Batch
    from quantdiff.quant.precision_plan import PrecisionPlan

SCHEMA = "quantdiff.sensitivity"


@dataclass(frozen=True)
class SensitivityRequest:
    model: str
    method: str
    bits: str
    sites: tuple[str, ...]
    granularity: str
    data: str
    tokens: int
    seq_len: int | None
    bos: str
    device: str | None
    json_path: Path | None
    plot: Path | None
    force: bool
    quiet: bool
    trust_remote_code: bool = False
    plan_budget: float | None = None  # plan a bit width per layer at this mean width (`quant.precision_plan`)
    out: Path | None = None  # where the plan is written


def run(request: SensitivityRequest) -> dict:
    """Every option checked before the model loads; the map (`eval.sensitivity.sensitivity_map`) as written."""
    from quantdiff.core.atomic import write_json
    from quantdiff.core.device import resolve_device
    from quantdiff.core.outputs import check_outputs
    from quantdiff.core.progress import task_bars
    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.eval.sensitivity import sensitivity_map, site_layers
    from quantdiff.models.bos import check_mode, decide_bos
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.models.names import check_one_model, resolve_models
    from quantdiff.quant.checkpoint import load
    from quantdiff.quant.registry import parse_bits
    from quantdiff.quant.sites import parse_config
    from quantdiff.quant.smoothing import Calibration
    from quantdiff.report.sensitivity_report import plot_sensitivity
    from quantdiff.quant.precision_plan import save_plan

    widths = parse_bits(request.bits)
    configs = [parse_config(request.method, b, site, request.granularity) for site in request.sites for b in dict.fromkeys(widths)]
    if not configs:
        raise ConfigError("--site names no site")
    check_plan_request(request, sorted(set(widths)))
    check_mode(request.bos)
    data = Calibration(request.data, request.tokens, request.seq_len)
    target = resolve_device(request.device, "--device")
    resolved = resolve_models([request.model])
    check_one_model(request.model, [path for _, path in resolved], "MODEL")
    [(name, path)] = resolved
    data_inputs = [] if request.data.startswith("builtin:") else [request.data]
    check_outputs({"--json": request.json_path, "--plot": request.plot, "--out": request.out}, model_inputs([request.model], [path]) + data_inputs)
    tokenizer = load_tokenizer(path)
    bos = decide_bos(path, tokenizer, request.bos)
    model = load(path, device=target, trust_remote_code=request.trust_remote_code)
    tokenize = None if tokenizer is None else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    sequences = load_sequences(data.source, tokenize, data.tokens, data.length(model.config), model.config.vocab_size, bos.token_id, tokenizer)
    batches = make_batches(sequences, 4, getattr(model.config, "pad_token_id", None) or 0)
    forwards = len(batches) * (1 + sum(len(site_layers(model, c)) + 1 for c in configs) + (2 if request.plan_budget is not None else 0))
    with task_bars(request.quiet) as start:
        advance = None if start is None else start(f"sensitivity {name}", forwards)
        result = sensitivity_map(model, batches, configs, progress=advance)
        result = {"schema": SCHEMA, "model": name, "method": request.method, "bits": sorted(set(widths)), "granularity": request.granularity,
                  "data": data.to_dict(), "bos": bos.token_id is not None, **result}
        if request.plan_budget is not None:
            calibration = {**data.to_dict(), "bos": result["bos"], "tokens_sha256": tokens_sha256(sequences), **data_digest(request.data)}
            plan = measured_plan(model, batches, result, request.plan_budget, calibration, advance)
            result["plan"] = plan.to_dict()
    if request.out is not None:
        save_plan(plan, request.out, request.force)
    if request.json_path is not None:
        write_json(request.json_path, result, indent=1, force=request.force)
    if request.plot is not None:
        plot_sensitivity(result, request.plot, request.force)
    return result


def check_plan_request(request: SensitivityRequest, widths: list[int]) -> None:
    """A plan needs one site and a budget from the narrowest to the widest width; --out needs a plan."""
    from quantdiff.quant.precision_plan import check_budget

    if request.out is not None and request.plan_budget is None:
        raise ConfigError("--out writes a precision plan: give --plan-budget too")
    if request.plan_budget is None:
        return
    if len(request.sites) != 1:
        raise ConfigError(f"--plan-budget plans one site's widths: give one --site, not {','.join(request.sites)}")
    check_budget(request.plan_budget, widths)


def tokens_sha256(sequences: list[list[int]]) -> str:
    """The sha256 of the calibration token ids, as the JSON of their list of sequences."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sequences, separators=(",", ":")).encode()).hexdigest()


def data_digest(source: str) -> dict:
    """{"sha256": the data file's} for a file, so an evaluation can refuse a plan calibrated on its data; {} for a builtin."""
    from quantdiff.data.sources import BUILTINS, file_sha256

    return {} if source in BUILTINS else {"sha256": file_sha256(source, "--data")}


def measured_plan(model: nn.Module, batches: Sequence[Batch], result: dict, budget: float, calibration: dict,
                  progress: Callable[[int], None] | None = None) -> PrecisionPlan:
    """The knapsack plan from the map's one site at each width, its whole-plan damage measured in one forward on
    the same tokens (`quant.precision_plan`)."""
    from quantdiff.eval.damage import damages
    from quantdiff.models import structure
    from quantdiff.quant.precision_plan import plan_from_map, planned_config

    by_bits = {site["bits"]: site for site in result["sites"]}
    model_record = {"name": result["model"], "decoder_layers": len(structure.decoder_layers(model))}
    plan = plan_from_map(by_bits, budget, model_record, result["method"], result["granularity"], calibration)
    [measured], _ = damages(model, batches, [planned_config(plan)], progress=progress)
    return replace(plan, measured_kld_mean=measured["kld_mean"])
