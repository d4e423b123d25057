"""Exact top-k of |x| per group, with the location of each value, under one total order.

The order is |x| descending, then location ascending, so ties are resolved the same way however the data is
split: the top-k of a union is the top-k of the union of the parts' top-k, and merging is exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from quantdiff.stats.workspace import Workspace

EMPTY = -1.0  # slot not filled yet (|x| ≥ 0)
CHUNKS_PER_K = 32  # chunks per top-k slot in `kth_lower_bound`: on SmolLM2 ~2.5× k candidates per row pass it

# locate(a, g, m) -> (n, L) int64 locations of tile entries x[a, g, m] (g relative to the tile's first group)
Locate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def kth_lower_bound(a: torch.Tensor, k: int) -> torch.Tensor:
    """(A, g, 1) at most the k-th largest value of each row of a (A, g, M) (its smallest when M < k).

    The rows are cut into CHUNKS_PER_K·k chunks: the chunks' k largest maxima are k entries of the row, so the
    k-th of them is a lower bound, from one pass of amax instead of a top-k over the whole row.
    """
    m = a.shape[-1]
    chunks = CHUNKS_PER_K * k
    if m < 2 * chunks:  # small rows: their exact k-th value costs little
        return a.topk(min(k, m), dim=-1).values[..., -1:]
    maxima = a[..., : m - m % chunks].unflatten(-1, (chunks, -1)).amax(dim=-1)  # the tail is left out: still a bound
    return maxima.topk(k, dim=-1).values[..., -1:]


class LocatedTopK:
    """(G, k) float32 values, descending and EMPTY-padded, and (G, k, L) int64 locations (-1 where EMPTY)."""

    def __init__(self, values: torch.Tensor, locations: torch.Tensor, location_names: Sequence[str]) -> None:
        self.values, self.locations, self.location_names = values, locations, tuple(location_names)
        # Python-side cache of "k-th value > 0" per group: lets the hot path skip a device sync once filled.
        self._positive_kth = [False] * values.shape[0]
        self._workspace = Workspace()
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None  # see deferred_merges

    @staticmethod
    def nbytes(groups: int, k: int, location_names: Sequence[str]) -> int:
        """Bytes `empty` allocates: a float32 value and int64 coordinates per slot."""
        return groups * k * (4 + 8 * len(location_names))

    @classmethod
    def empty(cls, groups: int, k: int, location_names: Sequence[str], device: torch.device | str) -> LocatedTopK:
        values = torch.full((groups, k), EMPTY, device=device)
        return cls(values, torch.full((groups, k, len(location_names)), -1, dtype=torch.int64, device=device), location_names)

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @contextmanager
    def deferred_merges(self) -> Iterator[None]:
        """Within the block, candidates are collected and merged once at its end: one sort instead of one per
        update. Candidates are still filtered by the k-th values at entry, so the result is exact."""
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            if pending:
                self._merge(*(torch.cat(parts) for parts in zip(*pending)))

    def candidates(self, a: torch.Tensor, valid: torch.Tensor | None, group_start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((1, g, 1) threshold, observed) for a tile a (A, g, M): entries ≥ their group's current k-th value (ties
        included) may enter the top k; selecting among them keeps the top k exact.

        Unobserved entries of `a` are 0: harmless once every k-th value is positive (the usual case after the
        first tile); until then `observed` (the valid mask, else None) must hold too.
        """
        n_groups = a.shape[1]
        threshold = self.values[group_start : group_start + n_groups, self.k - 1].view(1, -1, 1)
        if not all(self._positive_kth[group_start : group_start + n_groups]):
            positive = (threshold > 0).view(-1).tolist()
            self._positive_kth[group_start : group_start + n_groups] = positive
            if not all(positive):
                return threshold.clamp(min=0.0), valid
        return threshold, None

    @staticmethod
    def reaches(a: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        """0-dim bool: whether any candidate reaches its threshold. A row (one group of one sequence) whose max
        is below its group's k-th value adds nothing: the common case once statistics have filled."""
        return (a.amax(dim=-1, keepdim=True) >= threshold).any()

    def take(self, a: torch.Tensor, threshold: torch.Tensor, observed: torch.Tensor | None, group_start: int, locate: Locate | None) -> None:
        """Merge the entries of `a` reaching `threshold` (and `observed`, from `candidates`), located by `locate`;
        None records (row, group_start + g, flat) when there are three location names."""
        n_rows, n_groups, m = a.shape
        mask = torch.ge(a, threshold, out=self._workspace.get("mask", a.shape, torch.bool, a.device))
        if int(torch.count_nonzero(mask)) > self.k * n_rows * n_groups:  # early on nearly everything passes
            # an entry of the top k of a union is in the top k of its row, so a lower bound of each row's k-th
            # value keeps every entry that can enter (a few times k of them): no full top-k of the row needed
            torch.ge(a, torch.maximum(threshold, kth_lower_bound(a, self.k)), out=mask)
        if observed is not None:  # in place: no tile-sized copy of `a` with unobserved entries pushed below 0
            mask &= observed
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
            self._merge(a[rows, cols, flat], cols + group_start, locations)

    def _own_groups(self) -> torch.Tensor:
        g, k = self.values.shape
        return torch.arange(g, device=self.values.device).repeat_interleave(k)

    def _merge(self, values: torch.Tensor, groups: torch.Tensor, locations: torch.Tensor) -> None:
        g, k = self.values.shape
        self.values, self.locations = select_top(
            torch.cat([self.values.view(-1), values]),
            torch.cat([self._own_groups(), groups]),
            torch.cat([self.locations.view(g * k, -1), locations]),
            g,
            k,
        )

    def merge(self, other: LocatedTopK) -> None:
        """Same groups, k and location names (checked by the caller)."""
        g, k = self.values.shape
        self._merge(other.values.view(-1), self._own_groups(), other.locations.view(g * k, -1))

    def pooled(self, index: torch.Tensor) -> LocatedTopK:
        """One group: the top k of the union of the groups in `index`."""
        n, k = index.numel(), self.k
        values, locations = select_top(
            self.values[index].view(-1),
            torch.zeros(n * k, dtype=torch.int64, device=self.values.device),
            self.locations[index].view(n * k, -1),
            1,
            k,
        )
        return LocatedTopK(values, locations, self.location_names)

    def to(self, device: torch.device | str) -> LocatedTopK:
        return LocatedTopK(self.values.to(device), self.locations.to(device), self.location_names)

    def entries(self, top: int | None = None) -> list[dict]:
        """The first `top` filled entries of group 0 (all when None) as {"value", <location name>: int, …}."""
        values, locations = self.values[0].cpu(), self.locations[0].cpu()
        filled = int((values >= 0).sum())
        top = filled if top is None else min(top, filled)
        return [
            {"value": float(values[i]), **{name: int(v) for name, v in zip(self.location_names, locations[i].tolist())}}
            for i in range(top)
        ]
