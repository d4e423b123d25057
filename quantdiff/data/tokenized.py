"""A training corpus's BPE and token ids, derived once and kept in the user cache.

Training a text recipe starts by training a byte-level BPE on the corpus and encoding it: on Austen's novels
that is ~30 s of one core, spent again by every seed, resumed run and test that trains on the same text. Both
steps are deterministic functions of the text, the vocabulary size and the `tokenizers` release, so their results
are stored under a key made of exactly those (sha256 of the text, of the tokenizer's JSON) and read back instead.
A cache that cannot be written only costs the time: the values are computed as before.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import tokenizers
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from quantdiff.core.cache import cache_dir, cache_lock
from quantdiff.models.tokenizer import BOS, EOS, PAD, train_bpe


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _store(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` whole (a temporary, then a rename), or not at all where the cache is not writable."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _cached(path: Path, read: Callable[[Path], object], compute: Callable[[], object], write: Callable[[Path, object], None]):
    """`read(path)` if it holds a value, else `compute()`, stored at `path` for the next caller (one process
    computes it while another waits, so two test workers never both pay). An entry that does not read back (a
    damaged disk) is computed and written again."""
    with ExitStack() as stack:
        try:
            stack.enter_context(cache_lock(path))
        except OSError:  # an unwritable cache: compute, keep nothing
            return compute()
        if path.is_file():
            try:
                return read(path)
            except Exception:  # noqa: BLE001 - whatever the reader raises, the entry is recomputed
                pass
        value = compute()
        _store(path, lambda tmp: write(tmp, value))
        return value


def _from_json(path: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), bos_token=BOS, eos_token=EOS, pad_token=PAD)


def bpe(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """`models.tokenizer.train_bpe(text, vocab_size)`, from the cache when this text, size and `tokenizers`
    release were trained before."""
    path = cache_dir() / "tokenized" / f"bpe-{_digest(text)[:40]}-{vocab_size}-tokenizers{tokenizers.__version__}.json"
    return _cached(path, _from_json, lambda: train_bpe(text, vocab_size),
                   lambda tmp, tokenizer: tmp.write_text(tokenizer.backend_tokenizer.to_str(), encoding="utf-8"))


def _ids_path(tokenizer: PreTrainedTokenizerFast, what: str, text: str) -> Path:
    key = _digest(tokenizer.backend_tokenizer.to_str() + "\0" + what)[:24] + "-" + _digest(text)[:40]
    return cache_dir() / "tokenized" / f"{what}-{key}.npy"


def _save_array(tmp: Path, values: list[int]) -> None:
    array = np.asarray(values, dtype=np.int64)
    small = array.size == 0 or (array.min() >= 0 and array.max() < 2**31)  # ids and counts: half the bytes
    with tmp.open("wb") as f:
        np.save(f, array.astype(np.int32) if small else array)


def _load_list(path: Path) -> list[int]:
    return np.load(path, allow_pickle=False).tolist()


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """The ids of `text`, no special tokens added, from the cache when this tokenizer encoded it before."""
    return _cached(_ids_path(tokenizer, "ids", text), _load_list,
                   lambda: tokenizer(text, add_special_tokens=False)["input_ids"], _save_array)


def piece_counts(tokenizer: PreTrainedTokenizerFast, pieces: Sequence[str]) -> list[int]:
    """The token count of each piece, no special tokens added, from the cache when counted before."""
    return _cached(_ids_path(tokenizer, "counts", "\0".join(pieces)), _load_list,
                   lambda: [len(p) for p in tokenizer(list(pieces), add_special_tokens=False)["input_ids"]], _save_array)
