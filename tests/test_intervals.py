"""The across-seed intervals against independent references: printed t and binomial tables, closed forms of the
t and beta distributions, numerical integration of the beta density, numpy's mean and standard deviation (and
scipy, where it happens to be installed: it is not a dependency)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantdiff.across_seeds.distributions import beta_quantile, regularized_beta, t_cdf, t_quantile
from quantdiff.across_seeds.intervals import paired, share, summarize

# Student t, two-sided 95% (p = 0.975), from any printed table.
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042, 120: 1.980}


@pytest.mark.parametrize("df, expected", sorted(T_TABLE.items()))
def test_t_quantiles_match_the_printed_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=5e-4)


@pytest.mark.parametrize("p", [0.55, 0.8, 0.975, 0.999])
def test_t_quantiles_match_the_closed_forms_of_one_and_two_degrees_of_freedom(p):
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)  # Cauchy
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)
    assert t_cdf(t_quantile(p, 5), 5) == pytest.approx(p, abs=1e-12)


@pytest.mark.parametrize("x, a, b", [(0.1, 2, 3), (0.5, 1.5, 7), (0.9, 4, 2), (0.35, 10, 12), (0.7, 1, 1)])
def test_the_incomplete_beta_function_equals_the_integrated_density(x, a, b):
    grid = np.linspace(0.0, x, 400_001)
    density = grid ** (a - 1) * (1 - grid) ** (b - 1) / math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    integral = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(grid)))  # trapezoids
    assert regularized_beta(x, a, b) == pytest.approx(integral, rel=1e-8)


@pytest.mark.parametrize("p", [0.025, 0.5, 0.975])
def test_beta_quantiles_match_the_closed_forms(p):
    assert beta_quantile(p, 1, 5) == pytest.approx(1 - (1 - p) ** (1 / 5), rel=1e-10)  # I_x(1, b) = 1 − (1 − x)^b
    assert beta_quantile(p, 3, 1) == pytest.approx(p ** (1 / 3), rel=1e-10)  # I_x(a, 1) = x^a


def test_against_scipy_where_installed():
    stats = pytest.importorskip("scipy.stats")
    special = pytest.importorskip("scipy.special")
    for df in (1, 3, 4.5, 7, 50):
        for p in (0.6, 0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)
    rng = np.random.default_rng(0)
    for x, a, b in zip(rng.random(200), rng.uniform(0.1, 30, 200), rng.uniform(0.1, 30, 200)):
        assert regularized_beta(x, a, b) == pytest.approx(special.betainc(a, b, x), abs=1e-12)


def test_a_mean_gets_its_t_interval_and_a_ratio_its_geometric_one():
    values = [2.0, 3.5, 1.0, 8.0, 4.5]
    x = np.array(values)
    half = 2.776445 * x.std(ddof=1) / math.sqrt(5)
    summary = summarize(values)
    assert (summary["n"], summary["mean"], summary["low"], summary["high"]) == pytest.approx((5, x.mean(), x.mean() - half, x.mean() + half), rel=1e-6)
    logs = np.log(x)
    half = 2.776445 * logs.std(ddof=1) / math.sqrt(5)
    geometric = summarize(values, log=True)
    assert (geometric["mean"], geometric["low"], geometric["high"]) == pytest.approx(
        (math.exp(logs.mean()), math.exp(logs.mean() - half), math.exp(logs.mean() + half)), rel=1e-6)
    assert geometric["low"] > 0  # a ratio's interval stays positive where the plain one would not
    assert summarize([3.0, None, float("nan")]) == {"n": 1, "mean": 3.0, "sd": None, "low": None, "high": None}
    assert summarize([])["mean"] is None and summarize([0.0, 2.0], log=True)["n"] == 1  # log: only positive values


def test_paired_comparisons_count_the_seeds_each_way():
    reference = {"0": 10.0, "1": 6.0, "2": 4.0, "3": 5.0, "4": 9.0}
    other = {"0": 5.0, "1": 6.0, "2": 8.0, "3": None, "4": 3.0}
    ratio = paired(reference, other, ratio=True)  # reference ÷ other: 2, 1, 0.5, 3; seed 3 has no partner value
    assert ratio["per_seed"] == {"0": 2.0, "1": 1.0, "2": 0.5, "4": 3.0} and ratio["n"] == 4
    assert (ratio["reference_higher"], ratio["other_higher"], ratio["equal"]) == (2, 1, 1)
    assert ratio["mean"] == pytest.approx(3 ** 0.25)  # geometric mean of 2, 1, ½, 3
    difference = paired(reference, other, ratio=False)  # other − reference: −5, 0, 4, −6
    assert difference["per_seed"] == {"0": -5.0, "1": 0.0, "2": 4.0, "4": -6.0}
    assert (difference["reference_higher"], difference["other_higher"], difference["equal"]) == (2, 1, 1)
    assert difference["mean"] == pytest.approx(-7 / 4)


@pytest.mark.parametrize("k, n, low, high", [(0, 5, 0.0, 0.5218), (1, 5, 0.00505, 0.7164), (3, 8, 0.0852, 0.7551), (8, 8, 0.6306, 1.0)])
def test_the_share_of_seeds_gets_the_clopper_pearson_interval(k, n, low, high):
    result = share({str(i): i < k for i in range(n)})
    assert (result["k"], result["n"], result["share"]) == (k, n, k / n)
    assert (result["low"], result["high"]) == pytest.approx((low, high), abs=1e-4)  # binomial tables
    if k == 0:
        assert result["high"] == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-10)
