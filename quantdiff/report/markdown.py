"""report.md for `quantdiff reproduce`: our Table 5 and Figure 8 analogues beside the paper's numbers.

Built only from the JSON that `stats` and `sweep` write, so every number in the report can be checked against
the JSON next to it (the end-to-end test parses the tables back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import quantdiff.report.paper as paper
from quantdiff.core.atomic import atomic_file
from quantdiff.eval.tasks.registry import headline_metric
from quantdiff.report.numbers import number

TOPK_COLUMNS = (1, 2, 3, 10, 100)
ACTIVATIONS = {"attention_logits": "attention logits", "hidden_states": "hidden states"}


def _topk_values(block: dict) -> list[float]:
    return [float(v["value"] if isinstance(v, dict) else v) for v in block["topk"]]


def table5_row(block: dict) -> list[float | None]:
    """Top-1, 2, 3, 10, 100 and median of one activation block of the stats JSON (None where fewer values exist)."""
    values = _topk_values(block)
    return [values[k - 1] if len(values) >= k else None for k in TOPK_COLUMNS] + [None if block["median"] is None else float(block["median"])]


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table5_markdown(stats: dict, kinds: dict[str, str]) -> str:
    """Rows: (source, model, activation); ours first, then the paper's 3B models."""
    header = ["source", "model", "activation", *paper.TABLE5_COLUMNS]
    rows = []
    for model in stats["models"]:
        for key, label in ACTIVATIONS.items():
            rows.append(["ours", model["name"], label, *map(number, table5_row(model[key]))])
    for kind in ("standard", "diff"):
        for key, label in ACTIVATIONS.items():
            rows.append(["paper (3B)", "Transformer" if kind == "standard" else "DIFF", label, *map(number, paper.TABLE5[kind][key])])
    table = md_table(header, rows)
    return table + "\n\n" + _ratio_lines(stats, kinds)


def reference_name(kinds: dict[str, str]) -> str | None:
    """The arm the others are compared with, from {arm: kind} in order: the one named 'standard', else the first
    of kind standard; None without either."""
    return "standard" if "standard" in kinds else next((name for name, kind in kinds.items() if kind == "standard"), None)


def reference_model(stats: dict, kinds: dict[str, str]) -> dict | None:
    """The stats entry of the model the others are compared with (`reference_name`)."""
    name = reference_name({m["name"]: kinds.get(m["name"], "") for m in stats["models"]})
    return next((m for m in stats["models"] if m["name"] == name), None)


def _ratio_lines(stats: dict, kinds: dict[str, str]) -> str:
    """Top-1 of the standard model ÷ Top-1 of every other model (the paper's ratio beside Diff's)."""
    reference = reference_model(stats, kinds)
    if reference is None:
        return ""
    lines = []
    for model in (m for m in stats["models"] if m is not reference):
        for key, label in ACTIVATIONS.items():
            ours = table5_row(reference[key])[0] / max(table5_row(model[key])[0], 1e-30)
            theirs = paper.TABLE5["standard"][key][0] / paper.TABLE5["diff"][key][0]
            paper_note = f", paper {theirs:.2f}×" if kinds.get(model["name"]) == "diff" else ""
            lines.append(f"- Top-1 {label}, {reference['name']} ÷ {model['name']}: ours **{ours:.2f}×**{paper_note}")
    return "\n".join(lines)


def bos_peak(hidden: dict) -> float | None:
    """The largest |hidden state| at position 0 (None in stats written before it was tracked)."""
    first = hidden.get("first_position")
    return None if first is None else first["max"]


def sinks_markdown(stats: dict, kinds: dict[str, str]) -> str:
    """Per model: the attention-sink score and where the largest residual value sits, against the median."""
    header = ["model", "kind", "sink score (heads > ε)", "mean attention on position 0", "Top-1 hidden", "at position",
              "BOS peak", "median", "BOS peak ÷ median"]
    rows = []
    for model in stats["models"]:
        hidden, sinks = model["hidden_states"], model.get("sinks") or {}
        peak, median = bos_peak(hidden), hidden["median"]
        top = hidden["topk"][0] if hidden["topk"] else {}
        rows.append([model["name"], kinds.get(model["name"], "?"), number(sinks.get("score")), number(sinks.get("mean")),
                     number(hidden["max"]), str(top.get("position", "–")), number(peak),
                     number(median), f"{peak / median:.1f}×" if peak is not None and median else "–"])
    note = ("Sink score: share of heads (Diff: differential heads, maps combined) whose mean attention on the first "
            "position exceeds ε = 0.3 (Gu et al.). BOS peak: the largest |hidden state| (decoder-layer outputs) at position 0, "
            "the BOS token when the models were trained with one; median: of all hidden states.")
    return note + "\n\n" + md_table(header, rows)


