"""Histograms of |x| over fixed log-spaced bins, binned exactly by the float32 bit pattern.

2**MANTISSA_BITS bins per octave from 2**MIN_EXP to 2**MAX_EXP, one underflow bin below and one overflow bin
above, so every quantile is reported within QUANTILE_RELATIVE_ERROR of the exact value. Histograms of the same
layout add, so pooling groups and merging batches or processes is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

MANTISSA_BITS = 9  # 512 bins per octave: a bin spans at most 2**-9 of its lower edge
MIN_EXP, MAX_EXP = -24, 24  # log bins cover [2**-24, 2**24); smaller |x| underflow, larger overflow
QUANTILE_RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)  # bin midpoint vs any value in the bin (≈ 0.098%)
SHIFT = 23 - MANTISSA_BITS  # float32 bits >> SHIFT = (exponent, top mantissa bits): monotone in |x|
LO = (127 + MIN_EXP) << MANTISSA_BITS  # code of 2**MIN_EXP
HI = (127 + MAX_EXP) << MANTISSA_BITS  # code of 2**MAX_EXP
N_BINS = HI - LO + 2  # column 0: [0, 2**MIN_EXP); columns 1 … HI-LO: log bins; last: [2**MAX_EXP, inf)
HIST_LANES_CUDA = 32  # private histogram copies on CUDA: atomics on the few bins holding the bulk serialise


def bin_index(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(A, g, M) |x| (float32 ≥ 0) -> flat indices into (lanes, g, N_BINS) counts: the histogram column (the float
    bits >> SHIFT are monotone in |x|) plus the group's (and lane's) offset, added in one pass."""
    n_rows, n_groups, m = a.shape
    codes = torch.bitwise_right_shift(a.view(torch.int32), SHIFT, out=out)
    return codes.clamp_(LO - 1, HI).add_(index_offsets(n_groups, m, a.device) - (LO - 1))


@lru_cache(maxsize=1)
def bin_midpoints() -> torch.Tensor:
    """(N_BINS,) float64 on CPU, representative value of each column: 0 for underflow, the midpoint of log
    bins, 2**MAX_EXP for overflow."""
    edges = (torch.arange(LO, HI + 1, dtype=torch.int32) << SHIFT).view(torch.float32).double()
    return torch.cat([torch.zeros(1, dtype=torch.float64), (edges[:-1] + edges[1:]) / 2, edges[-1:]])


def histogram_lanes(device: torch.device) -> int:
    return HIST_LANES_CUDA if device.type == "cuda" else 1


def index_offsets(n_groups: int, m: int, device: torch.device) -> torch.Tensor:
    """(1, g, 1|M) int32 offsets turning the columns of a (A, g, M) tile into flat indices of (lanes, g, N_BINS)
    counts. On CUDA, entries are spread over HIST_LANES_CUDA private copies by position."""
    offsets = torch.arange(n_groups, dtype=torch.int32, device=device).view(1, -1, 1) * N_BINS
    lanes = histogram_lanes(device)
    if lanes > 1:
        offsets = offsets + (torch.arange(m, dtype=torch.int32, device=device) % lanes).view(1, 1, -1) * (n_groups * N_BINS)
    return offsets


def count_bins(index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(g, N_BINS) counts of flat histogram indices, without a device sync (bincount syncs for its size)."""
    lanes = histogram_lanes(index.device)
    ones = torch.ones(1, dtype=torch.int64, device=index.device).expand(index.numel())
    counts = torch.zeros(lanes * n_groups * N_BINS, dtype=torch.int64, device=index.device).index_add_(0, index.reshape(-1), ones)
    return counts.view(lanes, n_groups, N_BINS).sum(dim=0)


def quantile_values(hist: torch.Tensor, count: int, quantiles: Sequence[float], maximum: float) -> list[float]:
    """Quantile q = the value of rank floor(q·(count−1)) (0-based, ascending; torch.quantile's 'lower'),
    as its bin midpoint: within QUANTILE_RELATIVE_ERROR relative of exact in [2**MIN_EXP, 2**MAX_EXP).
    Below, 0 is reported (absolute error < 2**MIN_EXP); above, the maximum (an upper bound)."""
    cumulative = torch.cumsum(hist.to("cpu"), 0)
    ranks = torch.tensor([int(q * (count - 1)) for q in quantiles], dtype=torch.int64)
    columns = torch.searchsorted(cumulative, ranks, right=True).clamp(max=N_BINS - 1)
    mids = bin_midpoints()
    return [maximum if c == N_BINS - 1 else float(mids[c]) for c in columns.tolist()]


@dataclass
class Histogram:
    """(G, N_BINS) int64 counts of observed finite |x| per group."""

    counts: torch.Tensor

    @classmethod
    def empty(cls, groups: int, device: torch.device | str) -> Histogram:
        return cls(torch.zeros(groups, N_BINS, dtype=torch.int64, device=device))

    def add(self, groups: slice, index: torch.Tensor, unobserved: torch.Tensor | int) -> None:
        """Count a tile's flat indices into `groups`; `unobserved` (per group) entries were zeroed into column 0."""
        tile = count_bins(index, groups.stop - groups.start)
        tile[:, 0] -= unobserved  # unobserved entries were zeroed: take them out of column 0 again
        self.counts[groups] += tile

    def merge(self, other: Histogram) -> None:
        self.counts.add_(other.counts)

    def pooled(self, index: torch.Tensor) -> Histogram:
        return Histogram(self.counts[index].sum(dim=0, keepdim=True))

    def to(self, device: torch.device | str) -> Histogram:
        return Histogram(self.counts.to(device))

    def to_dict(self) -> dict:
        """Sparse: the flat indices of non-empty bins and their counts."""
        flat = self.counts.view(-1)
        nonzero = torch.nonzero(flat).view(-1)
        return {"index": nonzero.tolist(), "count": flat[nonzero].tolist()}

    @classmethod
    def from_dict(cls, data: dict, groups: int, device: torch.device | str) -> Histogram:
        histogram = cls.empty(groups, device)
        index = torch.tensor(data["index"], dtype=torch.int64, device=device)
        histogram.counts.view(-1)[index] = torch.tensor(data["count"], dtype=torch.int64, device=device)
        return histogram
