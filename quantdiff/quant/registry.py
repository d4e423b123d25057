"""The quantization vocabulary, in one place: method, site, granularity and export-format names, and the
parsing of bit widths. The CLI, recipes, sweep planning and the JSON round trip of configs all check names
here, so a name means the same thing everywhere and an unknown one gets the same one-line ConfigError."""

from __future__ import annotations

from typing import Sequence

from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int
from quantdiff.quant.numerics import Granularity, PerColumn, PerRow, PerTensor, check_bits

METHOD_NAMES = ("absmax", "llm-int8")  # fake quantization inside the model (sites)
SITE_NAMES = ("logits", "qk", "linear", "kv")
ATTENTION_SITE_NAMES = ("logits", "qk", "kv")  # the sites inside attention, which an export can record
GRANULARITY_NAMES: dict[str, Granularity] = {"tensor": PerTensor(), "row": PerRow(), "column": PerColumn()}
# "row" is the default: one scale per token (per query row for logits, per token and KV head for kv), as inference
# engines scale, so a token's quantized prediction never depends on later tokens. "tensor" (one scale per sequence,
# the former default, kept to regenerate the published results) and "column" (per channel, over the sequence's
# tokens) are not causal.
DEFAULT_GRANULARITY = "row"
CAUSAL_GRANULARITIES = ("row",)
EXPORT_METHODS = ("absmax", "llm-int8", "nf4", "fp4")  # weight formats written by `quant.export`
EXPORT_FORMATS = ("quantdiff", "compressed-tensors", "gguf")  # containers: our model directory, compressed-tensors' one, a GGUF file


def check_name(name: object, known: Sequence[str], what: str) -> str:
    """`name` if it is one of `known`, else ConfigError "unknown <what> 'x' (choose from …)"."""
    if name not in known:
        raise ConfigError(f"unknown {what} {name!r} (choose from {', '.join(known)})")
    return name


def method_name(name: object) -> str:
    """A quantization method name; recipes (TOML) may write llm_int8 for llm-int8."""
    return check_name(name.replace("_", "-") if isinstance(name, str) else name, METHOD_NAMES, "quantization method")


def site_name(name: object) -> str:
    return check_name(name, SITE_NAMES, "quantization site")


def granularity(name: object) -> Granularity:
    return GRANULARITY_NAMES[check_name(name, tuple(GRANULARITY_NAMES), "granularity")]


def granularity_name(value: Granularity) -> str:
    return next(name for name, g in GRANULARITY_NAMES.items() if g == value)


def is_causal(value: Granularity) -> bool:
    """True when every token's scale comes from that token alone (no later token, no batch-mate changes it)."""
    return granularity_name(value) in CAUSAL_GRANULARITIES


def split_names(text: str, what: str) -> list[str]:
    """"a,b" -> ["a", "b"]; an empty list is a ConfigError."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"no {what} given")
    return names


def _integer(text: str, message: str) -> int:
    if not text.strip().lstrip("+-").isdigit():
        raise ConfigError(f"{message}, got {text!r}")
    return int(text)


def parse_bit_width(bits: int | str) -> int:
    """One bit width as given (any integer, `core.integers`, or its text); its range is checked by the method
    or format using it."""
    if isinstance(bits, str):
        return _integer(bits, "bits must be an integer")
    value = as_int(bits)
    if value is None:
        raise ConfigError(f"bits must be an integer, got {bits!r}")
    return value


def parse_bits(text: str) -> list[int]:
    """"16,8,6,4" -> [16, 8, 6, 4]; anything but integers from 2 to 16 is a ConfigError."""
    return [check_bits(_integer(part, "bits must be integers")) for part in split_names(text, "bits")]
