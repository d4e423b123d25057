"""Reporting for `quantdiff stats`: the JSON document, rich tables in the paper's Table 5 layout, PNG plots.

JSON schema (`schema` "quantdiff.stats", `version` 1):

    {"schema": "quantdiff.stats", "version": 1,
     "quantile_relative_error": 0.0009765625,      # every quantile/median is within this of exact
     "quantile_definition": "...",
     "data": {"source", "tokens", "seq_len", "batch_size", "k"},
     "models": [                                    # one entry per model, in command-line order
       {"name", "path", "kind": "standard"|"diff", "layers", "heads", "hidden_size", "tokens", "sequences",
        "attention_logits": BLOCK + {"per_layer": [BLOCK], "per_head": [[BLOCK]], "per_map": {"1": BLOCK, "2": BLOCK}},
        "hidden_states": BLOCK + {"per_layer": [BLOCK], "channel_absmax": [[float]] (layer × channel),
                                  "outlier_features": {"count", "channels", "threshold", "min_layer_fraction",
                                                       "min_position_fraction"}},
        "sinks": {"epsilon", "per_head": [[mass]] (layer × head: mean attention on position 0 over valid query rows),
                  "mean", "max", "score" (share of heads above epsilon), "heads_scored",
                  Diff only: "per_map": {"1", "2"}: [[mass]], "combined": [[(A1 − λ·A2)/(1 − λ)]], "lambdas"}}]}
    BLOCK = {"count", "nonfinite": {"nan", "inf"}, "max", "median", "quantiles": {"0.5": …, "0.99": …},
             "mean", "std", "kurtosis", "topk": [{"value", "layer", "head", "sequence", "query", "key", "map"?}
                                                 | {"value", "layer", "sequence", "position", "channel"}]}

`topk` is sorted by value descending (ties: location ascending); per_head blocks keep the top 10; `per_map`
exists for differential models only (map 1 = heads 0…H/2−1, map 2 = the rest).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import quantdiff.report.paper as paper
from quantdiff.core.atomic import atomic_file
from quantdiff.report.markdown import ACTIVATIONS, table5_row
from quantdiff.stats.engine import QUANTILE_RELATIVE_ERROR, ModelStats, bin_midpoints

SCHEMA = "quantdiff.stats"
SCHEMA_VERSION = 1
QUANTILE_DEFINITION = (
    "quantile q of |x| is the value of rank floor(q*(count-1)) in ascending order (torch.quantile 'lower'), "
    "reported as the midpoint of its log-spaced histogram bin"
)


def model_entry(name: str, path: str, stats: ModelStats) -> dict:
    return {
        "name": name,
        "path": path,
        "kind": "standard" if stats.head_maps is None else "diff",
        "layers": stats.layers,
        "heads": stats.heads,
        "hidden_size": stats.hidden_size,
        "tokens": stats.tokens,
        "sequences": stats.sequences,
        **stats.summary(),
        **({"sinks": stats.sinks.summary()} if getattr(stats, "sinks", None) is not None else {}),
    }


def document(entries: list[dict], data: dict) -> dict:
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "quantile_relative_error": QUANTILE_RELATIVE_ERROR,
        "quantile_definition": QUANTILE_DEFINITION,
        "data": data,
        "models": entries,
    }


def table5_values(stats: ModelStats | dict) -> dict[str, dict[str, float | None]]:
    """{activation: {"Top-1": …, "Top-2", "Top-3", "Top-10", "Top-100", "Median"}} of ModelStats or a model entry."""
    entry = stats.summary() if isinstance(stats, ModelStats) else stats
    return {key: dict(zip(paper.TABLE5_COLUMNS, table5_row(entry[key]))) for key in ACTIVATIONS}


def write_json(path: str | Path, doc: dict) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"


def render(doc: dict, console, per_layer: bool = False) -> None:
    """Table 5 layout: rows = activation × model (+ ratio rows first ÷ other), columns Top-1 … Median."""
    from rich.table import Table

    models = doc["models"]
    bound = f"median within ±{QUANTILE_RELATIVE_ERROR:.3%} (relative) of exact"
    table = Table(title=f"Largest |activation| values — {doc['data']['tokens']:,} tokens per model", caption=bound)
    for column in ("activation", "model", *paper.TABLE5_COLUMNS):
        label_column = column in ("activation", "model")
        table.add_column(column, justify="left" if label_column else "right", no_wrap=label_column)
    for key, label in ACTIVATIONS.items():
        rows = [table5_row(m[key]) for m in models]
        for i, (model, row) in enumerate(zip(models, rows)):
            table.add_row(label if i == 0 else "", model["name"], *map(_fmt, row))
        for model, row in list(zip(models, rows))[1:]:
            table.add_row("", f"{models[0]['name']}÷{model['name']}", *(_ratio(a, b) for a, b in zip(rows[0], row)), style="dim")
        table.add_section()
    console.print(table)
    for model in models:
        features = model["hidden_states"]["outlier_features"]
        console.print(f"{model['name']}: {features['count']} LLM.int8 outlier feature(s) in hidden states"
                      + (f" (channels {features['channels'][:10]})" if features["count"] else ""))
        if "sinks" in model:
            console.print(sink_line(model["name"], model["sinks"]))
    if per_layer:
        for key, label in ACTIVATIONS.items():
            render_per_layer(models, key, label, console)


def sink_line(name: str, sinks: dict) -> str:
    heads = "differential heads (maps combined)" if "combined" in sinks else "heads"
    return (
        f"{name}: attention sinks: {sinks['score']:.0%} of {sinks['heads_scored']} {heads} put more than "
        f"{sinks['epsilon']:g} of their attention on the first position (mean {sinks['mean']:.3f}, max {sinks['max']:.3f})"
    )


def render_per_layer(models: list[dict], key: str, label: str, console) -> None:
    from rich.table import Table

    table = Table(title=f"{label}: per layer")
    table.add_column("layer", justify="right")
    for model in models:
        table.add_column(f"{model['name']} Top-1", justify="right")
        table.add_column(f"{model['name']} Median", justify="right")
    if len(models) > 1:
        table.add_column("Top-1 ratio", justify="right")
    for layer in range(max(m["layers"] for m in models)):
        blocks = [m[key]["per_layer"][layer] if layer < m["layers"] else None for m in models]
        cells = []
        for block in blocks:
            cells += [_fmt(block and block["max"]), _fmt(block and block["median"])]
        if len(models) > 1:
            cells.append(_ratio(blocks[0] and blocks[0]["max"], blocks[1] and blocks[1]["max"]))
        table.add_row(str(layer), *cells)
    console.print(table)


def write_plots(directory: str | Path, named: Sequence[tuple[str, ModelStats]]) -> list[Path]:
    """Per-layer Top-1 bars (one PNG per activation, a bar per model) and |x| CCDFs (one PNG per activation).

    Rendered into a temporary directory first, then moved into `directory`: no partial set on failure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        from quantdiff.core.errors import ConfigError

        raise ConfigError(f"--plot path exists and is not a directory: {directory}")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".plots.tmp-", dir=directory))
    try:
        names = []
        for key, label in ACTIVATIONS.items():
            fig, ax = plt.subplots(figsize=(7, 4))
            width = 0.8 / len(named)
            for i, (name, stats) in enumerate(named):
                groups = stats.logits if key == "attention_logits" else stats.hidden
                per_group = groups.top_values[:, 0].cpu().clamp(min=0)
                per_layer = per_group.view(stats.layers, -1).amax(dim=1)
                ax.bar([l - 0.4 + (i + 0.5) * width for l in range(stats.layers)], per_layer.tolist(), width, label=name)
            ax.set(xlabel="layer", ylabel="max |x| (Top-1)", title=f"{label}: Top-1 per layer")
            ax.set_xticks(range(max(stats.layers for _, stats in named)))
            ax.legend()
            names.append(_save(fig, tmp / f"top1_per_layer_{key}.png", plt))
            fig, ax = plt.subplots(figsize=(7, 4))
            mids = bin_midpoints()
            for name, stats in named:
                groups = stats.logits if key == "attention_logits" else stats.hidden
                hist = groups.hist.sum(dim=0).cpu().double()
                total = float(hist.sum())
                if total == 0:
                    continue
                ccdf = 1.0 - hist.cumsum(0) / total  # P(|x| > bin)
                keep = (hist > 0) & (ccdf > 0) & (mids > 0)
                ax.loglog(mids[keep].tolist(), ccdf[keep].tolist(), label=name)
            ax.set(xlabel="|x|", ylabel="P(|X| > x)", title=f"{label}: |x| CCDF")
            ax.legend()
            names.append(_save(fig, tmp / f"ccdf_{key}.png", plt))
        out = []
        for path in names:
            os.replace(path, directory / path.name)
            out.append(directory / path.name)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
