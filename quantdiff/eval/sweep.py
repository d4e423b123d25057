"""The accuracy sweep (the paper's Figure 8, plus LLM.int8): one task, every (method, bits, site) cell per model.

Each model gets an unquantized reference cell (method, bits and site all null) and one cell per supported
configuration. A (method, site) pair the quantizers do not support — LLM.int8 on the logits site, whose
outlier decomposition is defined for matmul operands — is skipped with its reason, never silently remapped.
A linear-site transform (Hadamard rotation, SmoothQuant) is recorded in each cell it applies to; with `blocks`,
each cell is also evaluated block by block (contiguous blocks of the task's items) for intervals by batch means.
Every cell records its granularity and whether it is causal (`registry.is_causal`): granularity tensor, the
former default, lets later tokens set earlier tokens' scales, and its cells say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import nn

from quantdiff.core.errors import ConfigError
from quantdiff.quant.numerics import check_bits
from quantdiff.quant.registry import DEFAULT_GRANULARITY, CAUSAL_GRANULARITIES, granularity, granularity_name, method_name, site_name
from quantdiff.quant.kv_layout import LAYOUTS
from quantdiff.quant.kv_plan import KVPlan, measured_bits
from quantdiff.quant.precision_plan import PlannedConfig
from quantdiff.quant.sites import KVSite, LinearSite, QuantConfig, linear_targets, parse_config, quantized
from quantdiff.quant.transforms import Transform, transform_record
from quantdiff.eval.cell_damage import cell_damages
from quantdiff.eval.scoring import counting_scored_logits
from quantdiff.eval.tasks.registry import Task

REFERENCE = "reference"
SWEEP_SCHEMA = "quantdiff.sweep"  # the JSON of `sweep --json` / `eval --json`


@dataclass(frozen=True)
class Cell:
    model: str
    task: str
    method: str | None  # None: the unquantized reference
    bits: int | None
    site: str | None
    metrics: dict[str, float | None] = field(default_factory=dict)
    nonfinite_logits: int = 0  # scored positions whose logits held NaN/Inf: > 0 makes the cell invalid
    group_size: int | None = None  # absmax weights in groups of this many inputs (linear site); None: per channel
    transform: dict | None = None  # the linear site's rotation or smoothing, as `transforms.transform_record` gives it
    blocks: list[dict] | None = None  # metrics of each block of items, when evaluated by blocks
    kv_plan: dict | None = None  # a kv plan's policy, budget and the effective bits it measured (`quant.kv_plan`)
    granularity: str | None = None  # registry.GRANULARITY_NAMES; None for the reference
    recorded: list[dict] | None = None  # what the model's export quantizes at run time (`checkpoint.recorded_quantization`)
    layers: list[int] | None = None  # the decoder layers quantized (`QuantConfig.layers`); None: every layer
    precision_plan: dict | None = None  # a mixed-precision plan's widths (`PrecisionPlan.record`); bits is then their average
    damage: dict | None = None  # KL divergence etc. against the model unquantized (`eval.cell_damage`); None: not measured
    kv_mode: str | None = None  # the kv site's cache layout (`kv_layout.LAYOUTS` name, else its description); None: none

    @property
    def causal(self) -> bool:
        """Whether every quantizer that ran, the cell's own and those its export records, is causal (a kv layout
        not named in `LAYOUTS` is not claimed causal)."""
        grains = [self.granularity] + [r["granularity"] for r in self.recorded or []]
        laid_out = self.kv_mode is None or (self.kv_mode in LAYOUTS and LAYOUTS[self.kv_mode].causal)
        return laid_out and all(g is None or g in CAUSAL_GRANULARITIES for g in grains)

    @property
    def is_reference(self) -> bool:
        return self.method is None

    @property
    def valid(self) -> bool:
        return self.nonfinite_logits == 0

    def to_dict(self) -> dict[str, Any]:
        optional = {k: v for k, v in (("group_size", self.group_size), ("transform", self.transform), ("kv_plan", self.kv_plan), ("recorded", self.recorded),
                                      ("layers", self.layers), ("precision_plan", self.precision_plan), ("damage", self.damage), ("kv_mode", self.kv_mode)) if v is not None}
        blocks = {} if self.blocks is None else {"blocks": self.blocks}
        return {"model": self.model, "task": self.task, "method": self.method, "bits": self.bits, "site": self.site,
                "granularity": self.granularity, "causal": self.causal, **optional, **self.metrics, "valid": self.valid, "nonfinite_logits": self.nonfinite_logits, **blocks}


@dataclass(frozen=True)
class SweepPlan:
    configs: list[QuantConfig]
    skipped: list[str]  # one line per unsupported (method, site) pair


def plan_sweep(
    methods: Sequence[str], bits: Sequence[int], sites: Sequence[str], group_size: int | None = None, transform: Transform | None = None,
    scales: str = DEFAULT_GRANULARITY, layers: Sequence[int] | None = None, kv_layout: str | None = None,
) -> SweepPlan:
    """Every supported (method, site, bits) configuration; unknown names are errors, unsupported pairs skipped.
    group_size: absmax weights at the linear site in groups of that many inputs (LLM.int8 is then skipped), or
    the kv site's rows in groups of that many channels.
    transform: a rotation or smoothing at the linear site, which must then be the only site.
    scales: every configuration's granularity (`sites.parse_config`); "tensor" is the former, non-causal default.
    layers: quantize only these decoder layers (None: every layer).
    kv_layout: the kv site's cache layout by name (`kv_layout.LAYOUTS`; `--kv-mode`), which must then be the only site."""
    granularity(scales)
    if kv_layout is not None and list(dict.fromkeys(sites)) != ["kv"]:
        raise ConfigError(f"--kv-mode {kv_layout} sets how the kv site quantizes the cache: use it with --site kv only, not {','.join(sites)}")
    if transform is not None and list(dict.fromkeys(sites)) != ["linear"]:
        raise ConfigError(f"--{'rotate' if transform.name == 'hadamard' else 'smooth'} transforms the linear site: use it with --site linear only")
    methods = [method_name(name) for name in methods]
    for name in sites:
        site_name(name)
    for b in bits:
        check_bits(b)
    configs, skipped = [], []
    for method in dict.fromkeys(methods):
        for site in dict.fromkeys(sites):
            try:
                configs.extend(parse_config(method, b, site, scales, group_size=group_size, transform=transform, kv_layout=kv_layout, layers=layers)
                               for b in dict.fromkeys(bits))
            except ConfigError as exc:  # names and bits are valid, so this pair is unsupported
                skipped.append(f"{method} at site {site}: {exc}")
    if not configs:
        raise ConfigError("no supported quantization configuration: " + "; ".join(skipped))
    return SweepPlan(configs, skipped)


