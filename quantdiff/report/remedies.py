"""The remedies report: after a Hadamard rotation or SmoothQuant, does the standard model still lose more at 4 bits
than the Diff model? Built only from what `scripts/remedies.py` writes into its output directory:

    manifest.json   the groups of models (task, arm, seed, attention kind), every command run and its wall time
    runs/*.json     one `quantdiff sweep --json --blocks K` document per (group, remedy)

and written back there as report.md, summary.json (every estimate below) and PNG plots. `python -m
quantdiff.report.remedies OUT` regenerates them.

An accuracy *loss* is the model's unquantized accuracy minus its quantized one, both from the same sweep run
(the task's headline metric). Intervals are Student-t 95%: over seeds when an arm has at least two (each seed's
loss from its pooled metrics), else over the blocks of the one evaluation (batch means, `report.intervals`).
Gaps between two arms pair seeds by name, or blocks by index (the arms see the same items).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from quantdiff.core.atomic import atomic_file, write_json
from quantdiff.core.documents import read_document
from quantdiff.core.owned import plot_metadata
from quantdiff.eval.sweep import Cell, cells_from_json
from quantdiff.eval.tasks.registry import headline_metric
from quantdiff.report.intervals import Estimate, over_blocks, over_seeds
from quantdiff.report.markdown import md_table

LINEAR_VARIANTS = ("absmax", "LLM.int8", "absmax + Hadamard", "absmax + SmoothQuant")
ATTENTION_VARIANTS = ("absmax @logits", "absmax @qk", "absmax @kv")
REMEDIES = ("absmax + Hadamard", "absmax + SmoothQuant")
TRANSFORM_LABELS = {"hadamard": " + Hadamard", "smooth": " + SmoothQuant"}
QUESTION_BITS = 4


def variant(cell: Cell) -> str:
    """A quantized cell's row label: method (+ remedy) at the linear site, method @site inside attention."""
    if cell.site != "linear":
        return f"{cell.method} @{cell.site}"
    method = "LLM.int8" if cell.method == "llm-int8" else cell.method
    return method + TRANSFORM_LABELS.get((cell.transform or {}).get("name"), "")


@dataclass
class Arm:
    """One arm of a group (a model trained one way) over its seeds: per seed, (variant, bits) → (cell, its run's reference)."""

    name: str
    kind: str
    seeds: dict[str, dict[tuple[str, int], tuple[Cell, Cell]]] = field(default_factory=dict)
    references: dict[str, Cell] = field(default_factory=dict)  # per seed, the first run's reference cell


@dataclass
class Group:
    name: str
    task: str
    arms: dict[str, Arm]

    @property
    def metric(self) -> str:
        return headline_metric(self.task)


def load_groups(out: Path) -> tuple[dict, list[Group]]:
    """(manifest, groups with every run's cells placed by arm, seed, variant and bits)."""
    manifest = json.loads((out / "manifest.json").read_text())
    groups = []
    for spec in manifest["groups"]:
        by_name = {m["name"]: m for m in spec["models"]}
        arms: dict[str, Arm] = {}
        for run in (r for r in manifest["runs"] if r["group"] == spec["name"]):
            cells = cells_from_json(read_document(out / run["json"]))
            references = {c.model: c for c in cells if c.is_reference}
            for cell in cells:
                model = by_name[cell.model]
                arm = arms.setdefault(model["arm"], Arm(model["arm"], model["kind"]))
                seed = str(model["seed"])
                arm.references.setdefault(seed, references[cell.model])
                if not cell.is_reference:
                    arm.seeds.setdefault(seed, {})[(variant(cell), cell.bits)] = (cell, references[cell.model])
        groups.append(Group(spec["name"], spec["task"], arms))
    return manifest, groups


# ---- estimates ----------------------------------------------------------------------------------------------


def _values(cell: Cell, metric: str) -> tuple[float | None, list[float] | None]:
    """(pooled value, per-block values) of one metric of one cell; None for an invalid cell."""
    pooled = cell.metrics.get(metric)
    blocks = None if cell.blocks is None else [b[metric] for b in cell.blocks]
    return pooled, blocks


def _estimate(per_seed: list[tuple[float | None, list[float] | None]]) -> Estimate | None:
    """Over seeds when there are two or more, else over the one seed's blocks; None when a value is missing."""
    if not per_seed or any(pooled is None for pooled, _ in per_seed):
        return None
    if len(per_seed) >= 2:
        return over_seeds([pooled for pooled, _ in per_seed])
    pooled, blocks = per_seed[0]
    return over_blocks(pooled, blocks or [])


