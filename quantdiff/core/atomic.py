"""Atomic file writes: readers see the old file or the complete new one, never a half-written one.

Temporaries are hidden siblings named `.<target>.tmp-<16 hex digits>` (or `.old-…` for a directory being
replaced). Before creating one, the process records its path in a registry file of its own (under
$XDG_STATE_HOME/quantdiff/temporaries, named by pid and start time). A process killed before its rename leaves
the temporary behind; the next write removes the recorded paths of processes that no longer run, and nothing
else: a file that merely looks like a temporary is never touched, and a recorded path is removed only if its
name has exactly that pattern and its directory is reached without a symlink (a registry file listing other
paths deletes nothing).

What a write replaces is checked again at the moment of the rename: something that appeared meanwhile and may
not be replaced is left alone, and the new output stays under its temporary name, which the error names.
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from quantdiff.core.errors import ConfigError, DiskFullError, QuantdiffError
from quantdiff.core.owned import check_replaceable

RANDOM_DIGITS = 16  # hex digits of a temporary's random part
# `.<target>.<role>-<random>[<suffix>]`: the only names the clean-up of a dead process' registry deletes.
TEMPORARY_NAME = re.compile(rf"^\..+\.(tmp|old)-[0-9a-f]{{{RANDOM_DIGITS}}}(\.[^./]+)?$")
MAX_NAME_BYTES = 255  # the longest file name Linux, macOS and Windows file systems take
TEMPORARY_EXTRA_BYTES = len("..tmp-") + RANDOM_DIGITS  # what a temporary name adds to its target's name
STDOUT = "-"  # a --json path meaning standard output (the convention)


class KeptOutput(ConfigError):
    """Raised when a finished output was kept under its temporary name instead of replacing what appeared."""

    def __init__(self, message: str, kept: Path) -> None:
        super().__init__(message)
        self.kept = kept


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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _registry_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "quantdiff" / "temporaries"


def _identity() -> dict:
    """Who is writing: enough to tell later, on this host, whether that process still runs."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "start": _start_time(pid) or 0}


def _register(path: Path) -> None:
    """Append `path` to this process' registry (created on first use); a registry that cannot be written only
    means the temporary is not cleaned up after a crash."""
    me = _identity()
    registry = _registry_file()
    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        with open(registry, "a", encoding="utf-8") as f:
            if f.tell() == 0:
                f.write(json.dumps(me) + "\n")
                atexit.register(_forget_if_clean, registry)
            f.write(json.dumps(str(path.absolute())) + "\n")
            f.flush()
            os.fsync(f.fileno())  # recorded before the temporary exists, even if killed right after
    except OSError:
        pass


def _registry_file() -> Path:
    me = _identity()
    return _registry_dir() / f"{me['pid']}-{me['start']}.paths"


def _recorded(registry: Path) -> list[Path]:
    lines = registry.read_text(encoding="utf-8").splitlines()
    return [Path(json.loads(line)) for line in lines[1:] if line.strip()]


def keep_temporary(path: Path) -> None:
    """Drop `path` from this process' registry: a temporary kept on purpose (an output that could not be put in
    place) is never cleaned up as stale. Only this process writes its registry, so a rewrite is safe."""
    registry = _registry_file()
    try:
        lines = registry.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [lines[0]] + [line for line in lines[1:] if line.strip() and Path(json.loads(line)) != path.absolute()]
        fresh = registry.with_name(registry.name + ".new")
        fresh.write_text("".join(kept), encoding="utf-8")
        os.replace(fresh, registry)
    except (OSError, ValueError, IndexError):
        pass


def _forget_if_clean(registry: Path) -> None:
    """At exit: drop this process' registry when none of its temporaries is left (the usual case)."""
    try:
        if not any(path.exists() or path.is_symlink() for path in _recorded(registry)):
            registry.unlink()
    except (OSError, ValueError):
        pass


def temporary_path(target: str | Path, role: str = "tmp", suffix: str = "") -> Path:
    """A fresh hidden name beside `target` (`.<name>.<role>-<random><suffix>`), recorded before it is created;
    role "tmp": being written, "old": a replaced directory about to be deleted."""
    target = Path(target)
    path = target.with_name(f".{target.name}.{role}-{secrets.token_hex(RANDOM_DIGITS // 2)}{suffix}")
    _register(path)
    return path


def check_name_length(name: str, what: str) -> None:
    """Refuse a file or directory name that is too long once written through its temporary (255 bytes in all):
    the write would fail with 'File name too long' after the work is done."""
    size = len(os.fsencode(name))
    if size + TEMPORARY_EXTRA_BYTES > MAX_NAME_BYTES:
        raise ConfigError(
            f"{what} '{_abbreviated(shown(name))}' is {size} bytes long: names may have at most {MAX_NAME_BYTES - TEMPORARY_EXTRA_BYTES} "
            f"(quantdiff writes through a temporary name {TEMPORARY_EXTRA_BYTES} bytes longer)"
        )


