"""A model directory's tokenizer as llama.cpp's `tokenizer.ggml.*` fields, for the one kind mapped here: a GPT-2
style byte-level BPE (`tokenizer.json` model BPE, pre-tokenizer ByteLevel with GPT-2's split regex and no prefix
space, no normalizer), which llama.cpp runs as model `gpt2` with pre-tokenizer `gpt-2` — the same split regex.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.core.errors import ConfigError

# llama.cpp's token types (gguf.TokenType): what its tokenizer does with each token.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def check_bpe_tokenizer(source: Path) -> dict:
    """`source`'s tokenizer.json if a GGUF file can hold it (checked before the model is loaded), else one
    ConfigError line saying why not."""
    spec = _tokenizer_json(source)
    pre = spec.get("pre_tokenizer") or {}
    if spec["model"].get("type") != "BPE" or spec.get("normalizer") or any(pre.get(k) != v for k, v in _GPT2_PRE.items()):
        raise ConfigError(f"--format gguf maps a GPT-2 style byte-level BPE tokenizer to llama.cpp; the one of {source} is not one")
    if not spec["model"].get("merges"):  # transformers' GGUF reader then looks for unigram scores, and fails
        raise ConfigError(
            f"--format gguf: the tokenizer of {source} is byte-level BPE without merges (as `quantdiff pair` writes), "
            "which transformers cannot read back from a GGUF file; use --format quantdiff or compressed-tensors"
        )
    return spec


def add_bpe_tokenizer(writer, source: Path, vocab_size: int) -> None:
    """Write `source`'s tokenizer into GGUF `writer`; ConfigError naming what does not map."""
    spec = check_bpe_tokenizer(source)
    tokens, types = _vocabulary(spec, vocab_size, source)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {token: i for i, token in enumerate(tokens)}
    settings = _json(source / "tokenizer_config.json")
    for role, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id), ("unk_token", writer.add_unk_token_id)):
        token = settings.get(role)
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            add(ids[token])
    writer.add_add_bos_token(_adds_bos(source, settings, ids))


def _tokenizer_json(source: Path) -> dict:
    spec = _json(source / "tokenizer.json")
    if not isinstance(spec.get("model"), dict):
        raise ConfigError(f"--format gguf needs {source / 'tokenizer.json'} (a fast tokenizer's file) to write the vocabulary")
    return spec


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _vocabulary(spec: dict, vocab_size: int, source: Path) -> tuple[list[str], list[int]]:
    """Tokens by id, padded to the embedding's rows with unused `[PAD<i>]` entries, as llama.cpp pads them."""
    by_id: dict[int, tuple[str, int]] = {i: (token, NORMAL) for token, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    if by_id and max(by_id) >= vocab_size:
        raise ConfigError(f"the tokenizer of {source} has ids up to {max(by_id)}, past the model's {vocab_size} embeddings")
    entries = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(vocab_size)]
    return [token for token, _ in entries], [kind for _, kind in entries]


def _adds_bos(source: Path, settings: dict, ids: dict[str, int]) -> bool:
    """Whether the tokenizer itself puts BOS first, which llama.cpp must then do too."""
    from tokenizers import Tokenizer

    bos = settings.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if bos not in ids:
        return False
    encoded = Tokenizer.from_file(str(source / "tokenizer.json")).encode("a").ids
    return bool(encoded) and encoded[0] == ids[bos]
