"""Byte-level BPE trained with the `tokenizers` library, saved so `AutoTokenizer.from_pretrained(dir)` loads it.

Byte level: any text (digits, accents, code) tokenizes without unknown tokens, like GPT-2's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
BYTES_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # the special tokens and every byte: the smallest byte-level BPE


def train_bpe(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with `vocab_size` entries (special tokens included) trained on `text`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    chunk = 1 << 16  # the trainer takes an iterator; chunks keep memory flat and the result is the same
    tok.train_from_iterator((text[i : i + chunk] for i in range(0, len(text), chunk)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def bytes_tokenizer() -> PreTrainedTokenizerFast:
    """The special tokens and the 256 bytes, no merges (BYTES_VOCAB_SIZE entries): any text tokenizes, learned from
    none, for models that were never trained (`quantdiff pair`) and whose vocabulary holds at least that many."""
    return train_bpe("", BYTES_VOCAB_SIZE)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """Writes tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) into `directory`."""
    tokenizer.save_pretrained(str(directory))
