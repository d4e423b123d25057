"""Mergeable statistics of activation magnitudes |x| for G independent groups (e.g. one per (layer, head)).

An `AbsStats` is three parts fed by the same tiles:
- `Moments`: counts of finite, NaN and Inf values (non-finite values never enter the other parts) and power
  sums for mean, standard deviation and kurtosis;
- `Histogram`: |x| over fixed log-spaced bins, for quantiles within QUANTILE_RELATIVE_ERROR;
- `LocatedTopK`: the exact top-k of |x| with the location of each value.

Coarser views (a layer, a map, the whole model) are exact poolings of groups, and merging two AbsStats of the
same layout is exact in the same way, so batches, processes and machines combine losslessly. Everything stays
on the tensors' device until reported.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from quantdiff.stats.histogram import Histogram, quantile_values
from quantdiff.stats.moments import Moments
from quantdiff.stats.tile import exact_summary, summarize
from quantdiff.stats.topk import Locate, LocatedTopK
from quantdiff.stats.workspace import Workspace

DEFAULT_QUANTILES = (0.5, 0.9, 0.99, 0.999, 0.9999)


class AbsStats:
    """Statistics of |x| for G groups; see the module docstring. Build with `AbsStats.empty`."""

    def __init__(self, moments: Moments, histogram: Histogram, top: LocatedTopK) -> None:
        self.moments, self.histogram, self.top = moments, histogram, top
        self._workspace = Workspace()
        self.fused = False  # True: per-element work through the compiled `tile.fused_tile` (fast on CUDA)

    @classmethod
    def empty(cls, groups: int, k: int, location_names: Sequence[str], device: torch.device | str = "cpu") -> AbsStats:
        if groups < 1 or k < 1:
            raise ValueError("need at least one group and k ≥ 1")
        return cls(Moments.empty(groups, device), Histogram.empty(groups, device), LocatedTopK.empty(groups, k, location_names, device))

    # The parts' tensors under their reported names.
    location_names = property(lambda self: self.top.location_names)
    count = property(lambda self: self.moments.count)
    nan = property(lambda self: self.moments.nan)
    inf = property(lambda self: self.moments.inf)
    power_sums = property(lambda self: self.moments.power_sums)
    hist = property(lambda self: self.histogram.counts)
    top_values = property(lambda self: self.top.values)
    top_locations = property(lambda self: self.top.locations)

    @property
    def groups(self) -> int:
        return self.count.shape[0]

    @property
    def k(self) -> int:
        return self.top.k

    @property
    def device(self) -> torch.device:
        return self.count.device

    @contextmanager
    def deferred_merges(self) -> Iterator[AbsStats]:
        """Within the block, top-k candidates are merged once at its end (see `LocatedTopK.deferred_merges`)."""
        with self.top.deferred_merges():
            yield self

    def update(self, x: torch.Tensor, group_start: int = 0, valid: torch.Tensor | None = None, locate: Locate | None = None) -> None:
        """Observe x of shape (A, g, M) for groups group_start … group_start+g-1.

        valid: bool broadcastable to x (only True entries are observed), None = all.
        locate(a, g, m) -> (n, L) int64 locations of entries x[a, g, m] (g relative to group_start);
        None records (a, g + group_start, m) when there are three location names.
        """
        if x.dim() != 3:
            raise ValueError(f"update expects (A, groups, M), got {tuple(x.shape)}")
        x = x.float()
        n_rows, n_groups, m = x.shape
        groups = slice(group_start, group_start + n_groups)
        tile = summarize(x, valid, self._workspace, self.fused)
        threshold, observed = self.top.candidates(tile.a, valid, group_start)
        any_candidate, all_finite = torch.stack([self.top.reaches(tile.a, threshold), tile.finite]).tolist()  # the tile's one device sync
        if not all_finite:  # rare: NaN/Inf present (or x⁴ overflows float32) → exact float64 path
            seen = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.expand_as(x)
            self.moments.add_nonfinite(groups, x, seen)
            valid = torch.isfinite(x) & seen
            tile = exact_summary(x, valid)
            threshold, observed = self.top.candidates(tile.a, valid, group_start)
            any_candidate = True
        self.moments.add(groups, tile.n_valid, tile.sums)
        self.histogram.add(groups, tile.histogram_index(self._workspace), n_rows * m - tile.n_valid)
        if any_candidate:
            self.top.take(tile.a, threshold, observed, group_start, locate)

    def merge(self, other: AbsStats) -> AbsStats:
        """Add `other` (same groups, k and location names) into self, exactly; returns self."""
        if (other.groups, other.k, other.location_names) != (self.groups, self.k, self.location_names):
            raise ValueError("cannot merge statistics of different layouts")
        other = other.to(self.device)
        self.moments.merge(other.moments)
        self.histogram.merge(other.histogram)
        self.top.merge(other.top)
        return self

    def pooled(self, groups: Sequence[int] | None = None) -> AbsStats:
        """One group holding exactly the statistics of the union of `groups` (None: all)."""
        index = torch.arange(self.groups, device=self.device) if groups is None else torch.as_tensor(list(groups), device=self.device)
        return AbsStats(self.moments.pooled(index), self.histogram.pooled(index), self.top.pooled(index))

    def to(self, device: torch.device | str) -> AbsStats:
        return AbsStats(self.moments.to(device), self.histogram.to(device), self.top.to(device))

    def summary(self, quantiles: Sequence[float] = DEFAULT_QUANTILES, top: int | None = None) -> dict:
        """JSON-ready numbers for a single group (pool first): count, non-finite, top-k with locations, quantiles, moments."""
        if self.groups != 1:
            raise ValueError("summary() needs one group: call pooled() first")
        cpu = self.to("cpu")
        n = int(cpu.count[0])
        topk = cpu.top.entries(top)
        out = {
            "count": n,
            "nonfinite": {"nan": int(cpu.nan[0]), "inf": int(cpu.inf[0])},
            "max": topk[0]["value"] if topk else None,
            "topk": topk,
            "median": None,
            "quantiles": {},
        }
        if n > 0:
            *qs, median = quantile_values(cpu.hist[0], n, [*quantiles, 0.5], float(cpu.top_values[0, 0]))
            out["quantiles"], out["median"] = {f"{q:g}": v for q, v in zip(quantiles, qs)}, median
        return {**out, **cpu.moments.summary()}

    def to_dict(self) -> dict:
        """JSON-safe and exact: float32 and float64 values survive as Python floats; histograms stored sparse."""
        return {
            "location_names": list(self.location_names),
            "groups": self.groups,
            "k": self.k,
            **self.moments.to_dict(),
            "hist": self.histogram.to_dict(),
            "top_values": self.top_values.tolist(),
            "top_locations": self.top_locations.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str = "cpu") -> AbsStats:
        groups, k = data["groups"], data["k"]
        top = LocatedTopK(
            torch.tensor(data["top_values"], dtype=torch.float32, device=device).view(groups, k),
            torch.tensor(data["top_locations"], dtype=torch.int64, device=device).view(groups, k, -1),
            data["location_names"],
        )
        return cls(Moments.from_dict(data, device), Histogram.from_dict(data["hist"], groups, device), top)