def figure8_markdown(cells: list[dict]) -> str:
    """One table per (task, site): rows model × method, columns the reference and each bit width."""
    out = []
    for task, site in dict.fromkeys((c["task"], c.get("site")) for c in cells if c["bits"] is not None):
        quantized = [c for c in cells if c["task"] == task and c.get("site") == site and c["bits"] is not None]
        references = {c["model"]: c for c in cells if c["task"] == task and c["bits"] is None}
        metric = headline_metric(task)
        bits = sorted({c["bits"] for c in quantized}, reverse=True)
        header = ["source", "model", "method", "unquantized", *[f"{b}-bit" for b in bits]]
        rows = []
        for model, method in dict.fromkeys((c["model"], c["method"]) for c in quantized):
            by_bits = {c["bits"]: c.get(metric) for c in quantized if c["model"] == model and c["method"] == method}
            ref = references.get(model, {}).get(metric)
            rows.append(["ours", model, method, number(ref), *[number(by_bits.get(b)) for b in bits]])
        out.append(f"### task `{task}`, site `{site}`, metric `{metric}` (fraction)\n\n" + md_table(header, rows))
    paper_rows = [
        ["paper (3B, HellaSwag, read from plot)", "Transformer" if kind == "standard" else "DIFF", "absmax", *map(number, values)]
        for kind, values in paper.FIGURE8.items()
    ]
    paper_header = ["source", "model", "method", *[f"{b}-bit" + (" (unquantized)" if b == 16 else "") for b in paper.FIGURE8_BITS]]
    out.append(
        "### the paper's Figure 8 (zero-shot HellaSwag accuracy %, logits absmax-quantized)\n\n" + md_table(paper_header, paper_rows)
    )
    return "\n\n".join(out)


def write_report_markdown(
    path: Path, stats: dict, sweep: dict | None, kinds: dict[str, str], context: dict, emergence: str | None = None,
    extra_sections: Sequence[str] = (), lead: str | None = None,
) -> None:
    """Write report.md (atomically) from the stats and sweep JSON; `context` lists what was run on what;
    `emergence` is the section body built from the train logs (report.emergence), None to leave it out;
    `extra_sections`: whole sections (with their headings) placed before the plots; `lead`: a paragraph right
    under the title (what the measured models are)."""
    parts = [
        "# quantdiff report",
        *([lead] if lead else []),
        "Rows marked **ours** were measured by this run; rows marked **paper** are the numbers of "
        f"{paper.SOURCE}, for comparison only (3B models trained on 350B tokens — ours are far smaller).",
        "## Setup\n\n" + "\n".join(f"- {k}: {v}" for k, v in context.items()),
        "## Largest activation values (the paper's Table 5)\n\n" + table5_markdown(stats, kinds),
        "## Attention sinks and the residual peak at the first token\n\n" + sinks_markdown(stats, kinds),
    ]
    if emergence is not None:
        parts.append("## Emergence of outliers during training\n\n" + emergence)
    if sweep is not None:
        parts.append("## Accuracy with quantized attention (the paper's Figure 8)\n\n" + figure8_markdown(sweep["cells"]))
    else:
        parts.append("## Accuracy with quantized attention\n\nNot run.")
    write_sections(path, parts + list(extra_sections))


def write_sections(path: Path, parts: Sequence[str], force: bool = False) -> None:
    """Write report.md (atomically): `parts` joined, then a Plots section listing the PNGs beside it. An
    existing report.md is replaced only with `force` (markdown carries no mark of who wrote it)."""
    plots = sorted(p.name for p in path.parent.glob("*.png"))
    if plots:
        parts = [*parts, "## Plots\n\n" + "\n".join(f"![{name}]({name})" for name in plots)]
    with atomic_file(path, force) as tmp:
        tmp.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