def _loss(entry: tuple[Cell, Cell], metric: str) -> tuple[float | None, list[float] | None]:
    """Reference minus quantized: pooled and per block."""
    (q, qb), (r, rb) = _values(entry[0], metric), _values(entry[1], metric)
    if q is None or r is None:
        return None, None
    return r - q, None if qb is None or rb is None else [b - a for a, b in zip(qb, rb)]


def metric_estimate(arm: Arm, metric: str, key: tuple[str, int] | None) -> Estimate | None:
    """The metric of one (variant, bits) cell (None key: the unquantized reference) across the arm's seeds."""
    if key is None:
        return _estimate([_values(ref, metric) for ref in arm.references.values()])
    return _estimate([_values(cells[key][0], metric) for cells in arm.seeds.values() if key in cells])


def loss_estimate(arm: Arm, metric: str, key: tuple[str, int]) -> Estimate | None:
    return _estimate([_loss(cells[key], metric) for cells in arm.seeds.values() if key in cells])


def gap_estimate(a: Arm, b: Arm, metric: str, key: tuple[str, int]) -> Estimate | None:
    """Loss of arm a minus loss of arm b (positive: a loses more), paired by seed name, or by block."""
    pairs = []
    for seed in sorted(set(a.seeds) & set(b.seeds)):
        if key in a.seeds[seed] and key in b.seeds[seed]:
            (la, ba), (lb, bb) = _loss(a.seeds[seed][key], metric), _loss(b.seeds[seed][key], metric)
            pooled = None if la is None or lb is None else la - lb
            blocks = None if ba is None or bb is None or len(ba) != len(bb) else [x - y for x, y in zip(ba, bb)]
            pairs.append((pooled, blocks))
    return _estimate(pairs)


# ---- text ---------------------------------------------------------------------------------------------------


def fmt(estimate: Estimate | None, decimals: int = 3) -> str:
    """"0.123 [0.100, 0.146]"; "invalid" for a missing value, no interval from one unit."""
    if estimate is None:
        return "invalid"
    value = f"{estimate.value:.{decimals}f}"
    if estimate.half_width is None:
        return value
    return f"{value} [{estimate.low:.{decimals}f}, {estimate.high:.{decimals}f}]"


def verdict(gap: Estimate | None, a: str, b: str) -> str:
    if gap is None:
        return "not measured (an invalid cell)"
    if not gap.excludes_zero:
        return f"no difference resolved ({a} − {b} {fmt(gap)})"
    return f"**{a if gap.value > 0 else b} loses more** ({a} − {b} {fmt(gap)})"


def baseline_arm(group: Group) -> Arm | None:
    """The arm the Diff arms are compared with: the one named 'standard', else the first of kind standard."""
    return group.arms.get("standard") or next((arm for arm in group.arms.values() if arm.kind == "standard"), None)


def answer_lines(group: Group) -> list[str]:
    """One line per (Diff arm, variant at 4 bits), or, without a Diff arm, each remedy's remaining loss."""
    metric, base = group.metric, baseline_arm(group)
    diffs = [arm for arm in group.arms.values() if arm.kind != "standard"]
    lines = []
    for arm in diffs if base is not None else []:
        for name in LINEAR_VARIANTS:
            key = (name, QUESTION_BITS)
            gap = gap_estimate(base, arm, metric, key)
            lines.append(f"- `{group.name}` {name} {QUESTION_BITS}-bit at `linear`: {base.name} loses {fmt(loss_estimate(base, metric, key))}, "
                         f"{arm.name} {fmt(loss_estimate(arm, metric, key))} {metric}: {verdict(gap, base.name, arm.name)}.")
    if not diffs:
        for arm in group.arms.values():
            unquantized = fmt(metric_estimate(arm, metric, None))
            for name in LINEAR_VARIANTS:
                key = (name, QUESTION_BITS)
                lines.append(f"- `{group.name}` {arm.name}, {name} {QUESTION_BITS}-bit at `linear`: loses {fmt(loss_estimate(arm, metric, key))} "
                             f"of its {unquantized} {metric}.")
        lines.append(f"- (`{group.name}` has no Diff model to compare with: the loss left after a remedy bounds what an architecture could still save there.)")
    return lines


def _bits_of(group: Group, variants: tuple[str, ...]) -> list[int]:
    keys = {key for arm in group.arms.values() for cells in arm.seeds.values() for key in cells}
    return sorted({bits for name, bits in keys if name in variants}, reverse=True)


