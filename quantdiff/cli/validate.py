"""Option checks shared by the commands, run before any work: a value the chosen mode would ignore is an error."""

from __future__ import annotations

import math

from quantdiff.core.errors import ConfigError


def check_list(text: str, flag: str) -> str:
    """A comma-separated option without empty or repeated items (`--bits 16,8,,4`); returns `text`."""
    items = [part.strip() for part in text.split(",")]
    if any(not item for item in items):
        raise ConfigError(f"{flag} has an empty item: {text!r}")
    repeated = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if repeated is not None:
        raise ConfigError(f"{flag} names {repeated!r} twice: {text!r}")
    return text


def check_positive(**values: int | float | None) -> None:
    """Each given (not None) size must be > 0; keyword names are flags with '_' for '-'."""
    for name, value in values.items():
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


def refuse_unused(reason: str, **given: object) -> None:
    """Options given (not None / not False) that do nothing here: an error naming them and why."""
    unused = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None and value is not False]
    if unused:
        raise ConfigError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing {reason}")


def check_group_option(group_size: int | None, sites: list[str]) -> None:
    """--group-size: a positive integer, and only where the linear site's weights or the kv site's rows are quantized."""
    check_positive(group_size=group_size)
    if group_size is not None and sites not in (["linear"], ["kv"]):
        raise ConfigError(f"--group-size sets the linear site's weight groups or the kv site's row groups: use it with --site linear or --site kv, not {','.join(sites)}")
