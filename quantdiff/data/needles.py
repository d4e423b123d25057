"""Needle documents for the multi-needle retrieval task: key → value needles hidden in corpus filler.

A document is filler sentences with needles inserted at chosen depths, then queries::

    <filler> Remember Falcon cobalt tiger kiwi. <filler> Remember Orchid walrus pixel onion. <filler>
    Recall Orchid walrus pixel onion. Recall Falcon            ← prompt ends here
                      cobalt tiger kiwi.                       ← answer

The key sits right before its value, and the value is a multi-token span (three words) seen earlier in
the context. Key and value words never occur in the corpus and are single tokens of the trained tokenizer
(see `vocabulary_text`), so the answer is a chain of single-token induction steps: this *needle copy* is
what a tiny model learns within a few hundred steps on CPU, unlike associative recall of tokens that also
occur elsewhere. Chance for exact match is about 1/n_needles for a model that copies some
needle's value, and ~0 for one that guesses words.

API (all deterministic given the `random.Random` passed in):

- `Filler(text, count_tokens)`: the sentences of a text with their token counts. Token counts add up
  exactly when pieces are joined with one leading space each (byte-level BPE pre-tokenizes at spaces),
  so documents fit a token budget without re-tokenizing.
- `make_needle_example(rng, filler, context_tokens, n_needles, depths, n_queries=1, value_length=3)`:
  `prompt + answer` has at most `context_tokens` tokens (the last filler sentence is cut at a word to fit).
  `depths[i]` ∈ [0, 1] places needle i at that fraction of the filler (0 = start, 1 = just before the
  queries). The last of `n_queries` queries is unanswered; earlier ones are answered in the prompt (the
  training documents query every needle). `value_length` = words per value (training starts longer).
- `NeedleExample`: `prompt`, `answer` (" value."), `needles` (key, value) pairs, `query_index` (which
  needle the final query asks for), and character spans into `prompt`: `needle_spans[i]` = the whole
  needle sentence i, `value_spans[i]` = its value, `answer_span` = the queried needle's value (the span
  the paper's "attention to answer" measures). Map them to tokens with a fast tokenizer's
  `return_offsets_mapping=True`.
- `vocabulary_text()`: text to append to a tokenizer's training text so needle words are single tokens
  (with another tokenizer the task still works; the words are then multi-token and harder to copy).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

from quantdiff.data.corpus import sentences
from quantdiff.core.errors import DataError

# Needle words never occur in the corpus (checked against all six novels), and the tokenizer is trained with
# them (`vocabulary_text`), so each is a single token: every answer token then follows a token that occurs
# once in the document — the single-token induction copy a tiny model learns within a few hundred steps.
KEYS = (
    "Falcon Orchid Copper Willow Thistle Garnet Beacon Cobble Juniper Quarry Tundra Zephyr Basalt Cinder Fjord "
    "Glacier Indigo Jasper Kestrel Lagoon Nectar Onyx Quartz Raven Sparrow Umber Violet Wombat Zinnia Acorn "
    "Bramble Gecko"
).split()
VALUE_WORDS = (
    "cobalt pebble comet oyster canyon tiger biscuit cactus dragon goblet helmet igloo jigsaw lemon magnet nutmeg "
    "parrot quiver radish thimble tulip walrus yacht zebra badger dolphin engine garlic kayak ladder orbit rocket "
    "spider trumpet banjo cello tuba rhino koala panda lizard cobra papaya kiwi melon onion pickle waffle pretzel "
    "noodle bagel laser robot pixel radar sonar guitar flute kazoo zipper"
).split()
VALUE_LENGTH = 3  # words per value: a multi-token span, so exact match needs a copy of every token
NEEDLE = " Remember {key} {value}."
QUERY = " Recall {key}"
ANSWER = " {value}."


@dataclass(frozen=True)
class NeedleExample:
    prompt: str
    answer: str
    needles: tuple[tuple[str, str], ...]  # (key, value) in document order
    query_index: int
    needle_spans: tuple[tuple[int, int], ...]  # char spans of the needle sentences in `prompt`
    value_spans: tuple[tuple[int, int], ...]  # char spans of each needle's value in `prompt`

    @property
    def query_key(self) -> str:
        return self.needles[self.query_index][0]

    @property
    def answer_span(self) -> tuple[int, int]:
        return self.value_spans[self.query_index]

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def vocabulary_text(repeats: int = 2000) -> str:
    """Every needle word (with its leading space) `repeats` times: appended to the tokenizer's training text,
    it makes each a single BPE token (2000 repeats outrank the merges a 1–2K vocabulary keeps)."""
    return "".join(" " + word for word in KEYS + VALUE_WORDS) * repeats


class Filler:
    """Sentences of `text`, each prefixed with one space, and their token counts under `count_tokens`."""

    def __init__(self, text: str, count_tokens: Callable[[Sequence[str]], list[int]],
                 count_pieces: Callable[[Sequence[str]], list[int]] | None = None):
        """`count_pieces`, where given, counts the sentences themselves (the same numbers, e.g. from a cache)."""
        self.pieces = [" " + s for s in sentences(text)]
        if not self.pieces:
            raise DataError("no sentences in the filler text")
        self.counts = (count_pieces or count_tokens)(self.pieces)
        self.count_tokens = count_tokens

    @classmethod
    def from_tokenizer(cls, text: str, tokenizer) -> Filler:
        """Counts with a transformers tokenizer, no special tokens added."""
        from quantdiff.data.tokenized import piece_counts

        count = lambda pieces: [len(ids) for ids in tokenizer(list(pieces), add_special_tokens=False)["input_ids"]]  # noqa: E731
        return cls(text, count, lambda pieces: piece_counts(tokenizer, pieces))

    def run(self, rng: random.Random, budget: int) -> list[tuple[str, int]]:
        """(piece, tokens) of consecutive sentences from a random start filling `budget` tokens.

        The sentence that does not fit is cut at a word boundary, so documents come out (nearly) full.
        """
        start, out, used = rng.randrange(len(self.pieces)), [], 0
        for i in range(len(self.pieces)):
            j = (start + i) % len(self.pieces)
            if used + self.counts[j] > budget:
                out.extend(self._cut(self.pieces[j], budget - used))
                break
            out.append((self.pieces[j], self.counts[j]))
            used += self.counts[j]
        return out

    def _cut(self, piece: str, budget: int) -> list[tuple[str, int]]:
        """The longest word prefix of `piece` within `budget` tokens (binary search), or nothing."""
        words = piece.split(" ")[1:]  # pieces start with one space
        lo, hi, best = 1, len(words), []
        while lo <= hi:
            mid = (lo + hi) // 2
            prefix = " " + " ".join(words[:mid])
            (count,) = self.count_tokens([prefix])
            if count <= budget:
                best, lo = [(prefix, count)], mid + 1
            else:
                hi = mid - 1
        return best


def random_needles(rng: random.Random, n: int, value_length: int = VALUE_LENGTH) -> list[tuple[str, str]]:
    """n distinct keys with values that share no word, so every value token sequence is unambiguous."""
    if value_length < 1 or not 1 <= n <= min(len(KEYS), len(VALUE_WORDS) // value_length):
        raise DataError(f"{n} needles of {value_length} words: at most {len(VALUE_WORDS)} distinct value words exist")
    keys = rng.sample(KEYS, n)
    words = rng.sample(VALUE_WORDS, n * value_length)
    return [(k, " ".join(words[i * value_length : (i + 1) * value_length])) for i, k in enumerate(keys)]


def min_document_tokens(n_needles: int, n_queries: int = 1, value_length: int = VALUE_LENGTH) -> int:
    """A lower bound on the tokens of any document with these needles, whatever the tokenizer: the filler may
    be empty, and every word of the needle, query and answer sentences is at least one token."""
    value = " ".join(["v"] * value_length)
    needle = len(NEEDLE.format(key="k", value=value).split())
    query = len(QUERY.format(key="k").split()) + len(ANSWER.format(value=value).split())
    return n_needles * needle + n_queries * query


def _fixed_pieces(needles: Sequence[tuple[str, str]], asked: Sequence[int]) -> tuple[list[str], list[str], str, str]:
    """A document's pieces other than filler: needle sentences, answered queries, the final query, its answer."""
    needle_texts = [NEEDLE.format(key=k, value=v) for k, v in needles]
    queries = [QUERY.format(key=needles[i][0]) + ANSWER.format(value=needles[i][1]) for i in asked[:-1]]
    return needle_texts, queries, QUERY.format(key=needles[asked[-1]][0]), ANSWER.format(value=needles[asked[-1]][1])


