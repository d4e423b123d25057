"""The choice task: HellaSwag JSONL parsing, and acc/acc_norm against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest
from task_fakes import EXPECTED_ACC, EXPECTED_ACC_NORM, ITEMS, CharTokenizer, UnigramModel, hand_loglik

from quantdiff.core.errors import DataError
from quantdiff.data.choice_items import ChoiceItem, read_jsonl, write_jsonl
from quantdiff.eval.tasks.choice import ChoiceTask, choice_metrics
from quantdiff.eval.scoring import score_targets


@pytest.fixture
def items_file(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return path


def test_hand_computed_acc_and_acc_norm(items_file):
    task = ChoiceTask(path=items_file, batch_size=2)
    prepared = task.prepare(CharTokenizer())
    # Each ending's log-likelihood, scored as " " + ending: e.g. " aa" = ln 0.25 + 2 ln 0.5.
    scores = score_targets(UnigramModel(), prepared.requests, batch_size=3)
    expected = [hand_loglik(e) for item in ITEMS for e in item["endings"]]
    assert [s.logprob for s in scores] == pytest.approx(expected, abs=1e-6)  # scored in float32
    assert expected[1] == pytest.approx(math.log(0.25) + 2 * math.log(0.5))
    metrics = task.evaluate(UnigramModel(), prepared)
    assert metrics["acc"] == pytest.approx(EXPECTED_ACC)
    assert metrics["acc_norm"] == pytest.approx(EXPECTED_ACC_NORM)
    assert metrics["items"] == 3


def test_acc_norm_divides_by_character_length_not_tokens():
    item = ChoiceItem("c", ("xxxx", "y"), label=0)
    # Same total log-likelihood: acc takes the first (argmax tie), acc_norm the longer ending.
    assert choice_metrics([item], [[-4.0, -2.0]]) == {"acc": 0.0, "acc_norm": 1.0, "items": 1}
    assert choice_metrics([item], [[-2.0, -2.0]])["acc"] == 1.0  # ties go to the first, like np.argmax


def test_limit_takes_the_first_items(items_file):
    prepared = ChoiceTask(path=items_file).prepare(CharTokenizer(), limit=2)
    assert [i.label for i in prepared.items] == [1, 1] and len(prepared) == 2 + 3


def test_jsonl_round_trip_and_string_labels(tmp_path):
    items = [ChoiceItem("a b", ("c", "d"), 1), ChoiceItem("é", ("f", "g", "h"), 2)]
    write_jsonl(items, tmp_path / "x.jsonl")
    assert read_jsonl(tmp_path / "x.jsonl") == items
    (tmp_path / "y.jsonl").write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": "1"}) + "\n")
    assert read_jsonl(tmp_path / "y.jsonl")[0].label == 1  # the HF copy of HellaSwag stores "1"


@pytest.mark.parametrize(
    "bad_line",
    [
        "{not json",
        json.dumps({"ctx": "a", "endings": ["b", "c"]}),
        json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 2}),
        json.dumps({"ctx": "a", "endings": "bc", "label": 0}),
        json.dumps({"ctx": "a", "endings": ["b", ""], "label": 0}),
        json.dumps({"ctx": "", "endings": ["b", "c"], "label": 0}),
        json.dumps(["a"]),
    ],
    ids=["not-json", "no-label", "label-out-of-range", "endings-not-list", "empty-ending", "empty-ctx", "not-object"],
)
def test_malformed_line_is_reported_with_its_number(tmp_path, bad_line):
    good = json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")  # the blank line 2 is skipped but counted
    with pytest.raises(DataError, match=r"bad\.jsonl:3: ") as info:
        read_jsonl(path)
    assert "\n" not in str(info.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        read_jsonl(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no multiple-choice items"):
        read_jsonl(tmp_path / "empty.jsonl")
