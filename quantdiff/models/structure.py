"""Model structure, read from transformers' own declarations: the one place that knows it.

Which modules are attention modules and decoder layers comes from the model class's `_can_record_outputs`
(what transformers itself hooks for `output_attentions` / `output_hidden_states`) and `_no_split_modules`,
never from class-name suffixes or projection names, so fused-QKV families (Phi-3 `qkv_proj`, GPT-2
`c_attn`, GPT-NeoX `query_key_value`) are found like any other. Differential attention is known by model type:
DiffLlama pairs heads i and i + H/2 (maps 1 and 2) with one λ per layer; DIFF V2 pairs heads 2i and 2i + 1 (one
GQA group) with a λ per token and per pair, sigmoid of its attention module's `lambda_proj` of the input. quantdiff's
gated and sink kinds are softmax attention with something added (an output gate, a sink logit): their heads do
not pair, and their kind is read from their model type.
"""

from __future__ import annotations

import torch
from torch import nn

from quantdiff.core.errors import LoadError
from quantdiff.models.diffv2 import MODEL_TYPE as DIFFV2_MODEL_TYPE
from quantdiff.models.gated import MODEL_TYPE as GATED_MODEL_TYPE
from quantdiff.models.sink import MODEL_TYPE as SINK_MODEL_TYPE

# Model types whose attention is differential, softmax(Q1K1ᵀ) − λ·softmax(Q2K2ᵀ), and how their heads pair:
# "halves" (head i with i + H/2, one λ per layer) or "adjacent" (head 2i with 2i + 1, λ per token and pair).
HEAD_PAIRING = {"diffllama": "halves", DIFFV2_MODEL_TYPE: "adjacent"}
DIFFERENTIAL_MODEL_TYPES = frozenset(HEAD_PAIRING)
UNPAIRED_KINDS = {GATED_MODEL_TYPE: "gated", SINK_MODEL_TYPE: "sink"}  # quantdiff's kinds with standard head maps


def _recorders(model: nn.Module, key: str) -> list[tuple[type | str, str | None]]:
    """(class or class-name suffix, layer-name suffix or None) declared under `_can_record_outputs[key]` of the
    model or its base."""
    declared = getattr(model, "_can_record_outputs", None) or getattr(getattr(model, "base_model", None), "_can_record_outputs", None) or {}
    entry = declared.get(key)
    entries = entry if isinstance(entry, (list, tuple)) else [entry] if entry is not None else []
    out = []
    for item in entries:
        if isinstance(item, type):
            out.append((item, None))
        elif getattr(item, "target_class", None) is not None:  # transformers' OutputRecorder
            out.append((item.target_class, item.layer_name))
        elif getattr(item, "class_name", None):  # an OutputRecorder naming its class
            out.append((item.class_name, item.layer_name))
    return out


def _is_declared(module: nn.Module, name: str, cls: type | str, suffix: str | None) -> bool:
    of_class = isinstance(module, cls) if isinstance(cls, type) else type(module).__name__.endswith(cls)
    return of_class and (suffix is None or name.endswith(suffix))


def _matching(model: nn.Module, declared: list[tuple[type | str, str | None]]) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if any(_is_declared(module, name, *d) for d in declared)]


def model_label(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every self-attention module, in layer order; LoadError if none is declared."""
    found = _matching(model, _recorders(model, "attentions"))
    if not found:
        raise LoadError(f"{model_label(model)}: the model declares no attention modules (no 'attentions' in _can_record_outputs)")
    missing = [name for name, module in found if not isinstance(getattr(module, "layer_idx", None), int)]
    if missing:
        raise LoadError(f"{model_label(model)}: attention module {missing[0]} carries no layer index")
    return sorted(found, key=lambda item: item[1].layer_idx)


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every decoder layer, in model order (`hidden_states` recorders, else `_no_split_modules`)."""
    found = _matching(model, _recorders(model, "hidden_states"))
    if not found:
        names = set(getattr(model, "_no_split_modules", None) or [])
        found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in names]
    if not found:
        raise LoadError(f"{model_label(model)}: the model declares no decoder layers")
    return found


def is_differential(model_or_config) -> bool:
    """True for differential-attention models (by model type, from the config)."""
    return head_pairing(model_or_config) is not None


