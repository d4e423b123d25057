"""Attention sinks: how much attention each head puts on the first position, measured tile by tile.

For every query row the attention backend's online softmax holds the max and sum of exp(x − max) over the valid
keys, x the softmax input (the logit, soft-capped and with any additive mask, as the model's softmax sees it), with
a model's sink logit per head (GPT-OSS, the sink kind) counted in every row, and the softmax input at key
position 0 (−∞ for a row that cannot see it: a sliding window, padding); the observer keeps that state
(`backend.SoftmaxRows`, so the T×T map is never built and softmax is not computed twice), and once a layer's
call has returned, the attention mass on position 0 is exp(x0 − m) / s: the true probability,
the sink's share left out of it as the model leaves it out of its output. Per (layer, head) it
accumulates the sum of that mass over valid query rows (padding excluded), in fixed point (units of 2⁻³²,
int64), and their count: integer sums merge exactly in any order, across batches and processes. A model with a
sink logit s per head also gets the share of each row's denominator the sink absorbs, exp(s − m) / s_row (the
attention the row gives no key; its masses on the keys add up to 1 minus it), summed the same way.

Score (Gu et al., "When Attention Sink Emerges in Language Models"): the share of heads whose mean mass
on the first position exceeds ε = 0.3. For differential attention the two maps of a head (DiffLlama: head i
with head i + H/2; DIFF V2: head 2i with head 2i + 1) are reported apart and combined as the Diff paper's
Table 3 combines attention scores, (A1 − λ·A2) / (1 − λ); the score then counts differential heads. DiffLlama's
λ is the layer's, so the combination of the mean masses is exact. DIFF V2's λ is per query token and pair
(fed by `on_lambda`), so each query row's masses are combined with that row's λ and the results averaged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantdiff.attention.backend import SoftmaxRows, TileContext
from quantdiff.core.errors import ConfigError
from quantdiff.models.structure import map_heads

SINK_EPSILON = 0.3
FIXED_POINT = 2.0**32  # mass units per 1.0: int64 holds sums over up to 2³¹ query rows per head


def _fixed_point_sum(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(H,) int64: the sum of the kept rows' values of (B, H, T), over batch and rows, in units of 2⁻³²."""
    return (torch.where(keep, values, 0.0).double().sum(dim=(0, 2)) * FIXED_POINT).round().to(torch.int64).cpu()