def sweep_table(group: Group, variants: tuple[str, ...]) -> str:
    """Rows (arm, variant); columns the unquantized metric and the loss at each width, with intervals."""
    bits = _bits_of(group, variants)
    header = ["arm", "kind", "quantization", f"unquantized {group.metric}", *(f"{b}-bit loss" for b in bits)]
    rows = []
    for arm in group.arms.values():
        reference = fmt(metric_estimate(arm, group.metric, None), 4)
        for name in variants:
            rows.append([arm.name, arm.kind, name, reference, *(fmt(loss_estimate(arm, group.metric, (name, b))) for b in bits)])
    return md_table(header, rows)


def summary(groups: list[Group]) -> dict:
    """Every estimate in the report, JSON-ready, keyed by group (lm, bb) beside its schema."""
    out: dict = {"schema": "quantdiff.remedies_summary"}
    for group in groups:
        arms = {}
        for arm in group.arms.values():
            keys = sorted({key for cells in arm.seeds.values() for key in cells})
            arms[arm.name] = {
                "kind": arm.kind,
                "seeds": sorted(arm.seeds),
                "unquantized": _as_dict(metric_estimate(arm, group.metric, None)),
                "cells": [{"variant": name, "bits": bits, "metric": _as_dict(metric_estimate(arm, group.metric, (name, bits))),
                           "loss": _as_dict(loss_estimate(arm, group.metric, (name, bits)))} for name, bits in keys],
            }
        base = baseline_arm(group)
        gaps = [{"baseline": base.name, "arm": arm.name, "variant": name, "bits": QUESTION_BITS,
                 "gap": _as_dict(gap_estimate(base, arm, group.metric, (name, QUESTION_BITS)))}
                for arm in group.arms.values() if base is not None and arm.kind != "standard" for name in LINEAR_VARIANTS]
        out[group.name] = {"task": group.task, "metric": group.metric, "arms": arms, "gaps": gaps}
    return out


def _as_dict(estimate: Estimate | None) -> dict | None:
    return None if estimate is None else estimate.to_dict()


def _scales_line(groups: list[Group]) -> str:
    """How the cells' scales were taken, from the granularity they record (`eval.sweep.Cell`)."""
    names = sorted({cell.granularity for group in groups for arm in group.arms.values() for cells in arm.seeds.values() for cell, _ in cells.values()})
    if names == ["tensor"]:
        return ("- scales: granularity `tensor`, **non-causal** (later tokens set earlier tokens' scales; no inference engine "
                "quantizes so): `linear`: nn.Linear weights per output channel, inputs per tensor per sequence (absmax), or "
                "LLM.int8 with outlier columns chosen over the sequence; `logits`: pre-softmax scores per sequence; `qk`: Q and K "
                "operands per sequence; `kv`: keys per channel, values per token (KIVI) after RoPE")
    return (f"- scales: granularity {', '.join(f'`{n}`' for n in names)} (`row`, causal: inputs, Q and K per token, logits per "
            "query row, keys and values per token and KV head; LLM.int8 outliers per token); nn.Linear weights per output channel")


def _setup_lines(manifest: dict, groups: list[Group]) -> list[str]:
    """What was run: models, data sizes, blocks, the remedies' settings as the cells record them."""
    lines = []
    for spec, group in zip(manifest["groups"], groups):
        arms = ", ".join(f"`{arm.name}` ({arm.kind}, {_seeds(arm)})" for arm in group.arms.values())
        lines.append(f"- group `{group.name}`: task `{group.task}` ({' '.join(spec['options']) or 'defaults'}), arms {arms}")
    lines.append(f"- every cell also evaluated in {manifest['blocks']} contiguous blocks of its items (`--blocks`)")
    records: dict[str, dict] = {}
    for group in groups:
        for arm in group.arms.values():
            for cells in arm.seeds.values():
                for cell, _ in cells.values():
                    if cell.transform is not None:
                        records.setdefault(f"{group.name}/{cell.transform['name']}", cell.transform)
    for name, record in sorted(records.items()):
        if record["name"] == "hadamard":
            blocks = ", ".join(f"width {w} → block {b}" for w, b in record.get("blocks", {}).items())
            lines.append(f"- `{name}`: block-diagonal Walsh–Hadamard, the largest power of two dividing each input width ({blocks})")
        else:
            done = record.get("calibrated") or {}
            lines.append(f"- `{name}`: α = {record['alpha']}, calibrated on {done.get('tokens')} tokens of `{done.get('source')}` "
                         f"({done.get('sequences')} sequences of ≤ {done.get('seq_len')}), {'folded into the norms' if done.get('folded') else 'unfolded'}; "
                         "as in the paper only the inputs behind a norm are smoothed (q/k/v and DIFF V2's λ projection, gate/up), "
                         "the attention output and FFN down projections' inputs are not")
    return lines