def _abbreviated(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def shown(path: str | Path) -> str:
    """`path` as an error line prints it: bytes that are not UTF-8 as `\\xff` escapes (the terminal's own
    encoding would print them as replacement characters, or fail)."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def check_path_names(path: str | Path, what: str, utf8: bool = False) -> None:
    """Refuse, before any work, an output path the file system or a writer would refuse only once the work is
    done: a last name too long for its temporary (`check_name_length`), a directory name on the way longer than
    a name may be (mkdir says 'File name too long', after creating the directories before it), and with
    `utf8` a path that is not UTF-8 (safetensors takes UTF-8 paths only; GGUF and JSON writers take any bytes)."""
    path = Path(path)
    check_name_length(path.name, f"{what} name")
    for part in path.parent.parts:
        if len(os.fsencode(part)) > MAX_NAME_BYTES:
            raise ConfigError(f"{what} '{_abbreviated(shown(path))}' passes through a directory name {len(os.fsencode(part))} bytes "
                              f"long ('{_abbreviated(shown(part))}'): names may have at most {MAX_NAME_BYTES}")
    if utf8:
        try:
            os.fsencode(str(path)).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{what} {shown(path)} is not valid UTF-8: safetensors, which writes the weights there, "
                              "takes UTF-8 paths only (rename it)") from None


def is_temporary_name(path: Path) -> bool:
    """Whether a recorded path may be deleted: absolute, without '..', named exactly like quantdiff's
    temporaries, in a directory reached without following a symlink (a link could lead anywhere)."""
    if not path.is_absolute() or ".." in path.parts or not TEMPORARY_NAME.match(path.name):
        return False
    return os.path.realpath(path.parent) == str(path.parent)


def _gone(writer: dict) -> bool:
    """Whether the process that wrote a registry has ended (a writer on another host is never presumed gone)."""
    me = _identity()
    if writer.get("host") != me["host"]:
        return False
    if writer.get("boot") != me["boot"]:
        return True
    return _start_time(int(writer["pid"])) not in (int(writer["start"]), 0)


def remove_stale_temporaries() -> list[Path]:
    """Delete the recorded temporaries of quantdiff processes that no longer run; returns what went."""
    removed: list[Path] = []
    try:
        registries = sorted(_registry_dir().glob("*.paths"))
    except OSError:
        return removed
    for registry in registries:
        try:
            with open(registry, encoding="utf-8") as f:
                writer = json.loads(f.readline())
            if not _gone(writer):
                continue
            paths = _recorded(registry)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue  # being written right now, or not ours to judge
        for path in paths:
            if is_temporary_name(path) and _remove(path):
                removed.append(path)
        registry.unlink(missing_ok=True)
    return removed


def _remove(path: Path) -> bool:
    """Delete one recorded temporary (a symlink is removed, never followed); False if it is already gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError:
        return False
    return True


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode a plain open()/mkdir() would give under the current umask (mkstemp/mkdtemp use 0600/0700)."""
    return (0o777 if directory else 0o666) & ~_umask()


def followed(path: str | Path) -> Path:
    """A symlink's final target (a dangling link: where it leads, which a write creates when that directory
    exists, and only then); a symlink loop leads
    nowhere and is refused (replacing it would destroy the link instead of writing anywhere)."""
    path = Path(path)
    if not path.is_symlink():
        return path
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        target = Path(os.path.realpath(path))
        if not target.parent.is_dir():  # as the shell's `>` does: a link may name a new file, never new directories
            raise ConfigError(f"output path {path} is a dangling symlink to {target}, whose directory does not exist: "
                              "refusing to create directories through a link") from None
        return target
    except OSError:
        raise ConfigError(f"output path {path} is a symlink loop (it leads to no file): refusing to write there") from None


def writable_target(path: str | Path, force: bool | None = None, flag: str = "output") -> Path:
    """The regular file a write to `path` should replace: a symlink's final target; devices, FIFOs, sockets,
    directories and symlink loops are refused (renaming over them would destroy them, not write to them), and
    so is a name too long to write through a temporary. With `force` given: an existing file quantdiff did not
    write is refused unless `force` is true (`core.owned`)."""
    path = Path(path)
    check_path_names(path, f"{flag} file")  # before the file system is asked (it would say 'File name too long')
    real = followed(path)
    if real.is_dir():
        raise ConfigError(f"output path is a directory: {path}")
    if real.exists() and not stat.S_ISREG(real.stat().st_mode):
        raise ConfigError(f"output path is not a regular file (a device, FIFO or socket): {path}")
    check_name_length(real.name, f"{flag} file name")
    creatable_parent(real, path)
    if force is not None:
        check_replaceable(real, force, flag)
    return real


def creatable_parent(path: Path, named: str | Path | None = None) -> None:
    """Refuse `path` whose nearest existing ancestor is not a directory (`words.txt/x.json`): mkdir would say
    only 'File exists'."""
    parent = next((p for p in Path(path).absolute().parents if p.exists() or p.is_symlink()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"cannot create {named or path}: {parent} is not a directory")


# What only a write can fail with: a full disk or quota, the file-size limit (`ulimit -f`), a read-only mount.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# What a file system says of a name it will not hold, past the checks at the door (`check_path_names`): a path
# longer than PATH_MAX once the files inside an output directory are added (ENAMETOOLONG), a character the file
# system forbids (EINVAL: ':' or '?' on FAT and SMB mounts), bytes it cannot encode (EILSEQ: NFS, ZFS utf8only).
NAME_ERRNOS = (errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ)


def write_errno(exc: BaseException) -> int | None:
    """The errno of a failed write: an OSError's own, or the one a library wraps in its text (safetensors says
    'I/O error: File too large (os error 27)'), when it is one of WRITE_ERRNOS or NAME_ERRNOS; None for anything
    else."""
    if isinstance(exc, OSError):
        code = exc.errno
    else:
        text = str(exc)
        found = re.search(r"\(os error (\d+)\)", text)
        code = int(found.group(1)) if found else errno.ENOSPC if "No space left on device" in text or "Disk quota exceeded" in text else None
    return code if code in WRITE_ERRNOS + NAME_ERRNOS else None


@contextmanager
def write_errors_as_error(target: Path) -> Iterator[None]:
    """Turn a failed write of `target` (full disk, file-size limit, read-only file system, a name the file system
    refuses) into one line naming it."""
    try:
        yield
    except QuantdiffError:
        raise
    except Exception as exc:
        code = write_errno(exc)
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"no space left on device while writing {shown(target)} (nothing was written)") from None
        if code in NAME_ERRNOS:
            raise ConfigError(f"cannot write {shown(target)}: {os.strerror(code)}, a name the file system refuses (nothing was written)") from None
        if code is not None:
            raise DiskFullError(f"cannot write {shown(target)}: {os.strerror(code)} (nothing was written)") from None
        raise


@contextmanager
def atomic_file(path: str | Path, force: bool = False, flag: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix); on success it replaces `path`, on failure it vanishes.

    A symlink is written through (its target is replaced, the link stays); the new file keeps the old one's
    mode, or gets the umask's default. An existing file is replaced only if quantdiff wrote it, or with
    `force` — checked before and again at the rename (`install_file`).
    """
    path = writable_target(path, force, flag)
    with write_errors_as_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries()
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else default_mode()
    tmp = temporary_path(path.with_name(path.stem), suffix=path.suffix)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    kept = False
    try:
        with write_errors_as_error(path):
            yield tmp
            os.chmod(tmp, mode)
            install_file(tmp, path, force, flag)
    except KeptOutput:
        kept = True
        raise
    finally:
        if not kept:
            tmp.unlink(missing_ok=True)


