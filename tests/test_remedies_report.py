"""The remedies report: t intervals against scipy, estimates over seeds and over blocks against hand computation,
the answer's direction, the pipeline's grouping of seed directories, and (slow) the whole pipeline on two bb arms."""

import importlib.util
import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
import scipy.stats

from quantdiff.eval.sweep import Cell, cells_to_json
from quantdiff.models.names import resolve
from quantdiff.report.intervals import half_width, over_blocks
from quantdiff.report.remedies import answer_lines, gap_estimate, load_groups, loss_estimate, render, summary, write_report

ROOT = Path(__file__).resolve().parents[1]


def _pipeline():
    spec = importlib.util.spec_from_file_location("remedies_pipeline", ROOT / "scripts" / "remedies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n", [2, 3, 6, 13, 31, 32, 46, 101, 1001])
def test_half_width_is_scipys_t_interval(n):
    values = [math.sin(i) for i in range(n)]
    expected = scipy.stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    assert half_width(values) == pytest.approx(expected, rel=1e-9)


def _cells(model: str, ref: list[float], quantized: dict[tuple[str, int, str | None], list[float]]) -> list[Cell]:
    """A reference and quantized cells whose blocks hold the given accuracies (equal blocks: pooled = mean)."""
    def cell(method, bits, site, values, transform=None):
        blocks = [{"accuracy": v} for v in values]
        return Cell(model, "bb", method, bits, site, {"accuracy": statistics.fmean(values)}, transform=transform, blocks=blocks)

    out = [cell(None, None, None, ref)]
    for (method, bits, transform), values in quantized.items():
        out.append(cell(method, bits, "linear", values, None if transform is None else {"name": transform}))
    return out


def _write_run(tmp_path: Path, arms: dict[str, dict[int | None, tuple[list[float], list[float]]]]) -> None:
    """A fake remedies output: per arm and seed, (reference blocks, absmax+hadamard 4-bit blocks)."""
    models, cells = [], []
    for arm, seeds in arms.items():
        for seed, (ref, quant) in seeds.items():
            name = f"seed-{seed}/{arm}" if seed is not None else arm
            models.append({"name": name, "path": name, "arm": arm, "seed": seed, "kind": "standard" if arm == "standard" else "diff"})
            cells += _cells(name, ref, {("absmax", 4, "hadamard"): quant})
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bb-hadamard.json").write_text(json.dumps(cells_to_json(cells)))
    manifest = {"blocks": 3, "groups": [{"name": "bb", "task": "bb", "options": [], "models": models}],
                "runs": [{"group": "bb", "remedy": "hadamard", "command": "quantdiff sweep …", "json": "runs/bb-hadamard.json", "wall_s": 1.0}],
                "wall_s": 1.0}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))


def test_one_seed_estimates_come_from_blocks(tmp_path):
    _write_run(tmp_path, {"standard": {None: ([1.0, 1.0, 1.0], [0.7, 0.8, 0.9])}, "diff": {None: ([0.95, 1.0, 0.95], [0.9, 1.0, 1.0])}})
    _, (group,) = load_groups(tmp_path)
    key = ("absmax + Hadamard", 4)
    loss = loss_estimate(group.arms["standard"], "accuracy", key)
    expected = over_blocks(0.2, [0.3, 0.2, 0.1])
    assert loss.over == "blocks" and loss.value == pytest.approx(0.2) and loss.half_width == pytest.approx(expected.half_width)
    assert loss.half_width == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-4)  # t(0.975, 2) printed to 3 decimals
    gap = gap_estimate(group.arms["standard"], group.arms["diff"], "accuracy", key)  # block gaps 0.25, 0.2, 0.15
    assert gap.value == pytest.approx(0.2) and gap.half_width == pytest.approx(4.303 * 0.05 / math.sqrt(3), rel=1e-4) and gap.excludes_zero
    assert "**standard loses more**" in "\n".join(answer_lines(group))


def test_several_seeds_are_aggregated_over_seeds_and_paired_by_seed(tmp_path):
    standard = {0: ([1.0] * 3, [0.6] * 3), 1: ([1.0] * 3, [0.9] * 3), 2: ([0.9] * 3, [0.8] * 3)}  # losses 0.4, 0.1, 0.1
    diff = {0: ([1.0] * 3, [0.9] * 3), 1: ([1.0] * 3, [0.7] * 3), 2: ([1.0] * 3, [0.9] * 3)}  # losses 0.1, 0.3, 0.1
    _write_run(tmp_path, {"standard": standard, "diff": diff})
    _, (group,) = load_groups(tmp_path)
    key = ("absmax + Hadamard", 4)
    loss = loss_estimate(group.arms["standard"], "accuracy", key)
    values = [0.4, 0.1, 0.1]
    assert loss.over == "seeds" and loss.units == 3 and loss.value == pytest.approx(0.2)
    assert loss.half_width == pytest.approx(scipy.stats.t.ppf(0.975, 2) * statistics.stdev(values) / math.sqrt(3), rel=1e-3)
    gap = gap_estimate(group.arms["standard"], group.arms["diff"], "accuracy", key)  # per seed 0.3, −0.2, 0.0
    assert gap.value == pytest.approx(0.1 / 3) and not gap.excludes_zero
    assert "no difference resolved" in "\n".join(answer_lines(group))
    doc = summary([group])
    assert doc["bb"]["arms"]["standard"]["seeds"] == ["0", "1", "2"] and doc["bb"]["gaps"][0]["arm"] == "diff"
    assert "absmax + Hadamard" in render(json.loads((tmp_path / "manifest.json").read_text()), [group], [])


def test_the_pipeline_groups_seed_directories_by_arm(tmp_path):
    for seed in (0, 1):
        for arm in ("standard", "diff"):
            shutil.copytree(resolve(f"bb/{arm}")[0], tmp_path / f"seed-{seed}" / arm)
    models = _pipeline().describe_models([str(tmp_path / f"seed-{s}" / a) for s in (0, 1) for a in ("standard", "diff")])
    assert [(m["arm"], m["seed"], m["kind"]) for m in models] == [("standard", 0, "standard"), ("diff", 0, "diff"), ("standard", 1, "standard"), ("diff", 1, "diff")]
    assert len({m["name"] for m in models}) == 4  # names stay distinct (whole paths where directory names repeat)


@pytest.mark.slow
def test_the_pipeline_writes_a_report_that_answers_for_every_diff_arm(tmp_path):
    out = tmp_path / "remedies"
    assert _pipeline().main(["--out", str(out), "--lm", "none", "--bb", "bb/standard", "bb/diffv2", "--bb-limit", "6", "--blocks", "3", "--calibration-tokens", "256"]) == 0
    report = (out / "report.md").read_text()
    for variant in ("absmax", "LLM.int8", "absmax + Hadamard", "absmax + SmoothQuant"):
        assert f"`bb` {variant} 4-bit at `linear`: standard loses" in report and "diffv2" in report
    manifest = json.loads((out / "manifest.json").read_text())
    assert [run["remedy"] for run in manifest["runs"]] == ["linear", "hadamard", "smooth", "attention"]
    assert all(str(out) in run["command"] for run in manifest["runs"])  # recorded with their final paths
    assert (out / "bb_linear.png").stat().st_size > 0 and json.loads((out / "summary.json").read_text())["bb"]["gaps"]
    write_report(out)  # regenerates from what is on disk
