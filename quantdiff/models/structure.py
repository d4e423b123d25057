"""Model structure, read from transformers' own declarations: the one place that knows it.

Which modules are attention modules and decoder layers comes from the model class's `_can_record_outputs`
(what transformers itself hooks for `output_attentions` / `output_hidden_states`) and `_no_split_modules`,
never from class-name suffixes or projection names, so fused-QKV families (Phi-3 `qkv_proj`, GPT-2
`c_attn`, GPT-NeoX `query_key_value`) are found like any other. Differential attention (DiffLlama) is
known by model type: heads i and i + H/2 are its maps 1 and 2, combined with a per-layer λ.
"""

from __future__ import annotations

import torch
from torch import nn

from quantdiff.core.errors import LoadError

# Model types whose attention is differential: softmax(Q1K1ᵀ) − λ·softmax(Q2K2ᵀ), heads i and i + H/2 paired.
DIFFERENTIAL_MODEL_TYPES = frozenset({"diffllama"})


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
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) in DIFFERENTIAL_MODEL_TYPES


def head_maps(heads: int) -> list[int]:
    """Per head of a differential layer: 1 or 2, which map it computes (head i pairs with head i + H/2)."""
    return [1] * (heads // 2) + [2] * (heads - heads // 2)


def model_head_maps(model: nn.Module) -> list[int] | None:
    """Per head 1 or 2 for differential attention, None for standard attention."""
    return head_maps(model.config.num_attention_heads) if is_differential(model) else None


def differential_map(probs: torch.Tensor, lam: float) -> torch.Tensor:
    """(A1 − λ·A2)/(1 − λ) of per-head attention probabilities (B, H, …): map 1 is heads [0, H/2), map 2 the rest,
    head i pairing with head i + H/2 (as `head_maps` says). Returns (B, H/2, …)."""
    a1, a2 = probs.chunk(2, dim=1)
    return (a1 - lam * a2) / (1 - lam)


def differential_lambda(module: nn.Module) -> float:
    """λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit, as DiffLlama (and the paper) computes it per layer."""
    dot = lambda q, k: torch.sum(q.detach().float() * k.detach().float())  # noqa: E731
    return float(torch.exp(dot(module.lambda_q1, module.lambda_k1)) - torch.exp(dot(module.lambda_q2, module.lambda_k2)) + module.lambda_init)


def layer_lambdas(model: nn.Module) -> list[float] | None:
    """λ of every differential attention layer, in layer order; None for standard attention."""
    if not is_differential(model):
        return None
    return [differential_lambda(module) for _, module in attention_modules(model)]


def logit_softcap(config) -> float | None:
    """The cap of attention-logit soft-capping (Gemma 2: cap·tanh(logits/cap) before softmax), None without."""
    return getattr(config, "attn_logit_softcapping", None) or None
