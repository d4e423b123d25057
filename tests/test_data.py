"""Data sources for observation passes: text, JSONL text, JSONL input_ids, budgets, batching, sharding, errors."""

from __future__ import annotations

import json

import pytest
import torch

from quantdiff.data.sources import load_sequences, make_batches, shard
from quantdiff.core.errors import DataError

VOCAB = 1000


def char_tokenize(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_text_file_is_cut_into_windows_within_the_budget(tmp_path):
    source = _write(tmp_path / "a.txt", "abcdefghij" * 3)
    seqs = load_sequences(source, char_tokenize, tokens=25, seq_len=8, vocab_size=VOCAB)
    flat = [t for s in seqs for t in s]
    assert flat == char_tokenize(("abcdefghij" * 3)[:25])
    assert [len(s) for s in seqs] == [8, 8, 8, 1]


def test_jsonl_text_records_are_tokenized_separately(tmp_path):
    source = _write(tmp_path / "a.jsonl", "\n".join(json.dumps({"text": t}) for t in ["hello world", "abc"]) + "\n\n")
    seqs = load_sequences(source, char_tokenize, tokens=100, seq_len=4, vocab_size=VOCAB)
    assert seqs == [char_tokenize(p) for p in ["hell", "o wo", "rld", "abc"]]


def test_jsonl_input_ids_are_used_as_is(tmp_path):
    records = [[5, 6, 7], [1], [9, 9, 9, 9]]
    source = _write(tmp_path / "ids.jsonl", "\n".join(json.dumps({"input_ids": r}) for r in records))
    assert load_sequences(source, None, tokens=100, seq_len=4, vocab_size=VOCAB) == records
    assert load_sequences(source, None, tokens=5, seq_len=4, vocab_size=VOCAB) == [[5, 6, 7], [1], [9]]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": broken\n', "line 2: not valid JSON"),
        ('{"text": "ok"}\n\n[1, 2]\n', "line 3: expected an object"),
        ('{"input_ids": [1, 2]}\n{"input_ids": [1, "x"]}\n', "line 2: 'input_ids' must be"),
        ('{"input_ids": [1, 2, 3, 4, 5, 6]}\n', "line 1: sequence of 6 tokens is longer than --seq-len 4"),
        ('{"input_ids": [1, 2000]}\n', "outside the model's vocabulary"),
        ('{"text": 3}\n', "line 1: 'text' must be a string"),
    ],
    ids=["bad-json", "not-object", "bad-ids", "too-long", "out-of-vocab", "bad-text"],
)
def test_malformed_jsonl_names_the_line(tmp_path, content, message):
    source = _write(tmp_path / "bad.jsonl", content)
    with pytest.raises(DataError, match=message):
        load_sequences(source, char_tokenize, tokens=100, seq_len=4, vocab_size=VOCAB)


def test_bad_sources_and_budgets(tmp_path):
    with pytest.raises(DataError, match="empty"):
        load_sequences(_write(tmp_path / "e.txt", "  \n"), char_tokenize, 10, 4, VOCAB)
    with pytest.raises(DataError, match="not found"):
        load_sequences(str(tmp_path / "missing.txt"), char_tokenize, 10, 4, VOCAB)
    with pytest.raises(DataError, match="directory"):
        load_sequences(str(tmp_path), char_tokenize, 10, 4, VOCAB)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="not UTF-8"):
        load_sequences(str(tmp_path / "latin1.txt"), char_tokenize, 10, 4, VOCAB)
    with pytest.raises(DataError, match="--tokens must be positive"):
        load_sequences(_write(tmp_path / "a.txt", "abc"), char_tokenize, 0, 4, VOCAB)
    with pytest.raises(DataError, match="no tokenizer"):
        load_sequences(_write(tmp_path / "b.txt", "abc"), None, 10, 4, VOCAB)


def test_batches_pad_on_the_right_and_shard_whole_batches():
    seqs = [[1, 2, 3], [4], [5, 6], [7, 8], [9]]
    batches = make_batches(seqs, batch_size=2, pad_id=0)
    assert [b.first_sequence for b in batches] == [0, 2, 4]
    assert batches[0].input_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batches[0].attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batches[1].attention_mask is None  # equal lengths: nothing to mask
    assert [b.tokens for b in batches] == [4, 4, 1]
    assert [b.first_sequence for b in shard(batches, 0, 2)] == [0, 4]
    assert [b.first_sequence for b in shard(batches, 1, 2)] == [2]
    with pytest.raises(DataError):
        make_batches(seqs, 0)
    assert torch.equal(batches[2].input_ids, torch.tensor([[9]]))
