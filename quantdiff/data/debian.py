"""Debian packages as text sources: `apt-get download` + `dpkg -x` into the user's cache, read at run time.

No root and no dependencies are needed (`dpkg -x` only unpacks), and nothing is ever committed: a corpus
is either unpacked under `corpus_root()/<name>/` or read from a system-wide install of the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from quantdiff.core.cache import cache_dir
from quantdiff.core.errors import DataError

SYSTEM_ROOT = Path("/")


def corpus_root() -> Path:
    """Where packages are unpacked, one directory per corpus (`$QUANTDIFF_CORPUS_DIR` overrides)."""
    return Path(os.environ.get("QUANTDIFF_CORPUS_DIR") or cache_dir() / "corpus")


def find_installed(name: str, relative: Path, system_root: Path = SYSTEM_ROOT) -> Path | None:
    """`relative` (a path inside the package's file tree) unpacked for corpus `name`, or installed under `system_root`."""
    for root in (corpus_root() / name, system_root):
        if (root / relative).exists():
            return root / relative
    return None


def install_package(package: str, name: str, quiet: bool = False) -> Path:
    """Download `package` and unpack it into `corpus_root()/name`; runs `apt-get update` once if needed."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise DataError(f"cannot install the corpus: apt-get/dpkg not found (install the Debian package {package} by hand)")
    target = corpus_root() / name
    with tempfile.TemporaryDirectory() as tmp:
        run = lambda *cmd: subprocess.run(cmd, cwd=tmp, capture_output=quiet, text=True)  # noqa: E731
        if run("apt-get", "download", package).returncode != 0:
            run("apt-get", "update")
            if run("apt-get", "download", package).returncode != 0:
                raise DataError(f"`apt-get download {package}` failed: is a Debian/Ubuntu package source reachable?")
        debs = sorted(Path(tmp).glob(f"{package}_*.deb"))
        unpacked = Path(tmp) / "root"
        if not debs or run("dpkg", "-x", str(debs[0]), str(unpacked)).returncode != 0:
            raise DataError(f"could not unpack {package}")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(unpacked), target)  # whole tree at once: a half-unpacked corpus is never visible
    return target
