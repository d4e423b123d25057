"""The sweep chart: a panel per site, a colour per model, a line style per method, error bars from the seeds,
and the legend outside every panel so the low-bit cells stay visible."""

from __future__ import annotations

import pytest

from quantdiff.report.sweep_report import UNPAIRED_CAPTION, SweepPoint, plot_sweep, sweep_figure

SITES, MODELS, METHODS, BITS = ("logits", "qk", "linear"), ("standard", "diff", "diffv2"), ("absmax", "llm-int8"), (16, 8, 6, 4)


def _points() -> list[SweepPoint]:
    points = [SweepPoint(model, None, None, None, 1.0) for model in MODELS]
    for s, site in enumerate(SITES):
        for m, model in enumerate(MODELS):
            for k, method in enumerate(METHODS):
                for bits in BITS:
                    value = 1.0 - (0.1 * (m + 1) + 0.05 * s if bits == 4 else 0.0) - 0.01 * k
                    points.append(SweepPoint(model, method, site, bits, value, value - 0.05, value + 0.03))
    return points


def test_small_multiples_keep_every_point_visible_and_the_legend_outside():
    points = _points()
    fig = sweep_figure(points, "accuracy", "bb")
    fig.canvas.draw()
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [f"site {s}" for s in SITES]
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert all(legend.x0 >= ax.get_window_extent(renderer).x1 for ax in axes)  # no panel under the legend
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [*MODELS, *METHODS, "unquantized"]
    for ax, site in zip(axes, SITES):
        low, high = ax.get_ylim()
        drawn = [(x, y) for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata()) if line.get_marker() in ("o", "s")]
        expected = [p for p in points if p.site == site]
        assert len(drawn) == len(expected)  # one marker per cell: none merged or lost
        four_bit = [p.value for p in expected if p.bits == 4]
        assert all(low <= v <= high for v in four_bit)
        xs_at_4 = sorted(x for x, _ in drawn if x > len(BITS) - 1.5)
        assert len(xs_at_4) == len(MODELS) * len(METHODS) and len(set(xs_at_4)) == len(xs_at_4)  # side by side, not on top
        # the error bars span each point's interval
        bars = [seg for coll in ax.collections for seg in coll.get_segments()]
        spans = sorted(round(seg[1][1] - seg[0][1], 9) for seg in bars)
        assert spans == pytest.approx([0.08] * len(expected))


def test_one_seed_draws_points_without_bars_and_invalid_cells_are_gaps(tmp_path):
    points = [SweepPoint("a", None, None, None, 0.9), SweepPoint("a", "absmax", "logits", 8, 0.9), SweepPoint("a", "absmax", "logits", 4, None)]
    fig = sweep_figure(points, "accuracy", "t")
    drawn = [y for line in fig.axes[0].lines for y in line.get_ydata() if line.get_marker() in ("o", "s")]
    assert drawn == [0.9]
    plot_sweep(points, tmp_path / "s.png", "accuracy", "t")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_the_axis_starts_at_zero_and_says_that_per_arm_bars_are_unpaired():
    # 4-bit values near 0.86 used to cut the axis at 0.80, which makes a 0.14 loss fill the panel
    points = [SweepPoint("a", None, None, None, 1.0), SweepPoint("a", "absmax", "linear", 8, 0.99, 0.98, 1.0),
              SweepPoint("a", "absmax", "linear", 4, 0.86, 0.83, 0.9)]
    fig = sweep_figure(points, "accuracy", "t")
    assert fig.axes[0].get_ylim()[0] == 0.0
    assert [t.get_text() for t in fig.texts] == ["t", UNPAIRED_CAPTION] and "unpaired" in UNPAIRED_CAPTION  # title, caption
    one_seed = [SweepPoint(p.model, p.method, p.site, p.bits, p.value) for p in points]
    assert [t.get_text() for t in sweep_figure(one_seed, "accuracy", "t").texts] == ["t"]  # no bars, no caption about them
    below = [*points[:2], SweepPoint("a", "absmax", "linear", 4, 0.05, -0.1, 0.2)]  # a t interval past the bound is drawn whole
    assert sweep_figure(below, "accuracy", "t").axes[0].get_ylim()[0] == -0.1
