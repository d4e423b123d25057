"""A directory's files as written: each file's size and sha256, recorded when a cache entry is made and checked
before every use, so a changed, truncated, missing or added file (a flipped weight byte, a deleted
tokenizer_config.json) makes the entry be rebuilt instead of being used as if it were what was written.
Ownership markers (`core.owned.MARKER`) are not content: they are rewritten as the directory is finished, after
the manifest, and are left out on both sides (manifests written before recorded them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from quantdiff.core.owned import MARKER

MANIFEST = "quantdiff-manifest.json"
CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))


def write_manifest(directory: Path) -> None:
    """Record every file under `directory` (but the manifest) with its size and sha256."""
    entries = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps({"files": entries}, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def matches_manifest(directory: Path) -> bool:
    """Whether `directory` holds exactly the files its manifest records, each of the recorded size and sha256."""
    return manifest_mismatch(directory) is None


def recorded_files(directory: Path) -> dict:
    """The manifest's {relative path: {size, sha256}}; OSError, ValueError, KeyError or TypeError if unreadable."""
    recorded = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
    if not isinstance(recorded, dict):
        raise TypeError("files is not an object")
    return recorded


def manifest_mismatch(directory: Path) -> str | None:
    """None when `directory` holds exactly the files its manifest records, each of the recorded size and sha256
    (sizes first: a truncated file costs no hashing); else what differs first, naming the file."""
    try:
        recorded = {name: entry for name, entry in recorded_files(directory).items() if Path(name).name != MARKER}
        files = {str(p.relative_to(directory)): p for p in _files(directory)}
        missing, added = sorted(set(recorded) - set(files)), sorted(set(files) - set(recorded))
        if missing or added:
            return f"{missing[0]} is missing" if missing else f"{added[0]} was added"
        resized = next((name for name, p in files.items() if p.stat().st_size != recorded[name]["size"]), None)
        changed = resized or next((name for name, p in files.items() if file_sha256(p) != recorded[name]["sha256"]), None)
        return None if changed is None else f"{changed} differs from the file written"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is missing or unreadable"
