"""Outlier emergence over training: the `outliers` series of every model's train_log.json, plotted and tabled.

`quantdiff train` measures every arm on the same held-out sequences at every eval step (train.emergence);
`across_seeds.curves` turns the series of one or more seeds into curves (a mean and, over several seeds, a 95%
band); this module draws them (`emergence.png`: a panel per quantity, a line per arm, the band shaded) and
writes report.md's "Emergence" section: one small table per quantity (rows: eval steps, columns: arms).
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.core.atomic import atomic_file
from quantdiff.core.owned import plot_metadata
from quantdiff.report.markdown import md_table


def read_series(dirs: dict[str, Path]) -> dict[str, list[dict]]:
    """{arm: outlier entries} from each model directory's train_log.json; arms without a series are left out."""
    series = {}
    for kind, directory in dirs.items():
        log = Path(directory) / "train_log.json"
        entries = json.loads(log.read_text()).get("outliers") if log.is_file() else None
        if entries:
            series[kind] = entries
    return series


# Sink panels are shares (of heads, of attention): a fixed 0-1 axis, so a drift of a percent cannot look like a
# sink forming; widened only where a value or a t band leaves it (Diff's combined map dips below 0, DIFF V2's can
# exceed 1, a t band can pass 0), never clipped.
SHARE_RANGE = (0.0, 1.0)
SHARE_NOTE = "a share: 0–1 fixed, widened only to fit"


def share_limits(values: list[float], margin: float = 0.02) -> tuple[float, float]:
    """The y-limits of a sink panel: SHARE_RANGE, widened to every plotted value and band edge."""
    return min([SHARE_RANGE[0], *values]) - margin, max([SHARE_RANGE[1], *values]) + margin


def plot_emergence(curves: dict[str, dict], path: Path) -> Path:
    """`emergence_figure` as one PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = emergence_figure(curves)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata=plot_metadata())
    plt.close(fig)
    return path


def emergence_figure(curves: dict[str, dict]):
    """A panel per quantity, a line per arm (x: training tokens per model), its band where there is one; sink
    panels on a fixed 0–1 axis (`share_limits`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), squeeze=False)
    for ax, (quantity, panel) in zip(axes[0], curves.items()):
        plotted = []
        for arm, curve in panel["arms"].items():
            points = [(t, m, lo, hi) for t, m, lo, hi in zip(curve["tokens"], curve["mean"], curve["low"], curve["high"]) if m is not None]
            line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=arm)
            banded = [p for p in points if p[2] is not None]
            plotted += [p[1] for p in points] + [edge for p in banded for edge in (p[2], p[3])]
            if banded:
                ax.fill_between([p[0] for p in banded], [p[2] for p in banded], [p[3] for p in banded], color=line.get_color(), alpha=0.18, linewidth=0)
        ax.set(xlabel="training tokens per model", title=panel["label"])
        ax.xaxis.set_major_formatter(EngFormatter())  # 400k, not 400000: six-digit ticks run into each other
        if quantity.startswith("sink/"):
            ax.set_ylim(*share_limits(plotted))
            ax.set_ylabel(SHARE_NOTE, fontsize=8)
            ax.axhline(0.0, color="grey", linewidth=0.5)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def _cell(curve: dict, index: int) -> str:
    mean, low, high = curve["mean"][index], curve["low"][index], curve["high"][index]
    if mean is None:
        return "–"
    return f"{mean:.3g}" if low is None else f"{mean:.3g} [{low:.3g}, {high:.3g}]"


def emergence_markdown(curves: dict[str, dict], seeds: int = 1) -> str:
    """One table per quantity: a row per eval step, a column per arm (over several seeds: mean [95% interval])."""
    if not curves:
        return "Not tracked: these models' train logs carry no `outliers` series (trained before emergence tracking)."
    note = (
        "Every model measured at every eval step on the same held-out sequences (BOS first when the recipe trains "
        "with one). Sink score: share of heads (Diff: differential heads, maps combined as (A1 − λ·A2)/(1 − λ)) "
        "whose mean attention on the first position exceeds ε = 0.3."
    )
    if seeds > 1:
        note += f" Each cell: the mean over {seeds} seeds [95% t interval]; per-seed values in seeds.json (`emergence`)."
    tables = []
    for panel in curves.values():
        arms = list(panel["arms"])
        steps = sorted({(s, t) for curve in panel["arms"].values() for s, t in zip(curve["steps"], curve["tokens"])})
        rows = []
        for step, tokens in steps:
            cells = []
            for arm in arms:
                curve = panel["arms"][arm]
                cells.append(_cell(curve, curve["steps"].index(step)) if step in curve["steps"] else "–")
            rows.append([str(step), f"{tokens:,}", *cells])
        tables.append(f"**{panel['label']}**\n\n" + md_table(["step", "tokens", *arms], rows))
    return note + "\n\n" + "\n\n".join(tables) + "\n\n![emergence.png](emergence.png)"