def describe(config: QuantConfig | PlannedConfig | None) -> tuple[str | None, int | float | None, str | None]:
    """(method, bits, site) names of a configuration, all None for the reference; a mixed-precision plan's bits
    are its average width."""
    if config is None:
        return None, None, None
    if isinstance(config, PlannedConfig):
        return config.plan.method, config.plan.average_bits, config.plan.site
    data = config.to_dict()
    return data["method"]["name"], data["method"]["bits"], data["site"]["name"]


def group_size_of(config: QuantConfig | PlannedConfig | None) -> int | None:
    """The group size of a configuration (the linear site's weights, the kv site's rows), None when weights are
    per output channel and cache rows whole (or nothing is quantized)."""
    if config is None or isinstance(config, PlannedConfig):
        return None
    layout = getattr(config.site, "layout", None)
    return getattr(config.method, "weight_group_size", None) or getattr(config.site, "group_size", None) or getattr(layout, "group_size", None)


def granularity_of(config: QuantConfig | PlannedConfig | None) -> str | None:
    if isinstance(config, PlannedConfig):
        return config.plan.granularity
    return None if config is None else granularity_name(config.method.granularity)


def layers_of(config: QuantConfig | PlannedConfig | None) -> list[int] | None:
    return None if config is None or isinstance(config, PlannedConfig) or config.layers is None else list(config.layers)


def precision_plan_of(config: QuantConfig | PlannedConfig | None) -> dict | None:
    return config.plan.record() if isinstance(config, PlannedConfig) else None


def transform_of(config: QuantConfig | PlannedConfig | None) -> Transform | None:
    return None if config is None or not isinstance(config.site, LinearSite) else config.site.transform


def transform_tag(transform: dict | None) -> str:
    """' +hadamard', ' +smooth α=0.5' or '' (a cell label's transform part)."""
    if transform is None:
        return ""
    return f" +{transform['name']}" + (f" α={transform['alpha']:g}" if "alpha" in transform else "")


