"""The accuracy sweep (the paper's Figure 8, plus LLM.int8): one task, every (method, bits, site) cell per model.

Each model gets an unquantized reference cell (method, bits and site all null) and one cell per supported
configuration. A (method, site) pair the quantizers do not support — LLM.int8 on the logits site, whose
outlier decomposition is defined for matmul operands — is skipped with its reason, never silently remapped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.table import Table
from torch import nn

from quantdiff.core.atomic import atomic_file
from quantdiff.core.errors import ConfigError
from quantdiff.quant.numerics import check_bits
from quantdiff.quant.sites import METHOD_NAMES, SITE_NAMES, QuantConfig, parse_config, quantized
from quantdiff.eval.tasks.registry import Task

REFERENCE = "reference"


@dataclass(frozen=True)
class Cell:
    model: str
    task: str
    method: str | None  # None: the unquantized reference
    bits: int | None
    site: str | None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def is_reference(self) -> bool:
        return self.method is None

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, "method": self.method, "bits": self.bits, "site": self.site, **self.metrics}


@dataclass(frozen=True)
class SweepPlan:
    configs: list[QuantConfig]
    skipped: list[str]  # one line per unsupported (method, site) pair


def split_names(text: str, what: str) -> list[str]:
    """"a,b" -> ["a", "b"]; an empty list is a ConfigError."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"no {what} given")
    return names


def parse_bits(text: str) -> list[int]:
    """"16,8,6,4" -> [16, 8, 6, 4]; anything but integers from 2 to 16 is a ConfigError."""
    out = []
    for part in split_names(text, "bits"):
        if not part.lstrip("+-").isdigit():
            raise ConfigError(f"bits must be integers, got {part!r}")
        out.append(check_bits(int(part)))
    return out


def plan_sweep(methods: Sequence[str], bits: Sequence[int], sites: Sequence[str]) -> SweepPlan:
    """Every supported (method, site, bits) configuration; unknown names are errors, unsupported pairs skipped."""
    for name in methods:
        if name not in METHOD_NAMES:
            raise ConfigError(f"unknown quantization method {name!r} (choose from {', '.join(METHOD_NAMES)})")
    for name in sites:
        if name not in SITE_NAMES:
            raise ConfigError(f"unknown quantization site {name!r} (choose from {', '.join(SITE_NAMES)})")
    for b in bits:
        check_bits(b)
    configs, skipped = [], []
    for method in dict.fromkeys(methods):
        for site in dict.fromkeys(sites):
            try:
                configs.extend(parse_config(method, b, site) for b in dict.fromkeys(bits))
            except ConfigError as exc:  # names and bits are valid, so this pair is unsupported
                skipped.append(f"{method} at site {site}: {exc}")
    if not configs:
        raise ConfigError("no supported quantization configuration: " + "; ".join(skipped))
    return SweepPlan(configs, skipped)


def describe(config: QuantConfig | None) -> tuple[str | None, int | None, str | None]:
    """(method, bits, site) names of a configuration, all None for the reference."""
    if config is None:
        return None, None, None
    data = config.to_dict()
    return data["method"]["name"], data["method"]["bits"], data["site"]["name"]


def label(method: str | None, bits: int | None, site: str | None) -> str:
    return REFERENCE if method is None else f"{method} {bits}b @{site}"


def cell_label(cell: Cell) -> str:
    return label(cell.method, cell.bits, cell.site)


CellProgress = Callable[[str, int], Callable[[float], None]]  # (label, total units) -> advance(n)


def run_cell(
    model: nn.Module, name: str, task: Task, prepared: Any, config: QuantConfig | None, progress: CellProgress | None = None, allow_partial: bool = False
) -> Cell:
    advance = progress(f"{name} · {label(*describe(config))}", len(prepared)) if progress is not None else None
    with quantized(model, config, allow_partial):
        metrics = task.evaluate(model, prepared, advance)
    return Cell(name, task.name, *describe(config), metrics)


