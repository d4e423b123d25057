"""95% intervals across seeds: of a metric's mean, of a paired comparison, of a share.

The method, and why: with 5–8 seeds a bootstrap has too few distinct resamples to estimate a 2.5% tail, so the
interval of a mean is Student's t on the per-seed values, mean ± t(0.975, n − 1) · s / √n (s: the sample
standard deviation). A quantity that is itself a ratio (the BOS peak ÷ median) and every paired ratio (the
standard arm ÷ another arm, seed by seed) is summarised on the log scale: the geometric mean with the interval
exp(mean(log) ± t · s(log) / √n), so that 2× and 0.5× are equally far from 1 and the interval never crosses 0.
A share of seeds (those with a sink head) gets the Clopper-Pearson exact binomial interval (Clopper & Pearson
1934). One seed gives a value and no interval (None). The t interval assumes the per-seed values are roughly
normal; with this few seeds that cannot be checked, which is why every per-seed value is kept beside its summary,
and why a paired difference of bounded values gets its p-value from a sign-flip permutation test instead
(across_seeds.significance).
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping

from quantdiff.across_seeds.distributions import beta_quantile, t_quantile
from quantdiff.across_seeds.significance import paired_t_p, sign_flip_p

CONFIDENCE = 0.95
METHOD = (
    "Student t over the per-seed values (n − 1 degrees of freedom): mean ± t·s/√n; ratios (BOS peak ÷ median, "
    "and every paired ratio) on the log scale: geometric mean × exp(± t·s_log/√n); share of seeds: "
    "Clopper-Pearson exact interval (Clopper & Pearson 1934). No bootstrap (over 5–12 seeds it has too few "
    "distinct resamples to estimate a 2.5% tail)."
)


def summarize(values: list[float], log: bool = False) -> dict:
    """{n, mean, sd, low, high}: the mean of the finite `values` with its t interval (on the log scale when
    `log`: geometric mean, sd of the logs); low/high None below two values, mean None without any."""
    finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    n = len(finite)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "low": None, "high": None}
    points = [math.log(v) for v in finite] if log else finite
    mean = statistics.fmean(points)
    back = math.exp if log else (lambda x: x)
    if n == 1:
        return {"n": 1, "mean": back(mean), "sd": None, "low": None, "high": None}
    sd = statistics.stdev(points)
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": back(mean), "sd": sd, "low": back(mean - half), "high": back(mean + half)}


def paired(reference: Mapping[str, float | None], other: Mapping[str, float | None], ratio: bool) -> dict:
    """Seed by seed, reference ÷ other (`ratio`) or other − reference, over the seeds where both are finite
    (and positive, for a ratio): the per-seed values, their summary, how many seeds point each way, and the
    two-sided p of no difference (unadjusted): the paired t test on the log ratios for a ratio, the sign-flip
    permutation test for a difference (across_seeds.significance)."""
    usable = lambda v: v is not None and math.isfinite(v) and (v > 0 or not ratio)  # noqa: E731
    seeds = [s for s in reference if s in other and usable(reference[s]) and usable(other[s])]
    values = {s: reference[s] / other[s] if ratio else other[s] - reference[s] for s in seeds}
    neutral = 1.0 if ratio else 0.0
    reference_higher = sum(v > neutral for v in values.values()) if ratio else sum(v < neutral for v in values.values())
    other_higher = sum(v < neutral for v in values.values()) if ratio else sum(v > neutral for v in values.values())
    return {
        "per_seed": values,
        **summarize(list(values.values()), log=ratio),
        "reference_higher": reference_higher,
        "other_higher": other_higher,
        "equal": sum(v == neutral for v in values.values()),
        "test": "t" if ratio else "sign-flip",
        "p": paired_t_p([math.log(v) for v in values.values()]) if ratio else sign_flip_p(list(values.values())),
    }


def share(flags: Mapping[str, bool]) -> dict:
    """{per_seed, k, n, share, low, high}: how many seeds the flag holds in, with its exact interval (Clopper &
    Pearson 1934: the beta quantiles of k and k + 1)."""
    n, k = len(flags), sum(bool(f) for f in flags.values())
    if n == 0:
        return {"per_seed": {}, "k": 0, "n": 0, "share": None, "low": None, "high": None}
    alpha = 1.0 - CONFIDENCE
    low = 0.0 if k == 0 else beta_quantile(alpha / 2, k, n - k + 1)
    high = 1.0 if k == n else beta_quantile(1 - alpha / 2, k + 1, n - k)
    return {"per_seed": dict(flags), "k": k, "n": n, "share": k / n, "low": low, "high": high}
