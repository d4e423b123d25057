"""Per-layer bit widths of an export (issue 55, item 4: a mixed-precision plan's {decoder layer: bits}).

The plan is checked once, at the door of each exporter: `check_widths` before the model loads (every width one
the format can hold, the types), `module_formats` once it has (every decoder layer named exactly once, no index
out of range). The linear weights of decoder layer i are then written as the same format at layer_bits[i] would
write them in a uniform export; a module outside the decoder layers (lm_head with include_lm_head) keeps the
format's own width. The export records the plan as its section's `layer_bits` ({"0": 8, "1": 4}: JSON keys),
and each quantized module's width as `module_bits`, by which quantdiff's loader decodes it (`stored_formats`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from torch import nn

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.integers import as_int
from quantdiff.models.structure import model_label
from quantdiff.quant.compressed_tensors import CompressedTensorsExport
from quantdiff.quant.formats import AbsmaxExport, ExportFormat
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.sites import decoder_layer_prefixes

SECTION_KEY = "layer_bits"  # the export's recorded plan, {"0": 8, ...}
MODULES_KEY = "module_bits"  # every quantized module's width, what quantdiff's loader decodes by


def check_widths(layer_bits: object, fmt: ExportFormat) -> dict[int, ExportFormat]:
    """{layer index: its format} for a plan `fmt` can hold; one ConfigError line naming the first layer (or the
    format) that it cannot. Indices are checked against the model by `module_formats`."""
    if not isinstance(fmt, (AbsmaxExport, CompressedTensorsExport, GGUFExport)):  # one width per file, in bitsandbytes' layout
        raise ConfigError(f"layer_bits: --method {fmt.name} (bitsandbytes' layout) stores every layer at {fmt.bits} bits; "
                          "per-layer widths need --method absmax, --format compressed-tensors or --format gguf")
    if not isinstance(layer_bits, Mapping) or not layer_bits:
        got = "an empty mapping" if isinstance(layer_bits, Mapping) else type(layer_bits).__name__  # a repr could run over lines
        raise ConfigError(f"layer_bits must map each decoder layer's index to its bits, e.g. {{0: 8, 1: 4}}; got {got}")
    formats = {}
    for layer, bits in layer_bits.items():
        index, width = as_int(layer), as_int(bits)
        if index is None:
            raise ConfigError(f"layer_bits: a layer index must be an integer, got {layer!r}")
        if index in formats:  # keys that differ as objects but are one integer (a custom Mapping may hold them)
            raise ConfigError(f"layer_bits: layer {index} is given twice: a plan names every decoder layer once")
        if width is None:
            raise ConfigError(f"layer_bits: layer {index}'s width must be an integer, got {bits!r}")
        try:
            formats[index] = replace(fmt, bits=width)  # the format's own check of the width, as a uniform export runs it
        except ConfigError as exc:
            raise ConfigError(f"layer_bits: layer {index} at {width} bits: {exc}") from None
    return formats


def module_formats(model: nn.Module, modules: list[str], fmt: ExportFormat, layer_bits: Mapping[int, int]) -> dict[str, ExportFormat]:
    """{module name: the format it is written in} for `modules` of `model`: each decoder layer's at its width in
    `layer_bits` (checked by `check_widths`), every other one (lm_head) at fmt's. Every decoder layer must be
    named exactly once, and no other index: ConfigError naming the first that is not."""
    formats = check_widths(layer_bits, fmt)
    prefixes = decoder_layer_prefixes(model)
    wrong = sorted(index for index in formats if not 0 <= index < len(prefixes))
    if wrong:
        raise ConfigError(f"layer_bits: layer {wrong[0]} is out of range: {model_label(model)} has {len(prefixes)} decoder layers (0–{len(prefixes) - 1})")
    missing = [index for index in range(len(prefixes)) if index not in formats]
    if missing:
        raise ConfigError(f"layer_bits: decoder layer {missing[0]} ({prefixes[missing[0]]}) has no width: a plan names every decoder layer once")
    layer_of = {prefix + ".": index for index, prefix in enumerate(prefixes)}
    return {fqn: next((formats[index] for prefix, index in layer_of.items() if fqn.startswith(prefix)), fmt) for fqn in modules}


def recorded(layer_bits: Mapping[int, int], formats: Mapping[str, ExportFormat]) -> dict:
    """What the export's section records of a plan: `layer_bits` as given (JSON keys are strings, in layer order)
    and `module_bits`, every quantized module's width, which quantdiff's loader decodes by (`stored_formats`)."""
    plan = {str(index): int(bits) for index, bits in sorted((as_int(k), v) for k, v in layer_bits.items())}
    return {SECTION_KEY: plan, MODULES_KEY: {fqn: module_fmt.bits for fqn, module_fmt in sorted(formats.items())}}


def stored_formats(section: dict, fmt: ExportFormat) -> dict[str, ExportFormat]:
    """{module: the format it was written in} of an export's section: fmt's for a uniform export, else each at
    its recorded `module_bits` (LoadError when they do not name exactly the quantized modules, or a width fmt
    cannot hold)."""
    modules = section["modules"]
    stored = section.get(MODULES_KEY)
    if stored is None:
        return {fqn: fmt for fqn in modules}
    if not isinstance(stored, dict) or sorted(stored) != sorted(modules):
        raise LoadError(f"the recorded {MODULES_KEY} do not name the quantized modules")
    try:
        return {fqn: replace(fmt, bits=stored[fqn]) for fqn in modules}
    except ConfigError as exc:
        raise LoadError(f"the recorded {MODULES_KEY} hold a width the format cannot: {exc}") from None


def described(fmt: ExportFormat, formats: Iterable[ExportFormat]) -> dict:
    """The section's description of an export in `fmt` whose modules are written in `formats`: fmt's own, with
    any field only another width has (a W8A8 layer's `activation_rule` in a W4A16 export) added, so a loader
    and a reader see every rule the file holds; the widths themselves are the section's `layer_bits`."""
    description = fmt.describe()
    for other in formats:
        description = {**other.describe(), **description}
    return description


def plan_phrase(plan: Mapping[str, int] | Mapping[int, int]) -> str:
    """A recorded plan in words, widest first: '8 bits: layers 0, 5; 4 bits: layers 1–4, 6–29'."""
    by_bits: dict[int, list[int]] = {}
    for index, bits in plan.items():
        by_bits.setdefault(int(bits), []).append(int(index))
    return "; ".join(f"{bits} bits: layer{'s' if len(layers) > 1 else ''} {_ranges(sorted(layers))}" for bits, layers in sorted(by_bits.items(), reverse=True))


def _ranges(indices: list[int]) -> str:
    """[1, 2, 3, 5] -> '1–3, 5'."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs)
