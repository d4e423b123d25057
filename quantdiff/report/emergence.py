"""Outlier emergence over training: the `outliers` series of every model's train_log.json, plotted and tabled.

`quantdiff train` measures every arm on the same held-out sequences at every eval step (train.emergence);
this module turns the series into report.md's "Emergence" section and `emergence.png` (Top-1 |attention
logit|, Top-1 |hidden state| and the attention-sink score against training tokens, standard vs diff).
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.core.owned import plot_metadata

PANELS = (
    ("attention_logits", "top1", "Top-1 attention logit (abs)"),
    ("hidden_states", "top1", "Top-1 hidden state (abs)"),
    ("hidden_states", "first_position_top1", "largest hidden state at position 0 (abs)"),
    ("sink", "score", "sink score (share of heads > ε)"),
    ("sink", "mean", "mean attention on position 0"),
)


def read_series(dirs: dict[str, Path]) -> dict[str, list[dict]]:
    """{kind: outlier entries} from each model directory's train_log.json; kinds without a series are left out."""
    series = {}
    for kind, directory in dirs.items():
        log = Path(directory) / "train_log.json"
        entries = json.loads(log.read_text()).get("outliers") if log.is_file() else None
        if entries:
            series[kind] = entries
    return series


def _value(entry: dict, block: str, key: str) -> float | None:
    return entry.get(block, {}).get(key)


def _panels(series: dict[str, list[dict]]) -> list[tuple[str, str, str]]:
    """The PANELS some entry has a value for (logs written before a quantity was tracked lack it)."""
    return [p for p in PANELS if any(_value(e, p[0], p[1]) is not None for entries in series.values() for e in entries)]


def plot_emergence(series: dict[str, list[dict]], path: Path) -> Path:
    """One PNG, a panel per tracked PANELS entry, a line per model (x: training tokens per model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(series)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (block, key, label) in zip(axes, panels):
        for kind, entries in series.items():
            points = [(e["tokens"], _value(e, block, key)) for e in entries if _value(e, block, key) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=kind)
        ax.set(xlabel="training tokens per model", title=label)
        if (block, key) == ("sink", "score"):
            ax.set_ylim(-0.02, 1.02)  # a share of heads: the whole range, so "no sink" reads as a flat zero
        elif block == "sink":
            ax.axhline(0.0, color="grey", linewidth=0.5)  # Diff's combined mass can dip below 0
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=plot_metadata())
    plt.close(fig)
    return path


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def emergence_markdown(series: dict[str, list[dict]]) -> str:
    """A table with one row per eval step: each panel's value for each kind side by side."""
    if not series:
        return "Not tracked: this pair's train logs carry no `outliers` series (it was trained before emergence tracking)."
    kinds = list(series)
    steps = sorted({e["step"] for entries in series.values() for e in entries})
    by_step = {kind: {e["step"]: e for e in entries} for kind, entries in series.items()}
    panels = _panels(series)
    header = ["step", "tokens"] + [f"{label} — {kind}" for _, _, label in panels for kind in kinds]
    rows = []
    for step in steps:
        tokens = next(by_step[k][step]["tokens"] for k in kinds if step in by_step[k])
        cells = [_fmt(_value(by_step[k].get(step, {}), block, key)) for block, key, _ in panels for k in kinds]
        rows.append([str(step), f"{tokens:,}", *cells])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    note = (
        "Every model measured at every eval step on the same held-out sequences (BOS first when the recipe trains "
        "with one). Sink score: share of heads (Diff: differential heads, maps combined as (A1 − λ·A2)/(1 − λ)) "
        "whose mean attention on the first position exceeds ε = 0.3."
    )
    return note + "\n\n" + "\n".join(lines) + "\n\n![emergence.png](emergence.png)"
