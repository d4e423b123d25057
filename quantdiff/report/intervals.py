"""Student-t 95% intervals of a mean: over seeds, or over blocks of evaluation items (batch means).

With n values x_i the interval is mean ± t(0.975, n − 1) · sd / √n, sd the sample standard deviation. Blocks of
one evaluation's items are the batch-means estimate of a metric's sampling error (its items are correlated within
a window or sequence, not across blocks); seeds add the training run's variance.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# t(0.975, df) for df = 1 … 30 (standard tables); beyond, Hill's (1970) expansion is within 1e-3.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Estimate:
    """A value with its 95% interval half-width (None from a single unit), over `units` seeds or blocks."""

    value: float
    half_width: float | None
    units: int
    over: str  # "seeds" or "blocks"

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.value - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.value + self.half_width

    @property
    def excludes_zero(self) -> bool:
        return self.half_width is not None and (self.low > 0 or self.high < 0)

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "units": self.units, "over": self.over}


def half_width(values: Sequence[float]) -> float | None:
    """t(0.975, n − 1) · sd / √n of `values`; None for fewer than two."""
    if len(values) < 2:
        return None
    return t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def over_seeds(values: Sequence[float]) -> Estimate:
    """The mean of one value per seed, with its t interval."""
    return Estimate(statistics.fmean(values), half_width(values), len(values), "seeds")


def over_blocks(pooled: float, blocks: Sequence[float]) -> Estimate:
    """One evaluation's pooled value, with the t interval of its blocks' mean (batch means)."""
    return Estimate(pooled, half_width(blocks), len(blocks), "blocks")
