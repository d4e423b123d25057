"""The Bigram-Backcopy source and task: the generator's rules, its statistics, the bb task, arms trained on it."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch

from quantdiff.core.errors import ConfigError, DataError
from quantdiff.data import bigram_backcopy as bb
from quantdiff.data import corpus
from quantdiff.eval.tasks.bb import BBTask
from quantdiff.train import loop as training
from quantdiff.train.recipe import parse_recipe

MICRO = """
[data]
corpus = "bigram-backcopy"
retrieval_fraction = 0.0
[model]
hidden_size = 32
num_layers = 1
num_heads = 4
vocab_size = 83
max_position_embeddings = 32
[train]
steps = 4
batch_size = 4
seq_len = 32
warmup_steps = 1
bos = true
device = "cpu"
checkpoint_every = 2
eval_every = 2
eval_batches = 1
outlier_sequences = 2
[tasks]
lm_tokens = 128
[[arms]]
name = "standard"
kind = "standard"
[[arms]]
name = "diff"
kind = "diff"
[[arms]]
name = "diffv2"
kind = "diffv2"
[[arms]]
name = "standard-sgd"
kind = "standard"
optimizer = "sgd"
lr = 0.03
weight_decay = 1e-4
"""


@pytest.fixture(scope="module")
def generator() -> bb.BigramBackcopy:
    return bb.load()


def test_counting_follows_the_authors_rule_and_triggers_are_the_most_frequent():
    chars, counts, unigrams = bb.bigram_counts("abcab a")
    assert chars == [" ", "a", "b", "c"]
    index = {c: i for i, c in enumerate(chars)}
    # every consecutive pair: ab, bc, ca, ab, b_, _a
    expected = {("a", "b"): 2, ("b", "c"): 1, ("c", "a"): 1, ("b", " "): 1, (" ", "a"): 1}
    assert counts.sum() == 6 and all(counts[index[a], index[b]] == n for (a, b), n in expected.items())
    gen = bb.BigramBackcopy.from_counts(chars, counts, unigrams, k=1)
    assert gen.triggers == (index["a"],)  # 'a' occurs 3 times
    assert gen.first[index["a"]] == 0 and gen.first.sum() == pytest.approx(1)
    np.testing.assert_allclose(gen.transition.sum(axis=1), 1)


def test_the_shipped_generator_matches_the_stated_setting(generator):
    assert [generator.chars[i] for i in generator.triggers] == [" ", "e", "t"]
    assert (generator.bos_id, generator.pad_id, generator.vocab_size) == (81, 82, 83)


@pytest.mark.skipif(corpus.find_rdata() is None, reason="corpus not installed (python -m quantdiff.data.corpus --install)")
def test_the_shipped_table_is_the_corpus_bigram_count():
    shipped = json.loads(bb.TABLE.read_text())
    rebuilt = bb.table_from_corpus()
    assert shipped == json.loads(json.dumps(rebuilt))


def test_sequences_are_pure_functions_of_seed_and_index(generator):
    a = generator.train_rows(0, 7, 6, 65)
    assert torch.equal(a, generator.train_rows(0, 7, 6, 65))
    assert torch.equal(a[:3], generator.train_rows(0, 7, 3, 65))  # a row does not depend on how many are drawn
    assert not torch.equal(a, generator.train_rows(0, 8, 6, 65)) and not torch.equal(a, generator.train_rows(1, 7, 6, 65))
    held = generator.held_out_rows(6, 65)
    assert torch.equal(held, generator.held_out_rows(6, 65))
    assert all(not torch.equal(held, generator.train_rows(seed, 0, 6, 65)) for seed in range(3))


def test_backcopy_positions_copy_the_token_before_the_trigger(generator):
    rows = generator.train_rows(3, 0, 64, 257)
    assert (rows[:, 0] == generator.bos_id).all() and (rows[:, 1:] < len(generator.chars)).all()
    assert not torch.isin(rows[:, 1], torch.tensor(generator.triggers)).any()  # the first character is no trigger
    copy = generator.backcopy_targets(rows[:, 1:-1])  # inputs at positions 1..T-2 whose successor is a copy
    assert copy.float().mean() > 0.2
    assert torch.equal(rows[:, 2:][copy], rows[:, :-2][copy])  # x[t+1] == x[t-1] after every trigger x[t]
    # and a copied token is never a trigger, so copies never chain
    assert not torch.isin(rows[:, 2:][copy], torch.tensor(generator.triggers)).any()


def test_bigram_positions_follow_the_transition_matrix(generator):
    rows = generator.train_rows(5, 0, 512, 257).numpy()
    previous, following = rows[:, 1:-1].ravel(), rows[:, 2:].ravel()
    bigram = ~np.isin(previous, generator.triggers)
    counts = np.zeros_like(generator.transition)
    np.add.at(counts, (previous[bigram], following[bigram]), 1)
    checked = 0
    for char in np.flatnonzero(counts.sum(axis=1) >= 3000):
        empirical = counts[char] / counts[char].sum()
        assert 0.5 * np.abs(empirical - generator.transition[char]).sum() < 0.04, generator.chars[char]
        checked += 1
    assert checked >= 8
    # the first character follows the unigram distribution without triggers
    first = np.bincount(rows[:, 1], minlength=len(generator.chars)) / len(rows)
    assert 0.5 * np.abs(first - generator.first).sum() < 0.15


class TrueDistribution(torch.nn.Module):
    """Predicts the generator's true next-token distribution; with `copy`, the backcopy after each trigger."""

    def __init__(self, generator: bb.BigramBackcopy, copy: bool):
        super().__init__()
        self.generator, self.copy = generator, copy
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # scoring finds the device through a parameter

    def forward(self, input_ids, **_masks_and_positions):
        probs = self.generator.next_distribution(input_ids).clone()
        triggers = self.generator.backcopy_targets(input_ids)
        previous = torch.cat([input_ids[:, :1], input_ids[:, :-1]], dim=1)
        if self.copy:
            probs[triggers] = torch.nn.functional.one_hot(previous[triggers], self.generator.vocab_size).double()
        else:
            probs[triggers] = 1.0 / self.generator.vocab_size
        return type("Out", (), {"logits": probs.clamp_min(1e-30).log().float()})


