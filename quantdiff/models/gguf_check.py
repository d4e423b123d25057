"""A GGUF file checked as transformers converts it: its header sizes before conversion, and every tensor it
holds read into the model.

transformers' GGUF loader would convert a file with 0 layers or 0 positions into a model that fails only later
(naming the cache's config.json, on every run), build a config whose heads do not divide the width (a raw
StrictDataclassClassValidationError), and silently drop a tensor it has no name for. Here each is one line
naming the GGUF file, before anything is cached.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from quantdiff.core.errors import LoadError

# Header sizes (under `<architecture>.`) that must be positive integers when present; transformers reads them
# into num_hidden_layers, max_position_embeddings, hidden_size, num_attention_heads, num_key_value_heads.
SIZE_KEYS = ("block_count", "context_length", "embedding_length", "attention.head_count", "attention.head_count_kv")
SHOWN = 3


def _positive_ints(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]  # some architectures give one count per layer
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def check_header_sizes(reader: Any, architecture: str, path: Path) -> None:
    """LoadError naming the GGUF file and the key of the first size that is not a positive integer, or heads
    that do not divide the width (with no explicit head width, `attention.key_length`, to say otherwise)."""
    values = {}
    for key in SIZE_KEYS:
        field = reader.get_field(f"{architecture}.{key}")
        if field is None:
            continue
        value = field.contents()
        if not _positive_ints(value):
            raise LoadError(f"GGUF file {path}: {architecture}.{key} must be a positive integer, got {value!r}")
        values[key] = value
    width, heads = values.get("embedding_length"), values.get("attention.head_count")
    explicit_head_width = reader.get_field(f"{architecture}.attention.key_length") is not None
    if isinstance(width, int) and isinstance(heads, int) and width % heads and not explicit_head_width:
        raise LoadError(f"GGUF file {path}: {architecture}.attention.head_count ({heads}) does not divide {architecture}.embedding_length ({width})")


@contextmanager
def dropped_tensors() -> Iterator[list[str]]:
    """Collect the GGUF tensors transformers' loader reads but has no model name for (it skips them silently)
    during the block. Its per-architecture tensor processors are wrapped, so every name they pass on is seen."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    dropped: list[str] = []

    def recording(cls: type) -> type:
        class Recording(cls):  # type: ignore[misc, valid-type]
            def process(self, weights, name, **kwargs):
                result = super().process(weights, name, **kwargs)
                if result.name is not None and result.name not in (kwargs.get("tensor_key_mapping") or {}):
                    dropped.append(name)
                return result

        return Recording

    processors, default = dict(gguf_utils.TENSOR_PROCESSORS), gguf_utils.TensorProcessor
    gguf_utils.TENSOR_PROCESSORS.update({arch: recording(cls) for arch, cls in processors.items()})
    gguf_utils.TensorProcessor = recording(default)
    try:
        yield dropped
    finally:
        gguf_utils.TENSOR_PROCESSORS.clear()
        gguf_utils.TENSOR_PROCESSORS.update(processors)
        gguf_utils.TensorProcessor = default


def refuse_dropped(dropped: list[str], path: Path, model_name: str) -> None:
    """A tensor the file holds but the model would not read is refused, as an unexpected safetensors tensor is."""
    if dropped:
        more = f" and {len(dropped) - SHOWN} more" if len(dropped) > SHOWN else ""
        raise LoadError(f"GGUF file {path} holds tensors {model_name} does not read: unexpected {', '.join(sorted(dropped)[:SHOWN])}{more}")
