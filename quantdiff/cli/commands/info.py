"""`quantdiff info MODEL`: what a model is, as quantdiff sees it (architecture, sizes, attention kind, source)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ATTENTION_LABELS = {
    "standard": "standard", "diff": "differential", "diffv2": "differential V2", "gated": "gated (head-wise)",
    "sink": "sink logit per head",
}


def info(
    models: Annotated[list[str], typer.Argument(help="Model directories, GGUF files, built-in names (tiny, smollm2, gemma3) or hub ids (org/name, org/name@revision).")],
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto (CUDA when present).")] = "auto",
    revision: Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit); only for hub ids (an error otherwise).")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model's own Python code (off by default).")] = False,
) -> None:
    """Load each model on the quantdiff backend and print its architecture, parameter counts (with the parameters
    its attention kind adds: λ, an output gate, sink logits) and source (a GGUF file is dequantized: what quantdiff
    measures is the dequantized model)."""
    from rich.table import Table

    from quantdiff.attention.backend import taps
    from quantdiff.core.device import resolve_device
    from quantdiff.quant.checkpoint import load
    from quantdiff.models.pairs import added_parameter_count, parameter_count
    from quantdiff.models.names import resolve_models
    from quantdiff.models.source import describe_source, model_source
    from quantdiff.models.structure import attention_kind
    from quantdiff.report.console import table_console

    target = resolve_device(device, "--device")  # before any loading: a bad name costs nothing
    table = Table(title="quantdiff models")
    for column in ("model", "architecture", "attention", "layers", "heads (kv)", "parameters", "λ / gate / sink", "device", "source"):
        table.add_column(column)
    for name, path in resolve_models(models, revision):
        model = load(path, device=target, trust_remote_code=trust_remote_code)
        tap_list = taps(model)
        cfg = model.config
        kind = ATTENTION_LABELS[attention_kind(model)]
        table.add_row(
            name, type(model).__name__, kind, str(len(tap_list)),
            f"{cfg.num_attention_heads} ({getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads})",
            f"{parameter_count(model):,}", f"{added_parameter_count(model):,}", str(next(model.parameters()).device),
            describe_source(model_source(path)) or "safetensors",
        )
    table_console(table).print(table)
