"""Mixed-precision plans: a bit width per decoder layer at one site, chosen from the per-layer sensitivity map
(`eval.sensitivity`, docs/damage.md "Mixed-precision plans").

The allocation rests on one approximation, stated in every plan file: **additive per-layer damage**. The damage of
quantizing a set of layers is taken to be the sum of the mean KL divergences (`kld_mean`, llama.cpp's definition,
`eval.damage`) each layer does when quantized alone at its width. Under it, choosing one candidate width per layer
to minimise the summed damage with the mean width at most the budget is an exact multiple-choice knapsack, solved
by dynamic programming over layers (`allocate`). How good the approximation is, is checked by measuring the whole
plan in one forward on the same tokens: a plan records both `predicted_kld_mean` (the sum) and
`measured_kld_mean`.

A plan file is JSON (`"schema": "quantdiff.precision-plan"`, version 1), validated as a whole when read
(`load_plan`): every malformed field is one ConfigError line naming the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import nn

from quantdiff.core.documents import read_json_file
from quantdiff.core.errors import ConfigError
from quantdiff.data.sources import BUILTINS
from quantdiff.quant.numerics import MAX_BITS, MIN_BITS
from quantdiff.quant.registry import GRANULARITY_NAMES, METHOD_NAMES, SITE_NAMES
from quantdiff.quant.sites import QuantConfig, parse_config

SCHEMA = "quantdiff.precision-plan"
VERSION = 1
APPROXIMATION = ("additive per-layer damage: a set of layers is predicted to do the sum of the mean KL divergences "
                 "(kld_mean) each does quantized alone at its width; measured_kld_mean is the whole plan in one forward")
MAX_PLAN_BYTES = 16 << 20  # a plan for 100,000 layers is a few MB
FIELDS = ("schema", "version", "model", "method", "site", "granularity", "budget_bits", "average_bits", "candidates", "layers",
          "approximation", "predicted_kld_mean", "measured_kld_mean", "calibration")
MODEL_FIELDS = ("name", "decoder_layers")
CALIBRATION_FIELDS = ("source", "tokens", "seq_len", "bos", "tokens_sha256", "sha256")
AVERAGE_TOLERANCE = 1e-9  # average_bits is a mean of integers, written as a float


@dataclass(frozen=True)
class PrecisionPlan:
    """A bit width per decoder layer (`bits[i]` for layer i) at one site, method and granularity."""

    model: dict  # {"name": what `quantdiff sensitivity` calls the model, "decoder_layers": its count}
    method: str
    site: str
    granularity: str
    budget_bits: float
    candidates: tuple[int, ...]
    bits: tuple[int, ...]
    predicted_kld_mean: float
    measured_kld_mean: float
    calibration: dict  # source, tokens, seq_len, bos, tokens_sha256 (of the token ids), sha256 (of a data file)

    @property
    def average_bits(self) -> float:
        return sum(self.bits) / len(self.bits)

    def bits_per_layer(self) -> dict[int, int]:
        """Decoder layer index -> its bit width."""
        return dict(enumerate(self.bits))

    def configs(self) -> list[QuantConfig]:
        """One config per bit width the plan uses, on that width's layers (disjoint sets covering every layer)."""
        widths = sorted(set(self.bits))
        return [parse_config(self.method, b, self.site, self.granularity, layers=[i for i, w in enumerate(self.bits) if w == b]) for b in widths]

    def record(self) -> dict:
        """What a cell run with this plan records (`eval.sweep.Cell.precision_plan`)."""
        return {"model": self.model["name"], "budget_bits": self.budget_bits, "average_bits": self.average_bits, "candidates": list(self.candidates),
                "bits_per_layer": list(self.bits), "predicted_kld_mean": self.predicted_kld_mean, "measured_kld_mean": self.measured_kld_mean}

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, "model": dict(self.model), "method": self.method, "site": self.site,
                "granularity": self.granularity, "budget_bits": self.budget_bits, "average_bits": self.average_bits,
                "candidates": list(self.candidates), "layers": [{"layer": i, "bits": b} for i, b in enumerate(self.bits)],
                "approximation": APPROXIMATION, "predicted_kld_mean": self.predicted_kld_mean,
                "measured_kld_mean": self.measured_kld_mean, "calibration": dict(self.calibration)}

    @classmethod
    def from_dict(cls, data: Any) -> PrecisionPlan:
        """The plan a document holds; ConfigError naming the first field that breaks the schema."""
        return _checked(data)

    def check_model(self, model: nn.Module | int, name: str = "the model") -> None:
        """ConfigError when the plan was made for another number of decoder layers than `model` (or a count) has."""
        from quantdiff.models import structure

        count = model if isinstance(model, int) else len(structure.decoder_layers(model))
        if count != len(self.bits):
            raise ConfigError(f"the precision plan for {self.model['name']} sets {len(self.bits)} decoder layers: {name} has {count}")