def test_the_bb_task_scores_an_oracle_one_and_a_bigram_only_model_less(generator):
    task = BBTask(sequences=8, context=128)
    prepared = task.prepare(generator.tokenizer())
    oracle = task.evaluate(TrueDistribution(generator, copy=True), prepared)
    assert oracle["accuracy"] == 1.0 and oracle["bigram_kl"] == pytest.approx(0, abs=1e-5)
    assert oracle["backcopy_loss"] == pytest.approx(0, abs=1e-5) and oracle["backcopy_positions"] > 50
    blind = task.evaluate(TrueDistribution(generator, copy=False), prepared)
    assert blind["accuracy"] < 0.2 and blind["bigram_kl"] == pytest.approx(0, abs=1e-5)
    assert blind["bigram_loss"] == pytest.approx(oracle["bigram_loss"])


def test_the_bb_task_refuses_another_tokenizer(generator):
    from quantdiff.models.tokenizer import train_bpe

    with pytest.raises(DataError, match="trained on bigram-backcopy"):
        BBTask(sequences=2).prepare(train_bpe("some text " * 50, 300))


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.replace("vocab_size = 83", "vocab_size = 300"), "vocab_size must be 83"),
    (lambda r: r.replace("retrieval_fraction = 0.0", "retrieval_fraction = 0.5"), "retrieval_fraction = 0"),
    (lambda r: r.replace("bos = true", "bos = false"), "bos must be true"),
    (lambda r: r.replace('corpus = "bigram-backcopy"', 'corpora = ["bigram-backcopy", "web"]'), "cannot be mixed"),
    (lambda r: r.replace('optimizer = "sgd"', 'optimizer = "lion"'), "unknown optimizer 'lion'"),
    (lambda r: r.replace('kind = "diffv2"', 'kind = "mamba"'), "unknown kind 'mamba'"),
    (lambda r: r.replace('name = "diffv2"', 'name = "diff"'), "lists a name twice"),
    (lambda r: r.replace('name = "diffv2"', 'name = "../x"'), "name must be"),
    (lambda r: r.replace("lr = 0.03", "lr = -1"), "lr must be a finite number"),
    (lambda r: r.replace("weight_decay = 1e-4", "wd = 1e-4"), "unknown key 'wd'"),
])
def test_bad_bigram_backcopy_recipes_are_rejected_by_name(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(edit(MICRO), "micro")


def test_a_micro_bb_recipe_trains_every_arm_on_the_same_batches_and_logs_emergence(tmp_path):
    recipe = parse_recipe(MICRO, "micro")
    data = training.prepare_data(recipe)
    inputs, targets = training.make_batch(1, data, recipe)
    rows = bb.load().train_rows(recipe.train.seed, 1, 4, 33)
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])
    paths = training.train_pair(recipe, tmp_path)
    assert list(paths) == ["standard", "diff", "diffv2", "standard-sgd"]
    logs = {name: json.loads((path / "train_log.json").read_text()) for name, path in paths.items()}
    for name, log in logs.items():
        assert [e["step"] for e in log["outliers"]] == [2, 4], name
        for entry in log["outliers"]:
            assert entry["hidden_states"]["top1"] >= entry["hidden_states"]["median"] > 0
            assert 0 <= entry["sink"]["score"] <= 1 and entry["sink"]["per_head"]
        assert 0 <= log["bb"]["accuracy"] <= 1 and log["bb"]["bigram_kl"] > 0
        assert len(log["train_loss_curve"]) == 4
    assert logs["standard-sgd"]["arm"] == {"name": "standard-sgd", "kind": "standard", "optimizer": "sgd", "lr": 0.03,
                                           "weight_decay": 1e-4, "momentum": 0.9, "match_budget": False}
    assert logs["diffv2"]["kind"] == "diffv2" and logs["standard"]["arm"]["optimizer"] == "adamw"
    # same initial seed, same batches: the two standard arms start from the same loss and then part
    assert logs["standard"]["train_loss_curve"][0] == logs["standard-sgd"]["train_loss_curve"][0]
    assert logs["standard"]["train_loss_curve"][1:] != logs["standard-sgd"]["train_loss_curve"][1:]


