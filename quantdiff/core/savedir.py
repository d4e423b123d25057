"""Atomic writes of model directories: everything goes to a temporary sibling, renamed at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from transformers import PreTrainedModel

from quantdiff.core.errors import ConfigError


def check_target(out: Path, force: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory without --force."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output path exists and is not a directory: {out}")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"output directory {out} is not empty (use --force to replace it)")


@contextmanager
def atomic_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on failure it vanishes."""
    out = Path(out)
    check_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_pair(models: dict[str, PreTrainedModel], out: str | Path, force: bool = False) -> None:
    """Save {kind: model} as OUT/<kind>/ HF directories (safetensors), atomically as a whole."""
    with atomic_dir(out, force) as tmp:
        for kind, model in models.items():
            model.save_pretrained(tmp / kind, safe_serialization=True)
