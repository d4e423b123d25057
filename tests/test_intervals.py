"""The across-seed intervals and tests against independent references: printed t and binomial tables, closed forms
of the t and beta distributions, numerical integration of the beta density, numpy's mean and standard deviation,
hand-worked Holm adjustments, and scipy (a dev dependency, never a runtime one) for the quantiles, the
Clopper-Pearson interval, the t, sign-flip permutation and exact McNemar (binomial) tests."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantdiff.across_seeds.distributions import beta_quantile, regularized_beta, t_cdf, t_quantile
from quantdiff.across_seeds.intervals import paired, share, summarize
from quantdiff.across_seeds.significance import RESAMPLES, holm, mcnemar_exact_p, paired_t_p, sign_flip_method, sign_flip_p

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


@pytest.mark.parametrize("k, n", [(0, 8), (1, 8), (3, 8), (7, 8), (8, 8), (5, 12), (0, 12), (11, 20)])
def test_the_clopper_pearson_interval_equals_scipys_exact_binomial_interval(k, n):
    stats = pytest.importorskip("scipy.stats")
    result = share({str(i): i < k for i in range(n)})
    expected = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert (result["low"], result["high"]) == pytest.approx((expected.low, expected.high), abs=1e-10)
    if 0 < k < n:
        assert result["low"] == pytest.approx(stats.beta.ppf(0.025, k, n - k + 1), abs=1e-10)


@pytest.mark.parametrize("values", [[0.1, -0.4, 0.3, 0.25, 0.9], [2.0, 2.5, 1.5, 3.0, 2.2, 2.9, 1.8, 2.4], [-1.0, 1.0]])
def test_the_paired_t_test_equals_scipys(values):
    stats = pytest.importorskip("scipy.stats")
    assert paired_t_p(values) == pytest.approx(stats.ttest_1samp(values, 0.0).pvalue, rel=1e-9)
    assert paired_t_p([1.0]) is None and paired_t_p([0.0, 0.0]) == 1.0 and paired_t_p([2.0, 2.0]) == 0.0


def _all_sign_flips(d: list[float]) -> float:
    """The two-sided sign-flip p by brute force: each of the 2ⁿ sign vectors, one at a time."""
    import itertools

    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12 for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("d", [
    [0.0836, 0.0951, 0.0109, -0.348, 0.166, 0.0394, 0.0971, 0.053],  # the 8-seed run (f3e65f9:results/bb-8seeds, = seeds 0–7 of results/bb): diff − standard, 4-bit linear
    [0.132, 0.139, 0.0781, 0.00543, 0.217, 0.0768, 0.137, 0.207],  # all 8 one way: p = 2/256
    [0.0, 0.5, -0.25, 0.0, -0.25, 0.0, 0.0, -0.25],  # sink score differences: ties and zeros
    [1.0, -2.0, 3.5], [0.0, 0.0],
])
def test_the_sign_flip_test_enumerates_every_sign_assignment(d):
    assert sign_flip_p(d) == pytest.approx(_all_sign_flips(d), abs=1e-15)
    stats = pytest.importorskip("scipy.stats")
    if any(d):  # scipy's exact one-sample permutation test flips signs the same way
        expected = stats.permutation_test((np.array(d),), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue
        assert sign_flip_p(d) == pytest.approx(expected, abs=1e-12)
    assert sign_flip_p([0.132] * 8) == 2 / 256 and sign_flip_p([]) is None
    assert "exact (all 2^8 = 256" in sign_flip_method(8)


def test_above_sixteen_seeds_the_sign_flip_test_samples_with_a_fixed_seed():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    d = list(rng.normal(0.3, 1.0, 18))
    p = sign_flip_p(d)
    assert p == sign_flip_p(d)  # the same resamples every time
    exact = stats.permutation_test((np.array(d),), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue  # 2^18
    assert abs(p - exact) < 4 * math.sqrt(exact * (1 - exact) / RESAMPLES)
    assert f"{RESAMPLES:,} random sign assignments" in sign_flip_method(18)


@pytest.mark.parametrize("reference_only, other_only", [(3, 0), (2, 1), (5, 1), (0, 0), (7, 7), (12, 3)])
def test_the_exact_mcnemar_test_is_the_binomial_test_of_the_discordant_seeds(reference_only, other_only):
    assert mcnemar_exact_p(3, 0) == 0.25  # the sink arm: 0 of 8 against the standard arm's 3 of 8
    stats = pytest.importorskip("scipy.stats")
    discordant = reference_only + other_only
    expected = stats.binomtest(reference_only, discordant, 0.5).pvalue if discordant else 1.0
    assert mcnemar_exact_p(reference_only, other_only) == pytest.approx(expected, rel=1e-12)


def test_holm_adjusts_step_down_and_keeps_the_order():
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → kept monotone at 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == [] and holm([0.2]) == [0.2]
    assert holm([0.01, 0.01]) == [0.02, 0.02]


def test_paired_comparisons_carry_the_test_of_their_kind():
    reference = {str(i): v for i, v in enumerate([10.0, 8.0, 9.0, 12.0, 11.0])}
    other = {str(i): v for i, v in enumerate([5.0, 6.0, 9.5, 4.0, 7.0])}
    ratio, difference = paired(reference, other, ratio=True), paired(reference, other, ratio=False)
    logs = [math.log(reference[s] / other[s]) for s in reference]
    assert (ratio["test"], difference["test"]) == ("t", "sign-flip")
    assert ratio["p"] == paired_t_p(logs) and difference["p"] == sign_flip_p([other[s] - reference[s] for s in reference])
