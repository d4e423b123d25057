"""Statistic objects against naive references: torch.topk/quantile/moments, exact merging, round trips."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantdiff.stats.absstats import AbsStats
from quantdiff.stats.channels import ChannelStats
from quantdiff.stats.massive import massive_activation
from quantdiff.stats.histogram import N_BINS, QUANTILE_RELATIVE_ERROR, bin_index, quantile_values
from quantdiff.stats.model_stats import ModelStats
from quantdiff.stats.tile import fused_tile, tile_summary
from quantdiff.stats.topk import CHUNKS_PER_K, kth_lower_bound
from quantdiff.stats.workspace import Workspace

LOC = ("row", "group", "flat")


def _heavy_tailed(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Student-t-like: normal / sqrt(chi2) gives outliers over many octaves
    return torch.randn(shape, generator=g) / torch.rand(shape, generator=g).clamp_min(1e-3) ** 0.5


def _fill(stats: AbsStats, x: torch.Tensor, valid: torch.Tensor | None, splits) -> AbsStats:
    """Feed x (A, G, M) in row chunks; locations are (row, group, flat) in x's own coordinates."""
    start = 0
    for stop in [*splits, x.shape[0]]:
        chunk_valid = None if valid is None else valid[start:stop]
        offset = start
        stats.update(x[start:stop], 0, chunk_valid, lambda a, g, m, o=offset: torch.stack([a + o, g, m], dim=1))
        start = stop
    return stats


def _reference_entries(x, valid, group):
    """(|value|, row, flat) of observed finite entries of one group, sorted by |value| desc then location asc."""
    a = x[:, group].abs()
    keep = torch.isfinite(a) if valid is None else torch.isfinite(a) & valid[:, 0].expand_as(a)
    rows, flat = keep.nonzero(as_tuple=True)
    entries = sorted(zip(a[rows, flat].tolist(), rows.tolist(), flat.tolist()), key=lambda e: (-e[0], e[1], e[2]))
    return entries


@pytest.mark.parametrize("splits", [(), (1,), (2, 3)], ids=["whole", "halves", "thirds"])
def test_topk_quantiles_moments_match_naive(splits):
    x = _heavy_tailed((5, 3, 400)) * 7.0  # (A, G, M)
    valid = torch.rand(5, 1, 400, generator=torch.Generator().manual_seed(1)) > 0.25
    stats = _fill(AbsStats.empty(3, 50, LOC), x, valid, splits)
    for g in range(3):
        values = x[:, g][valid[:, 0]].double()
        ref = _reference_entries(x, valid, g)[:50]
        summary = stats.pooled([g]).summary(quantiles=(0.5, 0.9, 0.99))
        assert [e["value"] for e in summary["topk"]] == [v for v, _, _ in ref]
        assert [(e["row"], e["flat"]) for e in summary["topk"]] == [(r, f) for _, r, f in ref]
        assert summary["count"] == values.numel()
        for q in (0.5, 0.9, 0.99):
            exact = torch.quantile(values.abs(), q, interpolation="lower").item()
            got = summary["quantiles"][f"{q:g}"]
            assert abs(got - exact) <= QUANTILE_RELATIVE_ERROR * exact, f"q={q}: {got} vs {exact}"
        assert summary["median"] == summary["quantiles"]["0.5"]
        assert abs(summary["median"] - values.abs().median().item()) <= QUANTILE_RELATIVE_ERROR * values.abs().median().item()
        mean, std = values.mean().item(), values.std(unbiased=False).item()
        kurt = (((values - mean) / std) ** 4).mean().item()
        assert summary["mean"] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        assert summary["std"] == pytest.approx(std, rel=1e-5)
        assert summary["kurtosis"] == pytest.approx(kurt, rel=1e-4)


