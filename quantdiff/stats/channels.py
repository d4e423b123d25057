"""Per-channel statistics of the linear layers' inputs: SmoothQuant's act scales and LLM.int8's outlier features."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdiff.quant.numerics import LLM_INT8_THRESHOLD

LLM_INT8_LAYER_FRACTION = 0.25
LLM_INT8_POSITION_FRACTION = 0.06
# The linear inputs of a decoder layer, in the order of the `over_threshold` / `positions` second axis.
LINEAR_INPUTS = ("attention", "ffn")
_BELOW = -1.0  # stands in for non-finite or unobserved |x|: never reaches the threshold nor the max


@dataclass
class ChannelStats:
    """Per (layer, channel) of the decoder layers' linear inputs — the normed hidden states that enter the
    attention projections (q/k/v) and the FFN expansion (gate/up): max |x| (SmoothQuant's act scales) and, per
    input, how many positions reach the LLM.int8 threshold, plus positions observed per layer and input. The max
    is kept per input too (`input_absmax`): SmoothQuant smooths each input with its own scales.

    Outlier feature (Dettmers et al. 2022, "LLM.int8()", §3.2 and §4.1): a feature dimension where |x| ≥ 6
    at ≥ 6% of the sequence positions, in ≥ 25% of the layers, counted only in the inputs of the attention
    projections and of the FFN expansion. A layer holds channel c when either of its two inputs does; positions
    are pooled over all sequences. The attention output projection's input is left out: its features are
    attention heads' value channels, not hidden-state channels.
    """

    input_absmax: torch.Tensor  # (L, 2, D) float32 max |x| over finite observed values, per LINEAR_INPUTS
    over_threshold: torch.Tensor  # (L, 2, D) int64 positions with |x| ≥ threshold, per LINEAR_INPUTS
    positions: torch.Tensor  # (L, 2) int64 positions observed, per LINEAR_INPUTS
    nan: torch.Tensor  # (L, 2) int64 NaN values among the observed positions' channels (`stats.nonfinite`)
    inf: torch.Tensor  # (L, 2) int64 ±Inf values, likewise
    threshold: float = LLM_INT8_THRESHOLD

    @classmethod
    def empty(cls, layers: int, channels: int, device: torch.device | str = "cpu", threshold: float = LLM_INT8_THRESHOLD) -> ChannelStats:
        inputs = len(LINEAR_INPUTS)
        return cls(
            torch.zeros(layers, inputs, channels, device=device),
            torch.zeros(layers, inputs, channels, dtype=torch.int64, device=device),
            torch.zeros(layers, inputs, dtype=torch.int64, device=device),
            torch.zeros(layers, inputs, dtype=torch.int64, device=device),
            torch.zeros(layers, inputs, dtype=torch.int64, device=device),
            threshold,
        )

    def update(self, layer: int, which: int, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """x (N, D): N positions of linear input `which` (an index of LINEAR_INPUTS); valid (N,) bool or None."""
        a = x.detach().float().abs()
        observed = torch.ones_like(a, dtype=torch.bool) if valid is None else valid.view(-1, 1).expand_as(a)
        self.nan[layer, which] += (torch.isnan(a) & observed).sum()
        self.inf[layer, which] += (torch.isinf(a) & observed).sum()
        a = torch.nan_to_num(a, nan=_BELOW, posinf=_BELOW)  # non-finite: never an outlier
        if valid is not None:
            a = torch.where(valid.view(-1, 1), a, _BELOW)
        torch.maximum(self.input_absmax[layer, which], a.amax(dim=0), out=self.input_absmax[layer, which])
        self.over_threshold[layer, which] += (a >= self.threshold).sum(dim=0)
        self.positions[layer, which] += a.shape[0] if valid is None else torch.count_nonzero(valid)

    def merge(self, other: ChannelStats) -> ChannelStats:
        if other.over_threshold.shape != self.over_threshold.shape or other.threshold != self.threshold:
            raise ValueError("cannot merge channel statistics of different layouts")
        torch.maximum(self.input_absmax, other.input_absmax.to(self.input_absmax.device), out=self.input_absmax)
        self.over_threshold += other.over_threshold.to(self.over_threshold.device)
        self.positions += other.positions.to(self.positions.device)
        self.nan += other.nan.to(self.nan.device)
        self.inf += other.inf.to(self.inf.device)
        return self

    @property
    def finite(self) -> torch.Tensor:
        """(L, 2) finite values observed per input (positions × channels, less the non-finite)."""
        return self.positions * self.input_absmax.shape[-1] - self.nan - self.inf

    @property
    def absmax(self) -> torch.Tensor:
        """(L, D) max |x| over both inputs of each layer (the stats JSON's `channel_absmax`)."""
        return self.input_absmax.amax(dim=1)

    def layers_holding(self) -> torch.Tensor:
        """(L, D) bool: layer l holds channel c (≥ 6% of the positions of one of its inputs reach the threshold)."""
        observed = self.positions.clamp(min=1).double().unsqueeze(-1)  # (L, 2, 1); an unobserved input counts 0
        fraction = self.over_threshold.double() / observed
        return (fraction >= LLM_INT8_POSITION_FRACTION).any(dim=1)

    def outlier_features(self) -> list[int]:
        """Channels meeting the LLM.int8 outlier-feature definition in the class docstring."""
        if int(self.positions.sum()) == 0:
            return []
        layers = self.absmax.shape[0]
        return torch.nonzero(self.layers_holding().sum(dim=0) >= LLM_INT8_LAYER_FRACTION * layers).view(-1).tolist()

    def outlier_summary(self) -> dict:
        """JSON-ready: the outlier features, in how many layers each appears, and the definition's parameters."""
        outliers = self.outlier_features()
        per_channel = self.layers_holding().sum(dim=0)
        return {
            "count": len(outliers),
            "channels": outliers,
            "layers": [int(per_channel[c]) for c in outliers],
            "threshold": self.threshold,
            "min_layer_fraction": LLM_INT8_LAYER_FRACTION,
            "min_position_fraction": LLM_INT8_POSITION_FRACTION,
            "inputs": [f"{name} input" for name in LINEAR_INPUTS],
        }

    def to_dict(self) -> dict:
        return {
            "input_absmax": self.input_absmax.tolist(),
            "over_threshold": self.over_threshold.tolist(),
            "positions": self.positions.tolist(),
            "nan": self.nan.tolist(),
            "inf": self.inf.tolist(),
            "threshold": self.threshold,
        }

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str = "cpu") -> ChannelStats:
        return cls(
            torch.tensor(data["input_absmax"], dtype=torch.float32, device=device),
            torch.tensor(data["over_threshold"], dtype=torch.int64, device=device),
            torch.tensor(data["positions"], dtype=torch.int64, device=device),
            torch.tensor(data["nan"], dtype=torch.int64, device=device),
            torch.tensor(data["inf"], dtype=torch.int64, device=device),
            float(data["threshold"]),
        )
