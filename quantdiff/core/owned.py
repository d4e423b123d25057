"""Which existing files quantdiff wrote: a file output (`--json`, `--plot`) replaces one of those, or any regular
file when the user passes `--force`, and nothing else — the same rule as for output directories and their marker.

Ours are JSON documents whose `"schema"` starts with `quantdiff.`, plots (PNG, PDF, SVG) whose own metadata
names quantdiff as their creator (PNG tEXt chunk, PDF Info dictionary, SVG Dublin Core creator), and GGUF
exports holding our key GGUF_KEY beside llama.cpp's. An output directory is ours file by file: its MARKER lists
every entry quantdiff wrote there (`core.savedir`).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from quantdiff.core.errors import ConfigError

SCHEMA_PREFIX = "quantdiff."
CREATOR = "quantdiff"
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
READ_LIMIT = 256 << 20  # larger files are not ours: quantdiff's JSON and plots are far smaller
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MARKER = ".quantdiff-output"  # an output directory's kind and the entries quantdiff wrote in it (core.savedir)
GGUF_KEY = "quantdiff.quantization_config"  # a GGUF export's description of itself (llama.cpp ignores it)


def plot_metadata() -> dict[str, str]:
    """The savefig metadata that marks a plot as quantdiff's (the same key in PNG, PDF and SVG)."""
    from quantdiff import __version__

    return {"Creator": f"{CREATOR} {__version__}"}


def _png_creator(data: bytes) -> bool:
    """A PNG whose tEXt chunk `Creator` starts with quantdiff (chunks walked, not searched)."""
    if not data.startswith(PNG_SIGNATURE):
        return False
    at = len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        body = data[at + 8 : at + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Creator\x00" + CREATOR.encode() + b" "):
            return True
        if kind == b"IEND":
            return False
        at += 12 + length
    return False


def _json_schema(data: bytes) -> bool:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("schema"), str) and doc["schema"].startswith(SCHEMA_PREFIX)


def _gguf_has_key(path: Path) -> bool:
    import gguf

    from quantdiff.core.errors import QuantdiffError
    from quantdiff.models.gguf_header import check_gguf_structure

    try:
        check_gguf_structure(path)  # a file gguf's reader would stall on is not one quantdiff wrote
        return gguf.GGUFReader(path).get_field(GGUF_KEY) is not None
    except (ValueError, KeyError, IndexError, OSError, QuantdiffError):
        return False


def written_by_quantdiff(path: str | Path) -> bool:
    """Whether the regular file at `path` carries quantdiff's mark for its kind (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return path.is_file() and _gguf_has_key(path)
    if suffix not in (".json", *PLOT_SUFFIXES):
        return False
    try:
        if not path.is_file() or path.stat().st_size > READ_LIMIT:
            return False
        data = path.read_bytes()
    except OSError:
        return False
    if suffix == ".json":
        return _json_schema(data)
    if suffix == ".png":
        return _png_creator(data)
    if suffix == ".pdf":
        return re.search(rb"/Creator \(" + CREATOR.encode() + rb" ", data) is not None
    return re.search(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + CREATOR.encode() + rb" ", data) is not None


def check_replaceable(path: str | Path, force: bool, flag: str = "output") -> None:
    """Refuse to replace an existing file quantdiff did not write, unless `force` (the user named it with
    --force); a missing file is always fine."""
    path = Path(path)
    if force or not path.exists() or written_by_quantdiff(path):
        return
    raise ConfigError(f"{flag} {path} exists and was not written by quantdiff: refusing to replace it (--force replaces it)")
