"""The KV plan file's schema (docs/quantization.md), checked as a whole before any field is used: every field's
type, range and relation to the others, so a hand-edited or damaged plan is one ConfigError line naming the
field, never an AttributeError, an overflow or a plan applied otherwise than it reads.

Besides the types: no unknown or repeated field (a misspelt one would be ignored); the version this quantdiff reads; `quantizer`, when given, is the one applied; per layer
entry, `layer` (when given) is its index, since entries are applied in list order; bits per KV head 2–16;
kept positions below MAX_POSITION; `evidence` an object, whose `calibration.source`, when given, names the
calibration data (`--kv-plan` requires it: `cli.transform_options.load_kv_plans`), and whose `calibration.sha256`,
when given, is a sha256 in hex (the calibration file's content, compared with the evaluation data's).
Files are read as quantdiff's inputs are: a regular file (`data.sources.check_data_file`), at most
MAX_PLAN_BYTES, UTF-8, JSON of bounded nesting.
"""

from __future__ import annotations

import json
import re
from numbers import Integral
from pathlib import Path
from typing import Any

from quantdiff.core.documents import read_json_file
from quantdiff.core.errors import ConfigError
from quantdiff.quant.numerics import MAX_BITS, MIN_BITS

MAX_PLAN_BYTES = 64 << 20  # a plan for 10,000 layers of 128 heads is a few MB
MAX_DIGITS = 20  # a plan's integers (positions, token counts) fit in 64 bits
MAX_POSITION = 2**31 - 1  # far beyond any model's positions; larger values overflow the index tensors
PLAN_SCHEMA = "quantdiff.kv-plan"
PLAN_VERSION = 1
POLICIES = ("uniform", "first", "massive", "heads")
QUANTIZER = {"method": "absmax", "scales": "the run's granularity: row (per token and KV head) or tensor (KIVI)", "full_bits": MAX_BITS}
# What plans written before the causal default said: the same plan, applied at whichever granularity the run asks.
EARLIER_QUANTIZER = {"method": "absmax", "keys": "per channel", "values": "per token", "full_bits": MAX_BITS}
# The fields each object may hold: any other (a misspelt "keep_position") would be ignored, so it is refused.
PLAN_FIELDS = ("schema", "version", "policy", "budget_bits", "quantizer", "model", "layers", "evidence")
MODEL_FIELDS = ("kind", "layers", "kv_heads", "query_heads", "head_dim", "name")
LAYER_FIELDS = ("layer", "kv_bits", "keep_positions")


def read_plan_json(path: str | Path) -> Any:
    """The JSON value of the plan file `path`; ConfigError in one line for anything that is not a plan-sized
    UTF-8 JSON regular file."""
    from quantdiff.data.sources import check_data_file

    check_data_file(path, "--kv-plan")
    return read_json_file(Path(path), "--kv-plan", "kv plan", MAX_PLAN_BYTES, parse_int=_bounded_int)


def _bounded_int(text: str) -> int:
    """A JSON integer of at most MAX_DIGITS digits: a plan holds none longer, and Python refuses to convert one
    of more than 4,300 digits with a ValueError (a version of 5,000 digits was a traceback)."""
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ConfigError(f"kv plan: an integer of {len(text.lstrip('-')):,} digits is not a plan value (at most {MAX_DIGITS})")
    return int(text)


def _known(value: dict, fields: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"kv plan: unknown field {where}{unknown[0]!r} (known: {', '.join(fields)})")


def _shown(value: Any) -> str:
    """`value` for a message, at most 40 characters; an integer too long for Python to print (a plan given as a
    dict through the API skips the reader's digit bound) by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length():,} bits"
    return f"{value!r:.40}"


def _integer(value: Any, field: str, least: int, most: int) -> int:
    """A JSON integer (never a float such as 0.0, nor true) from `least` to `most`."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not least <= value <= most:
        raise ConfigError(f"kv plan: {field} must be an integer from {least} to {most}, got {_shown(value)}")
    return int(value)


def _object(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"kv plan: {field} must be an object, got {json.dumps(value)[:40]}")
    return value


