"""A GGUF file's counts checked from its header before the `gguf` package reads it.

gguf-py's reader builds a numpy view per metadata array entry: a tokenizer of 2M tokens (44 MB) kept it busy
for hours, and counts larger than the file (a hostile tensor or key count) ended in an IndexError deep inside
it. Here the header is walked with plain reads (key names, value types, array lengths; string arrays entry by
entry), and a count that the file's size cannot hold, or an array longer than MAX_ARRAY_ENTRIES, is one
LoadError line naming the file and the key.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from quantdiff.core.errors import LoadError

MAGIC = b"GGUF"
MAX_ARRAY_ENTRIES = 1 << 20  # a metadata array's entries: the largest vocabularies hold 262,144 tokens
STRING, ARRAY = 8, 9  # GGUF value types with a variable size
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, dimensions, one dimension, type, offset
MIN_KV = 8 + 4  # key length, value type
CHUNK = 1 << 20


class _Header:
    def __init__(self, file: BinaryIO, size: int, named: Path, order: str) -> None:
        self.file, self.size, self.named, self.order = file, size, named, order

    def bad(self, reason: str) -> LoadError:
        return LoadError(f"unreadable GGUF file {self.named}: {reason}: refusing to read it")

    def number(self, fmt: str) -> int:
        data = self.file.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise self.bad("its header ends early")
        return struct.unpack(self.order + fmt, data)[0]

    def skip(self, count: int) -> None:
        if self.file.tell() + count > self.size:
            raise self.bad("its header claims more bytes than the file holds")
        self.file.seek(count, 1)

    def string(self) -> bytes:
        length = self.number("Q")
        if self.file.tell() + length > self.size:
            raise self.bad(f"a string of {length:,} bytes in its header is longer than the file")
        return self.file.read(length)

    def skip_strings(self, count: int) -> None:
        """Past `count` strings (a vocabulary), read in chunks: one read per string took a second for 262k."""
        position = self.file.tell()
        buffer, start = b"", position
        for _ in range(count):
            if position + 8 > start + len(buffer):
                self.file.seek(position)
                buffer, start = self.file.read(CHUNK), position
                if len(buffer) < 8:
                    raise self.bad("its header ends early")
            position += 8 + struct.unpack_from(self.order + "Q", buffer, position - start)[0]
            if position > self.size:
                raise self.bad("its header claims more bytes than the file holds")
        self.file.seek(position)

    def value(self, kind: int, key: str) -> None:
        if kind in FIXED_SIZES:
            self.skip(FIXED_SIZES[kind])
        elif kind == STRING:
            self.skip(self.number("Q"))
        elif kind == ARRAY:
            inner, count = self.number("I"), self.number("Q")
            if count > MAX_ARRAY_ENTRIES:
                raise self.bad(f"{key} holds {count:,} entries, more than the {MAX_ARRAY_ENTRIES:,} quantdiff reads")
            if inner in FIXED_SIZES:
                self.skip(count * FIXED_SIZES[inner])
            elif inner == STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(inner, key)
        else:
            raise self.bad(f"{key} has an unknown value type {kind}")


def check_header_counts(path: Path, named: Path | None = None) -> None:
    """LoadError unless `path` is a GGUF file whose tensor and key counts, strings and arrays fit its size, with
    no array longer than MAX_ARRAY_ENTRIES. `named`: the path to name in messages."""
    named = named or path
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            if file.read(4) != MAGIC:
                raise LoadError(f"unreadable GGUF file {named}: no GGUF magic at its start")
            version = struct.unpack("<I", file.read(4) or b"\0\0\0\0")[0]
            header = _Header(file, size, named, "<" if version & 0xFFFF else ">")  # byte-swapped files: big-endian
            tensors, keys = header.number("Q"), header.number("Q")
            if tensors * MIN_TENSOR_INFO > size or keys * MIN_KV > size:
                raise header.bad(f"its header claims {tensors:,} tensors and {keys:,} metadata keys, more than its {size:,} bytes can hold")
            for _ in range(keys):
                key = header.string().decode("utf-8", "replace")
                header.value(header.number("I"), key)
    except OSError as exc:
        raise LoadError(f"unreadable GGUF file {named}: {exc.strerror or exc}") from None
