"""The English training corpus: Jane Austen's six novels from Debian's `r-cran-janeaustenr`, read at run time.

The text is public domain but is never committed: `python -m quantdiff.data.corpus --install` fetches the Debian
package with `apt-get download` and unpacks it with `dpkg -x` into the user's cache (no root, no R), or the
corpus is read from a system-wide install of the package.

Split: every novel is cut into chapters; a chapter goes to the held-out split when a stable hash of its
(novel, chapter number) falls in the held-out fraction. Whole chapters keep held-out text from sharing
paragraphs with training text, and the hash makes the split independent of machine, order and seed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from functools import lru_cache
from pathlib import Path

from quantdiff.core.errors import DataError

PACKAGE = "r-cran-janeaustenr"
RDATA = Path("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")  # inside the package's file tree
SYSTEM_ROOT = Path("/")
HELD_OUT_FRACTION = 0.1
# Marker for other code (cloze set, eval windows): text of this split is never seen in training.
HELD_OUT_SPLIT = "held_out"
INSTALL_HINT = f"install it with `python -m quantdiff.data.corpus --install` (needs apt-get; Debian package {PACKAGE})"
_CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+([IVXLC\d]+)\b")


def cache_dir() -> Path:
    """`$QUANTDIFF_CACHE`, else `~/.cache/quantdiff`: where the corpus and derived data sets live."""
    return Path(os.environ.get("QUANTDIFF_CACHE") or Path.home() / ".cache" / "quantdiff")


def corpus_dir() -> Path:
    """Where `--install` unpacks the package (`$QUANTDIFF_CORPUS_DIR` overrides, as scripts/setup.sh checks)."""
    return Path(os.environ.get("QUANTDIFF_CORPUS_DIR") or cache_dir() / "corpus") / "janeaustenr"


def find_rdata() -> Path | None:
    for root in (corpus_dir(), SYSTEM_ROOT):
        if (root / RDATA).is_file():
            return root / RDATA
    return None


def install(quiet: bool = False) -> Path:
    """Download the Debian package and unpack it into `corpus_dir()`; run `apt-get update` once if needed."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise DataError(f"cannot install the corpus: apt-get/dpkg not found (install the Debian package {PACKAGE} by hand)")
    target = corpus_dir()
    with tempfile.TemporaryDirectory() as tmp:
        run = lambda *cmd: subprocess.run(cmd, cwd=tmp, capture_output=quiet, text=True)  # noqa: E731
        if run("apt-get", "download", PACKAGE).returncode != 0:
            run("apt-get", "update")
            if run("apt-get", "download", PACKAGE).returncode != 0:
                raise DataError(f"`apt-get download {PACKAGE}` failed: is a Debian/Ubuntu package source reachable?")
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        unpacked = Path(tmp) / "root"
        if not debs or run("dpkg", "-x", str(debs[0]), str(unpacked)).returncode != 0:
            raise DataError(f"could not unpack {PACKAGE}")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(unpacked), target)  # whole tree at once: a half-unpacked corpus is never visible
    read_novels.cache_clear()
    return target / RDATA


def parse_rdata(blob: bytes) -> list[list[str]]:
    """Decode an R lazy-load database of character vectors: blocks of (big-endian length, zlib stream).

    Each block is one R-serialised STRSXP: header "X\\n", three int32 versions, the native encoding, then
    int32 type 16, int32 length and per element int32 flags (low byte 9 = CHARSXP) + int32 byte length.
    """
    vectors, pos = [], 0
    while pos < len(blob):
        stream = zlib.decompressobj()
        data = stream.decompress(blob[pos + 4 :])
        pos = len(blob) - len(stream.unused_data)
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
    digest = hashlib.sha256(f"{novel}/{chapter_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@lru_cache(maxsize=4)
def split_text(split: str, fraction: float = HELD_OUT_FRACTION) -> str:
    """All chapters of one split ("train" or HELD_OUT_SPLIT), in novel then chapter order, blank-line separated."""
    if split not in ("train", HELD_OUT_SPLIT):
        raise DataError(f"unknown corpus split {split!r}: use 'train' or {HELD_OUT_SPLIT!r}")
    keep = split == HELD_OUT_SPLIT
    parts = [
        text
        for novel, lines in sorted(read_novels().items())
        for index, text in enumerate(chapters(lines))
        if is_held_out(novel, index, fraction) == keep
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
    parser = argparse.ArgumentParser(prog="python -m quantdiff.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help=f"download and unpack {PACKAGE} into {corpus_dir()}")
    args = parser.parse_args(argv)
    try:
        if args.install and find_rdata() is None:
            print(f"installed {install()}")
        train, held = train_text(), held_out_text()
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"corpus: {find_rdata()}  train {len(train):,} chars, held-out {len(held):,} chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
