"""The across-seed document (seeds.json): every metric of every arm over the seeds, paired comparisons with the
reference arm (each with its unadjusted p, and the recipe's primary ones with their Holm-adjusted p), the share of
seeds with a sink head (with the exact McNemar test against the reference), and the emergence curves with their
bands.

The primary comparisons are those the recipe names before the run (`[analysis] primary_metrics` ×
`primary_arms`, each arm against the reference); Holm's correction (Holm 1979) runs over that family alone.
Every other comparison is labelled exploratory: its p is unadjusted and supports no claim on its own. When the
recipe is one of the repository's confirmatory plans (`plan`: recipe.plan_file), the family is the plan's,
named before any of its models trained, and the report calls it confirmatory.

It is built only from each seed's stats.json, sweep.json and train logs, and keeps every per-seed value next to
its summary, so each number can be recomputed from the JSON alone. The same format is what a published
multi-seed result ships (across_seeds.published).

    {"schema": "quantdiff.seeds", "version": 2, "recipe", "seeds": [...], "arms": {arm: kind}, "reference",
     "method": {"confidence", "description", "tests", "sign_flip", "exact_up_to", "resamples", "resample_seed"},
     "primary": {"correction", "alpha", "metrics": [...], "arms": [...],
                 "plan": "recipes/confirm-<name>.toml" | None, ("plan_check": scripts/plan_check.py's result),
                 "comparisons": [{"metric", "arm", "test", "p", "holm_p", "detected"}]},
     "metrics": {key: {"label", "log", "comparison", ("cell": {task, site, method, bits, group_size}: sweep cells)
                       "arms": {arm: {"per_seed": {seed: value}, "n", "mean", "sd", "low", "high"}},
                       "paired": {arm: {"per_seed", "n", "mean", "sd", "low", "high",
                                        "reference_higher", "other_higher", "equal", "test", "p",
                                        "family": "primary" | "exploratory", ("holm_p": primary only)}}}},
     "sink_share": {arm: {"per_seed": {seed: bool}, "k", "n", "share", "low", "high",
                          ("mcnemar": {"reference_only", "other_only", "both", "neither", "p"}: not the reference)}},
     "emergence": {"block/key": {"label", "arms": {arm: {"steps", "tokens", "n", "mean", "low", "high", "per_seed"}}}}}
"""

from __future__ import annotations

from typing import Sequence

from quantdiff.across_seeds.curves import emergence_curves
from quantdiff.across_seeds.intervals import CONFIDENCE, METHOD, paired, share, summarize
from quantdiff.across_seeds.metrics import CHANGE_PREFIX, MODEL_METRICS, Metric, change_metric, change_values, has_sink, model_values, sweep_values
from quantdiff.across_seeds.significance import (EXACT_MAX_SEEDS, RESAMPLE_SEED, RESAMPLES, holm, mcnemar_exact_p,
                                                 sign_flip_method)

SCHEMA, VERSION = "quantdiff.seeds", 2
ALPHA = 0.05  # the family-wise error rate Holm's correction holds the primary comparisons to
CORRECTION = "Holm (1979) step-down, over the primary comparisons only"
TESTS = (
    "p-values are two-sided, of no difference from the reference arm. A paired ratio (Top-1 |attention logit|, "
    "overall or per softmax map, Top-1 |hidden state|, each over its median, kurtosis, BOS peak ÷ median): the paired "
    "t test on the per-seed log ratios (the test of the t interval beside it). A paired difference (accuracy, its "
    "change from the unquantized model, sink score, sink mass; bounded, so not assumed normal): "
    "the sign-flip permutation test of the mean difference (Fisher 1935). Seeds with a sink head, paired: the "
    "exact McNemar test (McNemar 1947). Which test a metric gets is fixed by its kind, not by its data."
)


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


def _mcnemar(reference: dict[str, bool], other: dict[str, bool]) -> dict:
    """The exact McNemar test (McNemar 1947) of a flag paired by seed, over the seeds both arms have it for."""
    seeds = [s for s in reference if s in other]
    count = lambda r, o: sum(reference[s] is r and other[s] is o for s in seeds)  # noqa: E731
    cells = {"reference_only": count(True, False), "other_only": count(False, True), "both": count(True, True), "neither": count(False, False)}
    return cells | {"p": mcnemar_exact_p(cells["reference_only"], cells["other_only"])}


