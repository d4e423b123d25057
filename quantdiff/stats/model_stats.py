"""`ModelStats`: everything `quantdiff stats` measures on one model, and its JSON summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from quantdiff.stats.absstats import DEFAULT_QUANTILES, AbsStats
from quantdiff.stats.channels import ChannelStats
from quantdiff.stats.massive import massive_activation
from quantdiff.stats.topk import LocatedTopK

LOGIT_LOCATION = ("layer", "head", "sequence", "query", "key")
HIDDEN_LOCATION = ("layer", "sequence", "position", "channel")
FIRST_TOP = 10  # the first position's own short top list: where the residual peak at BOS sits
PER_HEAD_TOP = 10  # per-head summaries keep a short top list: L·H full lists would swamp the JSON


@dataclass
class ModelStats:
    """Logits grouped by (layer, head), hidden states by layer, channels of the linear inputs; tokens and sequences seen."""

    layers: int
    heads: int
    hidden_size: int
    head_maps: list[int] | None  # per head: 1 or 2 = which differential map; None for standard attention
    logits: AbsStats  # group layer·heads + head; locations LOGIT_LOCATION
    hidden: AbsStats  # group layer; locations HIDDEN_LOCATION
    linear_inputs: ChannelStats  # what enters the attention projections and the FFN expansion
    first: AbsStats | None = None  # hidden states at position 0 only (BOS when trained with one), group layer
    tokens: int = 0
    sequences: int = 0

    @staticmethod
    def topk_bytes(layers: int, heads: int, k: int) -> int:
        """Bytes of the Top-k buffers of `empty` (one per layer × head of logits, one per layer of hidden states)."""
        return LocatedTopK.nbytes(layers * heads, k, LOGIT_LOCATION) + LocatedTopK.nbytes(layers, k, HIDDEN_LOCATION)

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
            AbsStats.empty(layers, FIRST_TOP, HIDDEN_LOCATION, device),
        )

    def merge(self, other: ModelStats) -> ModelStats:
        if (other.layers, other.heads, other.hidden_size, other.head_maps) != (self.layers, self.heads, self.hidden_size, self.head_maps):
            raise ValueError("cannot merge statistics of different models")
        self.logits.merge(other.logits)
        self.hidden.merge(other.hidden)
        self.linear_inputs.merge(other.linear_inputs)
        if self.first is not None and other.first is not None:
            self.first.merge(other.first)
        else:
            self.first = None  # one side never tracked it: no exact merge
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
            "linear_inputs": self.linear_inputs.to_dict(),
            "first": None if self.first is None else self.first.to_dict(),
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
            ChannelStats.from_dict(data["linear_inputs"], device),
            AbsStats.from_dict(data["first"], device) if data.get("first") else None,
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
        """JSON-ready: `attention_logits` (overall, per_layer, per_head, per_map for Diff), `hidden_states`
        (overall, per_layer, the massive activation, the largest |value| at position 0) and `linear_inputs`
        (per-channel max, LLM.int8 outlier features)."""
        logit = lambda groups, top=None: self._with_maps(self.logits.pooled(groups).summary(quantiles, top))  # noqa: E731
        logits = logit(None)
        logits["per_layer"] = [logit(self.logit_groups(layer=l)) for l in range(self.layers)]
        logits["per_head"] = [[logit([l * self.heads + h], PER_HEAD_TOP) for h in range(self.heads)] for l in range(self.layers)]
        if self.head_maps is not None:
            logits["per_map"] = {str(m): logit(self.logit_groups(head_map=m)) for m in (1, 2)}
        hidden = self.hidden.pooled().summary(quantiles)
        hidden["per_layer"] = [self.hidden.pooled([l]).summary(quantiles) for l in range(self.layers)]
        hidden["massive_activation"] = massive_activation(hidden)
        if self.first is not None:
            first = self.first.pooled()
            hidden["first_position"] = {"max": first.summary(())["max"],
                                        "per_layer_max": [self.first.pooled([l]).summary(())["max"] for l in range(self.layers)]}
        linear = {"channel_absmax": self.linear_inputs.absmax.tolist(), "outlier_features": self.linear_inputs.outlier_summary()}
        return {"attention_logits": logits, "hidden_states": hidden, "linear_inputs": linear}

    def _with_maps(self, summary: dict) -> dict:
        if self.head_maps is not None:
            for entry in summary["topk"]:
                entry["map"] = self.head_maps[entry["head"]]
        return summary
