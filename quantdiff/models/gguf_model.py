"""GGUF files as models: dequantized once, through transformers' own GGUF loader, into a float32 model directory
in the user cache, keyed by the file's sha256. Every later run finds that directory (hashing the file takes
well under a second; converting it, about half a minute) and loads it like any other model directory.

float32 keeps the dequantized weights exact: every GGUF block format decodes to scale·q (+ offset) computed in
float32, which is what transformers' loader (the `gguf` package's dequantizer) hands over.

The bytes converted are exactly the bytes hashed: the file is copied once, privately, while it is hashed, and
the copy is converted (a file changed between a hash and a read would otherwise fill the entry of one hash with
another file's weights). Each entry records every file's size and sha256 (`core.manifest`) and is rebuilt
when it differs; a file whose sizes or tensors transformers would misread is refused before anything is cached.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from huggingface_hub.errors import StrictDataclassError

from quantdiff.core.atomic import write_errors_as_error, remove_stale_temporaries, temporary_path, write_json
from quantdiff.core.cache import cache_dir, cache_lock
from quantdiff.core.errors import ConfigError, DiskFullError, LoadError
from quantdiff.models.gguf_header import check_gguf_structure
from quantdiff.core.manifest import file_sha256, matches_manifest, write_manifest
from quantdiff.core.owned import GGUF_KEY
from quantdiff.core.savedir import atomic_dir, marked_kind
from quantdiff.models.gguf_check import check_header_sizes, dropped_tensors, refuse_dropped
from quantdiff.models.source import SOURCE_FILE, model_source, note_given_file

CACHE_KIND = "gguf-model"  # the marker kind of a cached conversion: only such directories are ever replaced
DTYPE = "float32"
# What a broken or unsupported file raises inside the gguf package or transformers' converter.
CONVERSION_ERRORS = (
    ValueError, KeyError, IndexError, TypeError, AttributeError, NotImplementedError, OSError, RuntimeError, EOFError,
    StrictDataclassError,  # transformers' config validation (e.g. heads that do not divide the width)
)
REPORT_REFERENCE = "For details look at the above report!"  # transformers' pointer to a report we never show


def gguf_facts(path: Path, named: Path | None = None) -> dict:
    """Architecture, quantization and `tokenizer.ggml.add_bos_token` (None when absent) of a GGUF file, read from
    its header with the `gguf` package; its sizes checked (`gguf_check`). `named`: the path to name in messages (the file as given, not a private copy)."""
    import gguf

    named = named or path
    check_gguf_structure(path, named)  # before gguf's reader, which a huge array or a hostile count stalls or crashes
    try:
        reader = gguf.GGUFReader(path)
        architecture = reader.get_field("general.architecture").contents()
        file_type = reader.get_field("general.file_type")
        tensor_types = Counter(t.tensor_type.name for t in reader.tensors)
        add_bos = reader.get_field("tokenizer.ggml.add_bos_token")  # how the model was trained to be fed
        plan = _recorded_plan(reader.get_field(GGUF_KEY))
    except CONVERSION_ERRORS as exc:
        raise LoadError(f"unreadable GGUF file {named}: {type(exc).__name__}: {_first_line(exc)}") from None
    check_header_sizes(reader, architecture, named)
    if file_type is not None:
        quantization = gguf.LlamaFileType(file_type.contents()).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    else:  # an optional field: name the file by the type most of its tensors have
        quantization = tensor_types.most_common(1)[0][0] if tensor_types else "none"
    return {"architecture": architecture, "quantization": quantization, "tensor_types": dict(sorted(tensor_types.items())),
            "add_bos_token": None if add_bos is None else bool(add_bos.contents()),
            **({} if plan is None else {"layer_bits": plan})}  # a mixed-precision export's widths per decoder layer


def _recorded_plan(field) -> dict | None:
    """The `layer_bits` a quantdiff export's section records, or None (no section, no plan, or a section
    quantdiff did not write: informative only, it never stops the file from loading)."""
    try:
        plan = json.loads(field.contents()).get("layer_bits") if field is not None else None
    except (ValueError, TypeError, AttributeError):
        return None
    valid = isinstance(plan, dict) and all(isinstance(k, str) and k.isdigit() and type(v) is int for k, v in plan.items())
    return plan if valid else None


def _first_line(exc: BaseException) -> str:
    """The exception's first line, without transformers' pointer to a report that is not shown."""
    cause = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ else exc
    line = (str(cause).strip().splitlines() or [""])[0]
    return " ".join(line.replace(REPORT_REFERENCE, "").split()) or type(exc).__name__


def cache_root() -> Path:
    return cache_dir() / "gguf"


def is_complete(directory: Path, sha256: str) -> bool:
    """A finished conversion of the file with this hash: its source record matches, every file is as recorded
    when it was written (`core.manifest`), and its weights read whole."""
    from quantdiff.models.loading import check_model_dir

    record = model_source(directory)
    # A record without add_bos_token predates it: converted again, so the BOS decision reads the file's own.
    if record is None or record.get("sha256") != sha256 or "add_bos_token" not in record or not (directory / "tokenizer.json").is_file():
        return False
    if not matches_manifest(directory):
        return False
    try:
        check_model_dir(directory)
    except LoadError:
        return False
    return True


def gguf_model_dir(path: str | Path) -> Path:
    """The dequantized model directory of GGUF file `path`: from the cache, or converted into it now. Its source
    record names the file as given here, whichever name first filled the cache."""
    path = Path(path)
    try:
        sha256 = file_sha256(path)
    except OSError as exc:
        raise LoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    directory = cache_root() / sha256
    if not is_complete(directory, sha256):
        with cache_problems(directory), cache_lock(directory):
            if not is_complete(directory, sha256):  # else another process converted it while this one waited
                directory = convert(path, directory, sha256)
    note_given_file(directory, path.name)
    return directory


@contextmanager
def private_copy(path: Path) -> Iterator[tuple[Path, str]]:
    """(a copy of `path` only this process reads, the sha256 of exactly its bytes), removed after the block."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries()
    scratch = temporary_path(root / "source")
    scratch.mkdir(mode=0o700)
    try:
        copy = scratch / path.name
        with write_errors_as_error(copy):
            with path.open("rb") as src, copy.open("wb") as dst:
                digest = hashlib.sha256()
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
        yield copy, digest.hexdigest()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def cache_problems(entry: Path) -> Iterator[None]:
    """A cache that cannot be written is said to be one: the user named no output (never 'refusing to replace it')."""
    try:
        yield
    except (LoadError, DiskFullError):
        raise
    except (ConfigError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split())
        raise LoadError(f"cannot write the GGUF cache entry {entry}: {reason} (set QUANTDIFF_CACHE to another directory)") from None


