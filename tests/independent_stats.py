"""Independent references for the across-seed tests, written out from the definitions with no numpy and no
quantdiff: the sign-flip permutation test by brute force over every sign assignment (Fisher 1935), and Holm's
step-down adjustment (Holm 1979)."""

from __future__ import annotations

import itertools


def sign_flip(d: list[float]) -> float:
    """Two-sided p: the share of all 2ⁿ sign assignments whose |sum| reaches the observed |sum|."""
    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12 for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


def holm(p: list[float]) -> list[float]:
    """Holm-adjusted p-values in the order given."""
    m, out, running = len(p), [0.0] * len(p), 0.0
    for rank, i in enumerate(sorted(range(m), key=p.__getitem__)):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out
