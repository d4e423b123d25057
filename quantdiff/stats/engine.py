"""Mergeable statistics of activation magnitudes |x| (pure tensor code: no model knowledge).

`AbsStats` holds G independent groups (e.g. one per (layer, head)) and per group:
- `count` of finite observed values, `nan` and `inf` counts (non-finite values are counted, never enter
  top-k, histogram or moments);
- the exact top-k of |x| with the location of each value, under the total order
  (|x| descending, then location ascending), so ties are resolved the same way however data is split;
- a histogram of |x| over fixed log-spaced bins: 2**MANTISSA_BITS bins per octave from 2**MIN_EXP to
  2**MAX_EXP (one underflow bin below, one overflow bin above), binned by the float32 bit pattern, so
  binning is exact and every quantile is reported within QUANTILE_RELATIVE_ERROR of the exact value;
- power sums Σx, Σx², Σx³, Σx⁴ (float64) for mean, standard deviation and kurtosis.

Coarser views (a layer, a map, the whole model) are exact poolings of groups: counts, histograms and sums
add, and the top-k of a union is the top-k of the union of the groups' top-k. Merging two AbsStats of the
same layout is exact in the same way, so batches, processes and machines combine losslessly.

`ChannelStats` adds what hidden states need per channel: SmoothQuant's act scales (per-channel max |x|)
and LLM.int8's outlier features. Everything stays on the tensors' device until reported.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Sequence

import torch

MANTISSA_BITS = 9  # 512 bins per octave: a bin spans at most 2**-9 of its lower edge
MIN_EXP, MAX_EXP = -24, 24  # log bins cover [2**-24, 2**24); smaller |x| underflow, larger overflow
QUANTILE_RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)  # bin midpoint vs any value in the bin (≈ 0.098%)
_SHIFT = 23 - MANTISSA_BITS  # float32 bits >> _SHIFT = (exponent, top mantissa bits): monotone in |x|
_LO = (127 + MIN_EXP) << MANTISSA_BITS  # code of 2**MIN_EXP
_HI = (127 + MAX_EXP) << MANTISSA_BITS  # code of 2**MAX_EXP
HIST_LANES_CUDA = 32  # private histogram copies on CUDA: atomics on the few bins holding the bulk serialise
N_BINS = _HI - _LO + 2  # column 0: [0, 2**MIN_EXP); columns 1 … _HI-_LO: log bins; last: [2**MAX_EXP, inf)
DEFAULT_QUANTILES = (0.5, 0.9, 0.99, 0.999, 0.9999)
EMPTY = -1.0  # top-k slot not filled yet (|x| ≥ 0)
SIGNIFICANT_DIGITS = 8  # moments are float sums whose last bits depend on summation order: round them

LLM_INT8_THRESHOLD = 6.0
LLM_INT8_LAYER_FRACTION = 0.25
LLM_INT8_POSITION_FRACTION = 0.06


def bin_codes(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Histogram column of each |x| in `a` (float32 ≥ 0): the float bits >> _SHIFT are monotone in |x|."""
    codes = torch.bitwise_right_shift(a.view(torch.int32), _SHIFT, out=out)
    return codes.clamp_(_LO - 1, _HI).sub_(_LO - 1)


