"""The English training corpora, read at run time from Debian packages (never committed).

Corpora (`CORPORA`, mixable in a recipe's `[data] corpora`): `janeaustenr` (Jane Austen's six novels,
`r-cran-janeaustenr`; the default), `web` and `kjv` (World English and King James Bibles, `sword-text-web`,
`sword-text-kjv`) and `python-doc` (the Python 3.11 documentation as info text, `python3.11-doc`).
`python -m quantdiff.data.corpus --install [--corpus NAME ...]` fetches a package with `apt-get download` and
unpacks it with `dpkg -x` into the user's cache (no root), or the corpus is read from a system-wide install.

Split: every corpus is cut into documents (Austen: chapters; Bibles: chapters; Python docs: info nodes); a
document goes to the held-out split when a stable hash of its key falls in the held-out fraction. Whole
documents keep held-out text from sharing paragraphs with training text, and the hash makes the split
independent of machine, order, seed and of which other corpora are mixed in.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import struct
import sys
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from quantdiff.core.errors import DataError
from quantdiff.data import debian, infotext, sword

PACKAGE = "r-cran-janeaustenr"
RDATA = Path("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")  # inside the package's file tree
SYSTEM_ROOT = debian.SYSTEM_ROOT
DEFAULT_CORPORA = ("janeaustenr",)
HELD_OUT_FRACTION = 0.1
# Marker for other code (cloze set, eval windows): text of this split is never seen in training.
HELD_OUT_SPLIT = "held_out"
INSTALL_HINT = f"install it with `python -m quantdiff.data.corpus --install` (needs apt-get; Debian package {PACKAGE})"
_CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+([IVXLC\d]+)\b")
cache_dir = debian.cache_dir


def corpus_dir() -> Path:
    """Where `--install` unpacks the Austen package (`$QUANTDIFF_CORPUS_DIR` overrides, as scripts/setup.sh checks)."""
    return debian.corpus_root() / "janeaustenr"


def find_rdata() -> Path | None:
    return debian.find_installed("janeaustenr", RDATA, SYSTEM_ROOT)


def install(quiet: bool = False) -> Path:
    """Download the Austen package and unpack it into `corpus_dir()`."""
    return install_corpus("janeaustenr", quiet) / RDATA


def rdata_blocks(blob: bytes) -> list[tuple[bytes, bytes]]:
    """The blocks of an R lazy-load database, each (its bytes as stored, its decompressed bytes): a big-endian
    length, then a zlib stream. Any run of whole blocks is itself a database (`scripts/gpu_run.sh --smoke` reads
    one novel so)."""
    blocks, pos = [], 0
    while pos < len(blob):
        stream = zlib.decompressobj()
        data = stream.decompress(blob[pos + 4 :])
        end = len(blob) - len(stream.unused_data)
        blocks.append((blob[pos:end], data))
        pos = end
    return blocks


def parse_rdata(blob: bytes) -> list[list[str]]:
    """Decode an R lazy-load database of character vectors (`rdata_blocks`).

    Each block is one R-serialised STRSXP: header "X\\n", three int32 versions, the native encoding, then
    int32 type 16, int32 length and per element int32 flags (low byte 9 = CHARSXP) + int32 byte length.
    """
    vectors = []
    for _, data in rdata_blocks(blob):
        if data[:2] != b"X\n":
            raise DataError("corpus file is not in R's XDR serialisation format")
        (encoding_len,) = struct.unpack_from(">i", data, 14)
        at = 18 + encoding_len
        sexp_type, length = struct.unpack_from(">ii", data, at)
        if sexp_type & 0xFF != 16:
            raise DataError(f"corpus block holds R type {sexp_type & 0xFF}, not a character vector")
        at += 8
        strings = []
        for _ in range(length):
            flags, size = struct.unpack_from(">ii", data, at)
            at += 8
            if flags & 0xFF != 9:
                raise DataError("malformed character vector in corpus file")
            strings.append("" if size < 0 else data[at : at + size].decode("utf-8"))  # size −1 is NA
            at += max(size, 0)
        vectors.append(strings)
    return vectors


@lru_cache(maxsize=1)
def read_novels() -> dict[str, list[str]]:
    """{title: lines} for the six novels; DataError with install instructions when the corpus is missing."""
    path = find_rdata()
    if path is None:
        raise DataError(f"English corpus not found: {INSTALL_HINT}")
    novels = {}
    for lines in parse_rdata(path.read_bytes()):
        title = next(line for line in lines if line.strip()).strip()
        novels[title] = lines
    return novels


def chapters(lines: list[str]) -> list[str]:
    """Split a novel's lines at chapter headings into paragraph-joined chapter texts (front matter dropped)."""
    found, current = [], None
    for line in lines:
        if _CHAPTER.match(line.strip()):
            current = []
            found.append(current)
        elif current is not None:
            current.append(line.strip())
    texts = []
    for chapter in found:
        paragraphs, paragraph = [], []
        for line in chapter + [""]:  # a blank line ends a paragraph
            if line:
                paragraph.append(line)
            elif paragraph:
                paragraphs.append(" ".join(paragraph))
                paragraph = []
        texts.append("\n".join(paragraphs))
    return texts


