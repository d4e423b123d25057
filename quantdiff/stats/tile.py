"""The per-element work of one statistic update: |x|, power sums and histogram indices of a tile.

Two paths with the same math: `tile_summary` writes into reusable workspace buffers (fast in CPU eager mode);
`fused_summary` runs the pure `fused_tile` through torch.compile (fast on CUDA, where it fuses into a few
kernels). A tile whose values or sums are not finite is redone by `exact_summary` in float64.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantdiff.stats.histogram import HI, LO, SHIFT, bin_index, index_offsets
from quantdiff.stats.workspace import Workspace


class TileSummary(NamedTuple):
    a: torch.Tensor  # (A, g, M) |x| with unobserved entries zeroed
    sums: torch.Tensor  # (g, 4) float64 Σx, Σx², Σx³, Σx⁴ over observed entries
    n_valid: torch.Tensor  # (g,) int64 observed entries
    finite: torch.Tensor  # 0-dim bool on the device: False means redo the tile with `exact_summary`
    index: torch.Tensor | None  # flat histogram indices, when the kernel computed them already

    def histogram_index(self, workspace: Workspace) -> torch.Tensor:
        if self.index is not None:
            return self.index
        return bin_index(self.a, workspace.get("codes", self.a.shape, torch.int32, self.a.device))


def summarize(x: torch.Tensor, valid: torch.Tensor | None, workspace: Workspace, fused: bool) -> TileSummary:
    """x (A, g, M) float32; valid bool broadcastable to x, or None (all observed)."""
    return fused_summary(x, valid) if fused else tile_summary(x, valid, workspace)


def _n_valid(valid: torch.Tensor, n_rows: int, n_groups: int, m: int) -> torch.Tensor:
    """(g,) observed entries per group; heads often share one (A, 1, M) mask."""
    return torch.count_nonzero(valid.expand(n_rows, -1, m), dim=(0, 2)).expand(n_groups).to(torch.int64)


def tile_summary(x: torch.Tensor, valid: torch.Tensor | None, workspace: Workspace) -> TileSummary:
    """The eager path: every product goes to workspace buffers; `a` is a workspace tensor."""
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
        n_valid = _n_valid(valid, n_rows, n_groups, m)
    # Power sums per (row, group): float32 within a row, float64 across rows. Products go to scratch space.
    x2 = torch.mul(a, a, out=workspace.get("square", x.shape, x.dtype, x.device))  # (A, g, M), zero where unobserved
    product = workspace.get("product", x.shape, x.dtype, x.device)
    s3 = torch.mul(x2, x, out=product).sum(dim=-1)
    s4 = torch.mul(x2, x2, out=product).sum(dim=-1)
    sums = torch.stack([s1, x2.sum(dim=-1), s3, s4], dim=-1).double().sum(dim=0)  # (g, 4)
    return TileSummary(a, sums, n_valid, torch.isfinite(sums).all(), None)


def fused_tile(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-element work of an update as one pure function, for torch.compile to fuse into a few kernels.

    x (A, g, M) float32, weights (A|1, 1|g, M) 0/1 float32, offsets (1, g, 1|M) int32 histogram offsets
    -> (|x| zeroed where unobserved, (A, g, 4) float32 power sums per row, flat histogram indices).
    Same math as `tile_summary` + `bin_index`, which reuse buffers instead (CPU eager).
    """
    a = x.abs() * weights
    x2 = a * a
    row_sums = torch.stack([(x * weights).sum(dim=-1), x2.sum(dim=-1), (x2 * x).sum(dim=-1), (x2 * x2).sum(dim=-1)], dim=-1)
    codes = torch.bitwise_right_shift(a.view(torch.int32), SHIFT).clamp(LO - 1, HI) - (LO - 1)
    return a, row_sums, codes + offsets


_compiled_fused_tile = None


def fused_summary(x: torch.Tensor, valid: torch.Tensor | None) -> TileSummary:
    """`tile_summary` through the compiled `fused_tile`; also returns the histogram indices."""
    global _compiled_fused_tile
    if _compiled_fused_tile is None:
        _compiled_fused_tile = torch.compile(fused_tile, dynamic=True)
    n_rows, n_groups, m = x.shape
    offsets = index_offsets(n_groups, m, x.device)
    if valid is None:
        weights = torch.ones(1, 1, 1, device=x.device).expand(1, 1, m)
        n_valid = torch.full((n_groups,), n_rows * m, dtype=torch.int64, device=x.device)
    else:
        weights = valid.to(x.dtype)
        n_valid = _n_valid(valid, n_rows, n_groups, m)
    a, row_sums, index = _compiled_fused_tile(x, weights, offsets)
    sums = row_sums.double().sum(dim=0)  # (g, 4)
    return TileSummary(a, sums, n_valid, torch.isfinite(sums).all(), index)


def exact_summary(x: torch.Tensor, observed: torch.Tensor) -> TileSummary:
    """The rare tile holding NaN/Inf (or whose x⁴ overflows float32): sums in float64 over the finite observed
    entries `observed` (bool, x's shape). Returns `a` as float32 for binning and top-k."""
    summary = tile_summary(x.double().masked_fill(~observed, 0.0), observed, Workspace())
    return summary._replace(a=summary.a.float())