def run_model_cells(
    name: str,
    model: nn.Module,
    task: Task,
    prepared: Any,
    configs: Sequence[QuantConfig],
    progress: CellProgress | None = None,
    include_reference: bool = True,
    allow_partial: bool = False,
) -> list[Cell]:
    """One model's cells on data already prepared for its tokenizer: the reference first, then each config."""
    return [run_cell(model, name, task, prepared, config, progress, allow_partial) for config in ([None] if include_reference else []) + list(configs)]


def run_sweep(
    models: dict[str, tuple[nn.Module, Any]],
    task: Task,
    configs: Sequence[QuantConfig],
    limit: int | None = None,
    progress: CellProgress | None = None,
    include_reference: bool = True,
) -> list[Cell]:
    """{name: (model, tokenizer)} -> the unquantized reference cell, then one cell per config, model by model."""
    cells = []
    for name, (model, tokenizer) in models.items():
        prepared = task.prepare(tokenizer, limit)
        cells.extend(run_model_cells(name, model, task, prepared, configs, progress, include_reference))
    return cells


def cells_to_json(cells: Sequence[Cell]) -> dict[str, Any]:
    return {"cells": [cell.to_dict() for cell in cells]}


def cells_from_json(data: dict[str, Any]) -> list[Cell]:
    keys = ("model", "task", "method", "bits", "site")
    return [Cell(*(d[k] for k in keys), {k: v for k, v in d.items() if k not in keys}) for d in data["cells"]]



def write_json(cells: Sequence[Cell], path: str | Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(cells_to_json(cells), indent=2) + "\n", encoding="utf-8")


def _format(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def sweep_table(cells: Sequence[Cell], metrics: Sequence[str], title: str | None = None) -> Table:
    """A rich table, one row per cell, with the headline metric's change from the model's reference."""
    headline = metrics[0]
    reference = {c.model: c.metrics.get(headline) for c in cells if c.is_reference}
    table = Table(title=title)
    table.add_column("model")
    table.add_column("quantization")
    for metric in metrics:
        table.add_column(metric, justify="right")
    table.add_column(f"Δ {headline}", justify="right")
    for c in cells:
        values = [_format(c.metrics[m]) if m in c.metrics else "–" for m in metrics]
        base = reference.get(c.model)
        delta = "" if c.is_reference or base is None else f"{c.metrics[headline] - base:+.4f}"
        table.add_row(c.model, cell_label(c), *values, delta)
    return table


def plot_sweep(cells: Sequence[Cell], path: str | Path, metric: str) -> None:
    """Figure-8-style chart: `metric` vs bits (widest first), one line per model × method × site, each model's
    unquantized reference as a dashed line in the model's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = sorted({c.bits for c in cells if c.bits is not None}, reverse=True)
    x_of = {b: i for i, b in enumerate(bits)}  # evenly spaced, as the paper's x axis
    models = list(dict.fromkeys(c.model for c in cells))
    lines = list(dict.fromkeys((c.method, c.site) for c in cells if not c.is_reference))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^vP*X"
    styles = ["-", "-.", ":", (0, (5, 1))]  # "--" is the reference's; lines that coincide stay distinguishable
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, model in enumerate(models):
        colour = colours[m % len(colours)]
        for reference in (c for c in cells if c.model == model and c.is_reference):
            ax.axhline(reference.metrics[metric], color=colour, linestyle="--", linewidth=1, label=f"{model} unquantized")
        for n, (method, site) in enumerate(lines):
            points = sorted((x_of[c.bits], c.metrics[metric]) for c in cells if c.model == model and (c.method, c.site) == (method, site))
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=colour, marker=markers[n % len(markers)], linestyle=styles[n % len(styles)], label=f"{model} {method} @{site}")
    if all(c.metrics[metric] >= 0 for c in cells):
        ax.set_ylim(bottom=max(ax.get_ylim()[0], 0.0))  # no negative ticks for accuracies and losses
    ax.set_xticks(range(len(bits)), [str(b) for b in bits])
    ax.set_xlabel("bits")
    ax.set_ylabel(metric)
    ax.set_title(f"{cells[0].task}: {metric} vs bits")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", dpi=150)
    plt.close(fig)