@dataclass(frozen=True)
class PlannedConfig:
    """A plan's configs (`PrecisionPlan.configs`) applied together as one quantization (`sites.apply_quantization`)."""

    plan: PrecisionPlan
    parts: tuple[QuantConfig, ...]

    @property
    def site(self):
        """The one site every part quantizes (what code asking a config for its site's options reads)."""
        return self.parts[0].site

    def parts_for(self, model: nn.Module) -> list[QuantConfig]:
        """One config per width (`sites.apply_quantization`), once the plan is checked to fit `model` (a plan for
        fewer layers would leave the rest unquantized)."""
        self.plan.check_model(model)
        return list(self.parts)


def planned_config(plan: PrecisionPlan) -> PlannedConfig:
    return PlannedConfig(plan, tuple(plan.configs()))


# ---- the allocation -----------------------------------------------------------------------------------------


def allocate(damage: Sequence[Mapping[int, float]], budget_bits: float) -> list[int]:
    """The widths (one per layer) minimising Σ damage[i][width] subject to mean width ≤ budget_bits, each layer's
    width one of its `damage` keys: an exact multiple-choice knapsack by dynamic programming over layers, the state
    being the bits spent so far (integers, so the budget is ⌊n·budget⌋ bits in all). Of plans equally damaging,
    the one spending fewest bits. Additive per-layer damage is the approximation (module docstring)."""
    n = len(damage)
    if n == 0:
        raise ConfigError("a plan needs at least one layer")
    capacity = math.floor(n * budget_bits + AVERAGE_TOLERANCE)
    if sum(min(d) for d in damage) > capacity:
        raise ConfigError(f"budget {budget_bits:g} bits is below the narrowest widths' mean {sum(min(d) for d in damage) / n:g}")
    best: dict[int, float] = {0: 0.0}  # bits spent -> least damage so far
    choices: list[dict[int, tuple[int, int]]] = []  # per layer: bits spent -> (previous spent, width)
    for layer in damage:
        step: dict[int, float] = {}
        back: dict[int, tuple[int, int]] = {}
        for spent, total in sorted(best.items()):
            for width in sorted(layer):
                after = spent + width
                if after <= capacity and (after not in step or total + layer[width] < step[after]):
                    step[after], back[after] = total + layer[width], (spent, width)
        best = step
        choices.append(back)
    spent = min(best, key=lambda s: (best[s], s))
    widths = []
    for back in reversed(choices):
        spent, width = back[spent]
        widths.append(width)
    return widths[::-1]


