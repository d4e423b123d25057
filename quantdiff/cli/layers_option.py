"""`--layers`: quantize only some decoder layers (`QuantConfig.layers`), checked against each model before it loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.core.errors import ConfigError

LayersOpt = Annotated[Optional[str], typer.Option("--layers", help="Comma-separated decoder layers (0-based) to quantize at the site; default every layer. An index past a model's last layer is an error.")]


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """'0,3,29' -> (0, 3, 29); None stays None (every layer)."""
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ConfigError(f"--layers must be comma-separated decoder-layer indices (0, 1, …), got {text!r}")
    return tuple(int(part) for part in parts)


def check_layers(layers: tuple[int, ...] | None, specs: list[tuple[str, Path]], trust_remote_code: bool = False) -> None:
    """Every index against every model's layer count, from its config (before any weights load)."""
    from quantdiff.models.loading import load_config

    for name, path in specs if layers else []:
        count = getattr(load_config(path, trust_remote_code), "num_hidden_layers", None)
        wrong = [layer for layer in layers if count is not None and layer >= count]
        if wrong:
            raise ConfigError(f"--layers: layer {wrong[0]} is out of range: {name} has {count} decoder layers (0–{count - 1})")