def head_pairing(model_or_config) -> str | None:
    """"halves", "adjacent" (see HEAD_PAIRING) or None for standard attention."""
    config = getattr(model_or_config, "config", model_or_config)
    return HEAD_PAIRING.get(getattr(config, "model_type", None))


def attention_kind(model_or_config) -> str:
    """"standard", "diff" (DiffLlama), "diffv2", "gated" or "sink": the model kinds of `models.pairs`."""
    pairing = head_pairing(model_or_config)
    if pairing is not None:
        return {"halves": "diff", "adjacent": "diffv2"}[pairing]
    config = getattr(model_or_config, "config", model_or_config)
    return UNPAIRED_KINDS.get(getattr(config, "model_type", None), "standard")


def kind_of_head_maps(maps: list[int] | None) -> str:
    """The attention kind whose head maps (`model_head_maps`) these are."""
    if maps is None:
        return "standard"
    return "diffv2" if maps == head_maps(len(maps), "adjacent") else "diff"


def map_heads(heads: int, pairing: str = "halves") -> tuple[list[int], list[int]]:
    """(heads of map 1, heads of map 2), pair by pair: differential head j is the pair (first[j], second[j])."""
    if pairing == "adjacent":
        return list(range(0, heads, 2)), list(range(1, heads, 2))
    return list(range(heads // 2)), list(range(heads // 2, heads))


def head_maps(heads: int, pairing: str = "halves") -> list[int]:
    """Per head of a differential layer: 1 or 2, which map it computes."""
    first, _ = map_heads(heads, pairing)
    return [1 if h in first else 2 for h in range(heads)]


def model_head_maps(model: nn.Module) -> list[int] | None:
    """Per head 1 or 2 for differential attention, None for standard attention."""
    pairing = head_pairing(model)
    return None if pairing is None else head_maps(model.config.num_attention_heads, pairing)


def differential_map(probs: torch.Tensor, lam: float | torch.Tensor, pairing: str = "halves") -> torch.Tensor:
    """(A1 − λ·A2)/(1 − λ) of per-head attention probabilities (B, H, …), heads paired as `map_heads` says.
    λ: the layer's (a float) or one per pair and query row, broadcastable to (B, H/2, …). Returns (B, H/2, …).

    The division makes every row sum to 1 as in the paper's Table 3; DIFF V2 itself outputs the undivided
    A1 − λ·A2 (its rows sum to 1 − λ), so its combined map is that output's attention pattern, renormalised."""
    first, second = map_heads(probs.shape[1], pairing)
    a1, a2 = probs[:, first], probs[:, second]
    return (a1 - lam * a2) / (1 - lam)


def differential_lambda(module: nn.Module) -> float:
    """λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit, as DiffLlama (and the paper) computes it per layer."""
    dot = lambda q, k: torch.sum(q.detach().float() * k.detach().float())  # noqa: E731
    return float(torch.exp(dot(module.lambda_q1, module.lambda_k1)) - torch.exp(dot(module.lambda_q2, module.lambda_k2)) + module.lambda_init)


def layer_lambdas(model: nn.Module) -> list[float] | None:
    """λ of every differential attention layer, in layer order; None for standard attention and for DIFF V2
    (whose λ is per token: `lambda_projections`)."""
    if head_pairing(model) != "halves":
        return None
    return [differential_lambda(module) for _, module in attention_modules(model)]


def lambda_projections(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, W_λ module) of every DIFF V2 attention layer, whose output z gives λ = `token_lambda(z)`
    (B, T, H/2) for the pairs of that layer; [] for other models."""
    if head_pairing(model) != "adjacent":
        return []
    return [(module.layer_idx, module.lambda_proj) for _, module in attention_modules(model)]


def token_lambda(projected: torch.Tensor) -> torch.Tensor:
    """DIFF V2's λ from its projection's output: sigmoid, per token and pair, in float64 (1 − λ divides the
    combined map, and float32 rounds sigmoid(z) to 1 from z ≈ 17)."""
    return torch.sigmoid(projected.double())


def logit_softcap(config) -> float | None:
    """The cap of attention-logit soft-capping (Gemma 2: cap·tanh(logits/cap) before softmax), None without."""
    return getattr(config, "attn_logit_softcapping", None) or None
