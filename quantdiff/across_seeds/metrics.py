"""The per-seed values the across-seed summaries are made of, read from one seed's stats.json and sweep.json.

Each metric has a key, a label, and how it is summarised and compared with the reference (standard) arm:
- Table 5's Top-1 |attention logit| and |hidden state| (Ye et al. 2025, §3.4, Table 5: the largest absolute
  value over the measured tokens): arithmetic mean; compared as the ratio standard ÷ arm, as the paper does;
- the attention-sink score (Gu et al. 2025, "When Attention Sink Emerges", §3: the share of heads whose mean
  attention on the first token exceeds ε = 0.3): arithmetic mean; compared as the difference arm − standard;
- the sink mass, the continuous quantity that score thresholds (stats.sinks: the largest per-head mean attention
  on the first position; Diff: of the combined maps), so that a head at 0.301 and one at 0.299 read as
  neighbours: arithmetic mean; compared as the difference arm − standard;
- the smallest sink mass (sinks/min): the least per-head mean attention on the first position over the maps the
  model outputs — each head's softmax map, or for Diff V1 and DIFF V2 each combined map (A1 − λ·A2)/(1 − λ),
  which can be negative: where it is, the model subtracts attention from position 0 — defined for every kind,
  beside sinks/max: arithmetic mean; compared as the difference arm − standard;
- the mass the sink logit absorbs (sinks/sink_logit_max; the sink kind alone has one): per head, the mean over
  query rows of exp(s)/(exp(s) + Σ_j exp(ℓ_j)), the share of the row's softmax denominator that goes to no key,
  the largest over heads: arithmetic mean; None for the other kinds, so it is paired with none;
- the Top-1 |attention logit| per softmax map (each map's largest |logit|, averaged over the model's maps): a
  like-for-like Top-1, since every map of every arm holds the same number of logits, where the overall Top-1 is
  a maximum over as many logits as the arm has maps (DIFF V2 has twice the standard arm's): arithmetic mean;
  compared as standard ÷ arm;
- the same Top-1 over the first maps alone (top1_per_map1): Diff V1's and DIFF V2's map-1 heads, whose maxima
  are not lowered by λ's subtraction the way the second (subtracted) maps' are, and every map of standard
  attention: arithmetic mean; compared as standard ÷ arm. Beside it, the per-map figure shows how much of a
  difference the subtracted maps carry;
- the kurtosis of |attention logit| and of |hidden state| (the fourth standardised moment, E[(a − μ)⁴] / σ⁴ of
  a = |x|, stats.moments), a scale-free measure of how heavy the tail is: itself a ratio, so geometric mean;
  compared as standard ÷ arm;
- each Top-1 over its block's median |value| (Sun et al. 2024's yardstick for a massive activation), which
  takes out overall scale (an SGD-trained model's activations are smaller throughout): itself a ratio, so
  geometric mean; compared as standard ÷ arm;
- the BOS peak ÷ median (Sun et al. 2024, "Massive Activations": the largest |hidden state| at the first
  position over the median |hidden state|): itself a ratio, so geometric mean; compared as standard ÷ arm;
- every sweep cell's headline metric (the task's accuracy or loss after quantization, Ye et al. §3.4,
  Figure 8): arithmetic mean; compared as the difference arm − standard;
- a quantized cell's change from the same model unquantized (change/<task>/<site>/<method>/<bits>: quantized
  minus unquantized headline, per seed), what the quantizer costs each model whatever its unquantized level:
  arithmetic mean; compared as the difference arm − standard.
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
TOP1_LOGITS_PER_MAP = Metric("table5/attention_logits/top1_per_map", "Top-1 attention logit (abs) per softmax map, mean over maps", log=False, ratio=True)
TOP1_LOGITS_MAP1 = Metric("table5/attention_logits/top1_per_map1", "Top-1 attention logit (abs) per first softmax map, mean over map-1 maps",
                          log=False, ratio=True)
KURTOSIS_LOGITS = Metric("table5/attention_logits/kurtosis", "kurtosis (abs attention logit)", log=True, ratio=True)
KURTOSIS_HIDDEN = Metric("table5/hidden_states/kurtosis", "kurtosis (abs hidden state)", log=True, ratio=True)
TOP1_LOGITS_RELATIVE = Metric("table5/attention_logits/top1_over_median", "Top-1 ÷ median (abs attention logit)", log=True, ratio=True)
TOP1_HIDDEN_RELATIVE = Metric("table5/hidden_states/top1_over_median", "Top-1 ÷ median (abs hidden state)", log=True, ratio=True)
SINK_SCORE = Metric("sinks/score", "sink score (share of heads > ε)", log=False, ratio=False)
SINK_MASS = Metric("sinks/max", "sink mass (largest per-head attention on position 0)", log=False, ratio=False)
SINK_MIN = Metric("sinks/min", "smallest per-head attention on position 0 (Diff: combined maps, can be negative)", log=False, ratio=False)
SINK_LOGIT_MASS = Metric("sinks/sink_logit_max", "mass the sink logit absorbs (largest per-head share of the softmax denominator)",
                         log=False, ratio=False)
BOS_RATIO = Metric("sinks/bos_peak_over_median", "BOS peak ÷ median (abs hidden state)", log=True, ratio=True)
MODEL_METRICS = (TOP1_LOGITS, TOP1_HIDDEN, TOP1_LOGITS_PER_MAP, TOP1_LOGITS_MAP1, TOP1_LOGITS_RELATIVE, TOP1_HIDDEN_RELATIVE, KURTOSIS_LOGITS,
                 KURTOSIS_HIDDEN, SINK_SCORE, SINK_MASS, SINK_MIN, SINK_LOGIT_MASS, BOS_RATIO)
CHANGE_PREFIX = "change/"


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


def change_key(task: str, site: str, method: str, bits: int, group_size: int | None = None) -> str:
    """change/<task>/<site>/<method>/<bits>[/g<group size>]: a quantized cell minus the same model unquantized."""
    return CHANGE_PREFIX + sweep_key(task, site, method, bits, group_size).removeprefix("sweep/")


def change_metric(key: str, metrics: dict[str, Metric]) -> Metric | None:
    """The change metric `key` names, from the sweep metrics it is computed from (None: the sweep lacks either cell)."""
    cell = metrics.get("sweep/" + key.removeprefix(CHANGE_PREFIX))
    if cell is None or cell.cell is None or f"sweep/{cell.cell['task']}/unquantized" not in metrics:
        return None
    return Metric(key, cell.label + ", quantized − unquantized", log=False, ratio=False, cell=cell.cell)


def change_values(key: str, by_arm: dict[str, float | None], unquantized: dict[str, float | None]) -> dict[str, float | None]:
    """{arm: quantized − unquantized} of one seed (None where either is missing)."""
    return {arm: None if value is None or unquantized.get(arm) is None else value - unquantized[arm] for arm, value in by_arm.items()}


def _per_map_top1(logits: dict, first_maps_only: bool = False) -> float | None:
    """The mean over softmax maps (stats' per_head blocks: one per map, each holding the same count in every
    arm) of each map's largest |logit|; `first_maps_only`: over differential map-1 blocks (a block's top-k entries
    name its map) and every block of standard attention (which names none)."""
    maps = [block["max"] for layer in logits.get("per_head") or [] for block in layer
            if block.get("max") is not None and (not first_maps_only or _block_map(block) in (None, 1))]
    return sum(maps) / len(maps) if maps else None


def _block_map(block: dict) -> int | None:
    return block["topk"][0].get("map") if block.get("topk") else None


def _smallest_mass(sinks: dict) -> float | None:
    """The least per-head mean attention on position 0 over the maps the model outputs (Diff: the combined)."""
    maps = sinks.get("combined", sinks.get("per_head"))
    return min(min(layer) for layer in maps) if maps else None


def _over_median(value: float | None, block: dict) -> float | None:
    median = block["median"]
    return None if value is None or not median else value / median


def model_values(stats: dict) -> dict[str, dict[str, float | None]]:
    """{metric key: {arm: value}} of one seed's stats document."""
    values: dict[str, dict[str, float | None]] = {m.key: {} for m in MODEL_METRICS}
    for model in stats["models"]:
        arm = model["name"]
        logits, hidden = model["attention_logits"], model["hidden_states"]
        values[TOP1_LOGITS.key][arm] = table5_row(logits)[0]
        values[TOP1_HIDDEN.key][arm] = table5_row(hidden)[0]
        values[TOP1_LOGITS_PER_MAP.key][arm] = _per_map_top1(logits)
        values[TOP1_LOGITS_MAP1.key][arm] = _per_map_top1(logits, first_maps_only=True)
        values[KURTOSIS_LOGITS.key][arm] = logits.get("kurtosis")
        values[KURTOSIS_HIDDEN.key][arm] = hidden.get("kurtosis")
        values[TOP1_LOGITS_RELATIVE.key][arm] = _over_median(table5_row(logits)[0], logits)
        values[TOP1_HIDDEN_RELATIVE.key][arm] = _over_median(table5_row(hidden)[0], hidden)
        values[SINK_SCORE.key][arm] = (model.get("sinks") or {}).get("score")
        values[SINK_MASS.key][arm] = (model.get("sinks") or {}).get("max")
        values[SINK_MIN.key][arm] = _smallest_mass(model.get("sinks") or {})
        values[SINK_LOGIT_MASS.key][arm] = ((model.get("sinks") or {}).get("sink_logit") or {}).get("max")
        values[BOS_RATIO.key][arm] = _over_median(bos_peak(hidden), hidden)
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
