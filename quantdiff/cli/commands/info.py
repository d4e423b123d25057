"""`quantdiff info MODEL`: what a model is, as quantdiff sees it (architecture, sizes, attention kind, source)."""

from __future__ import annotations

from typing import Annotated

import typer

from quantdiff.cli.options import MODELS_HELP, DeviceOpt, JsonOpt, QuietOpt, RemoteOpt, RevisionOpt

ATTENTION_LABELS = {
    "standard": "standard", "diff": "differential", "diffv2": "differential V2", "gated": "gated (head-wise)",
    "sink": "sink logit per head",
}
COLUMNS = ("model", "architecture", "attention", "layers", "heads (kv)", "parameters", "λ / gate / sink", "device", "source")


def info(
    models: Annotated[list[str], typer.Argument(help=MODELS_HELP)],
    device: DeviceOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: RemoteOpt = False,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --json file that quantdiff did not write.")] = False,
) -> None:
    """What is this model, as quantdiff sees it?

    Loads each model on the quantdiff backend and prints its architecture, attention kind, parameter counts (with
    the parameters its attention kind adds: λ, an output gate, sink logits) and source (a GGUF file is
    dequantized: what quantdiff measures is the dequantized model). A mixed-precision export's per-layer bits
    follow the table."""
    from rich.table import Table

    from quantdiff.attention.backend import taps
    from quantdiff.cli.output import check_json, to_stdout, write_result
    from quantdiff.core.device import resolve_device
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.names import resolve_models
    from quantdiff.models.pairs import added_parameter_count, parameter_count
    from quantdiff.models.source import describe_source, model_source
    from quantdiff.models.structure import attention_kind
    from quantdiff.quant.checkpoint import load, recorded_plan
    from quantdiff.quant.layer_bits import plan_phrase
    from quantdiff.report.console import table_console

    target = resolve_device(device, "--device")  # before any loading: a bad name costs nothing
    specs = resolve_models(models, revision)
    check_json(json_path, model_inputs(models, [path for _, path in specs]), force)
    records = []
    for name, path in specs:
        model = load(path, device=target, trust_remote_code=trust_remote_code)
        cfg = model.config
        records.append({
            "name": name, "path": str(path), "architecture": type(model).__name__, "attention": attention_kind(model),
            "layers": len(taps(model)), "heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            "parameters": parameter_count(model), "added_parameters": added_parameter_count(model),
            "device": str(next(model.parameters()).device), "source": model_source(path), "layer_bits": recorded_plan(path),
        })
        del model
    table = Table(title="quantdiff models")
    for column in COLUMNS:
        table.add_column(column)
    for r in records:
        table.add_row(
            r["name"], r["architecture"], ATTENTION_LABELS[r["attention"]], str(r["layers"]), f"{r['heads']} ({r['kv_heads']})",
            f"{r['parameters']:,}", f"{r['added_parameters']:,}", r["device"], describe_source(r["source"]) or "safetensors",
        )
    console = table_console(table, stderr=to_stdout(json_path), quiet=quiet)
    console.print(table)
    for r in records:
        if r["layer_bits"] is not None:
            console.print(f"{r['name']}: a mixed-precision export, {plan_phrase(r['layer_bits'])}")
    write_result(json_path, "info", {"models": records}, force)
