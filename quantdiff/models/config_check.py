"""config.json checked before transformers parses it: a size that is not a positive integer would otherwise
surface as a traceback from deep inside transformers (a ZeroDivisionError for 0 heads), not as a reason.
Relations between sizes are mostly checked by transformers' own config validators; families without one
would build heads of width hidden_size // num_attention_heads and lose the remainder."""

from __future__ import annotations

from pathlib import Path

from quantdiff.core.errors import LoadError

# Sizes under their usual names and the GPT-2-style aliases transformers maps onto them.
SIZE_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
)


def check_raw_sizes(raw: dict, file: Path) -> None:
    """Every size field present (and not null) in the JSON is a positive integer (2.5, "abc", 0, true are not)."""
    for key in SIZE_FIELDS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise LoadError(f"{file}: {key} must be a positive integer, got {value!r}")



def check_heads(config, raw: dict, file: Path) -> None:
    """Query heads split the width when the head width is derived from it (no head_dim in config.json, and
    the family's head_dim is hidden_size // num_attention_heads)."""
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if raw.get("head_dim") is not None or not all(isinstance(n, int) and n > 0 for n in (hidden, heads)):
        return
    if hidden % heads and getattr(config, "head_dim", None) == hidden // heads:
        raise LoadError(f"{file}: num_attention_heads ({heads}) does not divide hidden_size ({hidden})")
