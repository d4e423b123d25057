"""Atomic file writes: readers see the old file or the complete new one, never a half-written one.

Temporaries are hidden siblings named `.<target>.tmp-<pid>-<process start>-<random>`: a process killed before
its rename leaves one behind, and the next write into that directory removes every such temporary whose
process is gone (or whose pid now belongs to a process started at another time).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from quantdiff.core.errors import ConfigError, DiskFullError, QuantdiffError

# `.<name>.tmp-<pid>-<start>-<random>` (a file or directory being written) or `.<name>.old-<pid>-<start>-…`
# (a replaced directory about to be deleted).
_TEMPORARY = re.compile(r"^\..+\.(?:tmp|old)-(?P<pid>\d+)-(?P<start>\d+)-")


def _start_time(pid: int) -> int | None:
    """The process' start time in clock ticks since boot (Linux), 0 where /proc is absent, None if no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if not Path("/proc/self/stat").exists():  # no /proc (macOS): fall back to the pid alone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return 0
        return None
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[19])  # field 22; the command name before ")" may hold spaces


def temporary_prefix(name: str, role: str = "tmp") -> str:
    """Hidden prefix of a temporary for target `name` ("tmp": being written, "old": being replaced), identifying
    this process across pid reuse."""
    return f".{name}.{role}-{os.getpid()}-{_start_time(os.getpid()) or 0}-"


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete temporaries in `directory` left by quantdiff processes that no longer run; returns what went."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None or _start_time(int(match["pid"])) in (int(match["start"]), 0):
            continue  # not ours, or its writer is still running
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode a plain open()/mkdir() would give under the current umask (mkstemp/mkdtemp use 0600/0700)."""
    return (0o777 if directory else 0o666) & ~_umask()


def writable_target(path: str | Path) -> Path:
    """The regular file a write to `path` should replace: a symlink's final target; devices, FIFOs, sockets
    and directories are refused (renaming over them would destroy them, not write to them)."""
    path = Path(path)
    real = Path(os.path.realpath(path)) if path.is_symlink() else path
    if real.is_dir():
        raise ConfigError(f"output path is a directory: {path}")
    if real.exists() and not stat.S_ISREG(real.stat().st_mode):
        raise ConfigError(f"output path is not a regular file (a device, FIFO or socket): {path}")
    return real


def is_disk_full(exc: BaseException) -> bool:
    """OSError ENOSPC/EDQUOT, or a library's wrapped one (safetensors reports 'StorageFull' in its text)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text


@contextmanager
def disk_full_as_error(target: Path) -> Iterator[None]:
    """Turn a full file system while writing `target` into one DiskFullError line."""
    try:
        yield
    except QuantdiffError:
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise DiskFullError(f"no space left on device while writing {target} (nothing was written)") from None
        raise


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix); on success it replaces `path`, on failure it vanishes.

    A symlink is written through (its target is replaced, the link stays); the new file keeps the old one's
    mode, or gets the umask's default.
    """
    path = writable_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else default_mode()
    fd, name = tempfile.mkstemp(prefix=temporary_prefix(path.stem), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with disk_full_as_error(path):
            yield tmp
            os.chmod(tmp, mode)
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


def json_text(doc: Any, indent: int | None = 1, **dumps: Any) -> str:
    """`doc` as strict JSON text (non-finite floats become null)."""
    return json.dumps(json_safe(doc), indent=indent, allow_nan=False, ensure_ascii=False, **dumps) + "\n"


def write_json(path: str | Path, doc: Any, indent: int | None = 1, **dumps: Any) -> None:
    """Write `doc` as strict JSON (non-finite floats become null), atomically."""
    text = json_text(doc, indent, **dumps)
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
