"""Where quantdiff keeps what it derives once and reuses: corpora, data sets, dequantized models."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock

from quantdiff.core.errors import LoadError


def cache_dir() -> Path:
    """`$QUANTDIFF_CACHE`, else `$XDG_CACHE_HOME/quantdiff`, else `~/.cache/quantdiff` (the XDG base directories)."""
    if os.environ.get("QUANTDIFF_CACHE"):
        return Path(os.environ["QUANTDIFF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantdiff"


@contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Held while one process builds cache entry `entry`: a second process (a second test worker, a second
    command) waits, then finds the entry complete instead of building it again and replacing it under a reader.
    The lock file `.<entry>.lock` stays beside the entry (removing it would race with a waiter); the wait has no
    timeout, since a conversion can take minutes and a lock is released when its holder exits."""
    lock = FileLock(entry.with_name(f".{entry.name}.lock"))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise LoadError(f"cannot write the cache {entry.parent}: {exc.strerror or exc} (set QUANTDIFF_CACHE to another directory)") from None
    try:
        yield
    finally:
        lock.release()
