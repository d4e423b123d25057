"""A GGUF file's structure checked, once, before the `gguf` package or transformers reads it.

gguf-py's reader builds a numpy view per metadata array entry: a tokenizer of 2M tokens (44 MB) kept it busy
for hours, and counts larger than the file (a hostile tensor or key count) ended in an IndexError deep inside
it. Nor does it check where tensors lie: a tensor count one lower, or an offset moved 3 bytes, read other
bytes as weights (NaN, 1e38) without a word. Here the header is walked with plain reads (key names, value
types, array lengths; string arrays entry by entry), then every tensor info, by llama.cpp's own rules
(gguf.cpp): at most 4 dimensions, each positive, a known type whose block divides the first, each tensor at
the aligned end of the one before it, the data section holding them all, and nothing after the last but
padding. Any breach is one LoadError line naming the file (and the key or tensor).
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
MAX_DIMS = 4  # GGML_MAX_DIMS
UINT32 = 4
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT


class _Header:
    def __init__(self, file: BinaryIO, size: int, named: Path, order: str) -> None:
        self.file, self.size, self.named, self.order = file, size, named, order
        self.alignment = DEFAULT_ALIGNMENT

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
        if key == ALIGNMENT_KEY and kind == UINT32:  # the only value the tensor walk needs
            self.alignment = self.number("I")
        elif kind in FIXED_SIZES:
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


    def tensor_info(self) -> tuple[str, int, int]:
        """(name, bytes, offset) of the next tensor info, its dimensions and type checked."""
        name = self.string().decode("utf-8", "replace")
        dims = self.number("I")
        if not 1 <= dims <= MAX_DIMS:
            raise self.bad(f"tensor {name} has {dims} dimensions (1 to {MAX_DIMS} can be read)")
        shape = [self.number("Q") for _ in range(dims)]
        kind = self.number("I")
        offset = self.number("Q")
        if not all(shape):
            raise self.bad(f"tensor {name} has a dimension of 0 (shape {shape})")
        block, block_bytes = quant_sizes().get(kind, (0, 0))
        if not block:
            raise self.bad(f"tensor {name} has an unknown type {kind}")
        if shape[0] % block:
            raise self.bad(f"tensor {name}'s rows of {shape[0]:,} are not whole blocks of {block} for its type")
        elements = 1
        for extent in shape:
            elements *= extent
            if elements > 8 * self.size:  # a byte holds at most 8 elements (1-bit types): bounded as it grows
                raise self.bad(f"tensor {name} of shape {shape} is larger than the file")
        return name, elements // block * block_bytes, offset

    def tensors(self, count: int) -> None:
        """Every tensor info, then the data section they describe: each tensor at the aligned end of the one
        before it (so none overlaps, none sits off its alignment), all within the file, nothing after but padding."""
        if not (self.alignment and self.alignment & (self.alignment - 1) == 0):
            raise self.bad(f"{ALIGNMENT_KEY} is {self.alignment}, not a power of two")
        infos, seen = [], set()
        for _ in range(count):
            info = self.tensor_info()
            if info[0] in seen:
                raise self.bad(f"tensor {info[0]} is listed twice")
            seen.add(info[0])
            infos.append(info)
        start = self._aligned(self.file.tell())
        padding = self.file.read(start - self.file.tell())
        if padding.strip(b"\0"):  # what a lower tensor count leaves: a tensor info read as padding
            raise self.bad("the bytes between its tensor infos and its data are not padding (is the tensor count right?)")
        expected = 0
        for name, nbytes, offset in infos:
            if offset != expected:
                raise self.bad(f"tensor {name} lies at data offset {offset:,}, expected {expected:,} (alignment {self.alignment})")
            if start + offset + nbytes > self.size:
                raise self.bad(f"tensor {name} ends {start + offset + nbytes - self.size:,} bytes past the end of the file")
            expected = self._aligned(offset + nbytes)
        if infos and self.size > start + expected:
            raise self.bad(f"it holds {self.size - start - expected:,} bytes after its last tensor (is the tensor count right?)")

    def _aligned(self, position: int) -> int:
        return -(-position // self.alignment) * self.alignment


def quant_sizes() -> dict[int, tuple[int, int]]:
    """(elements per block, bytes per block) of each GGML type, by type number."""
    import gguf

    return {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}


def check_gguf_structure(path: Path, named: Path | None = None) -> None:
    """LoadError unless `path` is a GGUF file whose counts, strings and arrays fit its size (no array longer than
    MAX_ARRAY_ENTRIES) and whose tensor infos and data section are whole (`_Header.tensors`). `named`: the path
    to name in messages (the file as the user gave it)."""
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
            header.tensors(tensors)
    except OSError as exc:
        raise LoadError(f"unreadable GGUF file {named}: {exc.strerror or exc}") from None