def _seeds(arm: Arm) -> str:
    seeds = sorted(arm.seeds)
    return "one model" if seeds == ["None"] else f"seeds {', '.join(seeds)}"


def _commands_table(manifest: dict) -> str:
    rows = [[f"`{run['command']}`", f"{run['wall_s']:.0f}"] for run in manifest["runs"]]
    return md_table(["command", "wall s"], rows) + f"\n\nTotal wall time {manifest['wall_s']:.0f} s ({manifest.get('machine', 'this machine')})."


def plot_group(group: Group, variants: tuple[str, ...], path: Path) -> None:
    """Loss vs bits (widest first), one panel per arm, one line per variant, 95% intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits = _bits_of(group, variants)
    arms = list(group.arms.values())
    fig, axes = plt.subplots(1, len(arms), figsize=(3.2 * len(arms), 3.2), sharey=True, squeeze=False)
    for ax, arm in zip(axes[0], arms):
        for n, name in enumerate(variants):
            points = [(i, loss_estimate(arm, group.metric, (name, b))) for i, b in enumerate(bits)]
            points = [(i, e) for i, e in points if e is not None]
            if points:
                xs = [i + (n - len(variants) / 2) * 0.05 for i, _ in points]  # a small offset keeps bars apart
                errors = [e.half_width or 0.0 for _, e in points]
                ax.errorbar(xs, [e.value for _, e in points], yerr=errors, marker="osD^v"[n % 5], capsize=2, label=name)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(bits)), [str(b) for b in bits])
        ax.set_title(f"{arm.name} ({arm.kind})", fontsize=9)
        ax.set_xlabel("bits")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{group.metric} loss (unquantized − quantized)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=130, metadata=plot_metadata())  # marks it ours: a rerun may replace it
    plt.close(fig)


def render(manifest: dict, groups: list[Group], plots: list[str]) -> str:
    parts = [
        "# Post-hoc remedies beside the architectural one",
        "After a Hadamard rotation (QuaRot) or SmoothQuant, does the standard model still lose more at 4 bits than the "
        "Diff model? Losses are in the task's headline metric (unquantized − quantized; positive = worse), with "
        "Student-t 95% intervals over seeds, or over blocks of the evaluation items when an arm has one seed.",
        "## The answer",
        "\n".join(line for group in groups for line in answer_lines(group)),
        "## Setup",
        "\n".join(_setup_lines(manifest, groups)) + "\n" + _scales_line(groups),
    ]
    for group in groups:
        parts += [f"## `{group.name}`: the linear site", sweep_table(group, LINEAR_VARIANTS),
                  f"## `{group.name}`: attention sites", sweep_table(group, ATTENTION_VARIANTS)]
    parts += ["## Plots", *[f"![{p}]({p})" for p in plots], "## Commands and wall time", _commands_table(manifest)]
    return "\n\n".join(parts) + "\n"


def write_report(out: Path) -> None:
    """report.md, summary.json and plots into `out` (which holds manifest.json and runs/): a directory quantdiff
    wrote (its marker, or the temporary directory of a run under way), whose report files are ours to replace."""
    from quantdiff.core.errors import ConfigError
    from quantdiff.core.savedir import marked_kind

    if (out / "report.md").exists() and marked_kind(out) != "report":
        raise ConfigError(f"{out} is not a remedies report quantdiff wrote: refusing to replace its report.md")
    manifest, groups = load_groups(out)
    plots = []
    for group in groups:
        for part, variants in (("linear", LINEAR_VARIANTS), ("attention", ATTENTION_VARIANTS)):
            name = f"{group.name}_{part}.png"
            plot_group(group, variants, out / name)
            plots.append(name)
    write_json(out / "summary.json", summary(groups), indent=2)
    with atomic_file(out / "report.md", force=True) as tmp:  # checked above: the directory is ours
        Path(tmp).write_text(render(manifest, groups, plots))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate report.md, summary.json and plots of a remedies run (scripts/remedies.py).")
    parser.add_argument("out", type=Path, help="the run's output directory (holds manifest.json and runs/)")
    write_report(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