def plan_from_map(
    sites_by_bits: Mapping[int, dict], budget_bits: float, model: dict, method: str, granularity: str, calibration: dict,
    measured_kld_mean: float = math.nan, bits: Sequence[int] | None = None,
) -> PrecisionPlan:
    """A plan from one site's sensitivity map at each candidate width ({bits: `sensitivity_map`'s site entry}):
    the knapsack's widths, or `bits` as given (a plan chosen otherwise, its damage predicted the same way);
    `measured_kld_mean` stays NaN until the caller measures the plan."""
    candidates = sorted(sites_by_bits)
    check_budget(budget_bits, candidates)
    entries = {b: {e["layer"]: e["damage"]["kld_mean"] for e in site["layers"]} for b, site in sites_by_bits.items()}
    layers = model["decoder_layers"]
    missing = next((i for i in range(layers) for b in candidates if i not in entries[b]), None)
    if missing is not None:
        raise ConfigError(f"a plan sets every decoder layer's width: layer {missing} has no damage measured at the site")
    damage = [{b: entries[b][i] for b in candidates} for i in range(layers)]
    chosen = allocate(damage, budget_bits) if bits is None else list(bits)
    site = next(iter(sites_by_bits.values()))["site"]
    return PrecisionPlan(dict(model), method, site, granularity, float(budget_bits), tuple(candidates), tuple(chosen),
                         float(sum(damage[i][b] for i, b in enumerate(chosen))), float(measured_kld_mean), dict(calibration))


def check_budget(budget_bits: float, candidates: Sequence[int], flag: str = "--plan-budget") -> None:
    """The budget must lie from the narrowest to the widest candidate width."""
    if not candidates:
        raise ConfigError(f"{flag} needs candidate bit widths (--bits 4,8)")
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, Real) or not min(candidates) <= budget_bits <= max(candidates):
        raise ConfigError(f"{flag} must be from the narrowest to the widest of --bits ({min(candidates)} to {max(candidates)}), got {budget_bits!r:.40}")


# ---- the file -----------------------------------------------------------------------------------------------


def save_plan(plan: PrecisionPlan, path: str | Path, force: bool = False) -> None:
    """Write the plan as JSON, atomically (`core.atomic`)."""
    from quantdiff.core.atomic import write_json

    write_json(path, plan.to_dict(), indent=1, force=force, flag="--out")


def load_plan(path: str | Path) -> PrecisionPlan:
    """The plan in file `path`, validated as a whole; ConfigError in one line naming what is wrong."""
    from quantdiff.data.sources import check_data_file

    check_data_file(path, "--plan")
    data = read_json_file(Path(path), "--plan", "precision plan", MAX_PLAN_BYTES)
    return _checked(data)


def _fail(field: str, want: str, value: Any) -> ConfigError:
    return ConfigError(f"precision plan: {field} must be {want}, got {json.dumps(value, default=repr)[:40]}")


def _integer(value: Any, field: str, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not least <= value <= most:
        raise _fail(field, f"an integer from {least} to {most}", value)
    return int(value)


def _number(value: Any, field: str, least: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < least:
        raise _fail(field, f"a finite number of at least {least:g}", value)
    return float(value)


def _choice(value: Any, field: str, names: Sequence[str]) -> str:
    if value not in names:
        raise _fail(field, f"one of {', '.join(names)}", value)
    return value


def _object(value: Any, field: str, fields: Sequence[str], required: Sequence[str]) -> dict:
    if not isinstance(value, dict):
        raise _fail(field, "an object", value)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"precision plan: unknown field {field + '.' if field else ''}{unknown[0]} (known: {', '.join(fields)})")
    missing = next((key for key in required if key not in value), None)
    if missing is not None:
        raise ConfigError(f"precision plan: the field {field + '.' if field else ''}{missing} is missing")
    return value


def _sha256(value: Any, field: str) -> str:
    if not (isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value)):
        raise _fail(field, "the 64 hex digits of a sha256", value)
    return value


