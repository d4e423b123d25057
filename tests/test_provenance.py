"""Where a trained model came from (train/provenance.py), and the budget-matched DIFF V2 (models.pairs.budget_matched):
each train_log.json names the code's commit, whether the tracked tree differed from it, and every start and resume
in UTC; a DIFF V2 arm with `match_budget = true` has the standard arm's parameter count."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from quantdiff.core.errors import ConfigError
from quantdiff.models.pairs import SizePreset, budget_matched, build_model, kind_configs, parameter_count
from quantdiff.train.loop import train_pair
from quantdiff.train.recipe import parse_recipe
from tests.test_seeds import MICRO_BB

ROOT = Path(__file__).resolve().parents[1]
ARMS = """
[[arms]]
name = "matched"
kind = "diffv2"
match_budget = true
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def _utc(stamp: str) -> datetime:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("preset", [
    SizePreset(hidden_size=64, num_layers=2, num_heads=2, vocab_size=83),  # the bb recipes: exact
    SizePreset(hidden_size=128, num_layers=4, num_heads=4, vocab_size=2048),  # the text recipes: exact
    SizePreset(hidden_size=256, num_layers=4, num_heads=16, num_kv_heads=8, vocab_size=512),  # 16 heads: rounded
], ids=["bb", "text", "16-heads"])
def test_a_budget_matched_diffv2_has_the_standard_models_parameter_count(preset):
    configs = kind_configs(preset, ("standard", "diffv2"))
    standard = parameter_count(build_model(configs["standard"]))
    added = parameter_count(build_model(configs["diffv2"])) - standard
    # per layer, Q2 (D x H·d) and W_λ (D x H) are what DIFF V2 adds on top of the baseline's sizes
    assert added == preset.num_layers * (preset.hidden_size ** 2 + preset.hidden_size * preset.num_heads)
    matched = budget_matched(configs["diffv2"], preset)
    assert matched.num_attention_heads == configs["diffv2"].num_attention_heads and matched.head_dim == configs["diffv2"].head_dim
    assert abs(parameter_count(build_model(matched)) - standard) / standard < 0.005
    assert configs["diffv2"].intermediate_size == preset.intermediate  # the original config is left as it was


def test_match_budget_is_refused_on_a_kind_that_already_has_the_baselines_sizes():
    with pytest.raises(ConfigError, match="match_budget narrows DIFF V2's MLP; kind 'diff'"):
        parse_recipe(MICRO_BB.replace("SEEDS", "seed = 0") + ARMS.replace('kind = "diffv2"', 'kind = "diff"'), "r")
    with pytest.raises(ConfigError, match="match_budget must be true or false"):
        parse_recipe(MICRO_BB.replace("SEEDS", "seed = 0") + ARMS.replace("match_budget = true", 'match_budget = "yes"'), "r")


def test_train_logs_record_the_commit_and_every_start_and_resume(tmp_path):
    recipe = parse_recipe(MICRO_BB.replace("SEEDS", "seed = 0") + ARMS, "micro")
    before = datetime.utcnow().replace(microsecond=0)
    assert train_pair(recipe, tmp_path / "run", stop_after=4) is None  # interrupted after step 4, then resumed
    paths = train_pair(recipe, tmp_path / "run")
    after = datetime.utcnow()
    commit = _git("rev-parse", "HEAD").strip()
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    logs = {name: json.loads((path / "train_log.json").read_text()) for name, path in paths.items()}
    assert logs["matched"]["parameters"] == logs["standard"]["parameters"] != logs["diff"]["parameters"]
    for log in logs.values():
        assert (log["git_commit"], log["git_dirty"]) == (commit, dirty)
        assert [(entry["from_step"], entry["git_commit"]) for entry in log["history"]] == [(0, commit), (4, commit)]
        assert log["started_at"] == log["history"][0]["at"]
        assert before <= _utc(log["started_at"]) <= _utc(log["history"][1]["at"]) <= _utc(log["finished_at"]) <= after
