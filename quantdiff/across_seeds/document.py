"""The across-seed document (seeds.json): every metric of every arm over the seeds, paired comparisons with the
reference arm, the share of seeds with a sink head, and the emergence curves with their bands.

It is built only from each seed's stats.json, sweep.json and train logs, and keeps every per-seed value next to
its summary, so each number can be recomputed from the JSON alone. The same format is what a published
multi-seed result ships (across_seeds.published).

    {"schema": "quantdiff.seeds", "version": 1, "recipe", "seeds": [...], "arms": {arm: kind}, "reference",
     "method": {"confidence", "description"},
     "metrics": {key: {"label", "log", "comparison", ("cell": {task, site, method, bits, group_size}: sweep cells)
                       "arms": {arm: {"per_seed": {seed: value}, "n", "mean", "sd", "low", "high"}},
                       "paired": {arm: {"per_seed", "n", "mean", "sd", "low", "high",
                                        "reference_higher", "other_higher", "equal"}}}},
     "sink_share": {arm: {"per_seed": {seed: bool}, "k", "n", "share", "low", "high"}},
     "emergence": {"block/key": {"label", "arms": {arm: {"steps", "tokens", "n", "mean", "low", "high", "per_seed"}}}}}
"""

from __future__ import annotations

from quantdiff.across_seeds.curves import emergence_curves
from quantdiff.across_seeds.intervals import CONFIDENCE, METHOD, paired, share, summarize
from quantdiff.across_seeds.metrics import MODEL_METRICS, Metric, has_sink, model_values, sweep_values

SCHEMA, VERSION = "quantdiff.seeds", 1


def _metric_block(metric: Metric, by_seed: dict[str, dict[str, float | None]], arms: list[str], reference: str | None) -> dict:
    """One metric: each arm's per-seed values and summary, and each other arm paired with the reference."""
    per_arm = {arm: {seed: values.get(arm) for seed, values in by_seed.items()} for arm in arms}
    block = {
        "label": metric.label,
        "log": metric.log,
        "comparison": "reference ÷ arm" if metric.ratio else "arm − reference",
        "arms": {arm: {"per_seed": values, **summarize(list(values.values()), log=metric.log)} for arm, values in per_arm.items()},
    }
    if metric.cell is not None:
        block["cell"] = metric.cell
    if reference in per_arm:
        block["paired"] = {arm: paired(per_arm[reference], per_arm[arm], metric.ratio) for arm in arms if arm != reference}
    return block


def seeds_document(recipe: str, arms: dict[str, str], reference: str | None, stats: dict[str, dict], sweeps: dict[str, dict],
                   series: dict[str, dict[str, list[dict]]]) -> dict:
    """The document from per-seed {seed: stats doc}, {seed: sweep doc} and {seed: {arm: outlier series}}
    (seeds as strings, in the order given; `reference`: the arm the others are compared with, None: none)."""
    names = list(arms)
    metrics: dict[str, Metric] = {m.key: m for m in MODEL_METRICS}
    values: dict[str, dict[str, dict[str, float | None]]] = {m.key: {} for m in MODEL_METRICS}
    for seed in stats:
        for key, by_arm in model_values(stats[seed]).items():
            values[key][seed] = by_arm
        sweep_metrics, sweep_by_key = sweep_values(sweeps[seed])
        for key, metric in sweep_metrics.items():
            metrics.setdefault(key, metric)
            values.setdefault(key, {})[seed] = sweep_by_key[key]
    flags = {arm: {seed: has_sink(m) for seed in stats for m in stats[seed]["models"] if m["name"] == arm} for arm in names}
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "recipe": recipe,
        "seeds": [int(seed) for seed in stats],
        "arms": arms,
        "reference": reference,
        "method": {"confidence": CONFIDENCE, "description": METHOD},
        "metrics": {key: _metric_block(metric, values[key], names, reference) for key, metric in metrics.items()},
        "sink_share": {arm: share({s: f for s, f in by_seed.items() if f is not None}) for arm, by_seed in flags.items()},
        "emergence": emergence_curves(series),
    }
