"""The shipped models: names resolve, files load with plain transformers, and each set is one seed (12) of a
confirmatory run, trained by that run's recipe (`tiny`: recipes/confirm-text.toml's standard and diff arms; `bb`:
recipes/confirm-bb.toml's six arms) on the authors' initialisation, analysed with causal scales."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DiffLlamaForCausalLM, LlamaForCausalLM

from quantdiff.models import names as zoo
from quantdiff.core.errors import LoadError
from quantdiff.models.pairs import KINDS, lambda_parameter_count, pair_configs, parameter_count
from quantdiff.train.recipe import REPO_RECIPES, load_recipe
from quantdiff.train.resume_state import same_training

SHIPPED = {kind: zoo.ASSETS / "tiny" / kind for kind in KINDS}
# built-in → the confirmatory recipe whose seed 12 it is (across_seeds.published names the same runs' documents)
SHIPPED_FROM = {"tiny": "confirm-text.toml", "bb": "confirm-bb.toml"}


@pytest.mark.parametrize("name", ["tiny", "bb"])
def test_a_shipped_set_is_seed_12_of_its_confirmatory_run_on_the_authors_initialisation(name):
    from quantdiff.across_seeds.published import PUBLISHED

    repository = load_recipe(REPO_RECIPES / SHIPPED_FROM[name])
    for directory in zoo.resolve(name):
        shipped = load_recipe(directory / "recipe.toml")
        # the run's recipe as committed, with only its seed list cut to the shipped seed (quantdiff train --set)
        assert shipped.source == re.sub(r"^seeds = \[.*\]$", "seeds = [12]  # --set", repository.source, count=1, flags=re.MULTILINE)
        assert shipped.train.seeds == [12] and same_training(shipped.source, repository)
        assert shipped.train.init == "authors" and shipped.analysis.granularity == "row"
        log = json.loads((directory / "train_log.json").read_text())
        assert log["seed"] == 12 and log["init"] == "authors" and log["git_dirty"] is False and len(log["git_commit"]) == 40
    assert PUBLISHED[name].parent.name == SHIPPED_FROM[name].removesuffix(".toml")


def test_names_resolve_to_the_shipped_directories(tmp_path):
    assert zoo.resolve("tiny") == [SHIPPED["standard"], SHIPPED["diff"]]
    assert zoo.resolve("tiny/diff") == [SHIPPED["diff"]]
    assert zoo.resolve("tiny/standard") == [SHIPPED["standard"]]
    assert zoo.resolve(tmp_path) == [tmp_path]
    assert zoo.resolve(str(tmp_path)) == [tmp_path]


@pytest.mark.parametrize("name", ["small", "tiny/big", "no/such/dir"])
def test_unknown_names_are_load_errors(name):
    with pytest.raises(LoadError, match="neither an existing path nor a built-in model"):
        zoo.resolve(name)


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_model_loads_and_matches_the_recipe(kind):
    recipe = load_recipe(REPO_RECIPES / SHIPPED_FROM["tiny"])
    model = AutoModelForCausalLM.from_pretrained(SHIPPED[kind], local_files_only=True)
    assert isinstance(model, {"standard": LlamaForCausalLM, "diff": DiffLlamaForCausalLM}[kind])
    expected = pair_configs(recipe.model)[kind]
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings"):
        assert getattr(model.config, field) == getattr(expected, field), field
    log = json.loads((SHIPPED[kind] / "train_log.json").read_text())
    assert log["parameters"] == parameter_count(model) and log["steps"] == recipe.train.steps
    assert len(log["train_loss_curve"]) == recipe.train.steps
    assert log["held_out_loss"] < log["unigram_entropy"] - 1.0  # learned far more than token frequencies
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED[kind], local_files_only=True)
    assert len(tokenizer) == recipe.model.vocab_size and tokenizer.pad_token_id == 0
    ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], recipe.model.vocab_size) and torch.isfinite(logits).all()


def test_shipped_pair_parameter_counts_differ_by_lambda_only():
    preset = load_recipe(REPO_RECIPES / SHIPPED_FROM["tiny"]).model
    std, diff = (AutoModelForCausalLM.from_pretrained(SHIPPED[kind], local_files_only=True) for kind in KINDS)
    head_dim = preset.hidden_size // preset.num_heads
    assert lambda_parameter_count(std) == 0
    # DiffLlama: λ_q1, λ_k1, λ_q2, λ_k2 of head_dim each, per layer
    assert parameter_count(diff) - parameter_count(std) == lambda_parameter_count(diff) == 4 * head_dim * preset.num_layers


def test_shipped_tokenizer_makes_every_needle_word_one_token():
    from quantdiff.data.needles import KEYS, VALUE_WORDS

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED["standard"], local_files_only=True)
    for word in KEYS + VALUE_WORDS:
        assert len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1, word


BB = zoo.BUILT_IN["bb"]


def test_the_shipped_bb_arms_resolve_load_and_carry_their_emergence_series():
    dirs = zoo.resolve("bb")
    assert dirs == [zoo.ASSETS / "bb" / arm for arm in BB] and zoo.resolve("bb/standard-sgd") == [dirs[-1]]
    shipped = load_recipe(dirs[0] / "recipe.toml")
    assert shipped.arm_names == BB
    # The repository's recipe trains the shipped one (its analysis may have grown since: the primary comparisons
    # change no weight): the built-in is seed `seed` of that very run.
    repository = load_recipe(REPO_RECIPES / SHIPPED_FROM["bb"])
    assert same_training(shipped.source, repository) and shipped.train.seed in shipped.train.seeds
    assert repository.arm_names == shipped.arm_names
    for arm, directory in zip(BB, dirs):
        assert (directory / "recipe.toml").read_text() == shipped.source
        log = json.loads((directory / "train_log.json").read_text())
        assert log["arm"]["name"] == arm and log["seed"] == shipped.train.seed and len(log["outliers"]) >= 5
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        assert model.config.vocab_size == 83 and AutoTokenizer.from_pretrained(directory, local_files_only=True).bos_token_id == 81