@pytest.mark.slow(seconds=30)
def test_reproduce_reports_every_arm_on_the_bb_task(tmp_path, monkeypatch, capsys):
    from quantdiff.cli.app import main

    from quantdiff.jobs import real_model

    monkeypatch.chdir(tmp_path)
    recipe = MICRO.replace("[analysis]", "") + "\n[analysis]\nstats_tokens = 128\nseq_len = 32\nbits = [8, 4]\n"
    (tmp_path / "micro.toml").write_text(recipe)
    # One real model end to end (Gemma: test_real_model), at the smallest size that runs every step: the
    # statistics, both methods at both sites, the weight-only rows; the figures themselves are test_real_model's.
    small = real_model.RealModelPlan(stats_tokens=64, seq_len=32, windows=1, context=32, bits=(8,))
    monkeypatch.setattr(real_model, "run_real_model", functools.partial(real_model.run_real_model, plan=small))
    main(["reproduce", "micro.toml", "--out", "rep", "--real-model", "smollm2"])
    assert "report -> rep/report.md" in capsys.readouterr().out.replace("\\", "/")
    assert "## Real pretrained models: `smollm2`" in (tmp_path / "rep" / "report.md").read_text()
    stats = json.loads((tmp_path / "rep" / "stats.json").read_text())
    sweep = json.loads((tmp_path / "rep" / "sweep.json").read_text())
    report = (tmp_path / "rep" / "report.md").read_text()
    arms = ["standard", "diff", "diffv2", "standard-sgd"]
    assert [(m["name"], m["kind"]) for m in stats["models"]] == list(zip(arms, ["standard", "diff", "diffv2", "standard"]))
    assert {c["task"] for c in sweep["cells"]} == {"bb"} and {c["model"] for c in sweep["cells"]} == set(arms)
    assert {c["site"] for c in sweep["cells"] if c["bits"]} == {"logits", "qk", "linear"}
    sinks = report.split("## Attention sinks and the residual peak at the first token", 1)[1].split("\n## ", 1)[0]
    for arm in arms:
        assert f"| {arm} |" in sinks and f"| ours | {arm} | hidden states |" in report
    for arm in arms[1:]:
        assert f"standard ÷ {arm}" in report
    assert "`standard-sgd`: standard, SGD (momentum 0.9), lr 0.03" in report


