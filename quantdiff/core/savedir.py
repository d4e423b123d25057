"""Atomic writes of output directories: everything goes to a temporary sibling, renamed at the end.

Every directory written here carries a marker file (MARKER: its kind and quantdiff's version). `--force`
replaces only a marked directory or an empty one, and never a model being read (or a directory holding it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from transformers import PreTrainedModel

from quantdiff.core.atomic import default_mode, disk_full_as_error, remove_stale_temporaries, temporary_prefix
from quantdiff.core.errors import ConfigError

MARKER = ".quantdiff-output"


def mark(directory: Path, kind: str) -> None:
    """Claim `directory` as quantdiff's output of `kind` (export, pair, model, report, checkpoint)."""
    from quantdiff import __version__

    (directory / MARKER).write_text(json.dumps({"kind": kind, "quantdiff_version": __version__}) + "\n")


def is_marked(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_target(out: str | Path, force: bool, sources: Iterable[str | Path] = (), flag: str = "output directory") -> None:
    """Refuse a target that cannot be replaced: unnamed ('.', ''), a file, a non-empty directory without
    `force`, and even with it one quantdiff did not write, or one that is or holds a `sources` directory."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise ConfigError(f"{flag} must name the directory to write, not {str(out)!r} (an empty name is the current directory)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} exists and is not a directory: {out}")
    resolved = out.resolve()
    for source in sources:
        if _within(Path(source).resolve(), resolved):
            what = "is" if Path(source).resolve() == resolved else "contains"
            raise ConfigError(f"{flag} {out} {what} the input model {source}: refusing to replace it")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"{flag} {out} is not empty (use --force to replace it)")
        if not is_marked(out):
            raise ConfigError(f"{flag} {out} was not written by quantdiff (no {MARKER}): refusing to replace it, even with --force")


@contextmanager
def atomic_dir(out: str | Path, force: bool = False, kind: str = "output", sources: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield a temporary directory beside `out` (already marked as `kind`); on success it replaces `out`, on
    failure it vanishes. `sources`: directories being read, which `out` must neither be nor contain."""
    out = Path(out)
    check_target(out, force, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(out.name), dir=out.parent))
    try:
        with disk_full_as_error(out):
            os.chmod(tmp, default_mode(directory=True))
            mark(tmp, kind)
            yield tmp
            if out.exists():
                old = out.with_name(temporary_prefix(out.name, "old") + tmp.name.rsplit("-", 1)[-1])
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
    with atomic_dir(out, force, kind="pair") as tmp:
        for kind, model in models.items():
            model.save_pretrained(tmp / kind, safe_serialization=True)
            mark(tmp / kind, "model")