class Workspace:
    """Tile-sized scratch tensors reused across updates. On CPU a fresh allocation of this size page-faults
    on every tile and cost 4-5× the arithmetic writing into it (measured on abs, x², shifts)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < n or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(n, dtype=dtype, device=device)
        return buffer[:n].view(shape)


@lru_cache(maxsize=1)
def bin_midpoints() -> torch.Tensor:
    """(N_BINS,) float64 on CPU, representative value of each column: 0 for underflow, the midpoint of log
    bins, 2**MAX_EXP for overflow."""
    edges = (torch.arange(_LO, _HI + 1, dtype=torch.int32) << _SHIFT).view(torch.float32).double()
    return torch.cat([torch.zeros(1, dtype=torch.float64), (edges[:-1] + edges[1:]) / 2, edges[-1:]])


def _round(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


def _lexsort_desc(values: torch.Tensor, groups: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """Permutation ordering entries by group ascending, value descending, location ascending."""
    perm = torch.arange(values.numel(), device=values.device)
    for col in reversed(range(locations.shape[1])):  # least significant key first, stable sorts keep it
        perm = perm[torch.sort(locations[perm, col], stable=True).indices]
    perm = perm[torch.sort(values[perm], descending=True, stable=True).indices]
    return perm[torch.sort(groups[perm], stable=True).indices]


def select_top(
    values: torch.Tensor, groups: torch.Tensor, locations: torch.Tensor, n_groups: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k first entries of each group in the total order; ((G, k) values, (G, k, L) locations).

    Every group must hold at least k entries (EMPTY-padded ones count).
    """
    perm = _lexsort_desc(values, groups, locations)
    groups = groups[perm]
    starts = torch.searchsorted(groups, torch.arange(n_groups, device=groups.device))  # first entry of each group
    slot = (torch.arange(groups.numel(), device=groups.device) - starts[groups]).clamp_(max=k)  # rank; k = dropped
    # Fixed-size scatter with a spill column instead of boolean selection: no device sync.
    out_v = torch.empty(n_groups, k + 1, dtype=values.dtype, device=values.device)
    out_l = torch.empty(n_groups, k + 1, locations.shape[1], dtype=locations.dtype, device=locations.device)
    out_v[groups, slot] = values[perm]
    out_l[groups, slot] = locations[perm]
    return out_v[:, :k].contiguous(), out_l[:, :k].contiguous()


