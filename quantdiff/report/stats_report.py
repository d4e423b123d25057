"""Reporting for `quantdiff stats`: rich tables in the paper's Table 5 layout and PNG plots (the JSON document
itself is `stats.schema`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

import quantdiff.core.atomic as atomic
from quantdiff.core.owned import plot_metadata
import quantdiff.report.paper as paper
from quantdiff.models.bos import describe_bos
from quantdiff.report.markdown import ACTIVATIONS, table5_row
from quantdiff.report.numbers import number, ratio
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR, bin_midpoints
from quantdiff.stats.model_stats import ModelStats


def table5_values(stats: ModelStats | dict) -> dict[str, dict[str, float | None]]:
    """{activation: {"Top-1": …, "Top-2", "Top-3", "Top-10", "Top-100", "Median"}} of ModelStats or a model entry."""
    entry = stats.summary() if isinstance(stats, ModelStats) else stats
    return {key: dict(zip(paper.TABLE5_COLUMNS, table5_row(entry[key]))) for key in ACTIVATIONS}


def nonfinite_share(block: dict) -> tuple[int, int, float]:
    """(NaN count, Inf count, their share of all values seen) of one activation block; statistics exclude them."""
    nan, inf = block["nonfinite"]["nan"], block["nonfinite"]["inf"]
    total = block["count"] + nan + inf
    return nan, inf, (nan + inf) / total if total else 0.0


def _nonfinite_cell(block: dict) -> str:
    nan, inf, share = nonfinite_share(block)
    return f"{nan:,} NaN, {inf:,} Inf ({share:.1%})" if nan or inf else "0"


def warn_nonfinite(doc: dict) -> None:
    """A warning on stderr per model and activation that had NaN/Inf values (printed even when quiet), in the
    words of the one non-finite guard (`stats.nonfinite`)."""
    from quantdiff.stats.nonfinite import split, warn_nonfinite as warn_found

    for key, label in ACTIVATIONS.items():
        for model in doc["models"]:
            nan, inf = model[key]["nonfinite"]["nan"], model[key]["nonfinite"]["inf"]
            if nan or inf:
                warn_found(model["name"], [split(label, nan, inf, model[key]["count"])], "every statistic excludes them")


def render(doc: dict, console=None, per_layer: bool = False, stderr: bool = False) -> None:
    """Table 5 layout: rows = activation × model (+ ratio rows first ÷ other), columns Top-1 … Median.

    Non-finite activations (excluded from every statistic) get a column (and `warn_nonfinite` a warning line),
    so a table of normal-looking numbers never hides that a share of the values was NaN or Inf.
    `console`: default, one that prints whole rows when piped (on stderr if `stderr`).
    """
    from rich.table import Table

    from quantdiff.report.console import table_console

    models = doc["models"]
    flagged = [(m, key, label) for key, label in ACTIVATIONS.items() for m in models if sum(nonfinite_share(m[key])[:2])]
    bound = f"median within ±{QUANTILE_RELATIVE_ERROR:.3%} (relative) of exact"
    if len({m["bos"]["added"] for m in models if "bos" in m}) > 1:  # each model measured as it was trained
        bound += "; BOS first for some models only: see below"
    table = Table(title=f"Largest |activation| values — {doc['data']['tokens']:,} tokens per model", caption=bound)
    extra = ("non-finite",) if flagged else ()
    for column in ("activation", "model", *paper.TABLE5_COLUMNS, *extra):
        label_column = column in ("activation", "model")
        table.add_column(column, justify="left" if label_column else "right", no_wrap=label_column)
    for key, label in ACTIVATIONS.items():
        rows = [table5_row(m[key]) for m in models]
        for i, (model, row) in enumerate(zip(models, rows)):
            table.add_row(label if i == 0 else "", model["name"], *map(number, row), *(_nonfinite_cell(model[key]) for _ in extra))
        for model, row in list(zip(models, rows))[1:]:
            ratios = (ratio(a, b) for a, b in zip(rows[0], row))
            table.add_row("", f"{models[0]['name']}÷{model['name']}", *ratios, *("" for _ in extra), style="dim")
        table.add_section()
    console = console or table_console(table, stderr=stderr)
    console.print(table)
    for model in models:
        console.print(massive_line(model["name"], model["hidden_states"]["massive_activation"]), soft_wrap=True)
        features = model["linear_inputs"]["outlier_features"]
        console.print(f"{model['name']}: {features['count']} LLM.int8 outlier feature(s) in the linear layers' inputs"
                      + (f" (channels {features['channels'][:10]})" if features["count"] else ""))
        if "sinks" in model:
            console.print(sink_line(model["name"], model["sinks"]))
        if "bos" in model:
            console.print(describe_bos(model["name"], model["bos"]), soft_wrap=True)
    if per_layer:
        for key, label in ACTIVATIONS.items():
            render_per_layer(models, key, label, console)


def massive_line(name: str, massive: dict | None) -> str:
    """Where the largest hidden state sits, its ratio to its layer's median, and whether it is a massive activation."""
    if massive is None:
        return f"{name}: no hidden states observed"
    where = f"layer {massive['layer']}, position {massive['position']}{' (first token)' if massive['first_position'] else ''}, channel {massive['channel']}"
    times = "n/a" if massive["ratio"] is None else f"{massive['ratio']:,.0f}×"
    verdict = (f"a massive activation (Sun et al.: > {massive['criterion']['min_magnitude']:g} and ≥ {massive['criterion']['min_ratio']:,.0f}× the median)"
               + (f" in layers {massive['layers'][0]}–{massive['layers'][-1]}" if massive["layers"] else "")
               if massive["massive"] else "no massive activation")
    return f"{name}: largest hidden state {number(massive['value'])} at {where}; {times} its layer's median: {verdict}"


