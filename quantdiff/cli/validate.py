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


def check_kv_mode(mode: str | None, sites: list[str], bits: list[int], granularity: str, group_size: int | None, kv_plan: list | None) -> None:
    """--kv-mode: a known layout, at site kv alone, and no other option saying otherwise (an engine's mode fixes its
    width and groups; every layout sets its own scales). Each contradiction is refused naming the mode."""
    if mode is None:
        return
    from quantdiff.quant.kv_engines import ENGINE_BITS, GROUPS
    from quantdiff.quant.kv_layout import LAYOUTS
    from quantdiff.quant.registry import check_name

    check_name(mode, tuple(LAYOUTS), "--kv-mode")
    if kv_plan:
        raise ConfigError(f"--kv-mode {mode} and --kv-plan both set the kv site's quantizer: give one")
    if sites != ["kv"]:
        raise ConfigError(f"--kv-mode {mode} sets how the kv site quantizes the cache: use it with --site kv, not {','.join(sites)}")
    if granularity != "row":
        raise ConfigError(f"--kv-mode {mode} sets its own scales: --granularity {granularity} contradicts it (leave it at row)")
    if mode in ENGINE_BITS:
        wrong = [b for b in bits if b != ENGINE_BITS[mode]]
        if wrong:
            raise ConfigError(f"--kv-mode {mode} stores {ENGINE_BITS[mode]}-bit codes: --bits {','.join(map(str, wrong))} contradicts it (give --bits {ENGINE_BITS[mode]})")
        if group_size is not None:
            fixed = "one scale per token and KV head" if GROUPS[mode] is None else f"blocks of {GROUPS[mode]} channels"
            raise ConfigError(f"--kv-mode {mode} fixes its groups ({fixed}): --group-size {group_size} contradicts it")
