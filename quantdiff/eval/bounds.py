"""How long a sequence a task may feed a model: at most the model's positions, and within the machine's memory.

Checked from the model's config before any data is built or any model runs (`--context 100000` on the retrieval
task was killed by the kernel at 24 GB, without a line), and again by the tasks that run sequences of a given
length, for callers of the Python API.
"""

from __future__ import annotations

from typing import Any

import torch

from quantdiff.core.errors import DataError
from quantdiff.core.memory import check_fits

DEFAULT_TILE_SIZE = 512  # the attention backend's key tile (attention.backend.DEFAULT_TILE_SIZE)
FLOAT_BYTES = 4


def forward_bytes(batch: int, length: int, vocab: int, heads: int, tile: int = DEFAULT_TILE_SIZE) -> int:
    """A lower bound of one evaluation forward pass' peak memory: the logits (batch, length, vocab) in float32
    three times (the model's output, its float copy, the log-softmax) and one attention-logits tile
    (batch, heads, length, tile) in float32 twice (the scores and their softmax)."""
    return FLOAT_BYTES * batch * length * (3 * vocab + 2 * heads * min(length, tile))


def task_length(task: Any) -> int | None:
    """The tokens per sequence a task was asked for (retrieval's document, lm's window, bb's context), or None
    when its data decides (choice)."""
    for field in ("context_tokens", "context"):
        value = getattr(task, field, None)
        if isinstance(value, int):
            return value
    return None


def check_positions(length: int, config: Any, what: str) -> int:
    """`length` if sequences of that many tokens fit the model's positions, else DataError: the one position
    check of every command and API function (never a silent cut to the positions)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and length > positions:
        raise DataError(f"{what} of {length:,} tokens exceeds the model's {positions:,} positions: use at most {positions:,}")
    return length


def check_sequence_fits(length: int, config: Any, batch: int, what: str, device: torch.device | str = "cpu") -> None:
    """DataError if sequences of `length` tokens exceed the model's positions; ConfigError if a forward pass over
    `batch` of them cannot fit the memory of `device`."""
    check_positions(length, config, what)
    vocab = getattr(config, "vocab_size", None) or 1
    heads = getattr(config, "num_attention_heads", None) or 1
    check_fits(forward_bytes(batch, length, vocab, heads), f"{what} of {length:,} tokens (batches of {batch})", device)


def check_task_fits(task: Any, config: Any, device: torch.device | str = "cpu") -> None:
    """The task's sequence length (if it has one) against the model `config` describes."""
    length = task_length(task)
    if length is not None:
        check_sequence_fits(length, config, getattr(task, "batch_size", 1), f"task {task.name}'s context", device)
