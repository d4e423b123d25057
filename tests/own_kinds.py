"""What the tests of quantdiff's own model kinds (DIFF V2, gated, sink) share: one size, weights under which every
mechanism matters, inputs, and a copy of a model on the quantdiff backend."""

from __future__ import annotations

import copy

import torch

from quantdiff.models import loading
from quantdiff.models.pairs import SizePreset, build_pair

# DIFF V2: 4 output heads → 8 query heads over 2 KV heads, groups of 4, so "halves" pairing would cross groups.
PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=61, max_position_embeddings=64)
B, T = 2, 10


def perturbed_models(kinds: tuple[str, ...]) -> dict[str, torch.nn.Module]:
    """The kinds on eager attention, with weights large enough that attention patterns, λ, gates and sinks vary
    visibly (logits of order one; 1-D parameters — norms, sinks — near 1)."""
    models = build_pair(PRESET, seed=0, attn_implementation="eager", kinds=kinds)
    torch.manual_seed(1)
    with torch.no_grad():
        for model in models.values():
            for param in model.parameters():
                param.copy_(1 + 0.3 * torch.randn_like(param) if param.dim() == 1 else 0.25 * torch.randn_like(param))
    return {kind: model.eval() for kind, model in models.items()}


def token_ids() -> torch.Tensor:
    return torch.randint(3, PRESET.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))


def on_backend(model: torch.nn.Module, tile_size: int | None = 4) -> torch.nn.Module:
    return loading.prepare(copy.deepcopy(model), tile_size)
