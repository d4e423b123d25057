"""report.md's across-seed sections, built from a seeds.json document (across_seeds.document) alone.

Every summary is written as `mean [low, high]` (the 95% interval of across_seeds.intervals; a ratio's mean is
geometric and written with ×); one seed gives the value alone. The same sections render a published
multi-seed document beside what a report measured live on one shipped seed (`published_markdown`).
"""

from __future__ import annotations

import quantdiff.report.paper as paper
from quantdiff.across_seeds.metrics import BOS_RATIO, MODEL_METRICS, SINK_SCORE, TOP1_HIDDEN, TOP1_LOGITS
from quantdiff.report.markdown import md_table
from quantdiff.report.numbers import MISSING


def _g(x: float | None) -> str:
    return MISSING if x is None else f"{x:.3g}"


def interval(summary: dict, times: bool = False) -> str:
    """`mean [low, high]` (with × for a ratio); the mean alone for one seed."""
    unit = "×" if times else ""
    if summary.get("mean") is None:
        return MISSING
    text = f"{_g(summary['mean'])}{unit}"
    return text if summary.get("low") is None else f"{text} [{_g(summary['low'])}, {_g(summary['high'])}]"


def _share(entry: dict) -> str:
    if not entry["n"]:
        return MISSING
    return f"{entry['k']} of {entry['n']} ({entry['share']:.0%} [{entry['low']:.0%}, {entry['high']:.0%}])"


def method_markdown(doc: dict) -> str:
    """How the intervals were made, over which seeds."""
    seeds = ", ".join(map(str, doc["seeds"]))
    return (f"{len(doc['seeds'])} seeds ({seeds}); every seed trains every arm on the same batches, so arms are compared "
            f"seed by seed with `{doc['reference']}`. 95% intervals: {doc['method']['description']} "
            "Per-seed values: `seeds.json` (`metrics.<key>.arms.<arm>.per_seed`).")


def table5_markdown(doc: dict) -> str:
    """Top-1 |attention logit| and |hidden state| per arm across seeds, the paper's 3B values below."""
    metrics = doc["metrics"]
    rows = [[arm, kind, *(interval(metrics[m.key]["arms"][arm]) for m in (TOP1_LOGITS, TOP1_HIDDEN))] for arm, kind in doc["arms"].items()]
    rows += [[f"paper (3B) {name}", kind, *(f"{paper.TABLE5[kind][block][0]:g}" for block in ("attention_logits", "hidden_states"))]
             for kind, name in (("standard", "Transformer"), ("diff", "DIFF"))]
    return md_table(["arm", "kind", f"{TOP1_LOGITS.label}: mean [95% CI]", f"{TOP1_HIDDEN.label}: mean [95% CI]"], rows)


def sinks_markdown(doc: dict) -> str:
    """Sink score, the share of seeds with a sink head, and the BOS peak ÷ median per arm across seeds."""
    metrics = doc["metrics"]
    rows = [[arm, interval(metrics[SINK_SCORE.key]["arms"][arm]), _share(doc["sink_share"][arm]),
             interval(metrics[BOS_RATIO.key]["arms"][arm], times=True)] for arm in doc["arms"]]
    header = ["arm", "sink score: mean [95% CI]", "seeds with a sink head (share [95% CI])", "BOS peak ÷ median: geometric mean [95% CI]"]
    return md_table(header, rows)


def _paired_row(metric: dict, arm: str, reference: str) -> list[str]:
    pair = metric["paired"][arm]
    ratio = metric["comparison"] == "reference ÷ arm"
    what = f"{reference} ÷ {arm}" if ratio else f"{arm} − {reference}"
    per_seed = ", ".join(_g(v) for v in pair["per_seed"].values())
    return [metric["label"], what, interval(pair, times=ratio), f"{pair['reference_higher']} / {pair['other_higher']} / {pair['equal']}", per_seed]


