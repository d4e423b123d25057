"""Per-channel statistics of hidden states: SmoothQuant's act scales and LLM.int8's outlier features."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdiff.quant.numerics import LLM_INT8_THRESHOLD

LLM_INT8_LAYER_FRACTION = 0.25
LLM_INT8_POSITION_FRACTION = 0.06
_BELOW = -1.0  # stands in for non-finite or unobserved |x|: never reaches the threshold nor the max


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
        a = torch.nan_to_num(x.float().abs(), nan=_BELOW, posinf=_BELOW)  # non-finite are counted by AbsStats
        if valid is not None:
            a = torch.where(valid.view(-1, 1), a, _BELOW)
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

    def outlier_summary(self) -> dict:
        """JSON-ready: the outlier features and the definition's parameters."""
        outliers = self.outlier_features()
        return {
            "count": len(outliers),
            "channels": outliers,
            "threshold": self.threshold,
            "min_layer_fraction": LLM_INT8_LAYER_FRACTION,
            "min_position_fraction": LLM_INT8_POSITION_FRACTION,
        }

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
