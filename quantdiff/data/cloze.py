"""A HellaSwag-format cloze set cut from the corpus' held-out text: which sentence comes next?

Each item's `ctx` is up to two consecutive sentences of a held-out paragraph, and its endings are the
sentence that really follows plus three distractor sentences from other held-out paragraphs, drawn from a
window of sentences of neighbouring length that holds the true ending at a uniformly random rank: the true
ending is then the shortest (or longest) of its item one time in four, and length alone wins neither `acc`
nor `acc_norm`. Deterministic: the same corpus and seed
give the same items. Built at run time and cached under the user's cache directory (corpus-derived text is
never committed).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re

import quantdiff.data.corpus as corpus
from quantdiff.core.errors import DataError
from quantdiff.data.choice_items import ChoiceItem, read_jsonl, write_jsonl

N_ENDINGS = 4
CONTEXT_SENTENCES = 2
ENDING_CHARS = (40, 160)  # true endings: shorter ones say too little, longer ones dominate the item
POOL_CHARS = (25, 200)  # distractors: wider than ENDING_CHARS, so every true ending has neighbours on both sides
LENGTH_WINDOW = 16  # sentences of neighbouring length (the true ending among them) that distractors come from
MIN_CONTEXT_CHARS = 40
FORMAT_VERSION = 2  # bump when the construction changes: cached files are keyed by it
_ABBREVIATION = re.compile(r"\b(Mr|Mrs|Dr|St|Messrs)\.$")


def paragraph_sentences(paragraph: str) -> list[str]:
    """corpus.sentences, re-joined after titles such as "Mr." that end no sentence."""
    merged: list[str] = []
    for piece in corpus.sentences(paragraph):
        if merged and _ABBREVIATION.search(merged[-1]):
            merged[-1] += " " + piece
        else:
            merged.append(piece)
    return merged


def _within(sentence: str, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= len(sentence) <= bounds[1]


def build_cloze_set(text: str, n_items: int, seed: int = 0) -> list[ChoiceItem]:
    """`n_items` items from `text` (paragraphs separated by newlines); DataError if it has too few."""
    paragraphs = [paragraph_sentences(p) for p in text.split("\n") if p.strip()]
    # (length, sentence, paragraph), sorted: a true ending's length neighbours are a slice around it.
    pool = sorted({(len(s), s, p) for p, sents in enumerate(paragraphs) for s in sents if _within(s, POOL_CHARS)})
    candidates = [
        (p, i)
        for p, sents in enumerate(paragraphs)
        for i in range(1, len(sents))
        if _within(sents[i], ENDING_CHARS) and len(" ".join(sents[max(0, i - CONTEXT_SENTENCES) : i])) >= MIN_CONTEXT_CHARS
    ]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    items = []
    for p, i in candidates[:n_items]:
        true = paragraphs[p][i]
        others = [s for _, s, q in pool if q != p and s != true]  # still sorted by length
        lengths = [len(s) for s in others]
        # The true ending's rank among others: a random place among those of equal length (there are many).
        at = rng.randint(bisect.bisect_left(lengths, len(true)), bisect.bisect_right(lengths, len(true)))
        start = min(max(at - rng.randrange(LENGTH_WINDOW), 0), len(others) - (LENGTH_WINDOW - 1))
        endings = rng.sample(others[start : start + LENGTH_WINDOW - 1], N_ENDINGS - 1)
        label = rng.randrange(N_ENDINGS)
        endings.insert(label, true)
        ctx = " ".join(paragraphs[p][max(0, i - CONTEXT_SENTENCES) : i])
        items.append(ChoiceItem(ctx, tuple(endings), label))
    if len(items) < n_items:
        raise DataError(f"the held-out text yields only {len(items)} cloze items, {n_items} requested")
    return items


def cloze_set(n_items: int = 200, seed: int = 0) -> list[ChoiceItem]:
    """The held-out cloze set, read from the cache or built (and cached) on first use."""
    text = corpus.held_out_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = corpus.cache_dir() / "cloze" / f"cloze-v{FORMAT_VERSION}-{digest}-seed{seed}-n{n_items}.jsonl"
    if path.is_file():
        return read_jsonl(path)
    items = build_cloze_set(text, n_items, seed)
    write_jsonl(items, path)
    return items
