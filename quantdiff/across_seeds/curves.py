"""Emergence curves across seeds: at every eval step, each arm's mean over seeds with its 95% t band.

The input is each seed's `outliers` series per arm (train.emergence: one entry per eval step, measured on the
same held-out sequences for every arm and seed). Seeds of one recipe share their eval steps; a step some seed
lacks is summarised over the seeds that have it (its `n` says how many). One seed gives the curve without a band.
"""

from __future__ import annotations

from quantdiff.across_seeds.intervals import summarize

# (block, key, label): the quantities of an emergence entry that are drawn and tabled
QUANTITIES = (
    ("attention_logits", "top1", "Top-1 attention logit (abs)"),
    ("hidden_states", "top1", "Top-1 hidden state (abs)"),
    ("hidden_states", "first_position_top1", "largest hidden state at position 0 (abs)"),
    ("sink", "score", "sink score (share of heads > ε)"),
    ("sink", "mean", "mean attention on position 0"),
)


def entry_value(entry: dict, block: str, key: str) -> float | None:
    value = entry.get(block, {}).get(key)
    return None if value is None else float(value)


def _arm_curve(entries_by_seed: dict[str, list[dict]], block: str, key: str) -> dict | None:
    """One arm's curve of one quantity: per step the per-seed values and their summary; None if never logged."""
    by_seed = {seed: {e["step"]: e for e in entries} for seed, entries in entries_by_seed.items()}
    steps = sorted({step for entries in by_seed.values() for step in entries})
    per_seed = {seed: [entry_value(entries[s], block, key) if s in entries else None for s in steps] for seed, entries in by_seed.items()}
    if all(v is None for values in per_seed.values() for v in values):
        return None
    tokens = {e["step"]: e["tokens"] for entries in entries_by_seed.values() for e in entries}
    summaries = [summarize([values[i] for values in per_seed.values()]) for i in range(len(steps))]
    return {
        "steps": steps,
        "tokens": [tokens[s] for s in steps],
        **{field: [summary[field] for summary in summaries] for field in ("n", "mean", "low", "high")},
        "per_seed": per_seed,
    }


def emergence_curves(series: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """{"block/key": {"label", "arms": {arm: curve}}} from {seed: {arm: outlier entries}}; quantities no entry
    carries (logs written before they were tracked) are left out, and so are arms without a series."""
    arms = list(dict.fromkeys(arm for by_arm in series.values() for arm, entries in by_arm.items() if entries))
    curves = {}
    for block, key, label in QUANTITIES:
        per_arm = {arm: _arm_curve({seed: by_arm.get(arm, []) for seed, by_arm in series.items()}, block, key) for arm in arms}
        per_arm = {arm: curve for arm, curve in per_arm.items() if curve is not None}
        if per_arm:
            curves[f"{block}/{key}"] = {"label": label, "arms": per_arm}
    return curves
