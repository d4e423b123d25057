"""The statistics JSON document (`schema` "quantdiff.stats", `version` 2) that `quantdiff stats --json` writes:

    {"schema": "quantdiff.stats", "version": 2,
     "quantile_relative_error": 0.0009765625,      # every quantile/median is within this of exact
     "quantile_definition": "...",
     "data": {"source", "tokens", "seq_len", "batch_size", "k", "tile_size", "world_size"},
     "models": [                                    # one entry per model, in command-line order
       {"name", "path", "kind": "standard"|"diff"|"diffv2"|"gated"|"sink", "layers", "heads", "hidden_size", "tokens", "sequences",
        "attention_logits": BLOCK + {"per_layer": [BLOCK], "per_head": [[BLOCK]], "per_map": {"1": BLOCK, "2": BLOCK}},
        "hidden_states": BLOCK + {"per_layer": [BLOCK],
                                  "massive_activation": {"value", "layer", "sequence", "position", "channel",
                                      "first_position", "layer_median", "ratio", "massive", "layers", "channels",
                                      "criterion": {"min_magnitude", "min_ratio"}} | null},
        "linear_inputs": {"channel_absmax": [[float]] (layer × channel, over the attention and FFN inputs),
                          "outlier_features": {"count", "channels", "layers" (per channel: layers holding it),
                              "threshold", "min_layer_fraction", "min_position_fraction", "inputs"}},
        "sinks": {"epsilon", "per_head": [[mass]] (layer × head: mean attention on position 0 over valid query rows),
                  "mean", "max", "score" (share of heads above epsilon), "heads_scored",
                  Diff only: "per_map": {"1", "2"}: [[mass]], "combined": [[(A1 − λ·A2)/(1 − λ)]], "lambdas",
                  "lambda_per_token" (DIFF V2: each query row combined with its own λ; "lambdas" is null),
                  a sink logit per head only (GPT-OSS, the sink kind): "sink_logit": {"per_head": [[share]] (layer ×
                  head: mean over valid query rows of exp(s)/(exp(s) + Σ exp(ℓ)), the attention given to no key),
                  "mean", "max"}}}]}
    BLOCK = {"count", "nonfinite": {"nan", "inf"}, "max", "median", "quantiles": {"0.5": …, "0.99": …},
             "mean", "std", "kurtosis", "topk": [{"value", "layer", "head", "sequence", "query", "key", "map"?}
                                                 | {"value", "layer", "sequence", "position", "channel"}]}

`topk` is sorted by value descending (ties: location ascending); per_head blocks keep the top 10; `per_map`
exists for differential models only (DiffLlama: map 1 = heads 0…H/2−1, map 2 = the rest; DIFF V2: map 1 = the
even heads, map 2 = the odd ones). Version 2 moved the per-channel statistics from the decoder-layer outputs to the
linear layers' inputs (`linear_inputs`, LLM.int8's definition) and added `massive_activation` to `hidden_states`.
"""

from __future__ import annotations

from quantdiff.models import structure
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR
from quantdiff.stats.model_stats import ModelStats

SCHEMA = "quantdiff.stats"
SCHEMA_VERSION = 2
QUANTILE_DEFINITION = (
    "quantile q of |x| is the value of rank floor(q*(count-1)) in ascending order (torch.quantile 'lower'), "
    "reported as the midpoint of its log-spaced histogram bin"
)


def model_entry(name: str, path: str, stats: ModelStats, kind: str | None = None) -> dict:
    """One element of the document's `models`: what the model is, then `stats.summary()`. `kind`: the model's
    (`structure.attention_kind`); None reads what the statistics tell (the gated and sink kinds then read as
    standard: their heads do not pair)."""
    return {
        "name": name,
        "path": path,
        "kind": kind or _kind(stats),
        "layers": stats.layers,
        "heads": stats.heads,
        "hidden_size": stats.hidden_size,
        "tokens": stats.tokens,
        "sequences": stats.sequences,
        **stats.summary(),
        **({"sinks": stats.sinks.summary()} if getattr(stats, "sinks", None) is not None else {}),
    }


def _kind(stats: ModelStats) -> str:
    """The attention kind: from the sink statistics' head pairing when collected (two heads pair the same way
    in DiffLlama and DIFF V2, so the head maps alone cannot tell them apart), else from the head maps."""
    sinks = getattr(stats, "sinks", None)
    if sinks is not None:
        return {"halves": "diff", "adjacent": "diffv2"}.get(sinks.pairing, "standard")
    return structure.kind_of_head_maps(stats.head_maps)


def document(entries: list[dict], data: dict) -> dict:
    """The whole document: `entries` from `model_entry`, `data` saying what was observed."""
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "quantile_relative_error": QUANTILE_RELATIVE_ERROR,
        "quantile_definition": QUANTILE_DEFINITION,
        "data": data,
        "models": entries,
    }
