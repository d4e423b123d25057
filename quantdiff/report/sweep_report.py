"""The accuracy sweep's cells as a rich table and as a Figure-8-style chart."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.table import Table

from quantdiff.core.atomic import atomic_file
from quantdiff.core.owned import plot_metadata
from quantdiff.eval.sweep import Cell, cell_label
from quantdiff.report.numbers import number

METRIC_DECIMALS = 4  # metrics are fractions and losses: fixed decimals keep the column aligned


def sweep_table(cells: Sequence[Cell], metrics: Sequence[str], headline: str, title: str | None = None) -> Table:
    """A rich table, one row per cell, with the `headline` metric's change from the model's reference."""
    reference = {c.model: c.metrics.get(headline) for c in cells if c.is_reference}
    table = Table(title=title)
    table.add_column("model")
    table.add_column("quantization")
    for metric in metrics:
        table.add_column(metric, justify="right")
    table.add_column(f"Δ {headline}", justify="right")
    flagged = any(not c.valid for c in cells)
    if flagged:
        table.add_column("invalid")
    for c in cells:
        values = [number(c.metrics.get(m), decimals=METRIC_DECIMALS) for m in metrics]
        base, value = reference.get(c.model), c.metrics.get(headline)
        delta = "" if c.is_reference or base is None or value is None else f"{value - base:+.4f}"
        table.add_row(c.model, cell_label(c), *values, delta, *([invalid_reason(c)] if flagged else []))
    return table


def invalid_reason(cell: Cell) -> str:
    """Why a cell has no metrics ("" for a valid cell)."""
    return "" if cell.valid else f"non-finite logits at {cell.nonfinite_logits:,} scored positions"


def plot_sweep(cells: Sequence[Cell], path: str | Path, metric: str, force: bool = False) -> None:
    """Figure-8-style chart: `metric` (the task's headline) vs bits (widest first), one line per model × method
    × site, each model's unquantized reference as a dashed line in the model's colour. It replaces an existing
    file only if quantdiff wrote it (its Creator metadata), or with `force`."""
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
        for reference in (c for c in cells if c.model == model and c.is_reference and c.valid):
            ax.axhline(reference.metrics[metric], color=colour, linestyle="--", linewidth=1, label=f"{model} unquantized")
        for n, (method, site) in enumerate(lines):
            # An invalid cell is a gap in its line, not a point.
            points = sorted((x_of[c.bits], c.metrics[metric]) for c in cells if c.model == model and (c.method, c.site) == (method, site) and c.valid)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=colour, marker=markers[n % len(markers)], linestyle=styles[n % len(styles)], label=f"{model} {method} @{site}")
    if all(c.metrics[metric] >= 0 for c in cells if c.valid):
        ax.set_ylim(bottom=max(ax.get_ylim()[0], 0.0))  # no negative ticks for accuracies and losses
    ax.set_xticks(range(len(bits)), [str(b) for b in bits])
    ax.set_xlabel("bits")
    ax.set_ylabel(metric)
    ax.set_title(f"{cells[0].task}: {metric} vs bits")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # every cell invalid: an empty chart, without matplotlib's warning
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path, force, "--plot") as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", dpi=150, metadata=plot_metadata())
    plt.close(fig)
