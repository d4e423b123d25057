"""The figures issue 54 put on the pages (scripts/claims_tables.py) against an independent recomputation from the
per-seed JSON with scipy and tests/independent_stats.py, and against the pages that quote them: map 1 alone beside
the per-map Top-1, the text run's 3-bit changes, Diff V1 at bb 2-bit linear, the power of the bb 4-bit
comparisons, the Gaussian reference, and the absence of massive activations."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import statistics
import tomllib
from pathlib import Path

import pytest

from tests.independent_stats import per_seed_values, sign_flip

ROOT = Path(__file__).resolve().parents[1]


def _stats(run: str, seed: int) -> dict:
    """One seed's stats document, read without quantdiff (published compressed: gzip -n)."""
    return json.loads(gzip.decompress((ROOT / "results" / run / f"seed-{seed}" / "stats.json.gz").read_bytes()))
SPEC = importlib.util.spec_from_file_location("claims_tables", ROOT / "scripts" / "claims_tables.py")
claims = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(claims)
README, RESULTS_PAGE = ROOT / "README.md", ROOT / "docs" / "results.md"


def _seeds(run: str) -> list[int]:
    return sorted(int(p.name.removeprefix("seed-")) for p in (ROOT / "results" / run).glob("seed-*"))


def _map1_top1(model: dict) -> float:
    """Mean over the model's first softmax maps of each map's largest |logit|, each map named by its top-k entries
    (standard attention names none: all its maps count)."""
    maxima = []
    for layer in model["attention_logits"]["per_head"]:
        for block in layer:
            maps = {entry.get("map") for entry in block["topk"]}
            assert len(maps) == 1  # one block holds one map
            if maps <= {None, 1}:
                maxima.append(max(abs(entry["value"]) for entry in block["topk"]))
    return sum(maxima) / len(maxima)


def _t_interval(values: list[float], log: bool) -> tuple[float, float, float]:
    stats = pytest.importorskip("scipy.stats")
    points = [math.log(v) for v in values] if log else values
    mean, half = statistics.fmean(points), stats.t.ppf(0.975, len(points) - 1) * statistics.stdev(points) / math.sqrt(len(points))
    back = math.exp if log else float
    return back(mean), back(mean - half), back(mean + half)


def _minus(text: str) -> str:
    return text.replace("-", "−")


@pytest.mark.parametrize(("run", "arm", "quoted", "pages"), [
    ("confirm-text", "diffv2", "1.09× [0.985, 1.20]", [README, RESULTS_PAGE, ROOT / "results/confirm-text/README.md"]),
    ("confirm-text", "diff", "1.14× [1.04, 1.26]", [README, RESULTS_PAGE, ROOT / "results/confirm-text/README.md"]),
    ("confirm-bb", "diffv2", "1.21× [0.984, 1.48]", [README, RESULTS_PAGE, ROOT / "results/confirm-bb/README.md"]),
    ("confirm-bb", "diff", "0.742× [0.636, 0.866]", [README, RESULTS_PAGE, ROOT / "results/confirm-bb/README.md"]),
])
def test_map_1_alone_recomputes_and_the_pages_quote_it(run, arm, quoted, pages):
    ratios = []
    for seed in _seeds(run):
        models = {m["name"]: m for m in _stats(run, seed)["models"]}
        ratios.append(_map1_top1(models["standard"]) / _map1_top1(models[arm]))
    mean, low, high = _t_interval(ratios, log=True)
    assert f"{mean:#.3g}× [{low:#.3g}, {high:#.3g}]" == quoted
    for page in pages:
        assert quoted in page.read_text(), page.name


@pytest.mark.parametrize(("run", "key", "arm", "quoted", "p", "pages"), [
    ("confirm-text", "change/lm/linear/absmax/3", "diff", "−0.0013 [−0.0024, −0.0002]", "0.031",
     [README, ROOT / "results/confirm-text/README.md"]),
    ("confirm-text", "change/lm/linear/absmax/3", "diffv2", "+0.0005 [−0.0011, +0.0022]", "0.48",
     [README, RESULTS_PAGE, ROOT / "results/confirm-text/README.md"]),
    ("confirm-bb", "change/bb/linear/absmax/2", "diff", "−0.1923 [−0.3288, −0.0558]", "0.013", [ROOT / "results/confirm-bb/README.md"]),
])
def test_the_quantized_changes_recompute_and_the_pages_quote_them(run, key, arm, quoted, p, pages):
    per_seed = [per_seed_values(ROOT / "results" / run, s)[key] for s in _seeds(run)]
    differences = [v[arm] - v["standard"] for v in per_seed]
    mean, low, high = _t_interval(differences, log=False)
    assert _minus(f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]") == quoted
    assert f"{sign_flip(differences):.2g}" == p
    for page in pages:
        assert quoted in page.read_text() or quoted.replace("0.1923 [−0.3288, −0.0558]", "0.192 [0.056, 0.329]") in page.read_text(), page.name
    if key.endswith("/2"):  # the README and docs round it and state it as a loss
        assert "0.192 [0.056, 0.329]" in README.read_text() and "0.192 [0.056, 0.329]" in RESULTS_PAGE.read_text()


