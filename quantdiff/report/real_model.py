"""The report's real-model section, built only from `real_model.json` (jobs.real_model): Table 5 with the massive
activation located, sinks and outlier features, the Figure-8-style lm sweep and the weight-only formats, every
accuracy with its sampling error."""

from __future__ import annotations

import math

from quantdiff.models.source import describe_source
from quantdiff.report.markdown import ACTIVATIONS, md_table, table5_row
from quantdiff.report.numbers import number
from quantdiff.report.stats_report import massive_line, sink_line
import quantdiff.report.paper as paper

SAMPLING_NOTE = (
    "Accuracy is ± one binomial standard error, √(p(1−p)/n) over the n scored tokens. Tokens of one window are "
    "correlated, so the real error is somewhat larger: read differences within a few ± as noise."
)


def binomial_error(accuracy: float, tokens: int) -> float:
    """Standard error of a proportion measured on `tokens` independent trials."""
    return math.sqrt(accuracy * (1 - accuracy) / tokens)


def accuracy_text(metrics: dict, perplexity: bool = True) -> str:
    """"0.287 ± 0.010 (ppl 50.43)" from a cell's lm metrics."""
    error = binomial_error(metrics["accuracy"], int(metrics["tokens"]))
    return f"{metrics['accuracy']:.3f} ± {error:.3f}" + (f" (ppl {number(metrics['perplexity'])})" if perplexity else "")


def _statistics(stats: dict) -> str:
    rows = [[label, *map(number, table5_row(stats[key]))] for key, label in ACTIVATIONS.items()]
    features = stats["linear_inputs"]["outlier_features"]
    holding = ", ".join(f"{c} (in {n} of {stats['layers']} layers)" for c, n in zip(features["channels"], features["layers"]))
    lines = [
        f"- {massive_line(stats['name'], stats['hidden_states']['massive_activation'])}",
        f"- {sink_line(stats['name'], stats['sinks'])}" if "sinks" in stats else None,
        f"- LLM.int8 outlier features (|x| ≥ {features['threshold']:g} at ≥ {features['min_position_fraction']:.0%} of the positions "
        f"in ≥ {features['min_layer_fraction']:.0%} of the layers, counted in the inputs of the attention projections and the "
        f"FFN expansion): **{features['count']}** of {stats['hidden_size']} channels" + (f": {holding}" if holding else ""),
    ]
    table = md_table(["activation", *paper.TABLE5_COLUMNS], rows)
    return table + "\n\n" + "\n".join(line for line in lines if line)


def _figure8(cells: list[dict]) -> str:
    reference = next(c for c in cells if c["method"] is None)
    quantized = [c for c in cells if c["method"] is not None]
    bits = sorted({c["bits"] for c in quantized}, reverse=True)
    rows = []
    for method, site in dict.fromkeys((c["method"], c["site"]) for c in quantized):
        by_bits = {c["bits"]: c for c in quantized if (c["method"], c["site"]) == (method, site)}
        rows.append([method, site, accuracy_text(reference), *(accuracy_text(by_bits[b]) if b in by_bits else "–" for b in bits)])
    return md_table(["method", "site", "unquantized", *[f"{b}-bit" for b in bits]], rows)


def _weight_only(reference: dict, rows: list[dict]) -> str:
    body = [["unquantized", "–", number(reference["perplexity"]), accuracy_text(reference, perplexity=False)]]
    for row in rows:
        body.append([f"{row['method']} {row['bits']}-bit", row["granularity"], number(row["perplexity"]), accuracy_text(row, perplexity=False)])
    return md_table(["weights", "granularity", "perplexity", "accuracy"], body)


def real_model_markdown(doc: dict) -> str:
    """The whole section (a level-2 heading and its subsections)."""
    plan, stats = doc["plan"], doc["stats"]
    reference = next(c for c in doc["cells"] if c["method"] is None)
    return "\n\n".join([
        f"## A real pretrained model: `{doc['model']}`",
        f"Measured by this run ({doc['seconds']:.0f} s) on `{doc['model']}` ({doc['path']}"
        + (f"; {describe_source(stats['source'])}, the statistics are of the dequantized model" if stats.get("source") else "")
        + f"): {stats['layers']} layers, "
        f"{stats['heads']} heads, width {stats['hidden_size']}. Statistics over {stats['tokens']:,} held-out corpus tokens "
        f"(sequences of {plan['seq_len']}); the sweep on the first {plan['windows']} held-out windows of {plan['context']} "
        f"tokens ({int(reference['tokens']):,} scored next tokens). All rows are **ours**.",
        "### Largest activation values (Table 5 layout)\n\n" + _statistics(stats),
        "### Next-token accuracy and perplexity, quantized (Figure 8 layout, task `lm`)\n\n"
        "`linear`: weights (per output channel) and inputs of every linear layer in the decoder layers; `qk`: Q and K "
        "as operands of the logits matmul.\n\n" + _figure8(doc["cells"]) + "\n\n" + SAMPLING_NOTE,
        f"### Weight-only {plan['weight_bits']}-bit formats (as `quantdiff quantize` exports and reloads them)\n\n"
        + _weight_only(reference, doc["weight_only"]),
    ])


def skipped_markdown(target: str, reason: str) -> str:
    return f"## A real pretrained model: `{target}`\n\nNot measured: {reason}"
