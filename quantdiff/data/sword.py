"""Bible texts in SWORD's compressed module format (`zText`, BlockType=BOOK), as Debian's sword-text-* ship them.

`<testament>.bzs` holds 12-byte little-endian records (offset, compressed size, uncompressed size) of zlib
blocks in `<testament>.bzz`; each block is one book of OSIS markup. Chapters start at `<chapter … sID=…/>`
milestones; footnotes (`<note>…</note>`) are dropped with their text, every other tag is dropped alone.
"""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

from quantdiff.core.errors import DataError

TESTAMENTS = ("ot", "nt")
_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_CHAPTER = re.compile(r"<chapter\b[^>]*\bsID=[^>]*/>")
_PARAGRAPH = re.compile(r"<div\b[^>]*type=\"x-p\"[^>]*/>|<lb\b[^>]*/>")
_TAG = re.compile(r"<[^>]*>")
_SPACES = re.compile(r"[ \t]+")


def read_blocks(module_dir: Path, testament: str) -> list[str]:
    """The decompressed blocks (books) of one testament, in order; DataError on a malformed index."""
    index, data = (module_dir / f"{testament}.bzs").read_bytes(), (module_dir / f"{testament}.bzz").read_bytes()
    if len(index) % 12:
        raise DataError(f"{module_dir / testament}.bzs: size {len(index)} is not a multiple of 12")
    blocks = []
    for offset, size, _ in struct.iter_unpack("<III", index):
        try:
            blocks.append(zlib.decompress(data[offset : offset + size]).decode("utf-8"))
        except (zlib.error, UnicodeDecodeError) as exc:
            raise DataError(f"{module_dir / testament}.bzz: bad block at offset {offset} ({exc})") from None
    return blocks


def plain_text(markup: str) -> str:
    """OSIS markup → plain text: notes dropped, paragraph breaks kept as newlines, whitespace collapsed."""
    text = _TAG.sub("", _PARAGRAPH.sub("\n", _NOTE.sub("", markup)))
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def chapters(module_dir: Path) -> dict[str, str]:
    """{"<testament>/<book>/<chapter>": plain text} of a module, in canonical order (front matter dropped)."""
    out = {}
    for testament in TESTAMENTS:
        if not (module_dir / f"{testament}.bzs").is_file():
            continue
        for book, block in enumerate(read_blocks(module_dir, testament)):
            for number, part in enumerate(_CHAPTER.split(block)[1:], start=1):
                text = plain_text(part)
                if text:
                    out[f"{testament}/{book}/{number}"] = text
    return out
