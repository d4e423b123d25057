"""Counts and power sums of |x| per group: how many values were finite, NaN or Inf, and Σx … Σx⁴ (float64)
for the mean, standard deviation and kurtosis. All of it adds, so pooling and merging are exact."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIGNIFICANT_DIGITS = 8  # moments are float sums whose last bits depend on summation order: round them


def _round(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")


@dataclass
class Moments:
    count: torch.Tensor  # (G,) int64 finite values observed
    nan: torch.Tensor  # (G,) int64
    inf: torch.Tensor  # (G,) int64
    power_sums: torch.Tensor  # (G, 4) float64: Σx, Σx², Σx³, Σx⁴ over finite values

    FIELDS = ("count", "nan", "inf", "power_sums")

    @classmethod
    def empty(cls, groups: int, device: torch.device | str) -> Moments:
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(zeros(groups), zeros(groups), zeros(groups), zeros(groups, 4, dtype=torch.float64))

    def add(self, groups: slice, n_valid: torch.Tensor, sums: torch.Tensor) -> None:
        self.count[groups] += n_valid
        self.power_sums[groups] += sums

    def add_nonfinite(self, groups: slice, x: torch.Tensor, observed: torch.Tensor) -> None:
        """Count NaN and Inf among the observed entries of a tile x (A, g, M)."""
        self.nan[groups] += (torch.isnan(x) & observed).sum(dim=(0, 2))
        self.inf[groups] += (torch.isinf(x) & observed).sum(dim=(0, 2))

    def merge(self, other: Moments) -> None:
        for name in self.FIELDS:
            getattr(self, name).add_(getattr(other, name))

    def pooled(self, index: torch.Tensor) -> Moments:
        return Moments(*(getattr(self, name)[index].sum(dim=0, keepdim=True) for name in self.FIELDS))

    def to(self, device: torch.device | str) -> Moments:
        return Moments(*(getattr(self, name).to(device) for name in self.FIELDS))

    def summary(self) -> dict:
        """Group 0's mean, std and kurtosis of |x| (None where undefined), rounded to SIGNIFICANT_DIGITS."""
        n = int(self.count[0])
        out = {"mean": None, "std": None, "kurtosis": None}
        if n == 0:
            return out
        s1, s2, s3, s4 = self.power_sums[0].tolist()
        mean = s1 / n
        var = max(s2 / n - mean**2, 0.0)
        out["mean"], out["std"] = _round(mean), _round(var**0.5)
        if var > 0:
            m4 = s4 / n - 4 * mean * s3 / n + 6 * mean**2 * s2 / n - 3 * mean**4
            out["kurtosis"] = _round(m4 / var**2)
        return out

    def to_dict(self) -> dict:
        return {name: getattr(self, name).tolist() for name in self.FIELDS}

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str) -> Moments:
        count, nan, inf = (torch.tensor(data[name], dtype=torch.int64, device=device) for name in ("count", "nan", "inf"))
        return cls(count, nan, inf, torch.tensor(data["power_sums"], dtype=torch.float64, device=device).view(-1, 4))
