"""GNU info manuals (gzip text) as documents: one document per node, as Debian's python3.11-doc ships them."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from quantdiff.core.errors import DataError

_NODE_HEADER = re.compile(r"^File: [^,]*,\s+Node: ([^,\n]*)")


def nodes(path: Path) -> dict[str, str]:
    """{node name: text} of an info file; the header line and the tag table are dropped."""
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"cannot read info file {path}: {exc}") from None
    out = {}
    for chunk in text.split("\x1f\n")[1:]:  # the part before the first separator is the file's preamble
        header, _, body = chunk.partition("\n")
        match = _NODE_HEADER.match(header)
        if match and body.strip():
            out[match.group(1).strip()] = body.strip("\n")
    return out
