"""Atomic writes of output directories: everything goes to a temporary sibling, renamed at the end.

Every directory written here carries a marker file (MARKER: its kind, quantdiff's version and every entry
quantdiff wrote in it). A non-empty directory is replaced only with `--force`, only if it carries the marker of
the same kind (an export replaces an export, never a model, pair or report), only if it holds nothing but the
entries its marker lists (a file the user added is refused by name, never deleted), and never if it is or holds
a model being read. `--out` given as a
symlink replaces the directory it points to; the link stays. The check runs again at the rename: a directory
that appeared meanwhile, or changed into something that may not be replaced, is left alone and the finished
output stays under its temporary name, which the error names.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from transformers import PreTrainedModel

from quantdiff.core.atomic import (
    KeptOutput,
    check_name_length,
    check_path_names,
    default_mode,
    write_errors_as_error,
    followed,
    keep_temporary,
    refuse_keeping,
    remove_stale_temporaries,
    signals_deferred,
    temporary_path,
)
from quantdiff.core.errors import ConfigError
from quantdiff.core.manifest import MANIFEST, recorded_files
from quantdiff.core.outputs import check_outputs
from quantdiff.core.owned import MARKER


def entries(directory: Path) -> list[str]:
    """Every file, directory and link under `directory` (links not followed) but its own marker, relative."""
    found = []
    for parent, dirs, files in os.walk(directory):
        found += [Path(parent, name).relative_to(directory).as_posix() for name in dirs + files]
    return sorted(name for name in found if name != MARKER)


def mark(directory: Path, kind: str) -> None:
    """Claim `directory` as quantdiff's output of `kind` (export, pair, model, report, checkpoint), listing every
    entry now in it as written by quantdiff (so mark it once it is complete)."""
    from quantdiff import __version__

    doc = {"kind": kind, "quantdiff_version": __version__, "written": entries(directory)}
    (directory / MARKER).write_text(json.dumps(doc) + "\n")


def written_entries(directory: Path) -> set[str] | None:
    """What quantdiff wrote in `directory`: the entries its marker lists; for a directory marked before markers
    listed them, the files of its manifest (trained arms, GGUF cache entries); None when neither says."""
    try:
        listed = json.loads((directory / MARKER).read_text(encoding="utf-8")).get("written")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(listed, list) and all(isinstance(name, str) for name in listed):
        return set(listed)
    try:
        return set(recorded_files(directory)) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def foreign_entry(directory: Path) -> str | None:
    """The first entry in `directory` that quantdiff did not write there (relative), "" when it cannot tell
    (no list of what it wrote), None when everything there is quantdiff's."""
    written = written_entries(directory)
    if written is None:
        return ""
    parents = {parent.as_posix() for name in written for parent in Path(name).parents}
    return next((name for name in entries(directory) if name not in written and name not in parents), None)


def marked_kind(directory: Path) -> str | None:
    """The kind recorded in `directory`'s marker; None without a (readable) marker."""
    try:
        kind = json.loads((directory / MARKER).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def real_target(out: str | Path) -> Path:
    """The directory a write to `out` replaces: a symlink's final target (the link itself stays; a loop is refused)."""
    return followed(out)


def check_target(
    out: str | Path, force: bool, sources: Iterable[str | Path] = (), flag: str = "output directory", kind: str = "output", per_file: bool = True
) -> None:
    """Refuse a target that cannot be replaced: unnamed ('.', ''), a file, a non-empty directory without
    `force`, and even with it one not marked as quantdiff's output of `kind`, one holding an entry quantdiff did
    not write there (unless not `per_file`: a cache entry is the cache's as a whole), or one that is, holds or
    lies in a `sources` directory."""
    named = Path(out)
    if named.name in ("", ".", ".."):
        raise ConfigError(f"{flag} must name the directory to write, not {str(named)!r} (an empty name is the current directory)")
    check_path_names(named, flag, utf8=True)  # before the file system or safetensors is asked, after the work
    out = real_target(named)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} exists and is not a directory: {named}")
    check_name_length(out.name, f"{flag} name")
    check_outputs({flag: named}, sources, replaced=True)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"{flag} {named} is not empty (use --force to replace it)")
        found = marked_kind(out)
        if found is None and (out / MARKER).exists():  # a truncated or edited marker is not "no marker"
            raise ConfigError(f"{flag} {named} has a damaged {MARKER} (not the JSON quantdiff writes): refusing to replace it, even with --force "
                              "(remove it yourself)")
        if found is None:
            raise ConfigError(f"{flag} {named} was not written by quantdiff (no {MARKER}): refusing to replace it, even with --force")
        if found != kind:
            article = "an" if kind[:1] in "aeiou" else "a"
            raise ConfigError(f"{flag} {named} holds a quantdiff {found}, not {article} {kind}: refusing to replace it, even with --force")
        if per_file:
            check_only_written(out, flag, named)


