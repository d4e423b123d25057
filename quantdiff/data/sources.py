"""Data sources → token sequences → padded batches, for passes that only observe a model.

A source is one of:
- a UTF-8 text file: its tokens, cut into consecutive windows of `seq_len`;
- a JSONL file whose records hold `text` (each record tokenized on its own, cut into windows of `seq_len`)
  or `input_ids` (each record used as-is as one sequence: exact across tokenizers);
- `builtin:corpus` (the held-out split of the project's corpus) or `builtin:retrieval` (needle documents
  of `seq_len` tokens built from that split);
- calibration data, disjoint from every task's evaluation data: `builtin:corpus-train` (the corpus' training
  split) and `builtin:bigram-backcopy` (Bigram-Backcopy sequences of the generator's calibration seed stream,
  BOS first, token ids of its own vocabulary).
Sequences are taken in order until `tokens` tokens are reached; the last one is cut to fit exactly. With a
`bos_id`, every sequence cut from text starts with that token and holds `seq_len` tokens with it (a model trained
with BOS first is measured as it runs: `models.bos`); `input_ids` records and Bigram-Backcopy rows (BOS first by
construction) stay exactly as given.
"""

from __future__ import annotations

import hashlib
import json
import random
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantdiff.core.errors import ConfigError, DataError
from quantdiff.core.memory import check_fits

BUILTIN_CORPUS = "builtin:corpus"
BUILTIN_RETRIEVAL = "builtin:retrieval"
BUILTIN_CORPUS_TRAIN = "builtin:corpus-train"
BUILTIN_BIGRAM_BACKCOPY = "builtin:bigram-backcopy"
BUILTINS = (BUILTIN_CORPUS, BUILTIN_RETRIEVAL, BUILTIN_CORPUS_TRAIN, BUILTIN_BIGRAM_BACKCOPY)
# Which tokenizer each builtin source's ids belong to: None = text, tokenized by the model's own tokenizer; else
# the source's ids are of that tokenizer only, and would mean something else to any other model.
BUILTIN_TOKENIZERS = {BUILTIN_CORPUS: None, BUILTIN_RETRIEVAL: None, BUILTIN_CORPUS_TRAIN: None, BUILTIN_BIGRAM_BACKCOPY: "bigram-backcopy"}
# The split each builtin source is drawn from. "evaluation": what a task evaluates (builtin:corpus is the corpus'
# held-out split, builtin:retrieval the retrieval task's needle documents built from it), so never calibration
# data, for any command; "train" and "calibration" are disjoint from every task's evaluation data.
EVALUATION_SPLIT = "evaluation"
BUILTIN_SPLITS = {BUILTIN_CORPUS: EVALUATION_SPLIT, BUILTIN_RETRIEVAL: EVALUATION_SPLIT, BUILTIN_CORPUS_TRAIN: "train", BUILTIN_BIGRAM_BACKCOPY: "calibration"}
TEXT_CHUNK_CHARS = 1 << 20  # tokenize long texts piecewise, stopping once the budget is reached
RETRIEVAL_NEEDLES = 4
RETRIEVAL_SEED = 0
BATCH_BYTES_PER_TOKEN = 16  # int64 id and int64 attention mask

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class Batch:
    """Right-padded sequences; sequence `first_sequence + b` of the whole data set is row b."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor | None  # (B, T) 1 = token, 0 = padding; None when nothing is padded
    first_sequence: int

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel() if self.attention_mask is None else self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return Batch(self.input_ids.to(device), mask, self.first_sequence)


def load_sequences(
    source: str, tokenize: Tokenize | None, tokens: int, seq_len: int, vocab_size: int, bos_id: int | None = None, tokenizer=None
) -> list[list[int]]:
    """Token sequences of `source` (see the module docstring), at most `seq_len` long, `tokens` in total.

    tokenize: text → ids (None when the source must be pre-tokenized). bos_id: put first in every sequence cut
    from text. tokenizer: the model's (None: it has none), checked against a builtin source whose ids belong to
    one tokenizer (`BUILTIN_TOKENIZERS`). Raises DataError on bad input.
    """
    check_builtin_tokenizer(source, tokenizer)
    check_token_budget(tokens, "--tokens")
    if seq_len < 1:
        raise DataError(f"--seq-len must be positive, got {seq_len}")
    prefix = [] if bos_id is None else [bos_id]
    if seq_len <= len(prefix):
        raise DataError(f"--seq-len {seq_len} leaves no room for text after BOS: use at least 2")
    if source in BUILTINS:
        sequences = _builtin(source, tokenize, tokens, seq_len, prefix)
    else:
        path = Path(source)
        if path.suffix == ".jsonl":
            sequences = _jsonl(path, tokenize, tokens, seq_len, prefix)
        else:
            sequences = _windows(_chunks(read_text(path)), _need(tokenize, source), tokens, seq_len, prefix)
    out = _budget(sequences, tokens)
    if not out:
        raise DataError(f"no tokens in {source}")
    for i, seq in enumerate(out):
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise DataError(f"{source}: sequence {i} holds token id {bad[0]} outside the model's vocabulary (size {vocab_size})")
    return out


def check_token_budget(tokens: int, flag: str) -> None:
    """DataError unless `tokens` (what `flag` asked for) is positive and its batches fit the machine's memory:
    every batch is held until the run ends."""
    if tokens < 1:
        raise DataError(f"{flag} must be positive, got {tokens}")
    check_fits(tokens * BATCH_BYTES_PER_TOKEN, f"{flag} {tokens:,}")


def check_calibration_split(source: str, flag: str = "--calibration") -> None:
    """ConfigError when `source` is a builtin source of an evaluation split (`BUILTIN_SPLITS`)."""
    if BUILTIN_SPLITS.get(source) == EVALUATION_SPLIT:
        calibration = ", ".join(name for name, split in BUILTIN_SPLITS.items() if split != EVALUATION_SPLIT)
        raise ConfigError(f"{flag} {source} is evaluation data (its split is {EVALUATION_SPLIT!r}): calibrate on {calibration} or a file")


def check_builtin_tokenizer(source: str, tokenizer) -> None:
    """DataError unless a builtin source's ids mean to a model with `tokenizer` what they meant when written."""
    if BUILTIN_TOKENIZERS.get(source) != "bigram-backcopy":
        return
    from quantdiff.data.bigram_backcopy import load

    try:
        if tokenizer is None:
            raise DataError("no tokenizer")
        load().check_tokenizer(tokenizer)
    except DataError:
        raise DataError(
            f"{source} holds token ids of the Bigram-Backcopy character tokenizer, and this model's tokenizer is another: "
            "use it with a model trained on bb, or give text data"
        ) from None