def check_cache_entry(entry: Path) -> None:
    """An entry directory that exists must be a conversion quantdiff wrote (it is then rebuilt); anything else
    there is the user's, and stays."""
    if (entry.exists() or entry.is_symlink()) and not (entry.is_dir() and not any(entry.iterdir())) and marked_kind(entry) != CACHE_KIND:
        raise LoadError(f"the GGUF cache entry {entry} holds files quantdiff did not write: move them away, or set QUANTDIFF_CACHE to another directory")


@contextmanager
def no_conversion_bar() -> Iterator[None]:
    """transformers draws a tqdm bar while dequantizing, which no setting turns off: it would stand beside the
    one `error:` line of a file that fails, and beside quantdiff's own progress bars."""
    from functools import partial

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert(path: Path, out: Path, sha256: str) -> Path:
    """Dequantize GGUF `path` with transformers into the cache (written atomically: an interrupted conversion
    leaves nothing that looks complete), with its tokenizer, source record and manifest; returns the entry.

    A private copy is converted, and the entry is named by the hash of exactly its bytes: `out` (the entry of
    `sha256`), or — when the file changed since it was hashed — the entry of what it holds now."""
    from quantdiff.models.loading import quiet_load_report

    gguf_facts(path)  # a header refused as it stands costs no copy (the copy is what is read, and checked, below)
    with cache_problems(out):
        check_cache_entry(out)
        with private_copy(path) as (copy, digest):
            entry = out if digest == sha256 else cache_root() / digest
            if entry != out and is_complete(entry, digest):
                return entry
            check_cache_entry(entry)
            model, tokenizer, facts = read_gguf(copy, path)
            record = {"format": "gguf", "file": path.name, "sha256": digest, **facts, "dtype": DTYPE,
                      "note": "statistics are of the dequantized model"}
            with atomic_dir(entry, force=True, kind=CACHE_KIND, flag="GGUF cache entry", per_file=False) as tmp, quiet_load_report():  # no "Writing model shards" bar
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                write_json(tmp / SOURCE_FILE, record)
                write_manifest(tmp)
    return entry


def read_gguf(copy: Path, named: Path) -> tuple:
    """(model, tokenizer, facts) of the GGUF file at `copy`, refused by name (`named`: the file as given) when a
    tensor is missing, of the wrong shape, or not read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdiff.models.loading import check_loading_report, loading_reports, quiet_load_report

    facts = gguf_facts(copy, named)
    where = dict(pretrained_model_name_or_path=copy.parent, gguf_file=copy.name, local_files_only=True)
    reports: list = []
    try:
        with quiet_load_report(), loading_reports() as reports, no_conversion_bar(), dropped_tensors() as dropped:
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, DTYPE))
        # A tensor the file lacks would be initialised randomly, then cached as if it had been read.
        check_loading_report(reports[-1], named, type(model).__name__)
        refuse_dropped(dropped, named, type(model).__name__)
        with quiet_load_report():
            tokenizer = AutoTokenizer.from_pretrained(**where)
    except CONVERSION_ERRORS as exc:
        if reports:  # the report transformers' message points to, as one line
            check_loading_report(reports[-1], named, facts["architecture"])
        raise LoadError(f"cannot read GGUF file {named} ({facts['architecture']}, {facts['quantization']}) with transformers: {_first_line(exc)}") from None
    del model.config.quantization_config  # the copy is a plain float model: nothing is left to dequantize
    model.hf_quantizer = None
    return model, tokenizer, facts