def most_document_tokens(count_tokens: Callable[[Sequence[str]], list[int]], n_needles: int, n_queries: int = 1, value_length: int = VALUE_LENGTH) -> int:
    """The most tokens any document with these needles needs under `count_tokens` (`Filler`'s counter), filler
    excluded: the needles drawn from the keys and value words that tokenize longest, the longest ones queried.
    Exact for byte-level BPE, whose counts add up over space-separated words."""
    by_length = lambda words: [w for _, w in sorted(zip(count_tokens([" " + w for w in words]), words), reverse=True)]  # noqa: E731
    keys, words = by_length(KEYS)[:n_needles], by_length(VALUE_WORDS)[: n_needles * value_length]
    if len(keys) < n_needles or len(words) < n_needles * value_length:
        raise DataError(f"{n_needles} needles of {value_length} words: at most {len(VALUE_WORDS)} distinct value words exist")
    needles = [(k, " ".join(words[i * value_length : (i + 1) * value_length])) for i, k in enumerate(keys)]
    needle_texts, queries, final_query, answer = _fixed_pieces(needles, list(range(n_queries)))
    return sum(count_tokens(needle_texts + queries + [final_query, answer]))


def make_needle_example(
    rng: random.Random,
    filler: Filler,
    context_tokens: int,
    n_needles: int,
    depths: Sequence[float],
    n_queries: int = 1,
    value_length: int = VALUE_LENGTH,
) -> NeedleExample:
    """One document; see the module docstring for the layout and the meaning of each argument."""
    if len(depths) != n_needles or not all(0.0 <= d <= 1.0 for d in depths):
        raise DataError(f"need {n_needles} depths in [0, 1], got {list(depths)}")
    if not 1 <= n_queries <= n_needles:
        raise DataError(f"n_queries must be between 1 and n_needles={n_needles}, got {n_queries}")
    needles = random_needles(rng, n_needles, value_length)
    asked = rng.sample(range(n_needles), n_queries)
    needle_texts, queries, final_query, answer = _fixed_pieces(needles, asked)
    fixed = sum(filler.count_tokens(needle_texts + queries + [final_query, answer]))
    if fixed > context_tokens:
        raise DataError(f"context_tokens={context_tokens} is too short for {n_needles} needles ({fixed} tokens needed)")

    pieces = filler.run(rng, context_tokens - fixed)
    run = [piece for piece, _ in pieces]
    ends = list(accumulate(count for _, count in pieces))  # token offset where each filler sentence ends
    # Needle i goes after the first sentence whose end reaches depth_i of the filler tokens.
    slots = [bisect_left(ends, d * ends[-1]) + 1 if ends and d > 0 else 0 for d in depths]
    order = sorted(range(n_needles), key=lambda i: (slots[i], i))

    prompt, needle_spans, value_spans = "", [None] * n_needles, [None] * n_needles
    cursor = 0
    for i in order:
        prompt += "".join(run[cursor : slots[i]])
        cursor = max(cursor, slots[i])
        start = len(prompt)
        prompt += needle_texts[i]
        value_start = prompt.index(needles[i][1], start + len(" Remember ") + len(needles[i][0]))
        needle_spans[i] = (start, len(prompt))
        value_spans[i] = (value_start, value_start + len(needles[i][1]))
    prompt += "".join(run[cursor:]) + "".join(queries) + final_query
    ordered = tuple(needles[i] for i in order)
    remap = {old: new for new, old in enumerate(order)}
    return NeedleExample(
        prompt=prompt,
        answer=answer,
        needles=ordered,
        query_index=remap[asked[-1]],
        needle_spans=tuple(needle_spans[i] for i in order),
        value_spans=tuple(value_spans[i] for i in order),
    )