def make_batches(sequences: list[list[int]], batch_size: int, pad_id: int = 0) -> list[Batch]:
    """Consecutive groups of `batch_size` sequences, right-padded to the longest of each group."""
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}")
    batches = []
    for start in range(0, len(sequences), batch_size):
        group = sequences[start : start + batch_size]
        width = max(len(s) for s in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.int64)  # (B, T)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        for row, seq in enumerate(group):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
            mask[row, : len(seq)] = 1
        batches.append(Batch(ids, None if bool(mask.all()) else mask, start))
    return batches


def shard(batches: list[Batch], rank: int, world: int) -> list[Batch]:
    """Whole batches round-robin, so every batch has the same rows as in a single-process run."""
    return batches[rank::world]


def _need(tokenize: Tokenize | None, source: str) -> Tokenize:
    if tokenize is None:
        raise DataError(f"{source} holds text but the model has no tokenizer: use a JSONL file with input_ids")
    return tokenize


def check_data_file(path: str | Path, flag: str = "--data") -> None:
    """A data path must be an existing regular file: the reason otherwise (missing, a directory, a device)."""
    if not str(path).strip():
        raise DataError(f"{flag} is empty: name a data file")
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise DataError(f"{flag} file not found: {path}") from None
    except OSError as exc:  # a name too long, a symlink loop, no permission
        raise DataError(f"{flag} {str(path)[:80]}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise DataError(f"{flag} is a directory, not a file: {path}")
    if not stat.S_ISREG(mode):
        raise DataError(f"{flag} is not a regular file: {path}")


def file_sha256(path: str | Path, flag: str = "--data") -> str:
    """The hex sha256 of a data file's bytes: what identifies data whatever its path (another directory, a
    symlink, a copy); DataError in one line naming `flag` when it cannot be read."""
    check_data_file(path, flag)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise DataError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents; DataError with a one-line reason if missing, unreadable or empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"data path is a directory, not a file: {path}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not text.strip():
        raise DataError(f"data file is empty: {path}")
    return text


def text_or_held_out(path: Path | None) -> str:
    """A task's text: the given file, or the corpus' held-out split (never trained on) when None."""
    if path is None:
        from quantdiff.data.corpus import held_out_text

        return held_out_text()
    return read_text(Path(path))


def _chunks(text: str) -> list[str]:
    """Pieces of about TEXT_CHUNK_CHARS, cut after a newline so tokens rarely straddle a cut."""
    pieces, start = [], 0
    while start < len(text):
        stop = text.find("\n", start + TEXT_CHUNK_CHARS)
        stop = len(text) if stop < 0 else stop + 1
        pieces.append(text[start:stop])
        start = stop
    return pieces


def _windows(texts, tokenize: Tokenize, tokens: int, seq_len: int, prefix: list[int], per_text: bool = False) -> list[list[int]]:
    """`prefix` + a window of the token stream of `texts` (one stream, or one per text if per_text), seq_len
    tokens in all."""
    width = seq_len - len(prefix)
    out, stream, total = [], [], 0
    for text in texts:
        stream.extend(tokenize(text))
        full = len(stream) - len(stream) % width
        out.extend(prefix + stream[i : i + width] for i in range(0, full, width))
        total += full
        stream = stream[full:]
        if per_text and stream:
            out.append(prefix + stream)
            total += len(stream)
            stream = []
        if total >= tokens:
            return out
    if stream:
        out.append(prefix + stream)
    return out


def _jsonl(path: Path, tokenize: Tokenize | None, tokens: int, seq_len: int, prefix: list[int]) -> list[list[int]]:
    text = read_text(path)
    records, field = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
        fields = {"text", "input_ids"} & set(record) if isinstance(record, dict) else set()
        if not fields:
            raise DataError(f"{path} line {number}: expected an object with a 'text' or 'input_ids' field")
        if len(fields) == 2:
            raise DataError(f"{path} line {number}: has both 'text' and 'input_ids': give one of them")
        if field is not None and fields != {field}:
            raise DataError(f"{path} line {number}: has {next(iter(fields))!r} where the lines before have {field!r}: a file holds one kind")
        field = field or next(iter(fields))
        value = record.get(field)
        if field == "text" and not isinstance(value, str):
            raise DataError(f"{path} line {number}: 'text' must be a string")
        if field == "input_ids":
            if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise DataError(f"{path} line {number}: 'input_ids' must be a non-empty list of integers")
            if len(value) > seq_len:
                raise DataError(f"{path} line {number}: sequence of {len(value)} tokens is longer than --seq-len {seq_len}")
        records.append(value)
        if field == "input_ids" and sum(map(len, records)) >= tokens:
            break
    if not records:
        raise DataError(f"data file is empty: {path}")
    if field == "input_ids":
        return records
    return _windows(records, _need(tokenize, str(path)), tokens, seq_len, prefix, per_text=True)


def _builtin(source: str, tokenize: Tokenize | None, tokens: int, seq_len: int, prefix: list[int]) -> list[list[int]]:
    # The corpus functions raise DataError with install instructions when the corpus is missing.
    from quantdiff.data.corpus import held_out_text, train_text

    if source == BUILTIN_BIGRAM_BACKCOPY:
        from quantdiff.data.bigram_backcopy import load

        return load().calibration_rows(-(-tokens // seq_len), seq_len).tolist()
    tokenize = _need(tokenize, source)
    if source == BUILTIN_CORPUS_TRAIN:
        return _windows(_chunks(train_text()), tokenize, tokens, seq_len, prefix)
    text = held_out_text()
    if source == BUILTIN_CORPUS:
        return _windows(_chunks(text), tokenize, tokens, seq_len, prefix)
    from quantdiff.data.needles import Filler, make_needle_example

    filler = Filler(text, lambda pieces: [len(tokenize(p)) for p in pieces])
    rng = random.Random(RETRIEVAL_SEED)
    out, total = [], 0
    while total < tokens:
        depths = sorted(rng.random() for _ in range(RETRIEVAL_NEEDLES))
        width = seq_len - len(prefix)
        ids = prefix + tokenize(make_needle_example(rng, filler, width, RETRIEVAL_NEEDLES, depths).text)[:width]
        out.append(ids)
        total += len(ids)
    return out


def _budget(sequences: list[list[int]], tokens: int) -> list[list[int]]:
    out, total = [], 0
    for seq in sequences:
        if total >= tokens:
            break
        seq = seq[: tokens - total]
        if seq:
            out.append(seq)
            total += len(seq)
    return out
