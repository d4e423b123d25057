"""A per-layer sensitivity map: the damage (`eval.damage`) of quantizing one decoder layer at a time at a site,
beside that layer's outlier statistics from the hooks of the same full-precision forwards, and the Spearman rank
correlation between each outlier measure and the damage."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.data.sources import Batch
from quantdiff.eval.damage import damages
from quantdiff.models import structure
from quantdiff.quant import sites
from quantdiff.stats.model_stats import ModelStats

# The outlier measures correlated with the damage (keys of each layer's `outliers`).
MEASURES = ("input_top1", "hidden_top1", "hidden_top1_over_median", "hidden_kurtosis", "outlier_features", "sink_heads")
DAMAGE_KEY = "kld_mean"


def site_layers(model: nn.Module, config: sites.QuantConfig) -> list[int]:
    """The decoder layers a one-layer config can quantize at the config's site: every layer for linear, the
    layers with attention for the attention sites (logits, qk, kv)."""
    if isinstance(config.site, sites.LinearSite):
        return list(range(len(structure.decoder_layers(model))))
    return [tap.layer_idx for tap in attention.taps(model)]


def layer_outliers(stats: ModelStats) -> list[dict]:
    """Per decoder layer: max |x| entering its linear layers (attention and FFN inputs, `input_top1`), its output
    hidden state's Top-1 |h|, Top-1 ÷ median |h| and kurtosis, how many channels it holds under LLM.int8's
    per-layer criterion (≥ 6 at ≥ 6% of positions, Dettmers et al. 2022 §3.2), its sink heads (attention mass on
    the first position > ε, Diff: combined maps; `stats.sinks`) and whether its Top-1 meets the massive-activation
    criterion (Sun et al. 2024)."""
    summary = stats.summary()
    hidden = summary["hidden_states"]
    massive = set((hidden.get("massive_activation") or {}).get("layers", []))
    sinks = stats.sinks.summary()
    scored = sinks.get("combined", sinks["per_head"])
    holding = stats.linear_inputs.layers_holding().sum(dim=1).tolist()
    input_top1 = stats.linear_inputs.absmax.amax(dim=1).tolist()
    rows = []
    for layer, block in enumerate(hidden["per_layer"]):
        median = block["median"]
        rows.append({
            "input_top1": input_top1[layer],
            "hidden_top1": block["max"],
            "hidden_top1_over_median": None if not median else block["max"] / median,
            "hidden_kurtosis": block["kurtosis"],
            "outlier_features": int(holding[layer]),
            "sink_heads": sum(mass > sinks["epsilon"] for mass in scored[layer]) if layer < len(scored) else 0,
            "massive": layer in massive,
        })
    return rows


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (as Spearman's coefficient needs)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's correlation of the average ranks); None with fewer than three
    pairs, a missing value, or a constant side."""
    if len(x) < 3 or any(v is None for v in (*x, *y)):
        return None
    rx, ry = _ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def sensitivity_map(
    model: nn.Module,
    batches: Sequence[Batch],
    configs: Sequence[sites.QuantConfig],
    progress: Callable[[int], None] | None = None,
    whole: bool = True,
) -> dict:
    """For each config (one site): every layer it can quantize, alone; `whole`: also every such layer at once,
    to check the additive approximation (the sum of one-layer damages against the measured whole-site damage).
    One full-precision forward per batch, then one quantized forward per cell."""
    plan: list[tuple[int, int | None]] = []  # (config index, layer or None for the whole site)
    cells: list[sites.QuantConfig] = []
    for index, config in enumerate(configs):
        layers = site_layers(model, config)
        for layer in layers:
            plan.append((index, layer))
            cells.append(replace(config, layers=(layer,)))
        if whole:
            plan.append((index, None))
            cells.append(replace(config, layers=tuple(layers)))
    results, stats = damages(model, batches, cells, stats_k=1, progress=progress)
    outliers = layer_outliers(stats)
    out = []
    for index, config in enumerate(configs):
        entries = [{"layer": layer, "damage": result, "outliers": outliers[layer]}
                   for (i, layer), result in zip(plan, results) if i == index and layer is not None]
        damage = [e["damage"][DAMAGE_KEY] for e in entries]
        site = {
            "config": config.to_dict(),
            "site": sites.site_name_of(config.site),
            "bits": config.method.bits,
            "layers": entries,
            "spearman": {m: spearman([e["outliers"][m] for e in entries], damage) for m in MEASURES},
        }
        if whole:
            measured = next(result for (i, layer), result in zip(plan, results) if i == index and layer is None)
            site["additivity"] = {"sum_of_layers": float(sum(damage)), "measured_whole": measured, "ratio": (
                None if measured[DAMAGE_KEY] == 0 else float(sum(damage)) / measured[DAMAGE_KEY])}
        out.append(site)
    return {"damage_measure": DAMAGE_KEY, "tokens": results[0]["tokens"] if results else 0, "sites": out}
