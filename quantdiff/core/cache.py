"""Where quantdiff keeps what it derives once and reuses: corpora, data sets, dequantized models."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$QUANTDIFF_CACHE`, else `~/.cache/quantdiff`."""
    return Path(os.environ.get("QUANTDIFF_CACHE") or Path.home() / ".cache" / "quantdiff")
