"""p-values across seeds and their correction for multiplicity, with numpy and math only (scipy is not a runtime
dependency; the tests check every function against it).

Which test a paired comparison gets is a property of its metric, fixed before any data is seen, never chosen by
how the differences look:
- a ratio of two positive, unbounded magnitudes (the Top-1 |attention logit| and |hidden state|, the BOS peak ÷
  median), compared on the log scale: the paired t test on the per-seed log ratios (Student 1908), the test
  that belongs to the t interval reported beside it (p < 0.05 exactly when that interval excludes 1×);
- a difference of bounded or discrete values (accuracy near its ceiling, the sink score's four values, the
  attention mass on position 0): the sign-flip permutation test of the mean difference (Fisher 1935; Good,
  "Permutation Tests", 2005, §3.3). Under the null the sign of each seed's difference is a fair coin; the
  p-value is the share of the 2ⁿ sign assignments whose |mean| reaches the observed one — enumerated exactly
  for n ≤ EXACT_MAX_SEEDS, else estimated from RESAMPLES random assignments drawn with RESAMPLE_SEED;
- a paired yes/no per seed (a sink head in the reference arm, in the other arm): the exact McNemar test
  (McNemar 1947), the two-sided binomial test of the discordant seeds at ½;
- a family of comparisons named before the run: Holm's step-down correction (Holm 1979), which controls the
  family-wise error rate without any assumption on how the tests depend on each other.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from quantdiff.across_seeds.distributions import t_cdf

EXACT_MAX_SEEDS = 16  # 2¹⁶ = 65,536 sign assignments: enumerated
RESAMPLES = 100_000  # random sign assignments above that
RESAMPLE_SEED = 0
_CHUNK = 8192  # sign assignments per numpy block: memory stays O(chunk × n)


def paired_t_p(values: list[float]) -> float | None:
    """Two-sided p of the one-sample t test of mean 0 (Student 1908): on per-seed log ratios, the paired t test.
    None below two values; with no spread, 1 for a mean of 0 and 0 otherwise."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    return min(1.0, 2.0 * (1.0 - t_cdf(t, n - 1)))


def _sign_blocks(n: int):
    """Blocks of ±1 sign vectors (rows): all 2ⁿ for n ≤ EXACT_MAX_SEEDS, else RESAMPLES random ones."""
    if n <= EXACT_MAX_SEEDS:
        codes = np.arange(2**n, dtype=np.int64)
        for start in range(0, codes.size, _CHUNK):
            bits = (codes[start:start + _CHUNK, None] >> np.arange(n)) & 1
            yield 1 - 2 * bits
        return
    rng = np.random.default_rng(RESAMPLE_SEED)
    for start in range(0, RESAMPLES, _CHUNK):
        yield rng.choice(np.array([-1, 1]), size=(min(_CHUNK, RESAMPLES - start), n))


def sign_flip_p(differences: list[float]) -> float | None:
    """Two-sided p of the sign-flip permutation test of a mean paired difference of 0 (Fisher 1935): the share
    of sign assignments whose |sum| is at least the observed |sum| (exact over all 2ⁿ for n ≤ EXACT_MAX_SEEDS;
    else (1 + hits) / (1 + RESAMPLES), the observed assignment counted, over a fixed-seed random sample).
    None without values."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        return None
    observed = abs(d.sum())
    tolerance = 1e-12 * float(np.abs(d).sum())  # sums of the same numbers in another order: equal, not below
    hits = total = 0
    for signs in _sign_blocks(d.size):
        hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tolerance))
        total += signs.shape[0]
    if d.size <= EXACT_MAX_SEEDS:
        return hits / total
    return (1 + hits) / (1 + total)


def sign_flip_method(n: int) -> str:
    """How `sign_flip_p` computes its p for n seeds, in words."""
    if n <= EXACT_MAX_SEEDS:
        return f"sign-flip permutation, exact (all 2^{n} = {2**n:,} sign assignments)"
    return f"sign-flip permutation, {RESAMPLES:,} random sign assignments (numpy seed {RESAMPLE_SEED})"


def binomial_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p), summed exactly term by term."""
    return math.fsum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(0, min(k, n) + 1))


def mcnemar_exact_p(reference_only: int, other_only: int) -> float:
    """Two-sided p of the exact McNemar test (McNemar 1947): of the discordant pairs, how unlikely a split at
    least this uneven is when each falls either way with probability ½. 1 without discordant pairs."""
    discordant = reference_only + other_only
    if discordant == 0:
        return 1.0
    return min(1.0, 2.0 * binomial_cdf(min(reference_only, other_only), discordant))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: sorted ascending, the i-th smallest
    (i from 0) becomes max over j ≤ i of min(1, (m − j) · p₍ⱼ₎). Reject at level α where the adjusted p ≤ α."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted
