"""Reading a JSON document that may be stored gzip-compressed.

Published per-seed and per-model documents are tracked as `<name>.json.gz` (about 10x smaller, so the tree fits a
device call's carry); readers still name `<name>.json`, and the compressed sibling is read when the plain file is
absent. A run's own outputs stay plain JSON: only publishing compresses them (`gzip -n`, so the bytes carry no
name or time and regenerate identically).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Callable

GZ_SUFFIX = ".gz"


def stored_path(path: Path) -> Path:
    """`path` itself when it exists, else its `.gz` sibling when that exists, else `path` (so the error names
    the document the caller asked for)."""
    compressed = path.with_name(path.name + GZ_SUFFIX)
    return compressed if not path.exists() and compressed.exists() else path


def document_exists(path: Path) -> bool:
    """Whether `path` or its compressed sibling is a file."""
    return stored_path(path).is_file()


def read_document(path: Path) -> Any:
    """The JSON value of `path`, or of `path.gz` when only the compressed sibling is stored."""
    stored = stored_path(path)
    if stored.name.endswith(GZ_SUFFIX) and stored != path:
        return json.loads(gzip.decompress(stored.read_bytes()).decode("utf-8"))
    return json.loads(stored.read_text(encoding="utf-8"))


def unique_keys(what: str) -> Callable[[list[tuple[str, Any]]], dict]:
    """A json `object_pairs_hook` that refuses an object giving one key twice (json keeps the last silently),
    with a ConfigError naming `what` ("kv plan", "precision plan") and the key."""
    from quantdiff.core.errors import ConfigError

    def hook(pairs: list[tuple[str, Any]]) -> dict:
        keys = [key for key, _ in pairs]
        repeated = next((key for index, key in enumerate(keys) if key in keys[:index]), None)
        if repeated is not None:
            raise ConfigError(f"{what}: the field {repeated!r} is given twice")
        return dict(pairs)

    return hook


def read_json_file(path: Path, flag: str, what: str, max_bytes: int, parse_int: Callable[[str], Any] | None = None) -> Any:
    """The JSON value of a file given to option `flag` (a plan): at most `max_bytes`, UTF-8, no object giving a key
    twice (`unique_keys(what)`); anything else one ConfigError line naming the option, the file and what is wrong.
    (The caller has checked it is a regular file: `data.sources.check_data_file`.)"""
    from quantdiff.core.errors import ConfigError

    try:
        if path.stat().st_size > max_bytes:
            raise ConfigError(f"{flag} {path} is larger than {max_bytes >> 20} MB: not a {what} file")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys(what), parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except (RecursionError, ValueError):  # nesting, or an integer of thousands of digits
        raise ConfigError(f"{flag} {path}: not a {what} file (JSON nested too deeply or a number too long)") from None