@dataclass
class SinkStats:
    """Sum and count of the first-position attention mass per (layer, head), plus the per-batch row state."""

    mass: torch.Tensor  # (layers, heads) int64: sums over valid query rows, in units of 1 / FIXED_POINT
    rows: torch.Tensor  # (layers, heads) int64 counts
    lambdas: list[float] | None = None  # per layer, differential attention with a layer λ (DiffLlama) only
    pairing: str | None = None  # how heads pair into maps (models.structure.map_heads); None: standard attention
    # λ per token (DIFF V2): (layers, heads / 2) int64 sums of each valid row's combined mass, fixed point
    combined_mass: torch.Tensor | None = None
    # a sink logit per head (GPT-OSS, the sink kind): (layers, heads) int64 sums of each valid row's absorbed share
    sink_logit_mass: torch.Tensor | None = None
    _rows: dict[int, SoftmaxRows] = field(default_factory=dict, repr=False)  # layer -> its call's softmax rows
    _sinks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # layer -> its sink logits (H,)
    _lambda: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # layer -> λ (B, T, heads / 2)

    @classmethod
    def empty(cls, layers: int, heads: int, lambdas: list[float] | None = None, pairing: str | None = None) -> SinkStats:
        """`lambdas` alone: DiffLlama's pairing; `pairing` without `lambdas`: differential attention whose λ comes
        per token through `on_lambda`."""
        zeros = lambda width: torch.zeros(layers, width, dtype=torch.int64)  # noqa: E731
        pairing = pairing or ("halves" if lambdas is not None else None)
        per_token = pairing is not None and lambdas is None
        return cls(zeros(heads), zeros(heads), lambdas, pairing, zeros(heads // 2) if per_token else None)

    def on_lambda(self, layer: int, lam: torch.Tensor) -> None:
        """DIFF V2: the λ (B, T, heads / 2) of one layer's forward, for `end_batch` to combine its rows."""
        self._lambda[layer] = lam

    def on_tile(self, logits: torch.Tensor, ctx: TileContext) -> None:
        """Keep the row state of the softmax the model computes (`ctx.rows`, final once the call returns): over the
        tiles as they enter softmax (soft-capped, plus any additive mask), and with a sink logit per head
        (GPT-OSS, the sink kind) in every row's sum from the start, so a row's masses on the keys add up to
        1 − its sink's mass."""
        if ctx.k_start == 0:  # the first tile of a layer's call; the backend writes the state in place
            self._rows[ctx.layer_idx] = ctx.rows
            if ctx.sinks is not None:
                self._sinks[ctx.layer_idx] = ctx.sinks

    def end_batch(self, row_mask: torch.Tensor | None) -> None:
        """Turn each layer's row state into first-position mass; `row_mask` (B, T) bool marks real tokens."""
        for layer, rows in self._rows.items():
            m, s, l0 = rows.max[..., 0], rows.sum[..., 0], rows.first_key[..., 0]  # (B, H, T)
            mass = torch.exp(l0 - m) / s.clamp_min(torch.finfo(torch.float32).tiny)
            keep = torch.isfinite(m) if row_mask is None else torch.isfinite(m) & row_mask.bool()[:, None, :]
            self.mass[layer] += _fixed_point_sum(mass, keep)
            self.rows[layer] += keep.sum(dim=(0, 2)).cpu()
            if self.combined_mass is not None:
                self._combine_rows(layer, mass, keep)
            if layer in self._sinks:  # the sink logit started every row's max and sum (backend), so this is its share
                absorbed = torch.exp(self._sinks[layer].view(1, -1, 1) - m) / s.clamp_min(torch.finfo(torch.float32).tiny)
                if self.sink_logit_mass is None:
                    self.sink_logit_mass = torch.zeros_like(self.mass)
                self.sink_logit_mass[layer] += _fixed_point_sum(absorbed, keep)
        self._rows.clear()
        self._lambda.clear()
        self._sinks.clear()

    def _combine_rows(self, layer: int, mass: torch.Tensor, keep: torch.Tensor) -> None:
        """Add each valid row's (a1 − λ·a2)/(1 − λ) of first-position masses, with that row's λ, per pair."""
        if layer not in self._lambda:
            raise ConfigError(f"layer {layer}: differential attention with a per-token λ, but no λ was observed")
        first, second = map_heads(mass.shape[1], self.pairing)
        lam = self._lambda[layer].double().transpose(1, 2)[..., -mass.shape[2] :]  # (B, H/2, T): the rows of this call
        combined = (mass[:, first].double() - lam * mass[:, second].double()) / (1 - lam)
        pair_rows = keep[:, first]
        self.combined_mass[layer] += _fixed_point_sum(combined, pair_rows)

    def merge(self, other: SinkStats) -> SinkStats:
        self.mass += other.mass
        self.rows += other.rows
        if self.combined_mass is not None:
            self.combined_mass += other.combined_mass
        if other.sink_logit_mass is not None:  # a part that saw no batch has none yet
            self.sink_logit_mass = other.sink_logit_mass.clone() if self.sink_logit_mass is None else self.sink_logit_mass + other.sink_logit_mass
        return self

    def to_dict(self) -> dict:
        combined = None if self.combined_mass is None else self.combined_mass.tolist()
        sink_logit = None if self.sink_logit_mass is None else self.sink_logit_mass.tolist()
        return {"mass": self.mass.tolist(), "rows": self.rows.tolist(), "lambdas": self.lambdas, "pairing": self.pairing, "combined_mass": combined,
                "sink_logit_mass": sink_logit}

    @classmethod
    def from_dict(cls, data: dict) -> SinkStats:
        as_tensor = lambda v: None if v is None else torch.tensor(v, dtype=torch.int64)  # noqa: E731
        pairing = data.get("pairing", "halves" if data["lambdas"] is not None else None)  # dumps from before DIFF V2
        return cls(as_tensor(data["mass"]), as_tensor(data["rows"]), data["lambdas"], pairing, as_tensor(data.get("combined_mass")),
                   as_tensor(data.get("sink_logit_mass")))

    def per_head(self) -> torch.Tensor:
        """(layers, heads) mean attention mass on the first position."""
        return self.mass.double() / FIXED_POINT / self.rows.clamp_min(1).double()

    def summary(self, epsilon: float = SINK_EPSILON) -> dict:
        """JSON-ready: per-(layer, head) mass, its mean, and the share of heads above ε (Diff: combined maps); with
        a sink logit per head, `sink_logit`: each head's mean share of the rows' denominators it absorbs."""
        per_head = self.per_head()
        out = {"epsilon": epsilon, "per_head": per_head.tolist()}
        if self.sink_logit_mass is not None:
            absorbed = self.sink_logit_mass.double() / FIXED_POINT / self.rows.clamp_min(1).double()
            out["sink_logit"] = {"per_head": absorbed.tolist(), "mean": float(absorbed.mean()), "max": float(absorbed.max())}
        if self.pairing is not None:
            first, second = map_heads(per_head.shape[1], self.pairing)
            if self.combined_mass is not None:  # λ per token: the mean of the rows' combined masses
                combined = self.combined_mass.double() / FIXED_POINT / self.rows[:, first].clamp_min(1).double()
            else:
                lam = torch.tensor(self.lambdas, dtype=torch.float64)[:, None]
                combined = (per_head[:, first] - lam * per_head[:, second]) / (1 - lam)
            out |= {
                "per_map": {"1": per_head[:, first].tolist(), "2": per_head[:, second].tolist()},
                "combined": combined.tolist(), "lambdas": self.lambdas, "lambda_per_token": self.combined_mass is not None,
            }  # fmt: skip
            scored = combined
        else:
            scored = per_head
        out |= {"mean": float(scored.mean()), "max": float(scored.max()), "score": float((scored > epsilon).double().mean()), "heads_scored": scored.numel()}
        return out
