"""The published multi-seed results (results/bb, exploratory; results/confirm-text, confirmatory) against an
independent recomputation from their per-seed JSON: the primary comparisons' p-values and their Holm adjustment
(Holm 1979), computed here with scipy's t test, a brute-force sign-flip enumeration and a hand-written Holm
step-down, must be what seeds.json and report.md publish; and the family must be the one the recipe names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantdiff.train.recipe import load_recipe
from tests.independent_stats import holm, sign_flip

ROOT = Path(__file__).resolve().parents[1]
# Each published run: its recipe, and what survives Holm's correction (its README states exactly these).
PUBLISHED = {
    "bb": ("bb", {  # the twelve pinned seeds; a post hoc family (results/bb/README.md)
        ("table5/attention_logits/top1", "diff"), ("table5/attention_logits/top1", "gated"), ("table5/attention_logits/top1", "standard-sgd"),
        ("table5/hidden_states/top1", "gated"), ("table5/hidden_states/top1", "standard-sgd"),
        ("sweep/bb/linear/absmax/4", "diffv2"), ("sweep/bb/linear/absmax/4", "gated"), ("sweep/bb/linear/absmax/4", "standard-sgd")}),
    "confirm-text": ("recipes/confirm-text.toml", {  # the plan committed before training
        ("table5/attention_logits/top1_per_map", "diff"), ("table5/attention_logits/top1_per_map", "diffv2")}),
}


def _per_seed_values(results: Path, seed: int) -> dict[str, dict[str, float]]:
    """{metric key: {arm: value}} of the primary metrics, read straight from seed-<s>/stats.json and sweep.json."""
    stats = json.loads((results / f"seed-{seed}" / "stats.json").read_text())
    sweep = json.loads((results / f"seed-{seed}" / "sweep.json").read_text())
    values: dict[str, dict[str, float]] = {}
    for model in stats["models"]:
        for block in ("attention_logits", "hidden_states"):
            values.setdefault(f"table5/{block}/top1", {})[model["name"]] = max(abs(t["value"]) for t in model[block]["topk"])
        maps = [max(abs(t["value"]) for t in head["topk"]) for layer in model["attention_logits"]["per_head"] for head in layer]
        values.setdefault("table5/attention_logits/top1_per_map", {})[model["name"]] = sum(maps) / len(maps)  # one block per softmax map
    cells = [c for c in sweep["cells"] if "accuracy" in c]  # the lm and bb tasks (choice scores acc_norm)
    unquantized = {(c["task"], c["model"]): c["accuracy"] for c in cells if c["bits"] is None}
    for cell in cells:
        if cell["bits"] is not None and cell["valid"]:
            cell_key = f"{cell['task']}/{cell['site']}/{cell['method']}/{cell['bits']}"
            values.setdefault(f"sweep/{cell_key}", {})[cell["model"]] = cell["accuracy"]
            values.setdefault(f"change/{cell_key}", {})[cell["model"]] = cell["accuracy"] - unquantized[cell["task"], cell["model"]]
    return values


@pytest.mark.parametrize("run", sorted(PUBLISHED))
def test_the_published_holm_adjusted_p_values_recompute_from_the_per_seed_json(run):
    stats = pytest.importorskip("scipy.stats")
    recipe, survivors = PUBLISHED[run]
    results = ROOT / "results" / run
    doc = json.loads((results / "seeds.json").read_text())
    seeds = sorted(int(p.name.removeprefix("seed-")) for p in results.glob("seed-*"))
    assert doc["seeds"] == seeds
    analysis = load_recipe(recipe if recipe == "bb" else ROOT / recipe).analysis
    assert (doc["primary"]["metrics"], doc["primary"]["arms"]) == (analysis.primary_metrics, analysis.primary_arms)
    values = [_per_seed_values(results, s) for s in seeds]
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
    assert {item for item, holm_p in zip(family, adjusted) if holm_p <= 0.05} == survivors
