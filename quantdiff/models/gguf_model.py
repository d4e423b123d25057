"""GGUF files as models: dequantized once, through transformers' own GGUF loader, into a float32 model directory
in the user cache, keyed by the file's sha256. Every later run finds that directory (hashing the file takes
well under a second; converting it, about half a minute) and loads it like any other model directory.

float32 keeps the dequantized weights exact: every GGUF block format decodes to scale·q (+ offset) computed in
float32, which is what transformers' loader (the `gguf` package's dequantizer) hands over.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quantdiff.core.atomic import write_json
from quantdiff.core.cache import cache_dir
from quantdiff.core.errors import LoadError
from quantdiff.core.savedir import atomic_dir
from quantdiff.models.source import SOURCE_FILE, model_source

CACHE_KIND = "gguf-model"  # the marker kind of a cached conversion: only such directories are ever replaced
DTYPE = "float32"
# What a broken or unsupported file raises inside the gguf package or transformers' converter.
CONVERSION_ERRORS = (ValueError, KeyError, IndexError, TypeError, AttributeError, NotImplementedError, OSError, RuntimeError, EOFError)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_facts(path: Path) -> dict:
    """Architecture, quantization and `tokenizer.ggml.add_bos_token` (None when absent) of a GGUF file, read from
    its header with the `gguf` package."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        architecture = reader.get_field("general.architecture").contents()
        file_type = reader.get_field("general.file_type")
        tensor_types = Counter(t.tensor_type.name for t in reader.tensors)
        add_bos = reader.get_field("tokenizer.ggml.add_bos_token")  # how the model was trained to be fed
    except CONVERSION_ERRORS as exc:
        raise LoadError(f"unreadable GGUF file {path}: {type(exc).__name__}: {_first_line(exc)}") from None
    if file_type is not None:
        quantization = gguf.LlamaFileType(file_type.contents()).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    else:  # an optional field: name the file by the type most of its tensors have
        quantization = tensor_types.most_common(1)[0][0] if tensor_types else "none"
    return {"architecture": architecture, "quantization": quantization, "tensor_types": dict(sorted(tensor_types.items())),
            "add_bos_token": None if add_bos is None else bool(add_bos.contents())}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def cache_root() -> Path:
    return cache_dir() / "gguf"


def is_complete(directory: Path, sha256: str) -> bool:
    """A finished conversion of the file with this hash: its source record matches and its weights read whole."""
    from quantdiff.models.loading import check_model_dir

    record = model_source(directory)
    # A record without add_bos_token predates it: converted again, so the BOS decision reads the file's own.
    if record is None or record.get("sha256") != sha256 or "add_bos_token" not in record or not (directory / "tokenizer.json").is_file():
        return False
    try:
        check_model_dir(directory)
    except LoadError:
        return False
    return True


def gguf_model_dir(path: str | Path) -> Path:
    """The dequantized model directory of GGUF file `path`: from the cache, or converted into it now."""
    path = Path(path)
    try:
        sha256 = file_sha256(path)
    except OSError as exc:
        raise LoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    directory = cache_root() / sha256
    if not is_complete(directory, sha256):
        convert(path, directory, sha256)
    return directory


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


def convert(path: Path, out: Path, sha256: str) -> None:
    """Dequantize GGUF `path` with transformers into model directory `out` (written atomically: an interrupted
    conversion leaves nothing that looks complete), with its tokenizer and source record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdiff.models.loading import check_loading_report, loading_reports, quiet_load_report

    facts = gguf_facts(path)
    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name, local_files_only=True)
    try:
        with quiet_load_report(), loading_reports() as reports, no_conversion_bar():
            model = AutoModelForCausalLM.from_pretrained(**where, dtype=getattr(torch, DTYPE))
        # A tensor the file lacks would be initialised randomly, then cached as if it had been read.
        check_loading_report(reports[-1], path, type(model).__name__)
        with quiet_load_report():
            tokenizer = AutoTokenizer.from_pretrained(**where)
    except CONVERSION_ERRORS as exc:
        raise LoadError(f"cannot read GGUF file {path} ({facts['architecture']}, {facts['quantization']}) with transformers: {_first_line(exc)}") from None
    del model.config.quantization_config  # the copy is a plain float model: nothing is left to dequantize
    model.hf_quantizer = None
    record = {"format": "gguf", "file": path.name, "sha256": sha256, **facts, "dtype": DTYPE,
              "note": "statistics are of the dequantized model"}
    with atomic_dir(out, force=True, kind=CACHE_KIND) as tmp, quiet_load_report():  # no "Writing model shards" bar
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / SOURCE_FILE, record)