def refuse_keeping(tmp: Path, reason: str) -> None:
    """The output cannot be put in place: keep it under its temporary name, which the one error line states."""
    keep_temporary(tmp)
    raise KeptOutput(f"{reason}; the new output is kept as {tmp}", tmp)


def install_file(tmp: Path, path: Path, force: bool, flag: str = "output") -> None:
    """Rename `tmp` onto `path`, checking now (not only before the work) what may be replaced: a file that
    appeared meanwhile, or one quantdiff did not write (without `force`), is left alone and `tmp` kept."""
    if os.path.lexists(path):
        try:
            check_replaceable(followed(path), force, flag)
        except ConfigError as exc:
            refuse_keeping(tmp, str(exc))
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if anything appeared at `path` since the check: never replaces it
    except FileExistsError:
        refuse_keeping(tmp, f"{flag} {path} appeared while quantdiff was writing it: refusing to replace it")
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        os.replace(tmp, path)  # no hard links on this file system: the check above is the last word
        return
    os.unlink(tmp)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then deliver them to the handlers in place before.

    For writes inside library code (safetensors, torch): an interrupt raised in the middle of their C++ calls
    surfaced as an unrelated TypeError. The block is interrupted only where Python would have been anyway."""
    caught: list[int] = []
    try:
        previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals go to the main thread anyway
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


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


def write_json(path: str | Path, doc: Any, indent: int | None = 1, force: bool = False, flag: str = "--json", **dumps: Any) -> None:
    """Write `doc` as strict JSON (non-finite floats become null), atomically; `path` "-" writes to stdout.
    An existing file is replaced only if quantdiff wrote it, or with `force` (`atomic_file`); a refusal names
    `flag`, the option that gave the path."""
    text = json_text(doc, indent, **dumps)
    if str(path) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with atomic_file(path, force, flag) as tmp:
        tmp.write_text(text, encoding="utf-8")
