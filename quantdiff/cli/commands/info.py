"""`quantdiff info MODEL`: what a model is, as quantdiff sees it (architecture, sizes, attention kind)."""

from __future__ import annotations

from typing import Annotated

import typer


def info(
    models: Annotated[list[str], typer.Argument(help="Model directories or built-in names (e.g. tiny).")],
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto (CUDA when present).")] = "auto",
) -> None:
    """Load each model on the quantdiff backend and print its architecture and parameter counts."""
    from rich.table import Table

    from quantdiff.attention.backend import taps
    from quantdiff.core.device import resolve_device
    from quantdiff.models.loading import load
    from quantdiff.models.pairs import lambda_parameter_count, parameter_count
    from quantdiff.models.names import resolve
    from quantdiff.report.console import table_console

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-model "Loading weights" bar would bury the one table
    target = resolve_device(device, "--device")  # before any loading: a bad name costs nothing
    table = Table(title="quantdiff models")
    for column in ("model", "architecture", "attention", "layers", "heads (kv)", "parameters", "λ parameters", "device"):
        table.add_column(column)
    for path in [p for name in models for p in resolve(name)]:
        model = load(path, device=target)
        tap_list = taps(model)
        cfg = model.config
        kind = "differential" if tap_list[0].differential else "standard"
        table.add_row(
            str(path), type(model).__name__, kind, str(len(tap_list)),
            f"{cfg.num_attention_heads} ({getattr(cfg, 'num_key_value_heads', None) or cfg.num_attention_heads})",
            f"{parameter_count(model):,}", f"{lambda_parameter_count(model):,}", str(next(model.parameters()).device),
        )
    table_console(table).print(table)
