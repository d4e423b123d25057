"""Recipe parsing: shipped recipes parse, bad ones fail with one line naming the problem, nothing trained."""

from __future__ import annotations

import pytest

from quantdiff.cli import app as cli
from quantdiff.data import corpus
from quantdiff.core.errors import ConfigError, DataError
from quantdiff.models.pairs import SizePreset
from quantdiff.train.recipe import REPO_RECIPES, load_recipe, parse_recipe

GOOD = """
[model]
hidden_size = 64
num_layers = 2
num_heads = 4
vocab_size = 300
max_position_embeddings = 64
[train]
steps = 4
batch_size = 2
seq_len = 32
lr = 1
[data]
retrieval_max_needles = 2
"""


def test_shipped_recipes_parse():
    tiny, gpu = load_recipe("tiny"), load_recipe(REPO_RECIPES / "gpu.toml")
    assert tiny.name == "tiny" and gpu.name == "gpu"
    assert tiny.train.device == "cpu" and tiny.train.dtype == "float32"
    # The GPU recipe (issue 46): three arms in float32 (bf16 autocast slowed Diff V1), on the authors' init.
    assert gpu.train.dtype == "float32" and gpu.train.device == "auto" and gpu.train.init == "authors"
    assert gpu.arm_names == ("standard", "diff", "diffv2")
    assert gpu.train.tokens == gpu.train.steps * gpu.train.batch_size * gpu.train.seq_len
    assert gpu.model.hidden_size > tiny.model.hidden_size
    assert tiny.source == (REPO_RECIPES / "tiny.toml").read_text()


def test_sections_become_dataclasses_with_defaults():
    recipe = parse_recipe(GOOD, "t")
    assert recipe.model == SizePreset(hidden_size=64, num_layers=2, num_heads=4, vocab_size=300, max_position_embeddings=64)
    assert recipe.train.lr == 1 and recipe.train.steps == 4
    assert recipe.analysis.bits == [16, 8, 6, 4]
    assert recipe.analysis.methods == ["absmax", "llm_int8"]  # TOML-friendly spelling, accepted by the registry


