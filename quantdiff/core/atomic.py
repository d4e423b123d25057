"""Atomic file writes: readers see the old file or the complete new one, never a half-written one."""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from quantdiff.core.errors import ConfigError


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix); on success it replaces `path`, on failure it vanishes."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"output path is a directory: {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.tmp-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: JSON has no NaN or Infinity (counts say how many)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str | Path, doc: Any, indent: int | None = 1) -> None:
    """Write `doc` as strict JSON (non-finite floats become null), atomically."""
    text = json.dumps(json_safe(doc), indent=indent, allow_nan=False, ensure_ascii=False)
    with atomic_file(path) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
