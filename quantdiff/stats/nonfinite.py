"""The one guard for non-finite values in what a model computed (docs/reliability.md, "Non-finite values"):
every command that reads activations or logits counts NaN and ±Inf, says what held them in the same words, and
then either goes on with a warning (what it reports excludes them, or marks them: `stats`, `eval`) or refuses
(what it would derive from them is not what it says: `kv-plan`'s sink masses and massive positions, smoothing's
channel maxima; a NaN row drops out of a sink mass, which then reads 0.0, and out of a maximum)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quantdiff.core.errors import DataError


@dataclass(frozen=True)
class NonFinite:
    """How many values of one kind (`what`) were NaN or ±Inf; `total`: how many were seen, finite or not (None:
    not counted). `nan`/`inf` split `count` where the source tells them apart."""

    what: str
    count: int
    total: int | None = None
    nan: int | None = None
    inf: int | None = None

    def text(self) -> str:
        share = f"{self.count / self.total:.1%} of " if self.total else f"{self.count:,} "
        split = f" ({self.nan:,} NaN, {self.inf:,} Inf)" if self.nan is not None and self.inf is not None else ""
        return f"{share}{self.what} were non-finite{split}"


def split(what: str, nan: int, inf: int, finite: int) -> NonFinite:
    """Counts that tell NaN from Inf, beside the finite values seen."""
    return NonFinite(what, nan + inf, nan + inf + finite, nan, inf)


def in_stats(stats) -> list[NonFinite]:
    """What the statistics of a pass (`stats.model_stats.ModelStats`) saw: attention logits, hidden states and
    linear inputs, each only when it held a NaN or an Inf."""
    found = [split(what, int(block.nan.sum()), int(block.inf.sum()), int(block.count.sum()))
             for what, block in (("attention logits", stats.logits), ("hidden states", stats.hidden))]
    channels = stats.linear_inputs
    found.append(split("linear inputs", int(channels.nan.sum()), int(channels.inf.sum()), int(channels.finite.sum())))
    return [item for item in found if item.count]


def warn_nonfinite(subject: str, found: Sequence[NonFinite], consequence: str) -> None:
    """A warning line per finding, on stderr even under --quiet: `subject: <finding>; <consequence>`."""
    from quantdiff.report.console import warn

    for item in found:
        warn(f"{subject}: {item.text()}; {consequence}")


def refuse_nonfinite(subject: str, found: Sequence[NonFinite], product: str) -> None:
    """DataError in one line naming the first finding, when `product` would be derived from non-finite values."""
    if found:
        raise DataError(f"{subject}: {found[0].text()} on the calibration data: {product} would be derived from them, so none is written")
