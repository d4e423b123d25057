"""The emergence chart's sink panels: a fixed 0–1 axis (a share), widened to every value and band, never clipped."""

from __future__ import annotations

from quantdiff.report.emergence import SHARE_NOTE, emergence_figure


def _curve(mean: list[float], low: list[float | None], high: list[float | None]) -> dict:
    return {"steps": [1, 2, 3], "tokens": [10, 20, 30], "mean": mean, "low": low, "high": high}


def _panel(label: str, **arms: dict) -> dict:
    return {"label": label, "arms": arms}


def test_sink_panels_show_zero_to_one_and_every_band_edge():
    drift = _curve([0.013, 0.016, 0.022], [None] * 3, [None] * 3)  # the H200 run's drift of a percent, one seed
    banded = _curve([0.0, 0.1, 0.2], [-0.03, -0.05, 0.04], [0.03, 0.25, 0.36])  # a t band below 0
    beyond = _curve([0.1, 1.4, 0.3], [None] * 3, [None] * 3)  # DIFF V2's combined mass can pass 1
    fig = emergence_figure({
        "hidden_states/top1": _panel("Top-1", standard=_curve([5.0, 6.0, 7.0], [None] * 3, [None] * 3)),
        "sink/mean": _panel("mean", standard=drift),
        "sink/score": _panel("score", standard=banded),
        "sink/max": _panel("max", diffv2=beyond),
    })
    top1, mean, score, largest = fig.axes[:4]
    assert top1.get_ylim()[1] < 10  # other quantities keep their own scale
    low, high = mean.get_ylim()
    assert low <= 0.0 and high >= 1.0 and mean.get_ylabel() == SHARE_NOTE
    low, high = score.get_ylim()
    assert low <= -0.05 and high >= 1.0  # the band's lowest edge is inside the panel
    assert largest.get_ylim()[1] >= 1.4
