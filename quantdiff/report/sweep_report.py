"""The accuracy sweep's cells as a rich table and as a Figure-8-style chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rich.table import Table
from rich.text import Text

from quantdiff.core.atomic import atomic_file
from quantdiff.core.owned import plot_metadata
from quantdiff.eval.cell_damage import SHOWN
from quantdiff.eval.sweep import Cell, cell_label
from quantdiff.report.numbers import number

METRIC_DECIMALS = 4  # metrics are fractions and losses: fixed decimals keep the column aligned


def sweep_table(cells: Sequence[Cell], metrics: Sequence[str], headline: str, title: str | None = None) -> Table:
    """A rich table, one row per cell, with the `headline` metric's change from the model's reference, and where any
    cell carries its damage (`eval.cell_damage`), its mean KL divergence (4 significant digits: it spans decades)
    and same-top-1 rate."""
    reference = {c.model: c.metrics.get(headline) for c in cells if c.is_reference}
    table = Table(title=title)
    table.add_column("model")
    table.add_column("quantization")
    for metric in metrics:
        table.add_column(metric, justify="right")
    table.add_column(f"Δ {headline}", justify="right")
    damaged = any(c.damage is not None for c in cells)
    for _, title in SHOWN if damaged else ():
        table.add_column(title, justify="right")
    flagged = any(not c.valid for c in cells)
    if flagged:
        table.add_column("invalid")
    for c in cells:
        values = [number(c.metrics.get(m), decimals=METRIC_DECIMALS) for m in metrics]
        base, value = reference.get(c.model), c.metrics.get(headline)
        delta = "" if c.is_reference or base is None or value is None else f"{value - base:+.4f}"
        # Text, not markup: a label's "[tensor, non-causal]" would be read as a style tag and vanish.
        damage = [] if not damaged else ["" if c.damage is None else number(c.damage.get(key), decimals=None if key == "kld_mean" else METRIC_DECIMALS)
                                         for key, _ in SHOWN]
        table.add_row(Text(c.model), Text(cell_label(c)), *values, delta, *damage, *([invalid_reason(c)] if flagged else []))
    return table


def invalid_reason(cell: Cell) -> str:
    """Why a cell has no metrics ("" for a valid cell)."""
    from quantdiff.stats.nonfinite import NonFinite

    return "" if cell.valid else NonFinite("scored positions' logits", cell.nonfinite_logits).text()


@dataclass(frozen=True)
class SweepPoint:
    """One cell of the chart: a model's headline value at (method, site, bits), bits None for the unquantized
    reference; low/high: its 95% interval across seeds (None for one seed)."""

    model: str
    method: str | None
    site: str | None
    bits: int | None
    value: float | None  # None: an invalid cell (non-finite logits), a gap in its line
    low: float | None = None
    high: float | None = None


def cell_points(cells: Sequence[Cell], metric: str) -> list[SweepPoint]:
    """The chart's points of one seed's cells (no intervals)."""
    return [SweepPoint(c.model, c.method, c.site, c.bits, c.metrics.get(metric) if c.valid else None) for c in cells]


METHOD_STYLES = ("-", "--", "-.", ":")
METHOD_MARKERS = "osD^v"

# Error bars across seeds are each arm's own spread; the tests against the reference are paired by seed, so
# their intervals (report.md) can exclude zero where these bars overlap.
UNPAIRED_CAPTION = ("Error bars: each arm's own 95% interval across seeds, unpaired. They do not test differences between "
                    "arms: the paired comparisons with the reference, seed by seed, are in report.md.")


def plot_sweep(points: Sequence[SweepPoint], path: str | Path, metric: str, title: str, force: bool = False) -> None:
    """Write `sweep_figure` to `path` (its format from the suffix). It replaces an existing file only if
    quantdiff wrote it (its Creator metadata), or with `force`."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(points, metric, title)
    with atomic_file(path, force, "--plot") as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", dpi=150, bbox_inches="tight", metadata=plot_metadata())
    plt.close(fig)


def sweep_figure(points: Sequence[SweepPoint], metric: str, title: str):
    """Figure-8-style small multiples: a panel per site, `metric` against bits (widest first); models are
    colours, methods line styles, error bars the 95% interval across seeds; each model's unquantized reference
    is a dotted line in its colour; the legend sits outside the panels so no point is hidden."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    quantized = [p for p in points if p.bits is not None]
    sites = list(dict.fromkeys(p.site for p in quantized)) or [None]
    bits = sorted({p.bits for p in quantized}, reverse=True)
    models = list(dict.fromkeys(p.model for p in points))
    methods = list(dict.fromkeys(p.method for p in quantized))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {model: colours[i % len(colours)] for i, model in enumerate(models)}
    style = {method: (METHOD_STYLES[i % len(METHOD_STYLES)], METHOD_MARKERS[i % len(METHOD_MARKERS)]) for i, method in enumerate(methods)}
    width = 0.5 / max(1, len(models) * len(methods))  # the lines of one bit width side by side, not on top of each other
    fig, axes = plt.subplots(1, len(sites), figsize=(3.4 * len(sites), 3.6), sharey=True, squeeze=False)
    for ax, site in zip(axes[0], sites):
        for m, model in enumerate(models):
            for reference in (p for p in points if p.model == model and p.bits is None and p.value is not None):
                ax.axhline(reference.value, color=colour[model], linestyle=":", linewidth=1)
            for k, method in enumerate(methods):
                line = sorted((p for p in quantized if (p.model, p.site, p.method) == (model, site, method) and p.value is not None), key=lambda p: -p.bits)
                if not line:
                    continue
                offset = (m * len(methods) + k - (len(models) * len(methods) - 1) / 2) * width
                xs = [bits.index(p.bits) + offset for p in line]
                ys = [p.value for p in line]
                errors = [[p.value - p.low if p.low is not None else 0.0 for p in line], [p.high - p.value if p.high is not None else 0.0 for p in line]]
                linestyle, marker = style[method]
                ax.errorbar(xs, ys, yerr=errors, color=colour[model], linestyle=linestyle, marker=marker, markersize=4, capsize=2, linewidth=1.2, zorder=3)
        ax.set_xticks(range(len(bits)), [str(b) for b in bits])
        ax.set(xlabel="bits", title=f"site {site}")
        ax.grid(alpha=0.3)
    if all(p.value >= 0 for p in points if p.value is not None) and any(p.value is not None for p in points):
        # the full range from 0 (lower only where an interval reaches below it): a cut near the data makes small losses look large
        axes[0][0].set_ylim(bottom=min([0.0, *(p.low for p in points if p.low is not None)]))
    axes[0][0].set_ylabel(metric)
    handles = [Line2D([], [], color=colour[m], linewidth=2, label=m) for m in models]
    handles += [Line2D([], [], color="black", linestyle=style[k][0], marker=style[k][1], label=str(k)) for k in methods]
    handles.append(Line2D([], [], color="grey", linestyle=":", label="unquantized"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if any(p.low is not None for p in quantized):
        fig.text(0.0, -0.04, UNPAIRED_CAPTION, ha="left", va="top", fontsize=8)
    return fig