def label(method: str | None, bits: int | None, site: str | None, group_size: int | None = None, transform: dict | None = None,
          kv_plan: dict | None = None, granularity: str | None = None, layers: Sequence[int] | None = None,
          precision_plan: dict | None = None, kv_mode: str | None = None) -> str:
    if method is None:
        return REFERENCE
    scales = "" if granularity in (None, DEFAULT_GRANULARITY) else f" [{granularity}{'' if granularity in CAUSAL_GRANULARITIES else ', non-causal'}]"
    if precision_plan is not None:  # bits is the plan's average width
        return f"{method} plan {precision_plan['average_bits']:.3g}b avg ({'/'.join(map(str, precision_plan['candidates']))}) @{site}{scales}"
    plan = "" if kv_plan is None else f" plan:{kv_plan['policy']}"
    chosen = "" if layers is None else f" layers {','.join(map(str, layers))}"
    mode = "" if kv_mode is None else f" ({kv_mode})"
    return f"{method} {bits}b{'' if group_size is None else f' g{group_size}'}{transform_tag(transform)} @{site}{mode}{chosen}{plan}{scales}"


def kv_mode_of(config: QuantConfig | None) -> str | None:
    """The kv site's layout by its `LAYOUTS` name, whatever its group size (`group_size_of` records that); its
    description when it is none of them; None without one."""
    layout = None if config is None or not isinstance(config.site, KVSite) else config.site.layout
    if layout is None:
        return None
    fields = lambda l: (l.keys, l.zero_point, l.residual, l.engine)  # noqa: E731
    return next((name for name, known in LAYOUTS.items() if fields(known) == fields(layout)), layout.name)


def kv_plan_of(config: QuantConfig | PlannedConfig | None) -> KVPlan | None:
    return None if config is None or not isinstance(config.site, KVSite) else config.site.plan


def cell_label(cell: Cell) -> str:
    """The cell's quantization, then what its model's export records (a cell adding none is labelled with the
    export's own: `describe_run`)."""
    own = label(cell.method, cell.bits, cell.site, cell.group_size, cell.transform, cell.kv_plan, cell.granularity, cell.layers, cell.precision_plan, cell.kv_mode)
    recorded = [label(r["method"], r["bits"], r["site"], granularity=r["granularity"]) for r in cell.recorded or []]
    if not recorded:
        return own
    return f"{'' if own == recorded[-1] else own + ' + '}{'; '.join(recorded)} (recorded in the export)"


def describe_run(config: QuantConfig | PlannedConfig | None, recorded: list[dict]) -> tuple[str | None, int | float | None, str | None, str | None]:
    """(method, bits, site, granularity) of a cell: its own configuration's, or, for a cell adding none to a model
    whose export records run-time quantizers, the last of those (what ran: never null beside a quantized run)."""
    if config is None and recorded:
        last = recorded[-1]
        return last["method"], last["bits"], last["site"], last["granularity"]
    return (*describe(config), granularity_of(config))


CellProgress = Callable[[str, int], Callable[[float], None]]  # (label, total units) -> advance(n)


def split_blocks(prepared: Any, count: int) -> list[Any]:
    """`count` contiguous, nearly equal blocks of a task's prepared items (a dataclass holding one list)."""
    lists = [f.name for f in dataclasses.fields(prepared) if isinstance(getattr(prepared, f.name), list)] if dataclasses.is_dataclass(prepared) else []
    if len(lists) != 1:
        raise ConfigError(f"{type(prepared).__name__} cannot be split into blocks")
    items = getattr(prepared, lists[0])
    if not 2 <= count <= len(items):
        raise ConfigError(f"--blocks must be from 2 to the {len(items)} items evaluated, got {count}")
    bounds = [round(i * len(items) / count) for i in range(count + 1)]
    return [dataclasses.replace(prepared, **{lists[0]: items[a:b]}) for a, b in zip(bounds, bounds[1:])]


def _evaluate(model: nn.Module, task: Task, prepared: Any, advance, blocks: int | None) -> tuple[dict, list[dict] | None]:
    """(metrics, per-block metrics or None); by blocks, the metrics pool the blocks' exactly (`task.pool`)."""
    if blocks is None:
        return dict(task.evaluate(model, prepared, advance)), None
    pool = getattr(task, "pool", None)
    if pool is None:
        raise ConfigError(f"task {task.name!r} cannot pool metrics over blocks (--blocks works with tasks lm and bb)")
    per_block = [dict(task.evaluate(model, part, advance)) for part in split_blocks(prepared, blocks)]
    return pool(per_block), per_block


