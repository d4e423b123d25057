"""What counts as an integer argument, everywhere: any integral number (a Python int, a numpy integer scalar:
`numbers.Integral`), used as a Python int; never a bool, a float (even 8.0) or a string (text is parsed only
where text is what the caller gives: the CLI's options, `parse_bit_width`)."""

from __future__ import annotations

from numbers import Integral


def as_int(value: object) -> int | None:
    """`value` as a Python int when it is an integer by the module's rule, else None."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        return None
    return int(value)