@pytest.mark.parametrize(
    "edit,message",
    [
        (("[train]", "[train]\nstepz = 3"), "unknown key 'stepz' in \\[train\\]"),
        (("[model]", "[model]\nhidden_sise = 3"), "hidden_sise"),
        (("[model]", "[optimizer]\nlr = 1\n[model]"), "unknown section \\[optimizer\\]"),
        (("hidden_size = 64", "hidden_size = 66"), "does not divide hidden_size=66"),
        (("num_heads = 4", "num_heads = 4\nnum_kv_heads = 1"), "num_kv_heads=1 is odd"),
        (("steps = 4", "steps = 4.5"), "steps must be an integer, got 4.5"),
        (("steps = 4", "steps = 4\ndtype = 'fp8'"), "dtype must be one of"),
        (("seq_len = 32", "seq_len = 128"), "exceeds max_position_embeddings"),
        (("num_layers = 2", "num_layers = 'two'"), 'num_layers must be an integer, got "two"'),
        (("lr = 1", "lr = 1\n[analysis]\nmethods = ['gptq']"), "\\[analysis\\] unknown quantization method 'gptq'"),
        (("lr = 1", "lr = 1\n[analysis]\nsites = ['values']"), "\\[analysis\\] unknown quantization site 'values'"),
        (("lr = 1", "lr = 1\n[analysis]\nbits = [8, 1]"), "\\[analysis\\] bits must be .*2.*16"),
    ],
    ids=["unknown-key", "unknown-model-key", "unknown-section", "heads-not-dividing", "odd-kv-heads", "float-steps", "dtype", "seq-too-long", "string-size",
         "analysis-method", "analysis-site", "analysis-bits"],
)
def test_bad_recipes_are_rejected_by_name(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(GOOD.replace(*edit), "bad")


@pytest.mark.parametrize(
    "edit,message",
    [
        (("[data]\n", "[data]\ncorpora = ['janeaustenr', 'bible']\n"), "unknown corpus 'bible'"),
        (("[data]\n", "[data]\ncorpora = ['web', 'web']\n"), "lists a corpus twice"),
        (("lr = 1", "lr = 1\nadam_beta2 = 1.0"), "adam_beta1 and adam_beta2 must be in"),
        (("lr = 1", "lr = 1\nbos = 1"), "bos must be true or false, got 1"),
        (("lr = 1", "lr = 1\noutlier_sequences = -1"), "outlier_sequences must be at least 0"),
    ],
    ids=["unknown-corpus", "repeated-corpus", "beta2", "bos-type", "outlier-sequences"],
)
def test_bad_emergence_options_are_rejected_by_name(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(GOOD.replace(*edit), "bad")


def test_emergence_options_default_to_the_old_behaviour_and_mix_corpora():
    old, sinks = parse_recipe(GOOD, "t"), load_recipe("cpu-sinks")
    assert (old.train.bos, old.train.adam_beta1, old.train.adam_beta2) == (False, 0.9, 0.95)
    assert old.data.corpus_names == ("janeaustenr",)
    assert sinks.data.corpus_names == ("janeaustenr", "web", "kjv") and sinks.train.bos


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="no recipe 'nonesuch'"):
        load_recipe("nonesuch")


def test_cli_bad_recipe_is_one_line_and_trains_nothing(tmp_path, capsys):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(GOOD.replace("[train]", "[train]\nbatch = 3"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", str(recipe), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code != 0
    assert err.count("\n") == 0 and "unknown key 'batch'" in err
    assert not (tmp_path / "out").exists()


def test_missing_corpus_is_a_data_error_before_training(tmp_path, monkeypatch):
    from quantdiff.train.loop import train_pair

    monkeypatch.setenv("QUANTDIFF_CORPUS_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(corpus, "SYSTEM_ROOT", tmp_path)
    corpus.read_novels.cache_clear()
    try:
        with pytest.raises(DataError, match="--install"):
            train_pair(parse_recipe(GOOD, "t"), tmp_path / "out")
    finally:
        corpus.read_novels.cache_clear()
    assert not (tmp_path / "out").exists()


def test_the_bb_recipe_names_its_primary_comparisons():
    analysis = load_recipe("bb").analysis
    assert analysis.primary_metrics == ["table5/attention_logits/top1", "table5/hidden_states/top1", "sweep/bb/linear/absmax/4"]
    assert analysis.primary_arms == ["diff", "diffv2", "gated", "sink", "standard-sgd"]  # every arm but the reference
    assert parse_recipe(GOOD, "t").analysis.primary_metrics == []  # none named: every comparison exploratory


PRIMARY = "lr = 1\n[analysis]\nbits = [8, 4]\nprimary_metrics = METRICS\nprimary_arms = ARMS"


@pytest.mark.parametrize(
    "metrics, arms, message",
    [
        ("['table5/hidden_states/top1']", "['diff']", None),
        ("['sweep/lm/linear/llm-int8/4', 'sinks/max']", "['diff']", None),
        ("['table5/hidden/top1']", "['diff']", "primary_metrics: unknown metric 'table5/hidden/top1' \\(known: table5/attention_logits/top1, "),
        ("['sweep/lm/linear/absmax/3']", "['diff']", "unknown metric 'sweep/lm/linear/absmax/3'.*bits.*e.g. sweep/lm/linear/absmax/4"),
        ("['sweep/bb/linear/absmax/4']", "['diff']", "unknown metric 'sweep/bb/linear/absmax/4'.*with task lm or choice or retrieval"),
        ("['table5/hidden_states/top1']", "['dif']", "primary_arms: 'dif' is not an arm compared with the reference arm 'standard' \\(those are: diff\\)"),
        ("['table5/hidden_states/top1']", "['standard']", "'standard' is not an arm compared with the reference"),
        ("['table5/hidden_states/top1']", "[]", "set both or neither"),
        ("['sinks/max', 'sinks/max']", "['diff']", "primary_metrics lists a name twice"),
        ("'sinks/max'", "['diff']", "primary_metrics must be a list of strings"),
    ],
    ids=["one", "sweep-cell", "unknown-metric", "bits-not-swept", "task-not-run", "unknown-arm", "reference-arm", "one-without-other", "repeat", "not-a-list"],
)
def test_primary_comparisons_name_only_what_the_run_measures(metrics, arms, message):
    text = GOOD.replace("lr = 1", PRIMARY.replace("METRICS", metrics).replace("ARMS", arms))
    if message is None:
        assert parse_recipe(text, "t").analysis.primary_arms == ["diff"]
        return
    with pytest.raises(ConfigError, match=message) as raised:
        parse_recipe(text, "bad")
    assert "\n" not in str(raised.value)