@pytest.mark.parametrize("kind", ["standard", "diff", "diffv2"])
def test_the_first_position_peak_equals_an_independent_capture(kind, generator):
    from quantdiff.data.sources import make_batches
    from quantdiff.models.loading import prepare
    from quantdiff.models.pairs import SizePreset, build_model, kind_configs
    from quantdiff.stats.collect import collect_stats

    preset = SizePreset(hidden_size=32, num_layers=2, num_heads=4, vocab_size=83, max_position_embeddings=40)
    model = build_model(kind_configs(preset, (kind,))[kind], seed=1, attn_implementation="eager").eval()
    with torch.no_grad():  # plant a large value at BOS so the test fails if position 0 is not the one tracked
        model.model.embed_tokens.weight[generator.bos_id, 3] = 50.0
    rows = generator.held_out_rows(5, 40)
    sequences = rows.tolist()
    sequences[-1] = sequences[-1][:17]  # one shorter row: padding must not count
    caught = []
    hooks = [layer.register_forward_hook(lambda m, i, o: caught.append((o[0] if isinstance(o, tuple) else o).detach())) for layer in model.model.layers]
    with torch.no_grad():
        for seq in sequences:
            model(input_ids=torch.tensor([seq]))
    for hook in hooks:
        hook.remove()
    per_layer = [max(c[0, 0].abs().max().item() for c in caught[layer::2]) for layer in range(2)]
    prepare(model)
    stats = collect_stats(model, make_batches(sequences, 2, generator.pad_id)).summary()["hidden_states"]
    assert stats["first_position"]["per_layer_max"] == pytest.approx(per_layer, rel=1e-5)
    assert stats["first_position"]["max"] == pytest.approx(max(per_layer), rel=1e-5) and max(per_layer) > 10


def test_a_resumed_state_is_checked_against_every_arm(tmp_path):
    """state.json of a four-arm run holds one curve per arm: a pair-shaped state (standard, diff) is refused."""
    from quantdiff.core.errors import LoadError
    from quantdiff.train.loop import new_state
    from quantdiff.train.recipe import parse_recipe
    from quantdiff.train.resume_state import checked_state

    recipe = parse_recipe(MICRO, "micro")
    assert len(recipe.arm_names) == 4
    fresh = new_state(recipe)
    assert checked_state(fresh, recipe, tmp_path)["loss"] == {name: [] for name in recipe.arm_names}
    pair_shaped = {**fresh, "loss": {"standard": [], "diff": []}}
    with pytest.raises(LoadError, match="loss must map standard, diff, diffv2 and standard-sgd to lists"):
        checked_state(pair_shaped, recipe, tmp_path)


def test_a_micro_recipe_with_the_bb_recipes_six_arms_trains_every_kind(tmp_path):
    """recipes/bb.toml's own [[arms]] over MICRO's sizes: all six kinds train on the same batches (the sink kind on
    eager attention, back to it after each emergence measurement) and log their series."""
    from safetensors.torch import load_file

    from quantdiff.train.recipe import REPO_RECIPES

    arms = "[[arms]]" + (REPO_RECIPES / "bb.toml").read_text().split("[[arms]]", 1)[1]
    recipe = parse_recipe(MICRO.split("[[arms]]", 1)[0] + arms, "micro-bb")
    assert recipe.arm_names == ("standard", "diff", "diffv2", "gated", "sink", "standard-sgd")
    paths = training.train_pair(recipe, tmp_path)
    logs = {name: json.loads((path / "train_log.json").read_text()) for name, path in paths.items()}
    assert {name: log["kind"] for name, log in logs.items()} == {arm.name: arm.kind for arm in recipe.arms}
    for name, log in logs.items():
        assert [e["step"] for e in log["outliers"]] == [2, 4] and 0 <= log["bb"]["accuracy"] <= 1, name
        assert all(math.isfinite(loss) for loss in log["train_loss_curve"]), name
    # the sink logits start at 0 and trained: they had gradients, so training computed them (SDPA would drop them)
    sinks = [t for n, t in load_file(paths["sink"] / "model.safetensors").items() if n.endswith("sinks")]
    assert len(sinks) == recipe.model.num_layers and all(t.abs().min() > 0 for t in sinks)
    assert logs["gated"]["parameters"] - logs["standard"]["parameters"] == recipe.model.num_layers * recipe.model.hidden_size * recipe.model.num_heads
    assert logs["sink"]["parameters"] - logs["standard"]["parameters"] == recipe.model.num_layers * recipe.model.num_heads
