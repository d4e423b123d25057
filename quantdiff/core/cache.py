"""Where quantdiff keeps what it derives once and reuses: corpora, data sets, dequantized models."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock


def cache_dir() -> Path:
    """`$QUANTDIFF_CACHE`, else `$XDG_CACHE_HOME/quantdiff`, else `~/.cache/quantdiff` (the XDG base directories)."""
    if os.environ.get("QUANTDIFF_CACHE"):
        return Path(os.environ["QUANTDIFF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantdiff"


@contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Held while one process builds cache entry `entry`: a second process (a second test worker, a second
    command) waits, then finds the entry complete instead of building it again and replacing it under a reader.
    The lock files live in the cache's own `locks/` folder, named by the entry's path, never beside the entry (a
    folder of entries holds entries only); they stay (removing one would race with a waiter). The wait has no
    timeout, since a conversion can take minutes and a lock is released when its holder exits. An unwritable cache
    raises OSError, which the caller words as its cache's problem."""
    name = hashlib.sha256(str(entry.absolute()).encode()).hexdigest()[:32]
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(locks / f"{name}.lock"):
        yield
