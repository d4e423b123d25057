"""The held-out cloze set: deterministic, the true ending really follows its context, distractors do not."""

from __future__ import annotations

import random

import pytest

from quantdiff.data import cloze, corpus
from quantdiff.core.errors import DataError


def synthetic_text(n_paragraphs: int = 40, seed: int = 1) -> str:
    rng = random.Random(seed)
    words = "river mill lantern quiet morning letter sister garden carriage evening window promise".split()
    paragraphs = []
    for p in range(n_paragraphs):
        sentences = [f"Paragraph {p} sentence {s} speaks of the {' '.join(rng.choices(words, k=6))}." for s in range(4)]
        paragraphs.append(" ".join(sentences))
    return "\n".join(paragraphs)


def test_same_seed_same_items_other_seed_other_items():
    text = synthetic_text()
    first = cloze.build_cloze_set(text, 20, seed=3)
    assert first == cloze.build_cloze_set(text, 20, seed=3)
    assert first != cloze.build_cloze_set(text, 20, seed=4)


def test_true_ending_follows_context_and_distractors_are_length_neighbours_from_elsewhere():
    text = synthetic_text()
    paragraphs = text.split("\n")
    pool_lengths = sorted(len(s) for p in paragraphs for s in cloze.paragraph_sentences(p))
    for item in cloze.build_cloze_set(text, 30, seed=0):
        assert len(item.endings) == cloze.N_ENDINGS and 0 <= item.label < cloze.N_ENDINGS
        true = item.endings[item.label]
        (home,) = [p for p in paragraphs if item.ctx + " " + true in p]  # ctx then the true sentence, verbatim
        home_index = int(home.split()[1])
        for i, ending in enumerate(item.endings):
            if i != item.label:
                assert int(ending.split()[1]) != home_index  # "Paragraph <n> ...": from another paragraph
                lo, hi = sorted((len(ending), len(true)))
                between = sum(lo < n < hi for n in pool_lengths)
                assert between < cloze.LENGTH_WINDOW  # no further from the true ending than the window reaches


def test_length_does_not_give_the_answer_away():
    """The true ending's length rank among its item is near uniform (shortest or longest about 1 in 4)."""
    items = cloze.build_cloze_set(synthetic_text(n_paragraphs=200), 400, seed=0)
    strictly_shortest = sum(all(len(e) > len(i.endings[i.label]) for k, e in enumerate(i.endings) if k != i.label) for i in items)
    strictly_longest = sum(all(len(e) < len(i.endings[i.label]) for k, e in enumerate(i.endings) if k != i.label) for i in items)
    assert strictly_shortest < 0.35 * len(items) and strictly_longest < 0.35 * len(items)


def test_titles_do_not_end_sentences():
    assert cloze.paragraph_sentences("Mr. Knightley came in. He sat down.") == ["Mr. Knightley came in.", "He sat down."]


def test_too_little_text_is_a_data_error():
    with pytest.raises(DataError, match="only"):
        cloze.build_cloze_set(synthetic_text(n_paragraphs=2), 50)


def test_cached_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "held_out_text", synthetic_text)
    items = cloze.cloze_set(10, seed=2)
    (path,) = (tmp_path / "cloze").glob("*.jsonl")
    assert "seed2-n10" in path.name and len(path.read_text().splitlines()) == 10
    path.write_text(path.read_text().replace(items[0].ctx, "EDITED"))  # the cache, not a rebuild, is read
    assert cloze.cloze_set(10, seed=2)[0].ctx == "EDITED"