def is_held_out(novel: str, chapter_index: int, fraction: float = HELD_OUT_FRACTION) -> bool:
    return key_is_held_out(f"{novel}/{chapter_index}", fraction)


def key_is_held_out(key: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def austen_documents(_path: Path) -> dict[str, str]:
    """{"<novel>/<chapter index>": chapter text}, novels in title order (the keys the split has always hashed)."""
    return {f"{novel}/{index}": text for novel, lines in sorted(read_novels().items()) for index, text in enumerate(chapters(lines))}


@dataclass(frozen=True)
class Corpus:
    package: str
    path: Path  # inside the package's file tree
    documents: Callable[[Path], dict[str, str]]  # installed path -> {document key: text}, in reading order
    key_prefix: str  # hashed with each key; "" keeps the Austen split as it always was


SWORD_MODULES = Path("usr/share/sword/modules/texts/ztext")
SOURCES = {
    "janeaustenr": Corpus(PACKAGE, RDATA, austen_documents, ""),
    "web": Corpus("sword-text-web", SWORD_MODULES / "engWEB2015eb", sword.chapters, "web/"),
    "kjv": Corpus("sword-text-kjv", SWORD_MODULES / "engKJV2006eb", sword.chapters, "kjv/"),
    "python-doc": Corpus("python3.11-doc", Path("usr/share/info/python3.11.info.gz"), infotext.nodes, "python-doc/"),
}
CORPORA = tuple(SOURCES)


def install_hint(name: str) -> str:
    if name == "janeaustenr":
        return INSTALL_HINT
    return f"install it with `python -m quantdiff.data.corpus --install --corpus {name}` (needs apt-get; Debian package {SOURCES[name].package})"


def install_corpus(name: str, quiet: bool = False) -> Path:
    """Download and unpack corpus `name`'s package into the cache; returns the unpacked root."""
    target = debian.install_package(SOURCES[name].package, name, quiet)
    read_novels.cache_clear()
    _read_documents.cache_clear()
    split_text.cache_clear()
    return target


def documents(name: str) -> dict[str, str]:
    """{document key: text} of one corpus; DataError naming the corpus and how to install it when missing."""
    if name not in SOURCES:
        raise DataError(f"unknown corpus {name!r} (known: {', '.join(CORPORA)})")
    path = debian.find_installed(name, SOURCES[name].path, SYSTEM_ROOT)
    if path is None:
        raise DataError(f"corpus {name!r} not found: {install_hint(name)}")
    return _read_documents(name, path)


@lru_cache(maxsize=8)
def _read_documents(name: str, path: Path) -> dict[str, str]:
    return SOURCES[name].documents(path)


def require(corpora: tuple[str, ...] = DEFAULT_CORPORA) -> None:
    """DataError with install instructions unless every corpus in `corpora` is readable."""
    for name in corpora:
        documents(name)


@lru_cache(maxsize=8)
def split_text(split: str, fraction: float = HELD_OUT_FRACTION, corpora: tuple[str, ...] = DEFAULT_CORPORA) -> str:
    """All documents of one split ("train" or HELD_OUT_SPLIT), corpus by corpus in reading order, blank-line separated."""
    if split not in ("train", HELD_OUT_SPLIT):
        raise DataError(f"unknown corpus split {split!r}: use 'train' or {HELD_OUT_SPLIT!r}")
    keep = split == HELD_OUT_SPLIT
    parts = [
        text
        for name in corpora
        for key, text in documents(name).items()
        if key_is_held_out(SOURCES[name].key_prefix + key, fraction) == keep
    ]
    return "\n\n".join(parts)


def train_text() -> str:
    return split_text("train")


def held_out_text() -> str:
    return split_text(HELD_OUT_SPLIT)


def sentences(text: str) -> list[str]:
    """Sentence-ish pieces (split after . ! ? followed by space): the filler unit of the retrieval documents."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")) if len(s) > 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantdiff.data.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help=f"download and unpack the corpora's packages into {debian.corpus_root()}")
    parser.add_argument("--corpus", action="append", choices=CORPORA, help="corpus to install or describe (repeatable; default janeaustenr)")
    args = parser.parse_args(argv)
    names = tuple(args.corpus or DEFAULT_CORPORA)
    try:
        for name in names:
            if args.install and debian.find_installed(name, SOURCES[name].path, SYSTEM_ROOT) is None:
                print(f"installed {install_corpus(name)}")
        for name in names:
            train, held = split_text("train", corpora=(name,)), split_text(HELD_OUT_SPLIT, corpora=(name,))
            print(f"{name}: {len(documents(name)):,} documents, train {len(train):,} chars, held-out {len(held):,} chars")
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