def sink_line(name: str, sinks: dict) -> str:
    heads = "differential heads (maps combined)" if "combined" in sinks else "heads"
    return (
        f"{name}: attention sinks: {sinks['score']:.0%} of {sinks['heads_scored']} {heads} put more than "
        f"{sinks['epsilon']:g} of their attention on the first position (mean {sinks['mean']:.3f}, max {sinks['max']:.3f})"
        + ("" if "sink_logit" not in sinks else f"; the sink logits absorb {sinks['sink_logit']['mean']:.3f} of the attention "
           f"(mean over heads; max {sinks['sink_logit']['max']:.3f})")
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
            cells += [number(block and block["max"]), number(block and block["median"])]
        if len(models) > 1:
            cells.append(ratio(blocks[0] and blocks[0]["max"], blocks[1] and blocks[1]["max"]))
        table.add_row(str(layer), *cells)
    console.print(table)


def plot_names() -> list[str]:
    """The files `write_plots` writes into its directory."""
    return [f"{kind}_{key}.png" for key in ACTIVATIONS for kind in ("top1_per_layer", "ccdf")]


def check_plot_dir(directory: Path, force: bool) -> None:
    """--plot: a directory (or a path to create) whose plot files, where they exist, quantdiff wrote (or `force`)."""
    from quantdiff.core.errors import ConfigError

    directory = atomic.followed(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--plot path exists and is not a directory: {directory}")
    for name in plot_names():
        atomic.writable_target(directory / name, force, "--plot")


def write_plots(directory: str | Path, named: Sequence[tuple[str, ModelStats]], force: bool = False) -> list[Path]:
    """Per-layer Top-1 bars (one PNG per activation, a bar per model) and |x| CCDFs (one PNG per activation).

    Rendered into a temporary directory first, then moved into `directory` file by file; an existing plot file
    is replaced only if quantdiff wrote it, or with `force` (checked before rendering and again at each rename).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = atomic.followed(Path(directory))
    check_plot_dir(directory, force)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temporaries()
    tmp = atomic.temporary_path(directory / "plots")
    tmp.mkdir(mode=0o700)
    installed: list[Path] = []
    try:
        with atomic.write_errors_as_error(directory):
            for path in _plot_into(tmp, named, plt):
                _install_plot(path, directory, force)
                installed.append(directory / path.name)
        return installed
    except BaseException as exc:
        if created and not isinstance(exc, atomic.KeptOutput):  # no partial set, no empty directory left behind
            for path in installed:
                path.unlink(missing_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                directory.rmdir()  # only if empty: never what someone put there meanwhile
            except OSError:
                pass
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install_plot(path: Path, directory: Path, force: bool) -> None:
    """Move one rendered plot into `directory` (`atomic.install_file`: what appeared meanwhile is not replaced)."""
    os.chmod(path, atomic.default_mode())
    target = atomic.followed(directory / path.name)
    kept = atomic.temporary_path(target)
    os.replace(path, kept)  # a registered name: if the install is refused, the error names it and it stays
    atomic.install_file(kept, target, force, "--plot")


def _plot_into(tmp: Path, named: Sequence[tuple[str, ModelStats]], plt) -> list[Path]:
    """Render every plot into `tmp`; returns their paths."""
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
        if ax.get_legend_handles_labels()[0]:  # no model had a finite value: an empty chart, no matplotlib warning
            ax.legend()
        names.append(_save(fig, tmp / f"ccdf_{key}.png", plt))
    return names


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=plot_metadata())
    plt.close(fig)
    return path