def paired_markdown(doc: dict, lowest_bits_only: bool = True) -> str:
    """Each arm against the reference, seed by seed: the Table-5 and sink metrics, and the sweep cells (only
    those at the lowest bit width of each site and method unless `lowest_bits_only` is off)."""
    reference, metrics = doc["reference"], doc["metrics"]
    if reference is None:
        return "No reference arm (none named `standard` or of kind standard): no paired comparisons."
    keys = [m.key for m in MODEL_METRICS]
    cells = {key: block["cell"] for key, block in metrics.items() if block.get("cell") and block["cell"]["bits"] is not None}
    lowest = {}
    for key, cell in cells.items():
        group = (cell["task"], cell["site"], cell["method"])
        if group not in lowest or cell["bits"] < cells[lowest[group]]["bits"]:
            lowest[group] = key
    keys += list(lowest.values()) if lowest_bits_only else list(cells)
    rows = [_paired_row(metrics[key], arm, reference) for key in keys for arm in doc["arms"] if arm in metrics[key].get("paired", {})]
    header = ["metric", "comparison", "mean [95% CI]", f"seeds: {reference} higher / arm higher / equal", "per seed"]
    return md_table(header, rows)


def sweep_markdown(doc: dict) -> str:
    """One table per (task, site): rows arm × method, columns the unquantized model and each bit width."""
    metrics = doc["metrics"]
    cells = [(key, block) for key, block in metrics.items() if block.get("cell")]
    out = []
    for task, site in dict.fromkeys((b["cell"]["task"], b["cell"]["site"]) for _, b in cells if b["cell"]["bits"] is not None):
        quantized = [(k, b) for k, b in cells if (b["cell"]["task"], b["cell"]["site"]) == (task, site) and b["cell"]["bits"] is not None]
        reference = next((b for _, b in cells if b["cell"]["task"] == task and b["cell"]["bits"] is None), None)
        bits = sorted({b["cell"]["bits"] for _, b in quantized}, reverse=True)
        rows = []
        for arm in doc["arms"]:
            for method in dict.fromkeys(b["cell"]["method"] for _, b in quantized):
                by_bits = {b["cell"]["bits"]: b["arms"].get(arm, {}) for _, b in quantized if b["cell"]["method"] == method}
                rows.append([arm, method, interval(reference["arms"].get(arm, {})) if reference else MISSING,
                             *[interval(by_bits.get(b, {})) for b in bits]])
        metric = quantized[0][1]["label"].split(",")[0]
        out.append(f"### {metric} at site `{site}`: mean [95% CI]\n\n" + md_table(["arm", "method", "unquantized", *[f"{b}-bit" for b in bits]], rows))
    return "\n\n".join(out)


def seeds_sections(doc: dict, label: str = "") -> list[str]:
    """The across-seed sections (with their headings; `label` is added to each heading, e.g. a published source)."""
    tag = f" ({label})" if label else ""
    return [
        f"## Across seeds: method{tag}\n\n" + method_markdown(doc),
        f"## Largest activation values across seeds (the paper's Table 5, Top-1){tag}\n\n" + table5_markdown(doc),
        f"## Attention sinks and the BOS peak across seeds{tag}\n\n" + sinks_markdown(doc),
        f"## Paired comparisons with `{doc['reference']}`{tag}\n\n" + paired_markdown(doc),
        f"## Accuracy with quantization across seeds (the paper's Figure 8){tag}\n\n" + sweep_markdown(doc),
    ]


def live_beside_published(doc: dict, live: dict[str, dict[str, float | None]], seed: int) -> str:
    """A table: each arm's metric measured live on the shipped seed, the published value for that seed, and the
    published mean over all seeds. `live`: {metric key: {arm: value}} (across_seeds.metrics)."""
    rows = []
    key_seed = str(seed)
    for metric in MODEL_METRICS:
        block = doc["metrics"].get(metric.key, {"arms": {}})
        for arm, value in live.get(metric.key, {}).items():
            published = block["arms"].get(arm)
            rows.append([metric.label, arm, _g(value), _g(published["per_seed"].get(key_seed)) if published else MISSING,
                         interval(published, times=metric.log) if published else MISSING])
    header = ["metric", "arm", f"live, shipped seed {seed}", f"published, seed {seed}", f"published, {len(doc['seeds'])} seeds: mean [95% CI]"]
    return md_table(header, rows)
