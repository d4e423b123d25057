"""Observation through forward hooks only: attention taps for logits, decoder layers for hidden states,
DIFF V2's λ projections for its per-token λ.

`observe(model, on_logits, on_hidden, on_lambda)` attaches the hooks and always removes them, so a model leaves the
block as it entered (and its taps fall back to the SDPA fast path once nobody listens).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.attention.backend import TileContext
from quantdiff.models import structure

LogitsHook = Callable[[torch.Tensor, TileContext], None]  # (logits (B, H, rows, cols) float32, ctx)
HiddenHook = Callable[[int, torch.Tensor], None]  # (layer index, hidden states (B, T, D))
LambdaHook = Callable[[int, torch.Tensor], None]  # (layer index, λ (B, T, H/2)) of layers with a per-token λ


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in model order (as the model declares them)."""
    return [module for _, module in structure.decoder_layers(model)]


@contextmanager
def observe(
    model: nn.Module, on_logits: LogitsHook | None = None, on_hidden: HiddenHook | None = None, on_lambda: LambdaHook | None = None
) -> Iterator[None]:
    """Call on_logits for every logits tile (each logit once), on_hidden for every decoder layer's output and
    on_lambda for every per-token λ a layer computes (DIFF V2; other models have none)."""
    handles = []
    try:
        if on_logits is not None:
            for tap in attention.taps(model):
                handles.append(tap.register_forward_hook(lambda _tap, args, _out: on_logits(*args)))
        if on_hidden is not None:
            for index, layer in enumerate(decoder_layers(model)):
                handles.append(layer.register_forward_hook(_hidden_hook(index, on_hidden)))
        if on_lambda is not None:
            for index, projection in structure.lambda_projections(model):
                handles.append(projection.register_forward_hook(lambda _m, _args, out, index=index: on_lambda(index, structure.token_lambda(out))))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hidden_hook(index: int, on_hidden: HiddenHook):
    def hook(_module: nn.Module, _args, output) -> None:
        on_hidden(index, output[0] if isinstance(output, (tuple, list)) else output)  # some layers return tuples

    return hook
