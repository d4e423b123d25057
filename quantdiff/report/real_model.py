"""The report's real-model section, built only from `real_model.json` (jobs.real_model): for the models side by side,
Table 5 with the massive activation located, sinks and outlier features, the Figure-8-style lm sweep and the
weight-only formats, every accuracy with its sampling error."""

from __future__ import annotations

import math

from quantdiff.models.bos import describe_bos
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


def _summary(docs: list[dict]) -> str:
    """One row per model: where its largest hidden state sits, against its layer's median, its sinks and features."""
    rows = []
    for doc in docs:
        stats = doc["stats"]
        massive, features = stats["hidden_states"]["massive_activation"], stats["linear_inputs"]["outlier_features"]
        where = "–" if massive is None else f"{massive['layer']}, {massive['position']}, {massive['channel']}"
        times = "–" if massive is None or massive["ratio"] is None else f"{massive['ratio']:,.0f}×"
        sinks = stats.get("sinks")
        rows.append([f"`{doc['model']}`", "yes" if doc["bos"]["added"] else "no", number(massive and massive["value"]), where, times,
                     "–" if sinks is None else f"{sinks['score']:.2f}", "–" if sinks is None else f"{sinks['mean']:.3f}",
                     f"{features['count']} of {stats['hidden_size']}"])
    header = ["model", "BOS first", "Top-1 \\|h\\|", "layer, position, channel", "÷ layer median", "sink score", "mean attention on position 0",
              "LLM.int8 outlier features"]
    return md_table(header, rows)


def _statistics(docs: list[dict]) -> str:
    rows = [[f"`{doc['model']}`", label, *map(number, table5_row(doc["stats"][key]))] for doc in docs for key, label in ACTIVATIONS.items()]
    lines = []
    for doc in docs:
        stats = doc["stats"]
        features = stats["linear_inputs"]["outlier_features"]
        holding = ", ".join(f"{c} (in {n} of {stats['layers']} layers)" for c, n in zip(features["channels"], features["layers"]))
        lines += [
            f"- {massive_line(stats['name'], stats['hidden_states']['massive_activation'])}",
            f"- {sink_line(stats['name'], stats['sinks'])}" if "sinks" in stats else None,
            f"- {stats['name']}: LLM.int8 outlier features: **{features['count']}** of {stats['hidden_size']} channels" + (f": {holding}" if holding else ""),
        ]
    definition = (
        "Sink score: the share of heads whose mean attention on the first position exceeds ε = 0.3 (Gu et al.). LLM.int8 "
        "outlier features: channels with |x| ≥ 6 at ≥ 6% of the positions in ≥ 25% of the layers, counted in the inputs "
        "of the attention projections and the FFN expansion (Dettmers et al., §4.1)."
    )
    table = md_table(["model", "activation", *paper.TABLE5_COLUMNS], rows)
    return "\n\n".join([_summary(docs), table, "\n".join(line for line in lines if line), definition])


def _figure8(docs: list[dict]) -> str:
    bits = sorted({c["bits"] for doc in docs for c in doc["cells"] if c["method"] is not None}, reverse=True)
    rows = []
    for doc in docs:
        reference = next(c for c in doc["cells"] if c["method"] is None)
        quantized = [c for c in doc["cells"] if c["method"] is not None]
        for method, site in dict.fromkeys((c["method"], c["site"]) for c in quantized):
            by_bits = {c["bits"]: c for c in quantized if (c["method"], c["site"]) == (method, site)}
            rows.append([f"`{doc['model']}`", method, site, accuracy_text(reference), *(accuracy_text(by_bits[b]) if b in by_bits else "–" for b in bits)])
    return md_table(["model", "method", "site", "unquantized", *[f"{b}-bit" for b in bits]], rows)


def _weight_only(docs: list[dict]) -> str:
    body = []
    for doc in docs:
        reference = next(c for c in doc["cells"] if c["method"] is None)
        body.append([f"`{doc['model']}`", "unquantized", "–", number(reference["perplexity"]), accuracy_text(reference, perplexity=False)])
        for row in doc["weight_only"]:
            body.append([f"`{doc['model']}`", f"{row['method']} {row['bits']}-bit", row["granularity"], number(row["perplexity"]), accuracy_text(row, perplexity=False)])
    return md_table(["model", "weights", "granularity", "perplexity", "accuracy"], body)


def _measured_line(doc: dict) -> str:
    plan, stats = doc["plan"], doc["stats"]
    reference = next(c for c in doc["cells"] if c["method"] is None)
    source = f"; {describe_source(stats['source'])}, the statistics are of the dequantized model" if stats.get("source") else ""
    return (
        f"- `{doc['model']}` ({doc['seconds']:.0f} s; {doc['path']}{source}): {stats['layers']} layers, {stats['heads']} heads, width "
        f"{stats['hidden_size']}; {describe_bos(doc['model'], doc['bos']).partition(': ')[2]}. Statistics over {stats['tokens']:,} held-out "
        f"corpus tokens (sequences of {plan['seq_len']}); the sweep on the first {plan['windows']} held-out windows of {plan['context']} "
        f"tokens ({int(reference['tokens']):,} scored next tokens), {_scales(plan.get('granularity', 'tensor'))}."
    )


def _scales(granularity: str) -> str:
    """A plan written before it recorded its granularity ran per sequence."""
    return "scales per token (causal)" if granularity == "row" else f"scales of granularity {granularity} (non-causal)"


def real_models_markdown(docs: list[dict]) -> str:
    """The whole section (a level-2 heading and its subsections), the measured models side by side and a line for
    each model that could not be measured."""
    measured = [doc for doc in docs if "skipped" not in doc]
    heading = "## Real pretrained models: " + ", ".join(f"`{doc['model']}`" for doc in docs)
    skipped = [f"- `{doc['model']}`: not measured: {doc['skipped']}" for doc in docs if "skipped" in doc]
    if not measured:
        return "\n\n".join([heading, "\n".join(skipped)])
    weight_bits = measured[0]["plan"]["weight_bits"]
    return "\n\n".join([
        heading,
        "Measured by this run, each model with its sequences opened as it was trained (BOS first where its tokenizer "
        "or GGUF file says so). All rows are **ours**.\n\n" + "\n".join([*map(_measured_line, measured), *skipped]),
        "### Largest activation values (Table 5 layout)\n\n" + _statistics(measured),
        "### Next-token accuracy and perplexity, quantized (Figure 8 layout, task `lm`)\n\n"
        "`linear`: weights (per output channel) and inputs of every linear layer in the decoder layers; `qk`: Q and K "
        "as operands of the logits matmul.\n\n" + _figure8(measured) + "\n\n" + SAMPLING_NOTE,
        f"### Weight-only {weight_bits}-bit formats (as `quantdiff quantize` exports and reloads them)\n\n" + _weight_only(measured),
    ])
