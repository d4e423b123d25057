"""The damage fields of eval and sweep cells (issue 55 item 1): each quantized cell's KL-divergence measures equal
`quantdiff.damage` run separately on the task's own sequences, and the lm task's own loss; the reference carries none."""

from __future__ import annotations

import json

import pytest
import torch

import quantdiff
from quantdiff.cli.app import main
from quantdiff.eval.cell_damage import unpadded_batches
from quantdiff.eval.sweep import cells_from_json, cells_to_json, run_model_cells
from quantdiff.eval.tasks.bb import BBTask
from quantdiff.eval.tasks.choice import ChoiceTask, TARGET_DELIMITER, encode_pair
from quantdiff.eval.tasks.lm import LMTask
from quantdiff.quant.sites import parse_config

FIELDS = ("kld_mean", "kld_p99", "kld_max", "same_top1", "delta_p_rms", "delta_loss")


@pytest.fixture(scope="module")
def tiny():
    return quantdiff.load("tiny/diff", device="cpu"), quantdiff.load_tokenizer("tiny/diff")


def test_lm_cells_carry_the_damage_quantdiff_damage_measures_on_the_same_windows(tiny):
    model, tokenizer = tiny
    task = LMTask(tokens=3 * 47, context=48, batch_size=2)  # 3 windows of BOS + 47 tokens: no short last window
    prepared = task.prepare(tokenizer, None, tokenizer.bos_token_id)
    configs = [parse_config("absmax", 4, "linear"), parse_config("absmax", 3, "kv")]
    reference, *cells = run_model_cells("m", model, task, prepared, configs, damage=True)
    assert reference.damage is None and "damage" not in reference.to_dict()
    ids = torch.tensor(task.damage_sequences(prepared))
    assert ids.shape == (3, 48)
    for cell, config in zip(cells, configs):
        alone = quantdiff.damage(model, ids, config, batch_size=task.batch_size)
        assert set(FIELDS) <= set(cell.damage) and cell.damage == pytest.approx(alone, rel=1e-9, abs=1e-15)
        # The task scores the same tokens its own way (left-padded float32 batches): the same losses.
        assert cell.damage["tokens"] == cell.metrics["tokens"] == 3 * 47
        assert cell.damage["loss_full"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
        assert cell.damage["delta_loss"] == pytest.approx(cell.metrics["loss"] - reference.metrics["loss"], rel=1e-3, abs=1e-6)
        assert cell.damage["kld_mean"] > 0
    assert cells_from_json(json.loads(json.dumps(cells_to_json([reference, *cells])))) == [reference, *cells]


def test_without_damage_no_cell_carries_it(tiny):
    model, tokenizer = tiny
    task = LMTask(tokens=47, context=48)
    cells = run_model_cells("m", model, task, task.prepare(tokenizer), [parse_config("absmax", 4, "linear")])
    assert [c.damage for c in cells] == [None, None]


def test_a_choice_item_is_measured_on_its_context_and_correct_ending(tiny):
    _, tokenizer = tiny
    task = ChoiceTask(cloze_items=5)
    prepared = task.prepare(tokenizer, None, tokenizer.bos_token_id)
    expected = [sum(encode_pair(tokenizer, item.ctx, TARGET_DELIMITER + item.endings[item.label], tokenizer.bos_token_id), []) for item in prepared.items]
    assert task.damage_sequences(prepared) == expected
    assert len({item.label for item in prepared.items}) > 1  # not always the first ending


def test_a_bb_sequence_is_measured_on_the_inputs_the_task_feeds(tiny):
    sequences = [[1, 5, 6, 7], [1, 8, 9, 10]]
    from quantdiff.eval.tasks.bb import PreparedBB

    assert BBTask(context=3).damage_sequences(PreparedBB(sequences)) == [[1, 5, 6], [1, 8, 9]]


def test_batches_hold_equal_lengths_only_and_long_sequences_keep_their_last_tokens(tiny):
    model, _ = tiny
    limit = model.config.max_position_embeddings
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8], [9], list(range(limit + 5)), [10, 11, 12]]
    batches = unpadded_batches(model, sequences, batch_size=2)
    assert all(b.attention_mask is None for b in batches)
    rows = sorted(tuple(row) for b in batches for row in b.input_ids.tolist())
    kept = [s for s in sequences if len(s) >= 2]
    kept[-2] = kept[-2][-limit:]
    assert rows == sorted(tuple(s) for s in kept)
    assert max(b.input_ids.shape[0] for b in batches) == 2


@pytest.mark.slow(seconds=12)
def test_eval_json_and_table_carry_the_damage_and_no_damage_leaves_it_out(tmp_path, capsys):
    common = ["eval", "tiny/diff", "--task", "lm", "--bits", "4", "--site", "linear", "--limit", "2", "--context", "32"]
    main([*common, "--json", str(tmp_path / "d.json")])
    out = capsys.readouterr().out
    assert "KL mean" in out and "same top-1" in out
    [cell] = json.loads((tmp_path / "d.json").read_text())["cells"]
    assert set(FIELDS) <= set(cell["damage"]) and cell["damage"]["tokens"] == cell["tokens"]
    main([*common, "--no-damage", "--json", str(tmp_path / "n.json")])
    assert "KL mean" not in capsys.readouterr().out
    [plain] = json.loads((tmp_path / "n.json").read_text())["cells"]
    assert "damage" not in plain and plain["loss"] == cell["loss"]