def _list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"kv plan: {field} must be a list, got {json.dumps(value)[:40]}")
    return value


def check_plan_document(data: Any) -> None:
    """ConfigError naming the first field of a plan document (parsed JSON) that breaks the schema."""

    if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
        raise ConfigError(f"not a KV plan: expected \"schema\": \"{PLAN_SCHEMA}\"")
    if type(data.get("version")) is not int or data["version"] != PLAN_VERSION:  # not true, not 1.0
        raise ConfigError(f"KV plan version {_shown(data.get('version'))} is not supported (this quantdiff reads version {PLAN_VERSION})")
    _known(data, PLAN_FIELDS, "")
    missing = next((key for key in ("policy", "budget_bits", "model", "layers", "evidence") if key not in data), None)
    if missing is not None:
        raise ConfigError(f"kv plan: the field {missing!r} is missing")
    if data["policy"] not in POLICIES:
        raise ConfigError(f"kv plan: unknown policy {_shown(data['policy'])} (choose from {', '.join(POLICIES)})")
    _integer(data["budget_bits"], "budget_bits", MIN_BITS, MAX_BITS)
    if "quantizer" in data and data["quantizer"] not in (QUANTIZER, EARLIER_QUANTIZER):
        raise ConfigError(f"kv plan: quantizer {json.dumps(data['quantizer'])[:80]} is not the one applied ({json.dumps(QUANTIZER)})")
    model = _object(data["model"], "model")
    _known(model, MODEL_FIELDS, "model.")
    if not isinstance(model.get("kind"), str):
        raise ConfigError(f"kv plan: model.kind must be a string, got {_shown(model.get('kind'))}")
    layers = _integer(model.get("layers"), "model.layers", 1, MAX_POSITION)
    for key in ("query_heads", "head_dim"):
        _integer(model.get(key), f"model.{key}", 1, MAX_POSITION)
    kv_heads = _list(model.get("kv_heads"), "model.kv_heads")
    if len(kv_heads) != layers:
        raise ConfigError(f"kv plan: model.kv_heads lists {len(kv_heads)} layers, model.layers says {layers}")
    for index, heads in enumerate(kv_heads):
        _integer(heads, f"model.kv_heads[{index}]", 1, MAX_POSITION)
    entries = _list(data["layers"], "layers")
    if len(entries) != layers:
        raise ConfigError(f"kv plan: {len(entries)} layer entries for a model of {layers} layers")
    for index, entry in enumerate(entries):
        _check_layer(_object(entry, f"layers[{index}]"), index, kv_heads[index])
    evidence = _object(data["evidence"], "evidence")
    if "calibration" in evidence:
        calibration = _object(evidence["calibration"], "evidence.calibration")
        source = calibration.get("source")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"kv plan: evidence.calibration.source must name the calibration data, got {_shown(source)}")
        digest = calibration.get("sha256")
        if "sha256" in calibration and not (isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)):
            raise ConfigError(f"kv plan: evidence.calibration.sha256 must be the 64 hex digits of a sha256, got {json.dumps(digest)[:80]}")


def _check_layer(entry: dict, index: int, heads: int) -> None:
    where = f"layers[{index}]"
    _known(entry, LAYER_FIELDS, f"{where}.")
    if "layer" in entry and _integer(entry["layer"], f"{where}.layer", 0, MAX_POSITION) != index:
        raise ConfigError(f"kv plan: {where} is marked layer {_shown(entry['layer'])}: entries are applied in list order, so layer i must be entry i")
    bits = _list(entry.get("kv_bits"), f"{where}.kv_bits")
    if len(bits) != heads:
        raise ConfigError(f"kv plan: layer {index} gives bits for {len(bits)} KV heads, the model has {heads}")
    for head, value in enumerate(bits):
        _integer(value, f"{where}.kv_bits[{head}]", MIN_BITS, MAX_BITS)
    for position, value in enumerate(_list(entry.get("keep_positions", []), f"{where}.keep_positions")):
        _integer(value, f"{where}.keep_positions[{position}]", 0, MAX_POSITION)
