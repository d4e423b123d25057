"""results/damage (issue 55 item 5): scripts/damage_maps.py's summaries against hand-computed ones, and every published
map parses with the `quantdiff.sensitivity` schema, one entry per layer, as runs.json and summary.json say, and
README.md's tables are the script's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("damage_maps", ROOT / "scripts" / "damage_maps.py")
maps = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(maps)
OUT = ROOT / "results" / "damage"
DAMAGE = ("tokens", "kld_mean", "kld_median", "kld_p99", "kld_max", "delta_p_mean", "delta_p_rms", "same_top1", "delta_loss", "loss_full")
OUTLIERS = ("input_top1", "hidden_top1", "hidden_top1_over_median", "hidden_kurtosis", "outlier_features", "sink_heads", "massive")


def _layer(index: int, kld: float, massive: bool) -> dict:
    return {"layer": index, "damage": {"kld_mean": kld, "same_top1": 0.9},
            "outliers": {"input_top1": 1.0, "hidden_top1": 2.0, "hidden_top1_over_median": 3.0, "hidden_kurtosis": 4.0,
                         "outlier_features": 0, "sink_heads": 0, "massive": massive}}


def test_massive_summary_ranks_and_shares_the_flagged_layers():
    layers = [_layer(0, 0.5, False), _layer(1, 0.1, True), _layer(2, 0.3, True), _layer(3, 0.1, False)]
    got = maps.massive_summary(layers)
    # by hand: total 1.0; order by KL 0 (0.5), 2 (0.3), 1 (0.1, lower index first), 3 (0.1)
    assert got == {"layers": [1, 2], "first": 1, "first_rank": 3, "first_share": pytest.approx(0.1), "flagged_share": pytest.approx(0.4),
                   "flagged_fraction_of_layers": 0.5}
    assert [e["layer"] for e in maps.ranked(layers)] == [0, 2, 1, 3]
    assert maps.massive_summary([_layer(0, 0.5, False)]) is None


def test_a_map_summary_lists_the_top_layers_with_their_outliers():
    layers = [_layer(i, kld, i == 4) for i, kld in enumerate([0.1, 0.6, 0.2, 0.05, 0.05, 0.0])]
    result = {"sites": [{"site": "linear", "layers": layers, "spearman": {"input_top1": None},
                         "additivity": {"ratio": 0.9, "measured_whole": {"kld_mean": 1.1}}}]}
    [site] = maps.map_summary(result)
    assert [e["layer"] for e in site["top"]] == [1, 2, 0, 3, 4]
    assert site["top"][0]["share"] == pytest.approx(0.6) and site["top"][0]["hidden_top1"] == 2.0
    assert (site["additivity"], site["whole_kld_mean"], site["massive"]["first_rank"]) == (0.9, 1.1, 5)
    assert "| 1 | 0.6000 | 60.0% |" in maps.markdown_top(site)


def test_every_command_writes_its_own_json_and_png():
    stems = [stem for stem, *_ in maps.RUNS]
    assert len(set(stems)) == len(stems)
    for stem, *spec in maps.RUNS:
        argv = maps.command(stem, *spec)
        assert argv[argv.index("--json") + 1] == f"results/damage/{stem}.json" and argv[argv.index("--plot") + 1] == f"results/damage/{stem}.png"


@pytest.mark.skipif(not (OUT / "summary.json").exists(), reason="results/damage not generated")
def test_published_maps_parse_with_the_sensitivity_schema():
    runs = json.loads((OUT / "runs.json").read_text())
    assert [r["json"] for r in runs] == [f"{stem}.json" for stem, *_ in maps.RUNS]
    summary = json.loads((OUT / "summary.json").read_text())
    for (stem, model, method, bits, granularity, _), run in zip(maps.RUNS, runs):
        assert run["command"].startswith(f"quantdiff sensitivity {model} ") and run["seconds"] > 0
        result = json.loads((OUT / run["json"]).read_text())
        assert (result["schema"], result["model"], result["method"], result["bits"], result["granularity"]) == (
            "quantdiff.sensitivity", model, method, bits, granularity)
        assert (OUT / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        for site in result["sites"]:
            assert [e["layer"] for e in site["layers"]] == list(range(len(site["layers"])))
            for entry in site["layers"]:
                assert set(DAMAGE) <= set(entry["damage"]) and set(OUTLIERS) <= set(entry["outliers"])
                assert entry["damage"]["tokens"] == result["tokens"] and entry["damage"]["kld_mean"] >= 0
            assert site["additivity"]["measured_whole"]["kld_mean"] > 0
        assert summary[stem]["sites"] == json.loads(json.dumps(maps.map_summary(result)))


@pytest.mark.skipif(not (OUT / "summary.json").exists(), reason="results/damage not generated")
def test_the_readme_shows_the_tables_the_script_prints_from_the_maps():
    summary = json.loads((OUT / "summary.json").read_text())
    results = {stem: json.loads((OUT / f"{stem}.json").read_text()) for stem, *_ in maps.RUNS}
    readme = (OUT / "README.md").read_text()
    for line in (maps.real_tables(summary, results) + "\n" + maps.arms_table(results)).splitlines():
        assert line in readme, line
