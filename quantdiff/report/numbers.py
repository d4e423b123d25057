"""How numbers are written in every table quantdiff prints or writes (rich tables, report.md)."""

from __future__ import annotations

MISSING = "–"
LARGE = 1000.0  # from here on, one decimal says enough


def number(x: float | int | None, decimals: int | None = None) -> str:
    """None: "–"; an int as written; a float below LARGE in magnitude with 4 significant digits (or `decimals`
    fixed decimals, for metric columns that should line up), larger ones with one decimal."""
    if x is None:
        return MISSING
    if isinstance(x, int):
        return str(x)
    if abs(x) >= LARGE:
        return f"{x:.1f}"
    return f"{x:.4g}" if decimals is None else f"{x:.{decimals}f}"


def ratio(a: float | None, b: float | None) -> str:
    """a ÷ b as "1.23×"; "–" when either is missing or b is 0."""
    return MISSING if a is None or not b else f"{a / b:.2f}×"
