"""The Bigram-Backcopy task (Guo et al., "Active-Dormant Attention Heads", arXiv 2410.13835, §2; their BBM/).

Each sequence starts with a BOS token; the first character is drawn from the unigram distribution without
the trigger tokens; after that, a character that is a trigger is followed by a copy of the character
*before* it (backcopy: deterministic), and any other character by a draw from the bigram transition matrix
(not deterministic). A trigger is therefore always preceded by a non-trigger (the first character is one, and
a copied character is the one before a trigger), so every backcopy copies a non-trigger.

What this module matches in the authors' generator (`data.py`, class `bbm`, and `data/prepare.py`):
- the transition matrix is the empirical character-bigram matrix of an English text: every pair of
  consecutive characters counted, each row normalised; the vocabulary is that text's characters;
- the triggers are the k = 3 most frequent characters (their `fixed_special_toks`, `k=3`);
- one BOS token, id = the number of characters (right after them), never generated: it opens every
  sequence and is the first input position;
- rows of `seq_len + 1` tokens, inputs the first `seq_len` (BOS first), targets the last `seq_len`
  (their `seq_length = 256`).

What it changes:
- the text: the authors count the bigrams of Karpathy's tiny-Shakespeare (65 characters); this project reads
  only Debian packages, so the matrix comes from Jane Austen's six novels (`r-cran-janeaustenr`, the
  project's corpus): 81 characters, the same three triggers (space, `e`, `t`). The counts ship in
  `quantdiff/assets/bigram_backcopy.json` (built by `python -m quantdiff.data.bigram_backcopy --rebuild`), so
  the task needs no corpus at run time;
- the vocabulary has a `<pad>` token (never generated) instead of their unused delimiter `<d>`: 83 tokens;
- randomness: each training batch is a pure function of (seed, step) and each held-out sequence of its
  index, drawn from a fixed held-out seed stream that no training seed reaches (the authors draw training
  and test batches from worker RNGs).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from quantdiff.core.errors import DataError

NAME = "bigram-backcopy"
TABLE = Path(__file__).resolve().parents[1] / "assets" / "bigram_backcopy.json"
SOURCE = "r-cran-janeaustenr: every chapter, joined by blank lines"
TRIGGERS = 3  # the authors' k
BOS, PAD = "<s>", "<pad>"
# First word of every seed: training, held-out (evaluation) and calibration draws never meet.
TRAIN_STREAM, HELD_OUT_STREAM, CALIBRATION_STREAM = 0, 1, 2


def bigram_counts(text: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(characters sorted, counts[a, b] of b right after a over every consecutive pair, count of each character)."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    counts = np.zeros((len(chars), len(chars)), dtype=np.int64)
    np.add.at(counts, (ids[:-1], ids[1:]), 1)
    return chars, counts, np.bincount(ids, minlength=len(chars))


@dataclass(frozen=True)
class BigramBackcopy:
    """The generator: characters (ids 0..C-1), BOS = C, PAD = C + 1, the transition matrix and the triggers."""

    chars: tuple[str, ...]
    transition: np.ndarray  # (C, C) float64, rows sum to 1
    first: np.ndarray  # (C,) distribution of the first character: the unigram marginal without triggers
    triggers: tuple[int, ...]  # character ids, most frequent first

    @classmethod
    def from_counts(cls, chars: list[str], counts: np.ndarray, unigram: np.ndarray, k: int = TRIGGERS) -> BigramBackcopy:
        counts, unigram = np.asarray(counts, dtype=np.float64), np.asarray(unigram, dtype=np.float64)
        if (counts.sum(axis=1) == 0).any():
            raise DataError("every character of the bigram table needs a successor")
        triggers = tuple(int(i) for i in np.argsort(-unigram, kind="stable")[:k])
        first = unigram.copy()
        first[list(triggers)] = 0
        return cls(tuple(chars), counts / counts.sum(axis=1, keepdims=True), first / first.sum(), triggers)

    @property
    def bos_id(self) -> int:
        return len(self.chars)

    @property
    def pad_id(self) -> int:
        return len(self.chars) + 1

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 2

    def sequences(self, seed: tuple[int, ...], count: int, length: int) -> torch.Tensor:
        """(count, length) int64 rows, BOS first; a pure function of (seed, count, length)."""
        if length < 2:
            raise DataError(f"a {NAME} sequence needs at least 2 tokens, got {length}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))
        # One uniform per position, drawn row after row: sequence i is the same whatever `count` is.
        uniform = rng.random((count, length))
        rows = np.empty((count, length), dtype=np.int64)
        rows[:, 0] = self.bos_id
        rows[:, 1] = _draw(np.broadcast_to(np.cumsum(self.first), (count, len(self.chars))), uniform[:, 1])
        cumulative = np.cumsum(self.transition, axis=1)
        is_trigger = np.zeros(self.vocab_size, dtype=bool)
        is_trigger[list(self.triggers)] = True
        for t in range(2, length):
            bigram = _draw(cumulative[rows[:, t - 1]], uniform[:, t])
            rows[:, t] = np.where(is_trigger[rows[:, t - 1]], rows[:, t - 2], bigram)
        return torch.from_numpy(rows)

    def next_distribution(self, inputs: torch.Tensor) -> torch.Tensor:
        """(…, vocab) true distribution of the token after each input token when it is BOS or a non-trigger
        (the first-character distribution after BOS, the transition row after a character); rows of triggers
        are left zero (their successor is the copy, which the distribution of the input alone does not give)."""
        table = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        table[: len(self.chars), : len(self.chars)] = torch.from_numpy(self.transition)
        table[self.bos_id, : len(self.chars)] = torch.from_numpy(self.first)
        table[list(self.triggers)] = 0
        return table[inputs]

    def train_rows(self, seed: int, step: int, count: int, length: int) -> torch.Tensor:
        return self.sequences((TRAIN_STREAM, seed, step), count, length)

    def held_out_rows(self, count: int, length: int) -> torch.Tensor:
        return self.sequences((HELD_OUT_STREAM,), count, length)

    def calibration_rows(self, count: int, length: int) -> torch.Tensor:
        """Sequences for calibrating a quantization (SmoothQuant's scales): neither trained on nor evaluated."""
        return self.sequences((CALIBRATION_STREAM,), count, length)

    def backcopy_targets(self, inputs: torch.Tensor) -> torch.Tensor:
        """Bool mask over `inputs` (B, T): True where the next token is a backcopy (the input is a trigger)."""
        return torch.isin(inputs, torch.tensor(self.triggers))

    def tokenizer(self):
        """A character-level tokenizer whose ids are the generator's (each character one token)."""
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {c: i for i, c in enumerate(self.chars)} | {BOS: self.bos_id, PAD: self.pad_id}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
        tok.add_special_tokens([BOS, PAD])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, pad_token=PAD)

    def check_tokenizer(self, tokenizer) -> None:
        """DataError unless `tokenizer` maps the generator's characters and BOS to the generator's ids."""
        ids = tokenizer.convert_tokens_to_ids(list(self.chars) + [BOS])
        if ids != list(range(len(self.chars) + 1)) or tokenizer.bos_token_id != self.bos_id:
            raise DataError(f"the {NAME} task needs a model trained on {NAME} (its character tokenizer); this tokenizer differs")


