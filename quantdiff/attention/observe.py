"""Observation through forward hooks only: attention taps for logits, decoder layers for hidden states, the
linear inputs of each decoder layer (what enters its attention projections and its FFN expansion), and DIFF V2's
λ projections for its per-token λ.

`observe(model, on_logits, on_hidden, on_linear_input, on_lambda)` attaches the hooks and always removes them, so
a model leaves the block as it entered (and its taps fall back to the SDPA fast path once nobody listens).
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
LinearInputHook = Callable[[int, int, torch.Tensor], None]  # (layer index, 0 attention / 1 FFN input, x (B, T, D))
ATTENTION_INPUT, FFN_INPUT = 0, 1


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in model order (as the model declares them)."""
    return [module for _, module in structure.decoder_layers(model)]


@contextmanager
def observe(
    model: nn.Module, on_logits: LogitsHook | None = None, on_hidden: HiddenHook | None = None,
    on_linear_input: LinearInputHook | None = None, on_lambda: LambdaHook | None = None,
) -> Iterator[None]:
    """Call on_logits for every logits tile (each logit once), on_hidden for every decoder layer's output,
    on_linear_input for each distinct input of a decoder layer's attention projections and FFN expansion, and
    on_lambda for every per-token λ a layer computes (DIFF V2; other models have none)."""
    handles = []
    try:
        if on_linear_input is not None:
            handles += _linear_input_hooks(model, on_linear_input)
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


def _linear_input_hooks(model: nn.Module, on_input: LinearInputHook) -> list:
    """Hooks that see what enters each decoder layer's linear layers from its normed hidden state, once per tensor.

    Attention projections: the attention module's `hidden_states` argument (q/k/v, fused or not, all read it).
    FFN expansion: the nn.Linear layers outside attention whose input is a (batch, tokens, hidden) tensor (gate and
    up share one; down reads the intermediate width; MoE routers and experts see flattened tokens and are left out).
    """
    attention_ids = {id(module) for _, module in structure.attention_modules(model)}
    hidden_size = model.config.hidden_size
    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        seen: dict[int, torch.Tensor] = {}  # per input kind: the tensor already reported in this forward of the layer

        def report(which: int, x: torch.Tensor, index: int = index, seen: dict = seen) -> None:
            if isinstance(x, torch.Tensor) and x.dim() == 3 and seen.get(which) is not x:
                seen[which] = x
                on_input(index, which, x)

        inside_attention = set()
        for module in layer.modules():
            if id(module) in attention_ids:
                inside_attention.update(id(m) for m in module.modules())
                handles.append(module.register_forward_pre_hook(
                    lambda _m, args, kwargs, report=report: report(ATTENTION_INPUT, kwargs.get("hidden_states", args[0] if args else None)),
                    with_kwargs=True))
        for module in layer.modules():
            if isinstance(module, nn.Linear) and id(module) not in inside_attention and module.in_features == hidden_size:
                handles.append(module.register_forward_pre_hook(lambda _m, args, report=report: report(FFN_INPUT, args[0])))
        handles.append(layer.register_forward_hook(lambda *_, seen=seen: seen.clear()))
    return handles
