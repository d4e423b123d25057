"""The per-seed values the across-seed summaries are made of, read from one seed's stats.json and sweep.json.

Each metric has a key, a label, and how it is summarised and compared with the reference (standard) arm:
- Table 5's Top-1 |attention logit| and |hidden state| (Ye et al. 2025, §3.4, Table 5: the largest absolute
  value over the measured tokens): arithmetic mean; compared as the ratio standard ÷ arm, as the paper does;
- the attention-sink score (Gu et al. 2025, "When Attention Sink Emerges", §3: the share of heads whose mean
  attention on the first token exceeds ε = 0.3): arithmetic mean; compared as the difference arm − standard;
- the BOS peak ÷ median (Sun et al. 2024, "Massive Activations": the largest |hidden state| at the first
  position over the median |hidden state|): itself a ratio, so geometric mean; compared as standard ÷ arm;
- every sweep cell's headline metric (the task's accuracy or loss after quantization, Ye et al. §3.4,
  Figure 8): arithmetic mean; compared as the difference arm − standard.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantdiff.eval.tasks.registry import headline_metric
from quantdiff.report.markdown import bos_peak, table5_row


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    log: bool  # summarised by its geometric mean (a ratio)
    ratio: bool  # compared with the reference arm as reference ÷ arm (else arm − reference)
    cell: dict | None = None  # a sweep cell's task, site, method, bits and group size


TOP1_LOGITS = Metric("table5/attention_logits/top1", "Top-1 attention logit (abs)", log=False, ratio=True)
TOP1_HIDDEN = Metric("table5/hidden_states/top1", "Top-1 hidden state (abs)", log=False, ratio=True)
SINK_SCORE = Metric("sinks/score", "sink score (share of heads > ε)", log=False, ratio=False)
BOS_RATIO = Metric("sinks/bos_peak_over_median", "BOS peak ÷ median (abs hidden state)", log=True, ratio=True)
MODEL_METRICS = (TOP1_LOGITS, TOP1_HIDDEN, SINK_SCORE, BOS_RATIO)


def sweep_key(task: str, site: str | None, method: str | None, bits: int | None, group_size: int | None = None) -> str:
    """sweep/<task>/unquantized, or sweep/<task>/<site>/<method>/<bits>[/g<group size>]."""
    if bits is None:
        return f"sweep/{task}/unquantized"
    return f"sweep/{task}/{site}/{method}/{bits}" + (f"/g{group_size}" if group_size else "")


def sweep_metric(cell: dict) -> Metric:
    task, bits = cell["task"], cell["bits"]
    what = "unquantized" if bits is None else f"{cell['method']} {bits}-bit at {cell['site']}"
    key = sweep_key(task, cell.get("site"), cell.get("method"), bits, cell.get("group_size"))
    where = {"task": task, "site": cell.get("site"), "method": cell.get("method"), "bits": bits, "group_size": cell.get("group_size")}
    return Metric(key, f"{task} {headline_metric(task)}, {what}", log=False, ratio=False, cell=where)


def _bos_over_median(model: dict) -> float | None:
    peak, median = bos_peak(model["hidden_states"]), model["hidden_states"]["median"]
    return None if peak is None or not median else peak / median


def model_values(stats: dict) -> dict[str, dict[str, float | None]]:
    """{metric key: {arm: value}} of one seed's stats document."""
    values: dict[str, dict[str, float | None]] = {m.key: {} for m in MODEL_METRICS}
    for model in stats["models"]:
        arm = model["name"]
        values[TOP1_LOGITS.key][arm] = table5_row(model["attention_logits"])[0]
        values[TOP1_HIDDEN.key][arm] = table5_row(model["hidden_states"])[0]
        values[SINK_SCORE.key][arm] = (model.get("sinks") or {}).get("score")
        values[BOS_RATIO.key][arm] = _bos_over_median(model)
    return values


def sweep_values(sweep: dict) -> tuple[dict[str, Metric], dict[str, dict[str, float | None]]]:
    """The sweep's metrics in cell order, and {metric key: {arm: headline value}} (None: an invalid cell)."""
    metrics: dict[str, Metric] = {}
    values: dict[str, dict[str, float | None]] = {}
    for cell in sweep["cells"]:
        metric = sweep_metric(cell)
        metrics.setdefault(metric.key, metric)
        values.setdefault(metric.key, {})[cell["model"]] = cell.get(headline_metric(cell["task"])) if cell.get("valid", True) else None
    return metrics, values


def has_sink(stats_model: dict) -> bool | None:
    """Whether any head of the model is a sink (score > 0); None when the stats carry no sink score."""
    score = (stats_model.get("sinks") or {}).get("score")
    return None if score is None else score > 0