def _primary(metrics: dict[str, dict], primary_metrics: Sequence[str], primary_arms: Sequence[str], plan: str | None) -> dict:
    """Label every paired comparison primary or exploratory, and correct the primary family's p by Holm (Holm
    1979). A primary comparison the run did not measure (or with no p) is listed with p None and Holm p None, yet
    still counts in the family's size, as a p of 1: the correction then holds for the family the recipe named."""
    family = [(key, arm) for key in primary_metrics for arm in primary_arms]
    for key, block in metrics.items():
        for arm, pair in block.get("paired", {}).items():
            pair["family"] = "primary" if (key, arm) in family else "exploratory"
    pairs = {(key, arm): metrics.get(key, {}).get("paired", {}).get(arm) for key, arm in family}
    tested = [item for item, pair in pairs.items() if pair is not None and pair["p"] is not None]
    untested = len(pairs) - len(tested)
    adjusted = dict(zip(tested, holm([pairs[item]["p"] for item in tested] + [1.0] * untested)))
    comparisons = []
    for item, pair in pairs.items():
        holm_p = adjusted.get(item)
        if pair is not None:
            pair["holm_p"] = holm_p
        comparisons.append({"metric": item[0], "arm": item[1], "test": pair and pair["test"], "p": pair and pair["p"],
                            "holm_p": holm_p, "detected": None if holm_p is None else holm_p <= ALPHA})
    return {"correction": CORRECTION, "alpha": ALPHA, "metrics": list(primary_metrics), "arms": list(primary_arms), "plan": plan,
            "comparisons": comparisons}


def seeds_document(recipe: str, arms: dict[str, str], reference: str | None, stats: dict[str, dict], sweeps: dict[str, dict],
                   series: dict[str, dict[str, list[dict]]], primary_metrics: Sequence[str] = (), primary_arms: Sequence[str] = (),
                   plan: str | None = None) -> dict:
    """The document from per-seed {seed: stats doc}, {seed: sweep doc} and {seed: {arm: outlier series}}
    (seeds as strings, in the order given; `reference`: the arm the others are compared with, None: none;
    `primary_metrics` × `primary_arms`: the recipe's primary comparisons, each arm against the reference;
    `plan`: the confirmatory plan the recipe is, recipe.plan_file, None: not a plan)."""
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
    for key in (k for k in primary_metrics if k.startswith(CHANGE_PREFIX)):  # computed where the plan names one
        metric = change_metric(key, metrics)
        if metric is not None:
            metrics[key] = metric
            unquantized = f"sweep/{metric.cell['task']}/unquantized"
            cell = "sweep/" + key.removeprefix(CHANGE_PREFIX)
            values[key] = {seed: change_values(key, values[cell].get(seed, {}), values[unquantized].get(seed, {})) for seed in stats}
    flags = {arm: {seed: has_sink(m) for seed in stats for m in stats[seed]["models"] if m["name"] == arm} for arm in names}
    flags = {arm: {s: f for s, f in by_seed.items() if f is not None} for arm, by_seed in flags.items()}
    sink_share = {arm: share(by_seed) for arm, by_seed in flags.items()}
    if reference in flags:
        for arm in names:
            if arm != reference:
                sink_share[arm]["mcnemar"] = _mcnemar(flags[reference], flags[arm])
    blocks = {key: _metric_block(metric, values[key], names, reference) for key, metric in metrics.items()}
    primary = _primary(blocks, primary_metrics, primary_arms, plan)
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "recipe": recipe,
        "seeds": [int(seed) for seed in stats],
        "arms": arms,
        "reference": reference,
        "method": {"confidence": CONFIDENCE, "description": METHOD, "tests": TESTS, "sign_flip": sign_flip_method(len(stats)),
                   "exact_up_to": EXACT_MAX_SEEDS, "resamples": RESAMPLES, "resample_seed": RESAMPLE_SEED},
        "primary": primary,
        "metrics": blocks,
        "sink_share": sink_share,
        "emergence": emergence_curves(series),
    }