def _draw(cumulative: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """One index per row of `cumulative` (rows of cumulative probabilities), by inverse transform sampling."""
    u = uniform[:, None] * cumulative[:, -1:]
    return np.minimum((cumulative <= u).sum(axis=1), cumulative.shape[1] - 1)


@lru_cache(maxsize=1)
def load() -> BigramBackcopy:
    """The shipped generator (bigram counts of Austen's novels)."""
    try:
        table = json.loads(TABLE.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"the {NAME} bigram table {TABLE} is unreadable ({type(exc).__name__}): reinstall quantdiff") from None
    return BigramBackcopy.from_counts(table["chars"], np.array(table["counts"]), np.array(table["unigrams"]))


def table_from_corpus() -> dict:
    """The bigram table of every Austen chapter, joined as the corpus reads them."""
    chars, counts, unigrams = bigram_counts(corpus_text())
    return {"source": SOURCE, "chars": chars, "unigrams": unigrams.tolist(), "counts": counts.tolist()}


def corpus_text() -> str:
    from quantdiff.data import corpus

    return "\n\n".join(corpus.documents("janeaustenr").values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantdiff.data.bigram_backcopy", description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help=f"recount the bigrams from the corpus into {TABLE}")
    args = parser.parse_args(argv)
    try:
        if args.rebuild:
            from quantdiff.core.atomic import write_json

            write_json(TABLE, table_from_corpus(), indent=None, force=True)  # the package's own table
        gen = load()
        print(f"{len(gen.chars)} characters, vocabulary {gen.vocab_size}, triggers {[gen.chars[i] for i in gen.triggers]}")
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