def test_the_bb_4_bit_comparisons_could_not_reach_0_05():
    """Of 12 paired differences, the sign-flip test ignores the zeros; with n non-zero its smallest p is 2^(1−n)."""
    per_seed = [per_seed_values(ROOT / "results" / "confirm-bb", s)["change/bb/linear/absmax/4"] for s in _seeds("confirm-bb")]
    for arm, nonzero, smallest in (("diff", 5, "0.0625"), ("diffv2", 2, "0.5")):
        differences = [v[arm] - v["standard"] for v in per_seed]
        assert sum(d != 0 for d in differences) == nonzero
        extreme = [abs(d) if d else 0.0 for d in differences]  # every non-zero difference on one side
        assert sign_flip(extreme) == pytest.approx(float(smallest))
    for page in (README, RESULTS_PAGE, ROOT / "results/confirm-bb/README.md"):
        assert "0.0625" in page.read_text(), page.name  # the smallest p the 4-bit Diff V1 test allows
    assert "is 0.0625 and 0.5" in (ROOT / "results/confirm-bb/README.md").read_text()


def test_the_minimum_detectable_effect_is_the_t_approximation():
    stats = pytest.importorskip("scipy.stats")
    for n, sd in ((10, 0.001), (12, 0.0042)):
        expected = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * sd / math.sqrt(n)
        assert claims.mde(sd, n) == pytest.approx(expected, rel=1e-6)


def test_the_gaussian_reference_is_a_half_normal():
    """The sample's kurtosis of |x| against the half-normal's from its moments: E|x| = √(2/π), E x² = 1,
    E|x|³ = 2√(2/π), E x⁴ = 3."""
    m1, m3 = math.sqrt(2 / math.pi), 2 * math.sqrt(2 / math.pi)
    variance = 1 - m1**2
    kurtosis = (3 - 4 * m1 * m3 + 6 * m1**2 - 3 * m1**4) / variance**2
    sample = claims.gaussian_reference(1 << 20)
    assert sample["kurtosis"] == pytest.approx(kurtosis, abs=0.03)
    assert f"{kurtosis:.2f}" == "3.87" and "3.87" in (ROOT / "results/confirm-text/README.md").read_text()
    assert sample["top1_over_median"] == pytest.approx(sample["top1"] / 0.6745, rel=0.01)  # the half-normal's median is Φ⁻¹(0.75)


@pytest.mark.parametrize(("run", "largest"), [("confirm-text", "9.9"), ("confirm-bb", "73.8")])
def test_no_trained_model_has_a_massive_activation(run, largest):
    """Sun et al.'s criterion, applied here to each layer's Top-1 and median: above 100 and ≥ 1,000× the median."""
    ratios = []
    for seed in _seeds(run):
        for model in _stats(run, seed)["models"]:
            for layer in model["hidden_states"]["per_layer"]:
                assert not (layer["max"] > 100 and layer["max"] >= 1000 * layer["median"])
                ratios.append(layer["max"] / layer["median"])
    assert f"{max(ratios):.1f}" == largest
    assert largest in README.read_text() and largest in RESULTS_PAGE.read_text()


@pytest.mark.parametrize("run", ["confirm-text", "confirm-bb"])
def test_the_pages_carry_the_script_s_logit_table(run):
    table = claims.logit_table(run, claims.per_seed(run))
    assert table.split("\n\n")[0] in (ROOT / "results" / run / "README.md").read_text()
    assert table.split("\n\n")[0] in RESULTS_PAGE.read_text()


@pytest.mark.parametrize(("page", "recipe"), [
    ("results/bb/README.md", "recipes/bb.toml"), ("results/text/README.md", "recipes/text.toml"),
    ("results/gpu/README.md", "results/gpu/recipe.toml"), ("results/cpu-sinks/README.md", "recipes/cpu-sinks.toml"),
])
def test_each_diff_v1_page_states_its_differential_head_count(page, recipe):
    """Diff V1 pairs the recipe's heads: num_heads // 2 differential heads, against the authors' minimum of 8."""
    heads = tomllib.loads((ROOT / recipe).read_text())["model"]["num_heads"] // 2
    text = (ROOT / page).read_text()
    assert f"{heads} differential head" in text and "at least 8" in text