def check_only_written(directory: Path, flag: str, named: Path) -> None:
    """ConfigError naming the first entry of `directory` (given as `named`) quantdiff did not write: --force
    replaces nothing else."""
    foreign = foreign_entry(directory)
    if foreign == "":
        raise ConfigError(f"{flag} {named} has no list of the files quantdiff wrote in it (an older quantdiff's {MARKER}): "
                          "refusing to replace it, even with --force (remove it yourself)")
    if foreign is not None:
        raise ConfigError(f"{flag} {named} holds {named / foreign}, which quantdiff did not write: refusing to replace it, even with --force "
                          "(move it away first)")


def _follow_umask(root: Path) -> None:
    """Libraries create some files 0600 (mkstemp); give every entry the mode a plain open() or mkdir() would."""
    for path in (root, *root.rglob("*")):
        if not path.is_symlink():
            os.chmod(path, default_mode(directory=path.is_dir()))


@contextmanager
def atomic_dir(
    out: str | Path, force: bool = False, kind: str = "output", sources: Iterable[str | Path] = (), flag: str = "output directory",
    per_file: bool = True,
) -> Iterator[Path]:
    """Yield a temporary directory beside `out` (already marked as `kind`, and marked again with everything in
    it once the block ends); on success it replaces `out`, on failure it vanishes. `sources`: directories being
    read, which `out` must neither be, hold nor lie in. `per_file`: see `check_target`."""
    sources = list(sources)
    check_target(out, force, sources, flag, kind, per_file)
    out = real_target(out)
    with write_errors_as_error(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries()
    tmp = temporary_path(out)
    tmp.mkdir(mode=0o700)
    kept = False
    try:
        with write_errors_as_error(out):
            mark(tmp, kind)
            yield tmp
            mark(tmp, kind)
            _follow_umask(tmp)
            with signals_deferred():  # an interrupt between the two renames would leave neither output
                _install(tmp, out, force, kind, sources, flag, per_file)
    except KeptOutput:
        kept = True
        raise
    finally:
        if not kept and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out: Path, force: bool, kind: str, sources: list, flag: str, per_file: bool) -> None:
    """Put the finished `tmp` in place of `out`, checking `out` again now: what may not be replaced is left
    alone (and `tmp` kept). Onto nothing or an empty directory, one rename, which the kernel refuses if a
    non-empty directory or a file appeared; a marked directory of our kind is moved aside first and checked as
    moved (what the check saw may have been swapped), then deleted."""
    try:
        check_target(out, force, sources, flag, kind, per_file)
    except ConfigError as exc:
        refuse_keeping(tmp, str(exc))
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = temporary_path(out, "old")
        out.rename(old)
        if marked_kind(old) != kind or (per_file and foreign_entry(old) is not None):  # not what was checked: put it back untouched
            old.rename(out)
            refuse_keeping(tmp, f"{flag} {out} changed while quantdiff was writing it: refusing to replace it")
    try:
        tmp.rename(out)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        if old is not None:
            keep_temporary(old)
        refuse_keeping(tmp, f"{flag} {out} appeared while quantdiff was writing it: refusing to replace it"
                       + (f" (the output it replaced is kept as {old})" if old is not None else ""))
    if old is not None:
        shutil.rmtree(old)


def save_pair(models: dict[str, PreTrainedModel], out: str | Path, force: bool = False, tokenizer=None) -> None:
    """Save {kind: model} as OUT/<kind>/ HF directories (safetensors, and `tokenizer` beside each model when
    given), atomically as a whole."""
    with atomic_dir(out, force, kind="pair") as tmp:
        for kind, model in models.items():
            model.save_pretrained(tmp / kind, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / kind))
            mark(tmp / kind, "model")  # its own list: the model directory is quantdiff's file by file too
