"""Where a model directory came from, when quantdiff derived it from another format (a GGUF file).

A derived directory holds SOURCE_FILE; every report (`info`, the JSON of `stats`, `sweep`, `eval`, the
metadata of `quantize`) takes its `source` record from `model_source`, so they all say the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

SOURCE_FILE = "quantdiff-source.json"
# Derived directory -> the file name this process was given for it: one cache entry serves every copy of a
# file, and each run reports the name it was given, not the name that first filled the cache.
_given_files: dict[str, str] = {}


def note_given_file(model_dir: str | Path, name: str) -> None:
    _given_files[str(Path(model_dir).resolve())] = name


def model_source(model_dir: str | Path) -> dict | None:
    """The source record of a derived model directory ({"format": "gguf", "quantization": "Q4_1", ...}), with
    `file` as this run named it, or None for an ordinary one."""
    try:
        record = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    given = _given_files.get(str(Path(model_dir).resolve()))
    return record if given is None else {**record, "file": given}


def model_sources(specs: Iterable[tuple[str, Path]]) -> dict[str, dict | None]:
    """{model name: its source record} for (name, directory) pairs, as the sweep and eval JSON record them."""
    return {name: model_source(path) for name, path in specs}


def describe_source(record: dict | None) -> str:
    """One phrase for tables: 'GGUF Q4_1, dequantized to float32', or '' for an ordinary directory."""
    if record is None:
        return ""
    return f"{str(record.get('format', '?')).upper()} {record.get('quantization', '?')}, dequantized to {record.get('dtype', '?')}"
