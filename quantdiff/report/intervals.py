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

from quantdiff.across_seeds.distributions import t_quantile


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
    return t_quantile(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def over_seeds(values: Sequence[float]) -> Estimate:
    """The mean of one value per seed, with its t interval."""
    return Estimate(statistics.fmean(values), half_width(values), len(values), "seeds")


def over_blocks(pooled: float, blocks: Sequence[float]) -> Estimate:
    """One evaluation's pooled value, with the t interval of its blocks' mean (batch means)."""
    return Estimate(pooled, half_width(blocks), len(blocks), "blocks")