Locate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class AbsStats:
    """Statistics of |x| for G groups; see the module docstring. Build with `AbsStats.empty`."""

    location_names: tuple[str, ...]
    count: torch.Tensor  # (G,) int64 finite values observed
    nan: torch.Tensor  # (G,) int64
    inf: torch.Tensor  # (G,) int64
    power_sums: torch.Tensor  # (G, 4) float64: Σx, Σx², Σx³, Σx⁴ over finite values
    hist: torch.Tensor  # (G, N_BINS) int64
    top_values: torch.Tensor  # (G, k) float32, descending, EMPTY-padded
    top_locations: torch.Tensor  # (G, k, len(location_names)) int64, -1 where EMPTY

    def __post_init__(self) -> None:
        # Python-side cache of "k-th value > 0" per group: lets the hot path skip a device sync once filled.
        self._positive_kth = [False] * self.groups
        self._workspace = Workspace()
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None  # see deferred_merges
        self.fused = False  # True: per-element work through the compiled `fused_tile` (fast on CUDA)

    @contextmanager
    def deferred_merges(self) -> Iterator[AbsStats]:
        """Within the block, top-k candidates are collected and merged once at its end: one sort instead of
        one per update. Candidates are still filtered by the k-th values at entry, so the result is exact."""
        self._pending = []
        try:
            yield self
        finally:
            pending, self._pending = self._pending, None
            if pending:
                self._merge_top(*(torch.cat(parts) for parts in zip(*pending)))

    @classmethod
    def empty(cls, groups: int, k: int, location_names: Sequence[str], device: torch.device | str = "cpu") -> AbsStats:
        if groups < 1 or k < 1:
            raise ValueError("need at least one group and k ≥ 1")
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(
            location_names=tuple(location_names),
            count=zeros(groups),
            nan=zeros(groups),
            inf=zeros(groups),
            power_sums=zeros(groups, 4, dtype=torch.float64),
            hist=zeros(groups, N_BINS),
            top_values=torch.full((groups, k), EMPTY, device=device),
            top_locations=torch.full((groups, k, len(location_names)), -1, dtype=torch.int64, device=device),
        )

    @property
    def groups(self) -> int:
        return self.count.shape[0]

    @property
    def k(self) -> int:
        return self.top_values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.count.device

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
        if self.fused:
            a, sums, n_valid, finite, index = _fused_summary(x, valid)
        else:
            a, sums, n_valid, finite = _tile_summary(x, valid, self._workspace)
            index = None
        a_top, threshold = self._candidate_values(a, valid, group_start)
        # A row (one group of one sequence) whose max is below its group's k-th value adds nothing to the top k:
        # the common case once statistics have filled, and then the tile needs no compare and no nonzero scan.
        reaches = a_top.amax(dim=-1, keepdim=True) >= threshold  # (A, g, 1)
        any_candidate, all_finite = torch.stack([reaches.any(), finite]).tolist()  # the tile's one device sync
        if not all_finite:  # rare: NaN/Inf present (or x⁴ overflows float32) → exact float64 path
            finite = torch.isfinite(x)
            seen = torch.ones_like(finite) if valid is None else valid.expand_as(x)
            self.nan[groups] += (torch.isnan(x) & seen).sum(dim=(0, 2))
            self.inf[groups] += (torch.isinf(x) & seen).sum(dim=(0, 2))
            valid = finite & seen
            a, sums, n_valid, _ = _tile_summary(x.double().masked_fill(~valid, 0.0), valid, Workspace())
            a, index = a.float(), None
            a_top, threshold = self._candidate_values(a, valid, group_start)
            any_candidate = True
        self.count[groups] += n_valid
        self.power_sums[groups] += sums
        if index is None:
            index = _histogram_index(bin_codes(a, self._workspace.get("codes", a.shape, torch.int32, a.device)))
        tile_hist = _count_bins(index, n_groups)
        tile_hist[:, 0] -= n_rows * m - n_valid  # unobserved entries were zeroed: take them out of column 0 again
        self.hist[groups] += tile_hist
        if any_candidate:
            self._take_top(a_top, threshold, group_start, locate)

    def _candidate_values(self, a: torch.Tensor, valid: torch.Tensor | None, group_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, (1, g, 1) threshold): entries ≥ their group's current k-th value (ties included) may enter
        the top k; selecting among them keeps the top k exact.

        Unobserved entries of `a` are 0: harmless once every k-th value is positive (the usual case after the
        first tile); until then they are masked out explicitly.
        """
        n_groups = a.shape[1]
        threshold = self.top_values[group_start : group_start + n_groups, self.k - 1].view(1, -1, 1)
        if not all(self._positive_kth[group_start : group_start + n_groups]):
            positive = (threshold > 0).view(-1).tolist()
            self._positive_kth[group_start : group_start + n_groups] = positive
            if not all(positive):
                threshold = threshold.clamp(min=0.0)
                a = a if valid is None else a.masked_fill(~valid, EMPTY)
        return a, threshold

    def _take_top(self, a: torch.Tensor, threshold: torch.Tensor, group_start: int, locate: Locate | None) -> None:
        n_rows, n_groups, m = a.shape
        mask = torch.ge(a, threshold, out=self._workspace.get("mask", a.shape, torch.bool, a.device))
        if int(torch.count_nonzero(mask)) > self.k * n_rows * n_groups:  # early on nearly everything passes
            kth = a.topk(min(self.k, m), dim=-1).values[..., -1:]  # (A, g, 1)
            mask = a >= torch.maximum(threshold, kth)  # an entry of the top k of a union is in the top k of its row
        rows, cols, flat = mask.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return
        if locate is None:
            if len(self.location_names) != 3:
                raise ValueError("pass locate() unless locations are (row, group, flat)")
            locations = torch.stack([rows, cols + group_start, flat], dim=1)
        else:
            locations = locate(rows, cols, flat)
        if self._pending is not None:
            self._pending.append((a[rows, cols, flat], cols + group_start, locations))
        else:
            self._merge_top(a[rows, cols, flat], cols + group_start, locations)

    def _merge_top(self, values: torch.Tensor, groups: torch.Tensor, locations: torch.Tensor) -> None:
        g, k = self.top_values.shape
        own_groups = torch.arange(g, device=self.device).repeat_interleave(k)
        self.top_values, self.top_locations = select_top(
            torch.cat([self.top_values.view(-1), values]),
            torch.cat([own_groups, groups]),
            torch.cat([self.top_locations.view(g * k, -1), locations]),
            g,
            k,
        )

    def merge(self, other: AbsStats) -> AbsStats:
        """Add `other` (same groups, k and location names) into self, exactly; returns self."""
        if (other.groups, other.k, other.location_names) != (self.groups, self.k, self.location_names):
            raise ValueError("cannot merge statistics of different layouts")
        other = other.to(self.device)
        for name in ("count", "nan", "inf", "power_sums", "hist"):
            getattr(self, name).add_(getattr(other, name))
        own_groups = torch.arange(self.groups, device=self.device).repeat_interleave(self.k)
        self._merge_top(other.top_values.view(-1), own_groups, other.top_locations.view(self.groups * self.k, -1))
        return self

    def pooled(self, groups: Sequence[int] | None = None) -> AbsStats:
        """One group holding exactly the statistics of the union of `groups` (None: all)."""
        index = torch.arange(self.groups, device=self.device) if groups is None else torch.as_tensor(list(groups), device=self.device)
        n, k = index.numel(), self.k
        values, locations = select_top(
            self.top_values[index].view(-1),
            torch.zeros(n * k, dtype=torch.int64, device=self.device),
            self.top_locations[index].view(n * k, -1),
            1,
            k,
        )
        sums = lambda t: t[index].sum(dim=0, keepdim=True)  # noqa: E731
        return AbsStats(self.location_names, sums(self.count), sums(self.nan), sums(self.inf), sums(self.power_sums), sums(self.hist), values, locations)

    def to(self, device: torch.device | str) -> AbsStats:
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return AbsStats(self.location_names, **moved)

    def summary(self, quantiles: Sequence[float] = DEFAULT_QUANTILES, top: int | None = None) -> dict:
        """JSON-ready numbers for a single group (pool first): count, non-finite, top-k with locations, quantiles, moments."""
        if self.groups != 1:
            raise ValueError("summary() needs one group: call pooled() first")
        cpu = self.to("cpu")
        n = int(cpu.count[0])
        values = cpu.top_values[0]
        filled = int((values >= 0).sum())
        top = filled if top is None else min(top, filled)
        topk = [
            {"value": float(values[i]), **{name: int(v) for name, v in zip(self.location_names, cpu.top_locations[0, i].tolist())}}
            for i in range(top)
        ]
        s1, s2, s3, s4 = cpu.power_sums[0].tolist()
        out = {
            "count": n,
            "nonfinite": {"nan": int(cpu.nan[0]), "inf": int(cpu.inf[0])},
            "max": topk[0]["value"] if topk else None,
            "topk": topk,
            "median": None,
            "quantiles": {},
            "mean": None,
            "std": None,
            "kurtosis": None,
        }
        if n == 0:
            return out
        *qs, median = quantile_values(cpu.hist[0], n, [*quantiles, 0.5], float(values[0]))
        out["quantiles"], out["median"] = {f"{q:g}": v for q, v in zip(quantiles, qs)}, median
        mean = s1 / n
        var = max(s2 / n - mean**2, 0.0)
        out["mean"], out["std"] = _round(mean), _round(var**0.5)
        if var > 0:
            m4 = s4 / n - 4 * mean * s3 / n + 6 * mean**2 * s2 / n - 3 * mean**4
            out["kurtosis"] = _round(m4 / var**2)
        return out

    def to_dict(self) -> dict:
        """JSON-safe and exact: float32 and float64 values survive as Python floats; histograms stored sparse."""
        flat = self.hist.view(-1)
        nonzero = torch.nonzero(flat).view(-1)
        return {
            "location_names": list(self.location_names),
            "groups": self.groups,
            "k": self.k,
            "count": self.count.tolist(),
            "nan": self.nan.tolist(),
            "inf": self.inf.tolist(),
            "power_sums": self.power_sums.tolist(),
            "hist": {"index": nonzero.tolist(), "count": flat[nonzero].tolist()},
            "top_values": self.top_values.tolist(),
            "top_locations": self.top_locations.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str = "cpu") -> AbsStats:
        stats = cls.empty(data["groups"], data["k"], data["location_names"], device)
        stats.count = torch.tensor(data["count"], dtype=torch.int64, device=device)
        stats.nan = torch.tensor(data["nan"], dtype=torch.int64, device=device)
        stats.inf = torch.tensor(data["inf"], dtype=torch.int64, device=device)
        stats.power_sums = torch.tensor(data["power_sums"], dtype=torch.float64, device=device).view(-1, 4)
        index = torch.tensor(data["hist"]["index"], dtype=torch.int64, device=device)
        stats.hist.view(-1)[index] = torch.tensor(data["hist"]["count"], dtype=torch.int64, device=device)
        stats.top_values = torch.tensor(data["top_values"], dtype=torch.float32, device=device).view(stats.groups, stats.k)
        stats.top_locations = torch.tensor(data["top_locations"], dtype=torch.int64, device=device).view(stats.groups, stats.k, -1)
        return stats


_TENSOR_FIELDS = ("count", "nan", "inf", "power_sums", "hist", "top_values", "top_locations")


def _histogram_lanes(device: torch.device) -> int:
    return HIST_LANES_CUDA if device.type == "cuda" else 1


def _histogram_index(codes: torch.Tensor) -> torch.Tensor:
    """(A, g, M) histogram columns -> flat indices into (lanes, g, N_BINS) counts (in place).

    On CUDA, entries are spread over HIST_LANES_CUDA private copies by position: atomics on the few bins
    holding the bulk of the values would otherwise serialise.
    """
    n_rows, n_groups, m = codes.shape
    codes.add_(torch.arange(n_groups, dtype=torch.int32, device=codes.device).view(1, -1, 1) * N_BINS)
    lanes = _histogram_lanes(codes.device)
    if lanes > 1:
        codes.add_((torch.arange(m, dtype=torch.int32, device=codes.device) % lanes).view(1, 1, -1) * (n_groups * N_BINS))
    return codes


def _count_bins(index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(g, N_BINS) counts of flat histogram indices, without a device sync (bincount syncs for its size)."""
    lanes = _histogram_lanes(index.device)
    ones = torch.ones(1, dtype=torch.int64, device=index.device).expand(index.numel())
    counts = torch.zeros(lanes * n_groups * N_BINS, dtype=torch.int64, device=index.device).index_add_(0, index.reshape(-1), ones)
    return counts.view(lanes, n_groups, N_BINS).sum(dim=0)