def _checked(data: Any) -> PrecisionPlan:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f'not a precision plan: expected "schema": "{SCHEMA}"')
    if type(data.get("version")) is not int or data["version"] != VERSION:
        raise ConfigError(f"precision plan: version {json.dumps(data.get('version'))[:20]} is not supported (this quantdiff reads version {VERSION})")
    _object(data, "", FIELDS, FIELDS)
    model = _object(data["model"], "model", MODEL_FIELDS, MODEL_FIELDS)
    if not isinstance(model["name"], str) or not model["name"]:
        raise _fail("model.name", "the model's name", model["name"])
    count = _integer(model["decoder_layers"], "model.decoder_layers", 1, 1 << 20)
    method = _choice(data["method"], "method", METHOD_NAMES)
    site = _choice(data["site"], "site", SITE_NAMES)
    granularity = _choice(data["granularity"], "granularity", tuple(GRANULARITY_NAMES))
    if not isinstance(data["candidates"], list) or not data["candidates"]:
        raise _fail("candidates", "a non-empty list of bit widths", data["candidates"])
    candidates = [_integer(b, f"candidates[{i}]", MIN_BITS, MAX_BITS) for i, b in enumerate(data["candidates"])]
    if candidates != sorted(set(candidates)):
        raise _fail("candidates", "distinct bit widths in increasing order", data["candidates"])
    budget = _number(data["budget_bits"], "budget_bits")
    check_budget(budget, candidates, "precision plan: budget_bits")
    entries = data["layers"]
    if not isinstance(entries, list) or len(entries) != count:
        raise _fail("layers", f"a list of {count} entries (model.decoder_layers)", entries if not isinstance(entries, list) else f"{len(entries)} entries")
    bits: dict[int, int] = {}
    for index, entry in enumerate(entries):
        entry = _object(entry, f"layers[{index}]", ("layer", "bits"), ("layer", "bits"))
        layer = _integer(entry["layer"], f"layers[{index}].layer", 0, count - 1)
        if layer in bits:
            raise ConfigError(f"precision plan: layers[{index}] names layer {layer} again: every decoder layer exactly once")
        if type(entry["bits"]) is not int or entry["bits"] not in candidates:
            raise _fail(f"layers[{index}].bits", f"one of the candidates {candidates}", entry["bits"])
        bits[layer] = entry["bits"]
    ordered = tuple(bits[i] for i in range(count))
    average = _number(data["average_bits"], "average_bits")
    if abs(average - sum(ordered) / count) > AVERAGE_TOLERANCE:
        raise ConfigError(f"precision plan: average_bits {average:g} is not the layers' mean width {sum(ordered) / count:g}")
    if average > budget + AVERAGE_TOLERANCE:
        raise ConfigError(f"precision plan: average_bits {average:g} is over budget_bits {budget:g}")
    if data["approximation"] != APPROXIMATION:
        raise _fail("approximation", "the additive per-layer damage this quantdiff plans with", data["approximation"])
    predicted = _number(data["predicted_kld_mean"], "predicted_kld_mean")
    measured = _number(data["measured_kld_mean"], "measured_kld_mean")
    calibration = _object(data["calibration"], "calibration", CALIBRATION_FIELDS, CALIBRATION_FIELDS[:5])
    if not isinstance(calibration["source"], str) or not calibration["source"]:
        raise _fail("calibration.source", "the calibration data's name", calibration["source"])
    _integer(calibration["tokens"], "calibration.tokens", 1, 1 << 40)
    if calibration["seq_len"] is not None:
        _integer(calibration["seq_len"], "calibration.seq_len", 2, 1 << 40)
    if not isinstance(calibration["bos"], bool):
        raise _fail("calibration.bos", "true or false", calibration["bos"])
    _sha256(calibration["tokens_sha256"], "calibration.tokens_sha256")
    if "sha256" not in calibration and calibration["source"] not in BUILTINS:  # else it cannot be compared with the evaluation data
        raise ConfigError("precision plan: the field calibration.sha256 is missing: a plan calibrated on a file records the file's sha256")
    if "sha256" in calibration:
        _sha256(calibration["sha256"], "calibration.sha256")
    parse_config(method, candidates[0], site, granularity)  # a (method, site, granularity) the quantizers support
    return PrecisionPlan(dict(model), method, site, granularity, budget, tuple(candidates), ordered, predicted, measured, dict(calibration))