def run_cell(
    model: nn.Module,
    name: str,
    task: Task,
    prepared: Any,
    config: QuantConfig | PlannedConfig | None,
    progress: CellProgress | None = None,
    allow_partial: bool = False,
    blocks: int | None = None,
) -> Cell:
    """One cell. Non-finite logits at any scored position make it invalid: its metrics become None (null in
    JSON), since an argmax over NaN picks a token anyway and would pass for an accuracy."""
    transform = transform_of(config)
    record = None if transform is None else transform_record(transform, model, [m for _, m in linear_targets(model, config.site, allow_partial)])
    plan = kv_plan_of(config)
    plan_record = None if plan is None else plan.record()
    widths = precision_plan_of(config)
    advance = progress(f"{name} · {label(*describe(config), group_size_of(config), record, plan_record, granularity_of(config), layers_of(config), widths, kv_mode_of(config))}",
                       len(prepared)) if progress is not None else None
    with quantized(model, config, allow_partial), counting_scored_logits() as scored:
        metrics, per_block = _evaluate(model, task, prepared, advance, blocks)
        if plan_record is not None:
            plan_record["effective_bits"] = measured_bits(model)
    if scored.nonfinite:
        metrics.update(dict.fromkeys(task.metrics))
        per_block = None
    recorded = getattr(model, "quantdiff_recorded", None) or []
    method, bits, site, grain = describe_run(config, recorded)
    return Cell(name, task.name, method, bits, site, metrics, scored.nonfinite, group_size_of(config), record, per_block, plan_record, grain, recorded or None,
                layers_of(config), widths, kv_mode=kv_mode_of(config))


def run_model_cells(
    name: str,
    model: nn.Module,
    task: Task,
    prepared: Any,
    configs: Sequence[QuantConfig | PlannedConfig],
    progress: CellProgress | None = None,
    include_reference: bool = True,
    allow_partial: bool = False,
    blocks: int | None = None,
    damage: bool = False,
) -> list[Cell]:
    """One model's cells on data already prepared for its tokenizer: the reference first, then each config.
    damage: each config's cell also carries its damage against the model unquantized (`eval.cell_damage`), all
    configs measured together after the cells; the reference carries none."""
    cells = [run_cell(model, name, task, prepared, config, progress, allow_partial, blocks) for config in ([None] if include_reference else []) + list(configs)]
    if not damage or not configs:
        return cells
    measured = cell_damages(model, task, prepared, configs, task.batch_size, progress, name, allow_partial)
    first = len(cells) - len(configs)  # the reference, when included, comes first
    return cells[:first] + [dataclasses.replace(cell, damage=fields) for cell, fields in zip(cells[first:], measured)]


def run_sweep(
    models: dict[str, tuple[nn.Module, Any]],
    task: Task,
    configs: Sequence[QuantConfig | PlannedConfig],
    limit: int | None = None,
    progress: CellProgress | None = None,
    include_reference: bool = True,
    bos_ids: dict[str, int | None] | None = None,
) -> list[Cell]:
    """{name: (model, tokenizer)} -> the unquantized reference cell, then one cell per config, model by model;
    `bos_ids`: {name: the BOS id opening its sequences (`models.bos`)}, none where absent."""
    cells = []
    for name, (model, tokenizer) in models.items():
        prepared = task.prepare(tokenizer, limit, (bos_ids or {}).get(name))
        cells.extend(run_model_cells(name, model, task, prepared, configs, progress, include_reference))
    return cells


def cells_to_json(cells: Sequence[Cell], sources: dict[str, dict | None] | None = None, bos: dict[str, dict] | None = None) -> dict[str, Any]:
    """The cells, and per model where it came from (`models.source.model_source`: None for a plain directory) and
    what opened its sequences (`models.bos.BosChoice.to_dict`); `schema` marks the file as quantdiff's
    (`core.owned`)."""
    return {"schema": SWEEP_SCHEMA, "cells": [cell.to_dict() for cell in cells], "sources": sources or {}, "bos": bos or {}}


def cells_from_json(data: dict[str, Any]) -> list[Cell]:
    """Cells of a sweep JSON. A quantized cell written before cells recorded their granularity ran per sequence:
    it reads back as granularity tensor (non-causal)."""
    keys = ("model", "task", "method", "bits", "site", "valid", "nonfinite_logits", "group_size", "transform", "blocks", "kv_plan", "granularity", "causal", "recorded", "layers",
            "precision_plan", "damage", "kv_mode")
    return [Cell(*(d[k] for k in keys[:5]), {k: v for k, v in d.items() if k not in keys}, d.get("nonfinite_logits", 0), d.get("group_size"),
                 d.get("transform"), d.get("blocks"), d.get("kv_plan"), d.get("granularity", None if d["method"] is None else "tensor"), d.get("recorded"),
                 d.get("layers"), d.get("precision_plan"), d.get("damage"), d.get("kv_mode"))
            for d in data["cells"]]
