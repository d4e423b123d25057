"""Outlier emergence during training: every arm measured on the same fixed held-out sequences.

At every eval step each model is switched to the quantdiff backend (which computes logits tile by tile
and lets the statistics observe them), measured, and switched back to the attention it trains on. The entry
keeps the paper's Table-5 numbers (Top-1, median, their ratio, kurtosis of |attention logits| and |hidden states|),
where the largest hidden value sits (massive activations sit at the first token), the attention-sink
score (share of heads whose mean attention to position 0 exceeds ε) and LLM.int8's outlier features.
Measuring changes no weight and draws no random number, so a resumed run logs the same series.
"""

from __future__ import annotations

import torch

from quantdiff.data.sources import Batch, make_batches
from quantdiff.models.loading import prepare
from quantdiff.stats.collect import collect_stats

TOP_K = 10  # only the largest values are reported; a small k keeps the measurement cheap


def windows_as_batches(windows: list[list[int]], pad_id: int) -> list[Batch]:
    """The held-out windows measured at every eval step (BOS first when training puts one there), as one batch."""
    return make_batches(windows, max(1, len(windows)), pad_id)


def _activation(summary: dict, location: tuple[str, ...]) -> dict:
    top = summary["topk"][0] if summary["topk"] else {}
    return {
        "top1": summary["max"],
        "median": summary["median"],
        "kurtosis": summary["kurtosis"],
        # the massive-activation criterion (Sun et al. 2024: ~1000x the median), without recomputing it from the two
        "top1_to_median": summary["max"] / summary["median"] if summary["median"] else None,
        "top1_at": {name: top.get(name) for name in location},
    }


@torch.no_grad()
def measure(model: torch.nn.Module, batches: list[Batch], step: int, tokens: int) -> dict:
    """One emergence entry of `model` (left in training mode on the attention implementation it came with)."""
    train_attention = model.config._attn_implementation  # SDPA, or eager for the sink kind (SDPA would drop its sinks)
    prepare(model)
    try:
        stats = collect_stats(model, batches, k=TOP_K)
    finally:
        model.set_attn_implementation(train_attention)
        model.train()
    summary = stats.summary()
    logits, hidden = summary["attention_logits"], summary["hidden_states"]
    entry = {
        "step": step,
        "tokens": tokens,
        "attention_logits": _activation(logits, ("layer", "head", "query", "key")),
        "hidden_states": _activation(hidden, ("layer", "position", "channel")),
        "sink": stats.sinks.summary(),
        "outlier_features": summary["linear_inputs"]["outlier_features"]["count"],
    }
    if "per_map" in logits:
        entry["attention_logits"]["per_map_top1"] = {m: s["max"] for m, s in logits["per_map"].items()}
    entry["hidden_states"]["per_layer_top1"] = [layer["max"] for layer in hidden["per_layer"]]
    entry["hidden_states"]["first_position_top1"] = hidden["first_position"]["max"]  # the residual peak at BOS
    return entry
