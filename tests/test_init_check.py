"""The natural-text init report (report.init_check, scripts/text_init_report.py) on train logs written here:
the gap to the standard arm and its interval against scipy's t distribution, and refusals."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from quantdiff.core.errors import ConfigError
from quantdiff.report.init_check import init_document, init_markdown
from tests import forked

ROOT = Path(__file__).resolve().parent.parent
LOSSES = {"standard": [4.10, 4.20, 4.05], "diff": [4.13, 4.22, 4.09]}


def _write_run(run: Path, init: str, losses: dict[str, list[float]]) -> Path:
    for arm, values in losses.items():
        for seed, loss in enumerate(values):
            directory = run / f"seed-{seed}" / arm
            directory.mkdir(parents=True)
            log = {"init": init, "held_out_loss": loss, "unigram_entropy": 5.1, "held_out_curve": [[0, 7.6], [10, loss]]}
            (directory / "train_log.json").write_text(json.dumps(log))
    return run


def test_the_gap_and_its_interval_equal_scipys_t(tmp_path):
    document = init_document({"authors": _write_run(tmp_path / "authors", "authors", LOSSES)})
    gap = document["authors"]["arms"]["diff"]["gap_to_standard"]
    differences = [d - s for d, s in zip(LOSSES["diff"], LOSSES["standard"])]
    low, high = scipy_stats.t.interval(0.95, len(differences) - 1, loc=statistics.fmean(differences),
                                       scale=scipy_stats.sem(differences))
    assert gap["mean"] == pytest.approx(statistics.fmean(differences))
    assert (gap["low"], gap["high"]) == (pytest.approx(low, rel=1e-6), pytest.approx(high, rel=1e-6))
    assert gap["other_higher"] == 3 and document["authors"]["arms"]["standard"]["gap_to_standard"] is None
    assert document["authors"]["gap_curves"]["diff"] == [[0, 0.0], [10, pytest.approx(statistics.fmean(differences))]]
    table = init_markdown(document)
    assert f"| diff | {statistics.fmean(LOSSES['diff']):.3f} | 4.130, 4.220, 4.090 | {gap['mean']:+.3f} [{low:+.3f}, {high:+.3f}] | 3 of 3 |" in table


def test_a_run_whose_logs_record_another_init_is_refused(tmp_path):
    run = _write_run(tmp_path / "authors", "transformers", LOSSES)
    with pytest.raises(ConfigError, match="record init transformers, not authors"):
        init_document({"authors": run})


def test_the_script_writes_the_report_and_says_whether_the_plan_holds(tmp_path):
    _write_run(tmp_path / "runs" / "authors", "authors", LOSSES)
    _write_run(tmp_path / "runs" / "transformers", "transformers", {"standard": [4.1, 4.2, 4.0], "diff": [4.6, 4.7, 4.5]})
    script = ROOT / "scripts" / "text_init_report.py"  # run as `python SCRIPT`, in a forked process (tests/forked.py)
    done = forked.run(code=f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                      args=[str(tmp_path / "runs"), "--out", str(tmp_path / "out")], cwd=ROOT, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gap to standard on the authors' init: +0.0300 nats" in done.stdout and "within the plan's 0.05 nats" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["curves.png", "init_check.json", "tables.md"]
    assert set(json.loads((tmp_path / "out" / "init_check.json").read_text())) == {"authors", "transformers"}