def fused_tile(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-element work of an update as one pure function, for torch.compile to fuse into a few kernels.

    x (A, g, M) float32, weights (A|1, 1|g, M) 0/1 float32, offsets (1, g, 1|M) int32 histogram offsets
    -> (|x| zeroed where unobserved, (A, g, 4) float32 power sums per row, flat histogram indices).
    Same math as `_tile_summary` + `bin_codes` + `_histogram_index`, which reuse buffers instead (CPU eager).
    """
    a = x.abs() * weights
    x2 = a * a
    row_sums = torch.stack([(x * weights).sum(dim=-1), x2.sum(dim=-1), (x2 * x).sum(dim=-1), (x2 * x2).sum(dim=-1)], dim=-1)
    codes = torch.bitwise_right_shift(a.view(torch.int32), _SHIFT).clamp(_LO - 1, _HI) - (_LO - 1)
    return a, row_sums, codes + offsets


_compiled_fused_tile = None


def _fused_summary(x: torch.Tensor, valid: torch.Tensor | None) -> tuple:
    """`_tile_summary` through the compiled `fused_tile`; also returns the histogram indices."""
    global _compiled_fused_tile
    if _compiled_fused_tile is None:
        _compiled_fused_tile = torch.compile(fused_tile, dynamic=True)
    n_rows, n_groups, m = x.shape
    offsets = torch.arange(n_groups, dtype=torch.int32, device=x.device).view(1, -1, 1) * N_BINS
    lanes = _histogram_lanes(x.device)
    if lanes > 1:
        offsets = offsets + (torch.arange(m, dtype=torch.int32, device=x.device) % lanes).view(1, 1, -1) * (n_groups * N_BINS)
    if valid is None:
        weights = torch.ones(1, 1, 1, device=x.device).expand(1, 1, m)
        n_valid = torch.full((n_groups,), n_rows * m, dtype=torch.int64, device=x.device)
    else:
        weights = valid.to(x.dtype)
        n_valid = torch.count_nonzero(valid.expand(n_rows, -1, m), dim=(0, 2)).expand(n_groups).to(torch.int64)
    a, row_sums, index = _compiled_fused_tile(x, weights, offsets)
    sums = row_sums.double().sum(dim=0)  # (g, 4)
    return a, sums, n_valid, torch.isfinite(sums).all(), index


def _tile_summary(
    x: torch.Tensor, valid: torch.Tensor | None, workspace: Workspace
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For x (A, g, M): |x| with unobserved entries zeroed (a workspace tensor), (g, 4) float64 power sums,
    observed entries per group, and whether the sums are finite (a 0-dim bool on the device; if not, the
    caller redoes the tile exactly)."""
    n_rows, n_groups, m = x.shape
    a = torch.abs(x, out=workspace.get("abs", x.shape, x.dtype, x.device))
    if valid is None:
        s1 = x.sum(dim=-1)
        n_valid = torch.full((n_groups,), n_rows * m, dtype=torch.int64, device=x.device)
    else:
        weights = valid.to(x.dtype).expand(n_rows, -1, m)  # (A, 1|g, M): the mask is 1/H of the tile
        a.mul_(weights)  # in place; unobserved entries of a finite tile become 0
        if weights.shape[1] == 1:  # one mask for all groups: a batched GEMV reads x once, no masked copy
            s1 = (x @ weights.transpose(1, 2)).squeeze(-1)  # (A, g, M) @ (A, M, 1) -> (A, g)
        else:
            s1 = (x * weights).sum(dim=-1)
        n_valid = torch.count_nonzero(valid.expand(n_rows, -1, m), dim=(0, 2)).expand(n_groups)  # (g,): heads share one mask
    # Power sums per (row, group): float32 within a row, float64 across rows. Products go to scratch space.
    x2 = torch.mul(a, a, out=workspace.get("square", x.shape, x.dtype, x.device))  # (A, g, M), zero where unobserved
    product = workspace.get("product", x.shape, x.dtype, x.device)
    s3 = torch.mul(x2, x, out=product).sum(dim=-1)
    s4 = torch.mul(x2, x2, out=product).sum(dim=-1)
    sums = torch.stack([s1, x2.sum(dim=-1), s3, s4], dim=-1).double().sum(dim=0)  # (g, 4)
    return a, sums, n_valid.to(torch.int64), torch.isfinite(sums).all()


@dataclass
class ChannelStats:
    """Per (layer, channel) of hidden states: max |x| (SmoothQuant's act scales) and how many positions
    reach the LLM.int8 threshold, plus positions observed per layer.

    Outlier feature (Dettmers et al. 2022, "LLM.int8()", §4): channel c is one when |x| ≥ 6 at ≥ 6% of the
    observed token positions of a layer, in ≥ 25% of the decoder layers. Positions are pooled over all
    sequences; the hidden state observed is each decoder layer's output (the residual stream).
    """

    absmax: torch.Tensor  # (L, D) float32 max |x| over finite observed values
    over_threshold: torch.Tensor  # (L, D) int64 positions with |x| ≥ threshold
    positions: torch.Tensor  # (L,) int64 positions observed
    threshold: float = LLM_INT8_THRESHOLD

    @classmethod
    def empty(cls, layers: int, channels: int, device: torch.device | str = "cpu", threshold: float = LLM_INT8_THRESHOLD) -> ChannelStats:
        return cls(
            torch.zeros(layers, channels, device=device),
            torch.zeros(layers, channels, dtype=torch.int64, device=device),
            torch.zeros(layers, dtype=torch.int64, device=device),
            threshold,
        )

    def update(self, layer: int, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """x (N, D) hidden states of N positions; valid (N,) bool or None."""
        a = torch.nan_to_num(x.float().abs(), nan=EMPTY, posinf=EMPTY)  # non-finite are counted by AbsStats
        if valid is not None:
            a = torch.where(valid.view(-1, 1), a, EMPTY)  # EMPTY never reaches the threshold nor the max
        torch.maximum(self.absmax[layer], a.amax(dim=0), out=self.absmax[layer])
        self.over_threshold[layer] += (a >= self.threshold).sum(dim=0)
        self.positions[layer] += a.shape[0] if valid is None else torch.count_nonzero(valid)

    def merge(self, other: ChannelStats) -> ChannelStats:
        if other.absmax.shape != self.absmax.shape or other.threshold != self.threshold:
            raise ValueError("cannot merge channel statistics of different layouts")
        torch.maximum(self.absmax, other.absmax.to(self.absmax.device), out=self.absmax)
        self.over_threshold += other.over_threshold.to(self.over_threshold.device)
        self.positions += other.positions.to(self.positions.device)
        return self

    def outlier_features(self) -> list[int]:
        """Channels meeting the LLM.int8 outlier-feature definition in the class docstring."""
        if int(self.positions.min()) == 0:
            return []
        fraction = self.over_threshold.double() / self.positions.double().view(-1, 1)  # (L, D)
        hit = fraction >= LLM_INT8_POSITION_FRACTION
        layers = self.absmax.shape[0]
        return torch.nonzero(hit.sum(dim=0) >= LLM_INT8_LAYER_FRACTION * layers).view(-1).tolist()

    def to_dict(self) -> dict:
        return {
            "absmax": self.absmax.tolist(),
            "over_threshold": self.over_threshold.tolist(),
            "positions": self.positions.tolist(),
            "threshold": self.threshold,
        }

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str = "cpu") -> ChannelStats:
        return cls(
            torch.tensor(data["absmax"], dtype=torch.float32, device=device),
            torch.tensor(data["over_threshold"], dtype=torch.int64, device=device),
            torch.tensor(data["positions"], dtype=torch.int64, device=device),
            float(data["threshold"]),
        )


def quantile_values(hist: torch.Tensor, count: int, quantiles: Sequence[float], maximum: float) -> list[float]:
    """Quantile q = the value of rank floor(q·(count−1)) (0-based, ascending; torch.quantile's 'lower'),
    as its bin midpoint: within QUANTILE_RELATIVE_ERROR relative of exact in [2**MIN_EXP, 2**MAX_EXP).
    Below, 0 is reported (absolute error < 2**MIN_EXP); above, the maximum (an upper bound)."""
    cumulative = torch.cumsum(hist.to("cpu"), 0)
    ranks = torch.tensor([int(q * (count - 1)) for q in quantiles], dtype=torch.int64)
    columns = torch.searchsorted(cumulative, ranks, right=True).clamp(max=N_BINS - 1)
    mids = bin_midpoints()
    return [maximum if c == N_BINS - 1 else float(mids[c]) for c in columns.tolist()]


LOGIT_LOCATION = ("layer", "head", "sequence", "query", "key")
HIDDEN_LOCATION = ("layer", "sequence", "position", "channel")
PER_HEAD_TOP = 10  # per-head summaries keep a short top list: L·H full lists would swamp the JSON


@dataclass
class ModelStats:
    """Everything `quantdiff stats` measures on one model: logits grouped by (layer, head), hidden states by layer."""

    layers: int
    heads: int
    hidden_size: int
    head_maps: list[int] | None  # per head: 1 or 2 = which differential map; None for standard attention
    logits: AbsStats  # group layer·heads + head; locations LOGIT_LOCATION
    hidden: AbsStats  # group layer; locations HIDDEN_LOCATION
    channels: ChannelStats
    tokens: int = 0
    sequences: int = 0

    @classmethod
    def empty(
        cls, layers: int, heads: int, hidden_size: int, head_maps: list[int] | None, k: int = 100, device: torch.device | str = "cpu"
    ) -> ModelStats:
        return cls(
            layers,
            heads,
            hidden_size,
            head_maps,
            AbsStats.empty(layers * heads, k, LOGIT_LOCATION, device),
            AbsStats.empty(layers, k, HIDDEN_LOCATION, device),
            ChannelStats.empty(layers, hidden_size, device),
        )

    def merge(self, other: ModelStats) -> ModelStats:
        if (other.layers, other.heads, other.hidden_size, other.head_maps) != (self.layers, self.heads, self.hidden_size, self.head_maps):
            raise ValueError("cannot merge statistics of different models")
        self.logits.merge(other.logits)
        self.hidden.merge(other.hidden)
        self.channels.merge(other.channels)
        self.tokens += other.tokens
        self.sequences += other.sequences
        return self

    def to_dict(self) -> dict:
        return {
            "layers": self.layers,
            "heads": self.heads,
            "hidden_size": self.hidden_size,
            "head_maps": self.head_maps,
            "logits": self.logits.to_dict(),
            "hidden": self.hidden.to_dict(),
            "channels": self.channels.to_dict(),
            "tokens": self.tokens,
            "sequences": self.sequences,
        }

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str = "cpu") -> ModelStats:
        return cls(
            data["layers"],
            data["heads"],
            data["hidden_size"],
            data["head_maps"],
            AbsStats.from_dict(data["logits"], device),
            AbsStats.from_dict(data["hidden"], device),
            ChannelStats.from_dict(data["channels"], device),
            data["tokens"],
            data["sequences"],
        )

    def logit_groups(self, layer: int | None = None, head: int | None = None, head_map: int | None = None) -> list[int]:
        """Group indices of the logits selected by layer / head / differential map (None = all)."""
        return [
            l * self.heads + h
            for l in range(self.layers)
            for h in range(self.heads)
            if (layer is None or l == layer)
            and (head is None or h == head)
            and (head_map is None or (self.head_maps is not None and self.head_maps[h] == head_map))
        ]

    def summary(self, quantiles: Sequence[float] = DEFAULT_QUANTILES) -> dict:
        """JSON-ready: `attention_logits` (overall, per_layer, per_head, per_map for Diff) and `hidden_states`
        (overall, per_layer, per-channel max, LLM.int8 outlier features)."""
        logit = lambda groups, top=None: self._with_maps(self.logits.pooled(groups).summary(quantiles, top))  # noqa: E731
        logits = logit(None)
        logits["per_layer"] = [logit(self.logit_groups(layer=l)) for l in range(self.layers)]
        logits["per_head"] = [[logit([l * self.heads + h], PER_HEAD_TOP) for h in range(self.heads)] for l in range(self.layers)]
        if self.head_maps is not None:
            logits["per_map"] = {str(m): logit(self.logit_groups(head_map=m)) for m in (1, 2)}
        hidden = self.hidden.pooled().summary(quantiles)
        hidden["per_layer"] = [self.hidden.pooled([l]).summary(quantiles) for l in range(self.layers)]
        outliers = self.channels.outlier_features()
        hidden["channel_absmax"] = self.channels.absmax.tolist()
        hidden["outlier_features"] = {
            "count": len(outliers),
            "channels": outliers,
            "threshold": self.channels.threshold,
            "min_layer_fraction": LLM_INT8_LAYER_FRACTION,
            "min_position_fraction": LLM_INT8_POSITION_FRACTION,
        }
        return {"attention_logits": logits, "hidden_states": hidden}

    def _with_maps(self, summary: dict) -> dict:
        if self.head_maps is not None:
            for entry in summary["topk"]:
                entry["map"] = self.head_maps[entry["head"]]
        return summary