@pytest.mark.parametrize("layout", ["spread", "one_block", "ties"])
def test_rows_long_enough_for_the_chunked_kth_bound_give_the_naive_topk(layout):
    """Rows of ≥ 2·CHUNKS_PER_K·k entries take `kth_lower_bound`: a bound at most each row's k-th value, and the
    top-k as exact as a full sort, also when the largest values share one chunk or tie."""
    k = 6
    x = _heavy_tailed((3, 2, 2 * CHUNKS_PER_K * k + 37), seed=5)
    if layout == "one_block":
        x[:, :, 100:100 + 3 * k] *= 1000.0  # every large value in one or two chunks
    elif layout == "ties":
        x = x.round().clamp(-3, 3)
    valid = torch.rand(3, 1, x.shape[-1], generator=torch.Generator().manual_seed(6)) > 0.3
    a = x.abs() * valid
    assert bool((kth_lower_bound(a, k) <= a.topk(k, dim=-1).values[..., -1:]).all())
    stats = _fill(AbsStats.empty(2, k, LOC), x, valid, (1,))
    for g in range(2):
        ref = _reference_entries(x, valid, g)[:k]
        assert [(e["value"], e["row"], e["flat"]) for e in stats.pooled([g]).summary()["topk"]] == ref


def test_ties_resolve_by_location_whatever_the_split():
    """Integer-valued data: thousands of ties; the kept locations are the smallest ones, in every split."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-6, 7, (6, 2, 300), generator=g).float()
    whole = _fill(AbsStats.empty(2, 40, LOC), x, None, ())
    for splits in [(1,), (3,), (1, 2, 4, 5)]:
        parts = _fill(AbsStats.empty(2, 40, LOC), x, None, splits)
        assert torch.equal(parts.top_values, whole.top_values)
        assert torch.equal(parts.top_locations, whole.top_locations)
    for group in range(2):
        ref = _reference_entries(x, None, group)[:40]
        assert whole.top_locations[group, :, 0].tolist() == [r for _, r, _ in ref]
        assert whole.top_locations[group, :, 2].tolist() == [f for _, _, f in ref]


def test_merge_of_halves_is_exactly_the_whole():
    x = _heavy_tailed((8, 4, 256), seed=3)
    valid = torch.rand(8, 1, 256, generator=torch.Generator().manual_seed(4)) > 0.5
    whole = _fill(AbsStats.empty(4, 30, LOC), x, valid, (2, 5))
    first = _fill(AbsStats.empty(4, 30, LOC), x[:3], valid[:3], ())
    second = AbsStats.empty(4, 30, LOC)
    second.update(x[3:], 0, valid[3:], lambda a, g, m: torch.stack([a + 3, g, m], dim=1))
    merged = first.merge(second)
    for name in ("count", "nan", "inf", "hist", "top_values", "top_locations"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    assert torch.allclose(merged.power_sums, whole.power_sums, rtol=1e-12)
    assert merged.pooled().summary() == whole.pooled().summary()


def test_to_dict_round_trip_is_exact_through_json():
    x = _heavy_tailed((3, 2, 100), seed=5)
    stats = _fill(AbsStats.empty(2, 20, LOC), x, None, (1,))
    back = AbsStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    for name in ("count", "nan", "inf", "power_sums", "hist", "top_values", "top_locations"):
        assert torch.equal(getattr(back, name), getattr(stats, name)), name
    assert back.location_names == stats.location_names


def test_nonfinite_values_are_counted_and_never_enter_topk():
    x = _heavy_tailed((2, 1, 500), seed=6)
    x[0, 0, 7] = float("nan")
    x[1, 0, 9] = float("inf")
    x[1, 0, 10] = -float("inf")
    x[0, 0, 11] = float("nan")
    stats = _fill(AbsStats.empty(1, 10, LOC), x, None, (1,))
    summary = stats.pooled().summary()
    finite = x[torch.isfinite(x)]
    assert summary["nonfinite"] == {"nan": 2, "inf": 2}
    assert summary["count"] == finite.numel() == int(stats.hist.sum())
    assert [e["value"] for e in summary["topk"]] == finite.abs().topk(10).values.tolist()
    assert summary["mean"] == pytest.approx(finite.double().mean().item(), rel=1e-5)
    assert math.isfinite(summary["kurtosis"])


def test_masked_entries_never_count_even_when_largest():
    x = _heavy_tailed((2, 2, 64), seed=7)
    valid = torch.ones(2, 1, 64, dtype=torch.bool)
    valid[:, :, 40:] = False
    x[:, :, 40:] = 1e6  # the largest entries, all masked
    summary = _fill(AbsStats.empty(2, 5, LOC), x, valid, ()).pooled().summary()
    assert summary["count"] == 2 * 2 * 40
    assert summary["max"] == x[:, :, :40].abs().max().item()
    assert all(e["flat"] < 40 for e in summary["topk"])


def test_quantiles_outside_the_binned_range():
    hist = torch.zeros(N_BINS, dtype=torch.int64)
    hist[0], hist[-1] = 3, 2  # three values below 2**-24, two above 2**24
    assert quantile_values(hist, 5, [0.0, 0.5, 1.0], maximum=3e7) == [0.0, 0.0, 3e7]


def test_fewer_values_than_k():
    stats = AbsStats.empty(1, 10, LOC)
    stats.update(torch.tensor([[[3.0, -1.0, 2.0]]]))
    summary = stats.pooled().summary()
    assert [e["value"] for e in summary["topk"]] == [3.0, 2.0, 1.0]
    assert summary["median"] == pytest.approx(2.0, rel=QUANTILE_RELATIVE_ERROR)


def test_outlier_features_follow_the_llm_int8_definition():
    layers, positions, channels = 4, 100, 6
    x = torch.zeros(layers, 2, positions, channels)  # (layer, attention/FFN input, position, channel)
    x[:, 0, :10, 0] = 7.0  # 10% of the attention input's positions in every layer: outlier feature
    x[:1, 1, :50, 1] = -8.0  # 50% of positions but 1 of 4 layers = 25%: outlier feature (≥ 25%)
    x[:, :, :5, 2] = 9.0  # 5% of positions (< 6%) in every layer: not one
    x[:, :, :50, 3] = 5.9  # below the magnitude threshold: not one
    x[:2, 0, :4, 4] = 6.0  # 4% of the attention input and 4% of the FFN input: each < 6%, so not one
    x[:2, 1, 4:8, 4] = 6.0
    stats = ChannelStats.empty(layers, channels)
    for layer in range(layers):
        for which in (0, 1):
            stats.update(layer, which, x[layer, which, :60])  # positions in two batches must pool
            stats.update(layer, which, x[layer, which, 60:])
    holds = lambda l, c: any(((x[l, w, :, c].abs() >= 6).float().mean() >= 0.06).item() for w in (0, 1))  # noqa: E731
    naive = [c for c in range(channels) if sum(holds(l, c) for l in range(layers)) >= 0.25 * layers]
    assert stats.outlier_features() == naive == [0, 1]
    assert stats.outlier_summary()["layers"] == [4, 1]
    assert stats.absmax[:, 2].tolist() == [9.0] * layers
    back = ChannelStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back.outlier_features() == [0, 1] and torch.equal(back.absmax, stats.absmax)


def test_massive_activation_is_located_and_judged_by_sun_et_al_criterion():
    def hidden(values_at: list[tuple[float, int, int]], medians: list[float]) -> dict:
        topk = [{"value": v, "layer": l, "sequence": 0, "position": p, "channel": 3} for v, l, p in values_at]
        return {"topk": topk, "per_layer": [{"max": max([v for v, l, _ in values_at if l == i] or [1.0]), "median": m} for i, m in enumerate(medians)]}

    found = massive_activation(hidden([(2000.0, 1, 0), (150.0, 0, 4)], [0.1, 1.5]))
    assert (found["value"], found["layer"], found["position"], found["channel"]) == (2000.0, 1, 0, 3)
    assert found["first_position"] and found["massive"] and found["ratio"] == pytest.approx(2000 / 1.5)
    assert found["layers"] == [0, 1] and found["channels"] == [3]
    assert not massive_activation(hidden([(99.0, 0, 2)], [0.01]))["massive"]  # not above 100
    assert not massive_activation(hidden([(500.0, 0, 2)], [1.0]))["massive"]  # only 500× the median
    assert massive_activation({"topk": [], "per_layer": []}) is None


def test_model_stats_round_trip_and_merge():
    a = ModelStats.empty(2, 4, 8, [1, 1, 2, 2], k=5)
    # layer 1 only; locations (layer, head, sequence, query, key) and (layer, sequence, position, channel)
    a.logits.update(_heavy_tailed((2, 4, 30), seed=8), 4, None, lambda s, h, m: torch.stack([s * 0 + 1, h, s, m // 6, m % 6], 1))
    a.hidden.update(_heavy_tailed((2, 1, 24), seed=9), 1, None, lambda s, _, m: torch.stack([s * 0 + 1, s, m // 8, m % 8], 1))
    a.linear_inputs.update(1, 0, _heavy_tailed((3, 8), seed=10) * 10)
    a.tokens, a.sequences = 6, 2
    back = ModelStats.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back.summary() == a.summary()
    doubled = ModelStats.from_dict(a.to_dict()).merge(back)
    assert doubled.tokens == 12 and doubled.summary()["attention_logits"]["count"] == 2 * 240
    summary = a.summary()["attention_logits"]
    assert summary["per_map"]["2"]["count"] == 2 * 60 and summary["per_map"]["1"]["count"] == 2 * 60
    assert all(e["map"] == (1 if e["head"] < 2 else 2) for e in summary["topk"])


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(st.integers(-8, 8), min_size=1, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=4),
    k=st.integers(1, 12),
)
def test_any_split_merges_to_the_naive_answer(data, cuts, k):
    """Small integer data (many ties, zeros, fewer values than k): every split gives the naive top-k and counts."""
    x = torch.tensor(data, dtype=torch.float32).view(1, 1, -1)
    bounds = sorted({0, len(data), *[c for c in cuts if c <= len(data)]})
    merged = AbsStats.empty(1, k, LOC)
    for start, stop in zip(bounds, bounds[1:]):
        part = AbsStats.empty(1, k, LOC)
        part.update(x[:, :, start:stop], 0, None, lambda a, g, m, o=start: torch.stack([a, g, m + o], dim=1))
        merged.merge(part)
    naive = sorted(((abs(v), i) for i, v in enumerate(data)), key=lambda e: (-e[0], e[1]))[:k]
    summary = merged.pooled().summary()
    assert [(e["value"], e["flat"]) for e in summary["topk"]] == [(float(v), i) for v, i in naive]
    assert summary["count"] == len(data) == int(merged.hist.sum())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_statistics_equal_cpu_statistics():
    x = _heavy_tailed((4, 3, 5000), seed=11)
    valid = torch.rand(4, 1, 5000, generator=torch.Generator().manual_seed(12)) > 0.2
    cpu = _fill(AbsStats.empty(3, 40, LOC), x, valid, (2,))
    gpu = _fill(AbsStats.empty(3, 40, LOC, "cuda"), x.cuda(), valid.cuda(), (2,))
    assert gpu.hist.is_cuda and gpu.top_values.is_cuda  # statistics stay on the device
    for name in ("count", "hist", "top_values", "top_locations"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


def test_deferred_merges_equal_immediate_merges():
    x = _heavy_tailed((6, 3, 300), seed=13)
    x[2:4] *= 5  # later rows beat the thresholds set at entry: many candidates pile up
    immediate = _fill(AbsStats.empty(3, 30, LOC), x, None, (1, 2, 4))
    deferred = AbsStats.empty(3, 30, LOC)
    with deferred.deferred_merges():
        _fill(deferred, x, None, (1, 2, 4))
        assert torch.equal(deferred.top_values, AbsStats.empty(3, 30, LOC).top_values)  # nothing merged yet
    for name in ("count", "hist", "top_values", "top_locations"):
        assert torch.equal(getattr(deferred, name), getattr(immediate, name)), name


def test_fused_tile_is_the_same_math_as_the_workspace_path():
    """fused_tile run eagerly (what torch.compile fuses) against the buffer-reusing CPU path."""
    x = _heavy_tailed((2, 3, 500), seed=16)
    valid = torch.rand(2, 1, 500, generator=torch.Generator().manual_seed(17)) > 0.4
    offsets = (torch.arange(3, dtype=torch.int32) * N_BINS).view(1, -1, 1)
    a, row_sums, index = fused_tile(x, valid.float(), offsets)
    ref_a, ref_sums, *_ = tile_summary(x, valid, Workspace())
    assert torch.equal(a, ref_a)
    assert torch.equal(index, bin_index(ref_a))
    assert torch.allclose(row_sums.double().sum(dim=0), ref_sums, rtol=1e-5)


@pytest.mark.slow
def test_compiled_fused_kernel_gives_the_same_statistics():
    x = _heavy_tailed((3, 4, 2000), seed=14)
    valid = torch.rand(3, 1, 2000, generator=torch.Generator().manual_seed(15)) > 0.3
    plain = _fill(AbsStats.empty(4, 20, LOC), x, valid, (1,))
    fused = AbsStats.empty(4, 20, LOC)
    fused.fused = True
    _fill(fused, x, valid, (1,))
    for name in ("count", "hist", "top_values", "top_locations"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    assert torch.allclose(fused.power_sums, plain.power_sums, rtol=1e-5)
