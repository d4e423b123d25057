"""Which config.json fields a GGUF file holds, and whether the model read back from one is the source's.

A GGUF export writes the hyperparameters llama.cpp reads (`HELD`); transformers' GGUF loader builds every other
field from its config class's defaults. A source field that is neither held nor at that default (a Llama with
`hidden_act = "gelu"`) would come back changed, and the file would compute another model: it is refused by name
before the export, and the model read back is compared with the source field by field as well. Fields that do
not change what a model computes from its inputs (`BOOKKEEPING`) are not compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from quantdiff.core.errors import ConfigError, LoadError

# What gguf_export writes into the header (`<arch>.*` keys, the tensor layout for tied embeddings, and the biases
# it checks); rope_parameters is compared as the plain RoPE with its theta, the one kind the file holds.
HELD = frozenset({
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
})
# Names, token ids (the tokenizer's), dtypes (a GGUF file is read back in float32: docs/reliability.md), training
# settings and output switches: none changes the logits of a model in evaluation.
BOOKKEEPING = frozenset({
    "_name_or_path", "_model_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "attention_dropout", "id2label",
    "label2id", "output_attentions", "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "tokenizer_class", "quantization_config", "auto_map", "generation_config",
    "max_window_layers",  # Qwen: read only to build layer_types, which is compared
})
# Special-token ids under any name (`unk_token_id`, `sep_token_id`, …) are the tokenizer's too: SmolLM2's config
# has unk_token_id = 0 where a config built from the file has None, and neither changes a logit.
TOKEN_ID_SUFFIX = "_token_id"


def _bookkeeping(key: str) -> bool:
    return key in BOOKKEEPING or key.endswith(TOKEN_ID_SUFFIX)


def _same(source: Any, other: Any) -> bool:
    """Equal values; floats as the file stores them (float32)."""
    if isinstance(source, float) and isinstance(other, (float, int)) and not isinstance(other, bool):
        return bool(np.float32(source) == np.float32(other))
    if isinstance(source, dict) and isinstance(other, dict):
        return source.keys() == other.keys() and all(_same(source[k], other[k]) for k in source)
    if isinstance(source, (list, tuple)) and isinstance(other, (list, tuple)):
        return len(source) == len(other) and all(_same(a, b) for a, b in zip(source, other))
    return source == other


def differences(source: dict, other: dict) -> list[tuple[str, Any, Any]]:
    """(field, source's value, other's value) for every computed field of `source` that `other` gives otherwise."""
    return [(key, value, other.get(key)) for key, value in sorted(source.items())
            if not _bookkeeping(key) and not _same(value, other.get(key))]


def _plain_rope(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    return {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}


def as_held(config: dict) -> dict:
    """The config transformers reads back from a GGUF export of `config`: its class built from the held fields
    (and a plain RoPE of its theta) of `config` alone, so fields derived from them (Qwen's `layer_types`) follow."""
    from transformers import AutoConfig

    held = {key: config[key] for key in HELD if key in config}
    return AutoConfig.for_model(config["model_type"], **held, rope_parameters=_plain_rope(config)).to_dict()


def _shown(differing: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{key}={value!r} (read back as {got!r})" for key, value, got in differing)


def check_held(config: Any, source: Path, architecture: str) -> None:
    """ConfigError naming every field of the source's config (a transformers config) that a GGUF file cannot hold."""
    full = config.to_dict()
    differing = differences(full, as_held(full))
    if differing:
        raise ConfigError(f"--format gguf cannot hold {_shown(differing)} of {source}: llama.cpp's {architecture} graph has no such setting")


def check_reloaded(config: Any, reloaded: Any, out: Path) -> None:
    """LoadError when the model read back from the file has another config than the source's, field by field."""
    differing = differences(config.to_dict(), reloaded.to_dict())
    if differing:
        raise LoadError(f"export check failed: {out} reads back with another config: {_shown(differing)}; nothing was written")
