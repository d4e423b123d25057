"""The cached BPE and token ids (quantdiff/data/tokenized.py) against computing them afresh with `tokenizers`:
a first call (computed and stored) and a second (read back) give exactly what train_bpe and the tokenizer give,
an unwritable or damaged cache costs only the time, and a text recipe's data is the same either way."""

from __future__ import annotations

import random

import pytest
import torch

from quantdiff.data import tokenized
from quantdiff.data.needles import Filler
from quantdiff.models.tokenizer import train_bpe

WORDS = "truth universally acknowledged single man possession good fortune want wife feelings views neighbourhood".split()
_rng = random.Random(0)
TEXT = " ".join(" ".join(_rng.choice(WORDS) for _ in range(_rng.randint(3, 12))) + "." for _ in range(600))
SAMPLE = "A single man, in want of a good fortune; views and feelings. Über 12 digits: 3.14159!"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenized"


def _same_tokenizer(a, b) -> None:
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a(SAMPLE)["input_ids"] == b(SAMPLE)["input_ids"]


def test_a_stored_and_a_read_back_bpe_equal_a_fresh_one(cache):
    fresh = train_bpe(TEXT, 300)
    first = tokenized.bpe(TEXT, 300)
    assert len(list(cache.glob("bpe-*.json"))) == 1
    second = tokenized.bpe(TEXT, 300)
    for got in (first, second):
        _same_tokenizer(got, fresh)
    tokenized.bpe(TEXT, 310)  # another size is another entry
    assert len(list(cache.glob("bpe-*.json"))) == 2


def test_ids_and_piece_counts_read_back_equal_the_tokenizers_own(cache):
    tok = train_bpe(TEXT, 300)
    expected = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenized.ids(tok, TEXT) == expected and tokenized.ids(tok, TEXT) == expected
    pieces = [" " + s for s in TEXT.split(".")[:50]]
    counts = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in pieces]
    assert tokenized.piece_counts(tok, pieces) == counts == tokenized.piece_counts(tok, pieces)
    assert Filler.from_tokenizer(TEXT, tok).counts == Filler(TEXT, lambda ps: [len(tok(p, add_special_tokens=False)["input_ids"]) for p in ps]).counts


def test_a_damaged_entry_is_computed_again(cache):
    tok = train_bpe(TEXT, 300)
    expected = tokenized.ids(tok, TEXT)
    (entry,) = cache.glob("ids-*.npy")
    entry.write_bytes(b"not an array")
    assert tokenized.ids(tok, TEXT) == expected
    assert not list(cache.glob("bpe-*.json"))  # only what was asked for is stored
    tokenized.bpe(TEXT, 300)
    (bpe_entry,) = cache.glob("bpe-*.json")
    bpe_entry.write_text("{")
    _same_tokenizer(tokenized.bpe(TEXT, 300), tok)


def test_an_unwritable_cache_only_costs_the_time(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("QUANTDIFF_CACHE", str(blocker / "cache"))  # under a file: nothing can be created
    tok = tokenized.bpe(TEXT, 300)
    _same_tokenizer(tok, train_bpe(TEXT, 300))
    assert tokenized.ids(tok, TEXT) == tok(TEXT, add_special_tokens=False)["input_ids"]


def test_a_text_recipe_prepares_the_same_data_from_the_cache(cache, monkeypatch):
    from quantdiff.data import corpus
    from quantdiff.train import loop
    from quantdiff.train.recipe import parse_recipe

    monkeypatch.setattr(corpus, "split_text", lambda split, *a, **k: TEXT if split == "train" else TEXT[:2000])
    recipe = parse_recipe('[model]\nvocab_size = 300\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nmax_position_embeddings = 64\n[train]\nseq_len = 64\n', "t")
    first = loop.prepare_data(recipe)
    monkeypatch.setattr(tokenized, "train_bpe", lambda *a: pytest.fail("trained a BPE the cache holds"))
    second = loop.prepare_data(recipe)
    _same_tokenizer(first.tokenizer, second.tokenizer)
    assert torch.equal(first.train_ids, second.train_ids) and torch.equal(first.held_out_ids, second.held_out_ids)
    assert first.filler.counts == second.filler.counts and first.bos_id == second.bos_id
