"""The published multi-seed results (results/bb, exploratory; results/confirm-text, results/confirm-bb and
results/confirm-bb-v2, confirmatory) against an independent recomputation from their per-seed JSON: the primary comparisons' p-values and
their Holm adjustment (Holm 1979), computed here with scipy's t test, a brute-force sign-flip enumeration and a
hand-written Holm step-down, must be what seeds.json and report.md publish; and the family must be the one the
recipe names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantdiff.train.recipe import load_recipe
from tests.independent_stats import holm, per_seed_values, sign_flip

ROOT = Path(__file__).resolve().parents[1]
# Each published run (results/<run>, trained from recipes/<run>.toml): what survives Holm's correction (its README
# states exactly these).
PUBLISHED = {
    "bb": {  # the twelve pinned seeds; a post hoc family (results/bb/README.md)
        ("table5/attention_logits/top1", "diff"), ("table5/attention_logits/top1", "gated"), ("table5/attention_logits/top1", "standard-sgd"),
        ("table5/hidden_states/top1", "gated"), ("table5/hidden_states/top1", "standard-sgd"),
        ("sweep/bb/linear/absmax/4", "diffv2"), ("sweep/bb/linear/absmax/4", "gated"), ("sweep/bb/linear/absmax/4", "standard-sgd")},
    "confirm-text": {  # the plan committed before training
        ("table5/attention_logits/top1_per_map", "diff"), ("table5/attention_logits/top1_per_map", "diffv2")},
    "confirm-bb": {  # the plan committed before training
        ("table5/attention_logits/top1_per_map", "diffv2"), ("table5/hidden_states/top1", "diffv2")},
    "confirm-bb-v2": {  # the plan committed before training
        ("table5/attention_logits/top1_per_map", "diffv2-matched"), ("table5/attention_logits/top1_per_map", "diffv2"),
        ("table5/hidden_states/top1", "diffv2-matched"), ("table5/hidden_states/top1", "diffv2")},
}


@pytest.mark.parametrize("run", sorted(PUBLISHED))
def test_the_published_holm_adjusted_p_values_recompute_from_the_per_seed_json(run):
    stats = pytest.importorskip("scipy.stats")
    results = ROOT / "results" / run
    doc = json.loads((results / "seeds.json").read_text())
    seeds = sorted(int(p.name.removeprefix("seed-")) for p in results.glob("seed-*"))
    assert doc["seeds"] == seeds
    analysis = load_recipe(ROOT / "recipes" / f"{run}.toml").analysis
    assert (doc["primary"]["metrics"], doc["primary"]["arms"]) == (analysis.primary_metrics, analysis.primary_arms)
    values = [per_seed_values(results, s) for s in seeds]
    family, p = [], []
    for key in analysis.primary_metrics:
        for arm in analysis.primary_arms:
            reference, other = [v[key]["standard"] for v in values], [v[key][arm] for v in values]
            if key.startswith("table5/"):  # standard ÷ arm, compared on the log scale: the paired t test
                p.append(stats.ttest_1samp([math.log(r / o) for r, o in zip(reference, other)], 0.0).pvalue)
            else:  # arm − standard, bounded: the sign-flip permutation test, every sign assignment
                p.append(sign_flip([o - r for r, o in zip(reference, other)]))
            family.append((key, arm))
    adjusted = holm(p)
    published = {(c["metric"], c["arm"]): c for c in doc["primary"]["comparisons"]}
    assert list(published) == family and len(family) == len(analysis.primary_metrics) * len(analysis.primary_arms)
    report = (results / "report.md").read_text()
    for item, p_value, holm_p in zip(family, p, adjusted):
        entry = published[item]
        assert entry["p"] == pytest.approx(p_value, rel=1e-9) and entry["holm_p"] == pytest.approx(holm_p, rel=1e-9)
        assert entry["detected"] == (holm_p <= 0.05)
        assert doc["metrics"][item[0]]["paired"][item[1]]["holm_p"] == entry["holm_p"]
        verdict = "difference detected" if holm_p <= 0.05 else "no difference detected"
        holm_text = f"{holm_p:.2g}" if holm_p >= 0.001 else f"{holm_p:.1e}"
        assert any(line.endswith(f"| {holm_text} | {verdict} |") and f" {item[1]} " in line for line in report.splitlines()), item
    assert {item for item, holm_p in zip(family, adjusted) if holm_p <= 0.05} == PUBLISHED[run]
