"""`quantdiff sensitivity`: load one model and its data, run the per-layer sensitivity map, write JSON and plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.errors import ConfigError

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
    from quantdiff.quant.sites import parse_config
    from quantdiff.quant.smoothing import Calibration
    from quantdiff.report.sensitivity_report import plot_sensitivity

    configs = [parse_config(request.method, request.bits, site, request.granularity) for site in request.sites]
    if not configs:
        raise ConfigError("--site names no site")
    check_mode(request.bos)
    data = Calibration(request.data, request.tokens, request.seq_len)
    target = resolve_device(request.device, "--device")
    resolved = resolve_models([request.model])
    check_one_model(request.model, [path for _, path in resolved], "MODEL")
    [(name, path)] = resolved
    data_inputs = [] if request.data.startswith("builtin:") else [request.data]
    check_outputs({"--json": request.json_path, "--plot": request.plot}, model_inputs([request.model], [path]) + data_inputs)
    tokenizer = load_tokenizer(path)
    bos = decide_bos(path, tokenizer, request.bos)
    model = load(path, device=target, trust_remote_code=request.trust_remote_code)
    tokenize = None if tokenizer is None else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    sequences = load_sequences(data.source, tokenize, data.tokens, data.length(model.config), model.config.vocab_size, bos.token_id, tokenizer)
    batches = make_batches(sequences, 4, getattr(model.config, "pad_token_id", None) or 0)
    forwards = len(batches) * (1 + sum(len(site_layers(model, c)) + 1 for c in configs))
    with task_bars(request.quiet) as start:
        advance = None if start is None else start(f"sensitivity {name}", forwards)
        result = sensitivity_map(model, batches, configs, progress=advance)
    result = {"schema": SCHEMA, "model": name, "method": request.method, "bits": int(request.bits), "granularity": request.granularity,
              "data": data.to_dict(), "bos": bos.token_id is not None, **result}
    if request.json_path is not None:
        write_json(request.json_path, result, indent=1, force=request.force)
    if request.plot is not None:
        plot_sensitivity(result, request.plot, request.force)
    return result
