"""Matched-pair training: batches, schedule, checkpoint round trip, resume = uninterrupted, saved directories.

The corpus is replaced by synthetic sentences so these tests run without the Debian package.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantdiff.data import corpus
from quantdiff.train import loop as training
from quantdiff.models.pairs import KINDS, build_pair
from quantdiff.train.recipe import ArmConfig, parse_recipe

RECIPE = """
[data]
retrieval_fraction = 0.5
retrieval_max_needles = 2
[model]
hidden_size = 32
num_layers = 2
num_heads = 4
vocab_size = 300
max_position_embeddings = 160
[train]
steps = 6
batch_size = 4
seq_len = 160
warmup_steps = 2
checkpoint_every = 2
eval_every = 3
eval_batches = 1
[tasks]
lm_tokens = 1024
retrieval_needles = [1, 2]
retrieval_examples = 3
"""
WORDS = "the lady walked to the house and spoke with her sister about a letter from town".split()


@pytest.fixture
def synthetic_corpus(monkeypatch):
    """Both splits from a fixed word list; a different seed for the held-out split."""

    def split_text(split: str, fraction: float = 0.1, corpora: tuple[str, ...] = ("janeaustenr",)) -> str:
        rng = random.Random(split)
        return " ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 14))).capitalize() + "." for _ in range(600))

    monkeypatch.setattr(corpus, "split_text", split_text)
    monkeypatch.setattr(corpus, "read_novels", lambda: {})
    monkeypatch.setattr(corpus, "require", lambda corpora: None)


@pytest.fixture
def recipe():
    return parse_recipe(RECIPE, "unit")


def test_lr_schedule_warms_up_then_follows_the_cosine(recipe):
    cfg = recipe.train
    assert training.lr_at(0, cfg) == pytest.approx(cfg.lr / 2)
    assert training.lr_at(1, cfg) == pytest.approx(cfg.lr)
    for step in range(2, cfg.steps + 1):
        t = (step - 2) / (cfg.steps - 2)
        assert training.lr_at(step, cfg) == pytest.approx(cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t)) / 2)


def test_curriculum_moves_from_easy_to_evaluated_documents_by_mid_training(recipe):
    recipe = parse_recipe(RECIPE.replace("retrieval_max_needles = 2", "retrieval_max_needles = 2\nretrieval_value_words_start = 9"), "unit")
    stages = [training.curriculum(step, recipe) for step in range(recipe.train.steps)]
    assert stages[0] == (1, pytest.approx(0.1), 9)
    assert stages[recipe.train.steps // 2] == (2, pytest.approx(1.0), 3) == stages[-1]
    assert [s[:2] for s in stages] == sorted(s[:2] for s in stages)
    assert [s[2] for s in stages] == sorted((s[2] for s in stages), reverse=True)


def test_batches_are_a_pure_function_of_seed_and_step(synthetic_corpus, recipe):
    data = training.prepare_data(recipe)
    a_in, a_tg = training.make_batch(3, data, recipe)
    b_in, b_tg = training.make_batch(3, data, recipe)
    assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    assert a_in.shape == a_tg.shape == (4, 160)
    assert not torch.equal(a_in, training.make_batch(4, data, recipe)[0])
    # targets are the inputs shifted by one wherever they are not padding
    valid = a_tg[:, :-1] != training.IGNORE
    assert torch.equal(a_in[:, 1:][valid], a_tg[:, :-1][valid])
    texts = [data.tokenizer.decode(row) for step in range(6) for row in training.make_batch(step, data, recipe)[0]]
    needle_rows = sum(" Recall " in text for text in texts)
    assert 0 < needle_rows < len(texts)  # retrieval_fraction = 0.5


def test_copy_warmup_rows_repeat_a_random_span_and_later_batches_are_unchanged(synthetic_corpus, recipe):
    warm = parse_recipe(RECIPE.replace("[data]", "[data]\ncopy_warmup_steps = 3"), "unit")
    data = training.prepare_data(recipe)
    specials = set(data.tokenizer.all_special_ids)
    copy_rows = 0
    for step in range(recipe.train.steps):
        (a_in, a_tg), (b_in, b_tg) = training.make_batch(step, data, recipe), training.make_batch(step, data, warm)
        if step >= 3:  # after the warm-up (and with the default of 0 throughout) nothing changes
            assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
            continue
        for r in range(len(a_in)):
            if " Recall " not in data.tokenizer.decode(a_in[r]):
                assert torch.equal(a_in[r], b_in[r]) and torch.equal(a_tg[r], b_tg[r])
                continue
            copy_rows += 1
            row = torch.cat([b_in[r], b_tg[r, -1:]]).tolist()
            assert (b_tg[r] != training.IGNORE).all() and not specials & set(row)  # loss on every token
            span = row[: training.COPY_SPAN]
            gaps = range(training.COPY_GAP + 1)
            assert any(row[training.COPY_SPAN + g : 2 * training.COPY_SPAN + g] == span for g in gaps)
    assert copy_rows > 0


def test_unigram_entropy_matches_the_formula():
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 2, 3])
    p = torch.tensor([2, 1, 4, 1], dtype=torch.float64) / 8
    assert training.unigram_entropy(ids) == pytest.approx(float(-(p * p.log()).sum()))


def test_optimizer_state_round_trips_without_pickle(recipe):
    model = build_pair(recipe.model)["diff"]
    optimizer, names = training.make_optimizer(model, recipe.train, recipe.arms[1])
    model(input_ids=torch.randint(0, 300, (2, 8))).logits.sum().backward()
    optimizer.step()
    tensors = training.optimizer_tensors(optimizer, names)
    fresh, _ = training.make_optimizer(model, recipe.train, recipe.arms[1])
    training.load_optimizer_tensors(fresh, names, tensors)
    for (index, before), after in zip(optimizer.state_dict()["state"].items(), fresh.state_dict()["state"].values()):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), (names[index], key)
    assert len(optimizer.state_dict()["state"]) == len(names)


class Oracle(torch.nn.Module):
    """A 'model' whose greedy continuation is a fixed token sequence, to test the exact-match check."""

    def __init__(self, continuation: list[int], vocab: int):
        super().__init__()
        self.continuation, self.vocab, self.start = continuation, vocab, None
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # scoring finds the device through a parameter

    def forward(self, input_ids, **_masks_and_positions):
        self.start = self.start or input_ids.shape[1]
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[0, -1, self.continuation[input_ids.shape[1] - self.start]] = 1.0
        return type("Out", (), {"logits": logits})


def test_greedy_exact_match_counts_only_the_full_value(synthetic_corpus, recipe):
    data = training.prepare_data(recipe)
    [example] = training.retrieval_examples(corpus.held_out_text(), data.tokenizer, 160, 2, 1, seed=0)
    # the retrieval task's answer: the queried value and the period after it
    assert example.answer == " " + example.needles[example.query_index][1] + "."
    value = data.tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    assert training.retrieval_exact_match(Oracle(value, 300), data.tokenizer, [example]) == 1.0
    wrong = value[:-1] + [(value[-1] + 1) % 300]
    assert training.retrieval_exact_match(Oracle(wrong, 300), data.tokenizer, [example]) == 0.0


def test_interrupted_then_resumed_run_equals_an_uninterrupted_one(synthetic_corpus, recipe, tmp_path):
    full = training.train_pair(recipe, tmp_path / "full")
    assert training.train_pair(recipe, tmp_path / "resumed", stop_after=3) is None
    assert not training.arms_exist(tmp_path / "resumed", recipe)
    assert json.loads((tmp_path / "resumed" / training.CHECKPOINT / "state.json").read_text())["step"] == 3
    resumed = training.train_pair(recipe, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / training.CHECKPOINT).exists()
    for kind in KINDS:
        a, b = load_file(full[kind] / "model.safetensors"), load_file(resumed[kind] / "model.safetensors")
        assert a.keys() == b.keys() and not any("parametrizations" in name for name in a)  # the init's reparametrisations folded
        for name in a:
            assert torch.equal(a[name], b[name]), f"{kind} {name}: max diff {(a[name] - b[name]).abs().max()}"
        log_a, log_b = (json.loads((p[kind] / "train_log.json").read_text()) for p in (full, resumed))
        assert log_a["train_loss_curve"] == log_b["train_loss_curve"] and len(log_a["train_loss_curve"]) == 6
        assert log_a["held_out_loss"] == log_b["held_out_loss"] and log_a["init"] == recipe.train.init == "authors"
        _check_outlier_series(log_a["outliers"], recipe, kind)
        assert log_a["outliers"] == log_b["outliers"]  # measuring changes nothing: a resumed run logs the same series
        # a complete HF directory: loads with transformers alone
        model = AutoModelForCausalLM.from_pretrained(full[kind], local_files_only=True)
        assert model.config.hidden_size == recipe.model.hidden_size
        assert AutoTokenizer.from_pretrained(full[kind], local_files_only=True).pad_token_id == 0
        assert (full[kind] / "recipe.toml").read_text() == recipe.source
    # both models trained on the same batches: identical step count, parameter counts differ by λ only
    std, diff = (json.loads((full[k] / "train_log.json").read_text()) for k in KINDS)
    assert diff["parameters"] - std["parameters"] == diff["lambda_parameters"] > 0


def _check_outlier_series(series: list[dict], recipe, kind: str) -> None:
    """One entry per eval step with the Table-5 numbers and the sink score, from the same held-out tokens."""
    cfg = recipe.train
    assert [e["step"] for e in series] == list(range(cfg.eval_every, cfg.steps + 1, cfg.eval_every)) and len(series) >= 2
    for entry in series:
        assert entry["tokens"] == entry["step"] * cfg.batch_size * cfg.seq_len
        for key in ("attention_logits", "hidden_states"):
            block = entry[key]
            assert block["top1"] >= block["median"] > 0 and block["kurtosis"] is not None
            assert block["top1_to_median"] == block["top1"] / block["median"]  # the massive-activation ratio
        sink = entry["sink"]
        assert 0 <= sink["score"] <= 1 and 0 < sink["mean"] <= sink["max"] <= 1
        assert len(sink["per_head"]) == recipe.model.num_layers
        assert ("combined" in sink) == (kind == "diff")
        assert len(entry["hidden_states"]["per_layer_top1"]) == recipe.model.num_layers


def test_bos_rows_start_with_bos_and_keep_their_length(synthetic_corpus):
    bos = parse_recipe(RECIPE.replace("[train]", "[train]\nbos = true"), "unit")
    data = training.prepare_data(bos)
    inputs, targets = training.make_batch(0, data, bos)
    assert inputs.shape == (bos.train.batch_size, bos.train.seq_len)
    assert (inputs[:, 0] == data.tokenizer.bos_token_id).all()
    assert (targets[:, 0] != data.tokenizer.bos_token_id).all() and (targets != data.tokenizer.bos_token_id).all()
    windows = training.held_out_windows(data, bos.train.seq_len, 1000)
    assert all(w[0] == data.tokenizer.bos_token_id and len(w) == bos.train.seq_len for w in windows)


def test_adam_betas_come_from_the_recipe(recipe):
    custom = parse_recipe(RECIPE.replace("[train]", "[train]\nadam_beta1 = 0.8\nadam_beta2 = 0.99"), "unit")
    model = build_pair(custom.model, 0, "sdpa")["standard"]
    assert training.make_optimizer(model, custom.train, custom.arms[0])[0].defaults["betas"] == (0.8, 0.99)
    assert training.make_optimizer(model, recipe.train, recipe.arms[0])[0].defaults["betas"] == (0.9, 0.95)  # the default: as before


def test_an_sgd_arm_gets_sgd_with_its_own_rate_and_decay(recipe):
    model = build_pair(recipe.model, 0, "sdpa")["standard"]
    arm = ArmConfig("control", "standard", optimizer="sgd", lr=0.03, weight_decay=1e-4, momentum=0.8)
    optimizer, names = training.make_optimizer(model, recipe.train, arm)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.8
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0] and optimizer.defaults["lr"] == 0.03
    assert len(names) == sum(1 for _ in model.parameters())


def test_existing_pair_is_not_overwritten_without_force(synthetic_corpus, recipe, tmp_path):
    for kind in KINDS:
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text("{}")
    with pytest.raises(training.ConfigError, match="--force"):
        training.train_pair(recipe, tmp_path)


def test_set_changes_the_recipe_text_so_the_saved_recipe_says_what_trained(synthetic_corpus, tmp_path, capsys):
    from quantdiff.cli.app import main
    from quantdiff.cli.commands.train import with_settings

    text = with_settings(RECIPE, ["train.steps=3", "train.device=cpu", "tasks.retrieval_needles=[1]", "train.log_every=1", "analysis.bits=[8, 4]"])
    changed = parse_recipe(text, "unit")
    assert (changed.train.steps, changed.train.device, changed.tasks.retrieval_needles, changed.train.log_every) == (3, "cpu", [1], 1)
    assert changed.analysis.bits == [8, 4] and text.count("[analysis]") == 1  # a missing section is added once
    assert changed.train.batch_size == 4 and "steps = 6" not in text and "steps = 3  # --set" in text

    (tmp_path / "unit.toml").write_text(RECIPE)
    main(["train", str(tmp_path / "unit.toml"), "--out", str(tmp_path / "run"), "--set", "train.steps=3", "-q"])
    capsys.readouterr()  # transformers' saving bars
    saved = (tmp_path / "run" / "standard" / "recipe.toml").read_text()
    assert parse_recipe(saved, "unit").train.steps == 3 == json.loads((tmp_path / "run" / "standard" / "train_log.json").read_text())["steps"]

    for bad, message in [("steps=3", "--set takes SECTION.KEY=VALUE"), ("arms.lr=1", "--set takes SECTION.KEY=VALUE"),
                         ("train.stpes=3", "unknown key 'stpes' in [train]"), ("train.steps=x", "[train] steps must be an integer")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["train", str(tmp_path / "unit.toml"), "--out", str(tmp_path / "other"), "--set", bad])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code != 0 and len(err.splitlines()) == 1 and message in err, err
