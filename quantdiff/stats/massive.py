"""Massive activations in the residual stream (Sun et al. 2024, "Massive Activations in Large Language Models",
arXiv 2402.17762, §2): a few hidden-state entries with magnitude above 100 and roughly 1,000× the median
magnitude of their hidden state, at fixed channels and usually on the first token."""

from __future__ import annotations

MIN_MAGNITUDE = 100.0  # Sun et al.'s criterion: larger than 100 …
MIN_RATIO = 1000.0  # … and about 1,000× the median magnitude of the layer's hidden state


def _is_massive(value: float | None, median: float | None) -> bool:
    return value is not None and median is not None and value > MIN_MAGNITUDE and value >= MIN_RATIO * median


def massive_activation(hidden: dict) -> dict | None:
    """The Top-1 hidden state located (layer, sequence, position, channel), on the first position or not, ÷ the
    median |h| of its layer; the layers whose Top-1 meets the criterion and the channels of the Top-k entries that
    meet it. `hidden`: the hidden-state summary with its `topk` and `per_layer` blocks. None when nothing was seen."""
    if not hidden["topk"]:
        return None
    top = hidden["topk"][0]
    per_layer = hidden["per_layer"]
    median = per_layer[top["layer"]]["median"]
    ratio = None if not median else top["value"] / median
    return {
        **{key: top[key] for key in ("value", "layer", "sequence", "position", "channel")},
        "first_position": top["position"] == 0,
        "layer_median": median,
        "ratio": ratio,
        "massive": _is_massive(top["value"], median),
        "layers": [l for l, block in enumerate(per_layer) if _is_massive(block["max"], block["median"])],
        "channels": sorted({e["channel"] for e in hidden["topk"] if _is_massive(e["value"], per_layer[e["layer"]]["median"])}),
        "criterion": {"min_magnitude": MIN_MAGNITUDE, "min_ratio": MIN_RATIO},
    }
