"""The type of every recipe value, list items included, checked against its dataclass field before any use:
`retrieval_contexts = ["a"]`, `sites = [["logits"]]` or `corpora = [1]` is one line naming the key and the
type it takes, never an error about something else later (a vocabulary size, a comparison of str and int)."""

from __future__ import annotations

import typing
from types import UnionType
from typing import Any

from quantdiff.core.errors import ConfigError

WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
PLURALS = {int: "integers", float: "numbers", bool: "true or false values", str: "strings"}


def _scalar_ok(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))  # TOML writes 1 for 1.0
    return isinstance(value, kind)


def _options(hint: Any) -> list:
    """The types a field's hint allows (`float | None` -> [float]; TOML has no null)."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        return [h for h in typing.get_args(hint) if h is not type(None)]
    return [hint]


def matches(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a field's type hint (int, float, bool, str, list[...] of them)."""
    for option in _options(hint):
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            if isinstance(value, list) and all(_scalar_ok(v, item) for v in value):
                return True
        elif isinstance(option, type) and _scalar_ok(value, option):
            return True
    return False


def describe(hint: Any) -> str:
    option = _options(hint)[0]
    if typing.get_origin(option) is list:
        return f"a list of {PLURALS.get(typing.get_args(option)[0], 'values')}"
    return WORDS.get(option, getattr(option, "__name__", str(option)))


def toml_text(value: Any) -> str:
    """A value as it reads in TOML (true, "text", [1, "a"]), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_text(v)}" for k, v in value.items()) + "}"
    return repr(value)


def check_types(cls: type, section: str, table: dict) -> None:
    """ConfigError naming the first key of `table` whose value does not fit `cls`'s field of that name."""
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        if key in hints and not matches(value, hints[key]):
            raise ConfigError(f"[{section}] {key} must be {describe(hints[key])}, got {toml_text(value)}")
