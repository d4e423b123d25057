"""Run a model over batches and collect its ModelStats.

`collect_stats(model, batches)` is the Python API (used by `quantdiff stats` and `quantdiff reproduce`):
hooks from `observe` feed every logits tile, every decoder layer's output and the inputs of its attention
projections and FFN expansion into the statistics, which stay on the model's device. Under `torchrun` each rank takes whole batches round-robin (`data.shard`) and
rank 0 merges the gathered statistics exactly. Every run checks that each attention module and decoder layer
was reached (`collect` returns that coverage), and models that soft-cap their logits also get statistics of the
capped values that enter softmax.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.attention.backend import TileContext
from quantdiff.data.sources import Batch
from quantdiff.attention.coverage import Coverage, tracking
from quantdiff.attention.observe import observe
from quantdiff.core.errors import ConfigError
from quantdiff.models import structure
from quantdiff.stats.absstats import AbsStats
from quantdiff.stats.model_stats import LOGIT_LOCATION, ModelStats
from quantdiff.stats.sinks import SinkStats

DEFAULT_K = 100


def _check_one_attention_per_layer(model: nn.Module) -> int:
    """The statistics index logits and hidden states by one layer axis: refuse hybrids (some layers without
    softmax attention) by name. Returns the number of layers."""
    tap_layers = [tap.layer_idx for tap in attention.taps(model)]
    decoder = len(structure.decoder_layers(model))
    if tap_layers != list(range(decoder)):
        raise ConfigError(
            f"{structure.model_label(model)}: statistics need softmax attention in every decoder layer; "
            f"{decoder} decoder layers have attention modules at layers {tap_layers[:8]}{' …' if len(tap_layers) > 8 else ''}"
        )
    return decoder


@dataclass
class Collected:
    """What one collection run yields: the statistics, what the forwards reached and, for models that
    soft-cap their logits, the statistics of the capped values that enter softmax (None otherwise)."""

    stats: ModelStats
    coverage: Coverage
    capped_logits: AbsStats | None = None


class StatsCollector:
    """Hook callbacks that know the current batch (its global sequence offset and padding)."""

    def __init__(self, model: nn.Module, k: int = DEFAULT_K, compile: bool | None = None) -> None:
        config = model.config
        device = next(model.parameters()).device
        layers, heads = _check_one_attention_per_layer(model), config.num_attention_heads
        self.stats = ModelStats.empty(layers, heads, config.hidden_size, structure.model_head_maps(model), k, device)
        # Capped logits get their own block: the paper's logits are QKᵀ·scaling before any capping.
        self.capped = AbsStats.empty(layers * heads, k, LOGIT_LOCATION, device) if structure.logit_softcap(config) else None
        # Compiled per-element kernels pay off on CUDA; on CPU the one-off compile outweighs them for short runs.
        self.stats.logits.fused = self.stats.hidden.fused = device.type == "cuda" if compile is None else compile
        self.sinks = SinkStats.empty(len(attention.taps(model)), heads, structure.layer_lambdas(model), structure.head_pairing(model))
        self.batch: Batch | None = None
        self.label = structure.model_label(model)

    def on_logits(self, logits: torch.Tensor, ctx: TileContext) -> None:
        self.sinks.on_tile(logits, ctx)
        b, h, rows, cols = logits.shape
        valid = ctx.valid
        mask = self.batch.attention_mask
        if mask is not None:  # padded query rows see real keys in the mask: drop them too
            valid = valid & mask.bool()[:, ctx.q_positions].view(b, 1, rows, 1)
        valid = valid.expand(valid.shape[0], valid.shape[1], rows, cols).reshape(valid.shape[0], valid.shape[1], rows * cols)
        first, q_positions = self.batch.first_sequence, ctx.q_positions

        def locate(seq: torch.Tensor, head: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
            layer = torch.full_like(seq, ctx.layer_idx)
            return torch.stack([layer, head, seq + first, q_positions[flat // cols], flat % cols + ctx.k_start], dim=1)

        # (B, H, rows, cols) -> (B, H, rows·cols): one group per head of this layer
        self.stats.logits.update(logits.reshape(b, h, rows * cols), ctx.layer_idx * h, valid, locate)
        if ctx.softcap is not None and self.capped is not None:
            capped = torch.tanh(logits / ctx.softcap) * ctx.softcap
            self.capped.update(capped.reshape(b, h, rows * cols), ctx.layer_idx * h, valid, locate)

    def on_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        if hidden.dim() != 3 or hidden.shape[-1] != self.stats.hidden_size:
            raise ConfigError(f"{self.label}: decoder layer {layer} returns hidden states of shape {tuple(hidden.shape)}, not (batch, tokens, {self.stats.hidden_size})")
        b, t, d = hidden.shape
        mask = self.batch.attention_mask
        valid = None if mask is None else mask.bool().view(b, 1, t, 1).expand(b, 1, t, d).reshape(b, 1, t * d)
        first = self.batch.first_sequence

        def locate(seq: torch.Tensor, _group: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.full_like(seq, layer), seq + first, flat // d, flat % d], dim=1)

        self.stats.hidden.update(hidden.reshape(b, 1, t * d), layer, valid, locate)  # (B, T, D) -> (B, 1, T·D)
        # Position 0 on its own (right-padded batches: always a real token): the residual peak at BOS.
        first_valid = None if valid is None else valid[:, :, :d]
        self.stats.first.update(hidden[:, :1].reshape(b, 1, d), layer, first_valid, locate)

    def on_linear_input(self, layer: int, which: int, x: torch.Tensor) -> None:
        b, t, d = x.shape
        if d != self.stats.hidden_size:
            raise ConfigError(f"{self.label}: decoder layer {layer} feeds its linear layers inputs of width {d}, not {self.stats.hidden_size}")
        mask = self.batch.attention_mask
        self.stats.linear_inputs.update(layer, which, x.reshape(b * t, d), None if mask is None else mask.bool().view(-1))

    def run(self, model: nn.Module, batch: Batch, lm_head: bool = False) -> torch.Tensor | None:
        """One forward of the base model (no LM head: its logits are not observed), or with `lm_head` of the whole
        model, returning its output logits (the damage pass's full-precision reference, `eval.damage`)."""
        device = self.stats.logits.device
        self.batch = batch.to(device)
        with ExitStack() as deferred:
            for block in (self.stats.logits, self.stats.hidden, self.capped):
                if block is not None:
                    deferred.enter_context(block.deferred_merges())
            forward = model if lm_head else model.base_model
            out = forward(input_ids=self.batch.input_ids, attention_mask=self.batch.attention_mask, use_cache=False)
        self.sinks.end_batch(self.batch.attention_mask)
        self.stats.tokens += batch.tokens
        self.stats.sequences += batch.input_ids.shape[0]
        return out.logits if lm_head else None


def collect(
    model: nn.Module,
    batches: Iterable[Batch],
    k: int = DEFAULT_K,
    progress: Callable[[int], None] | None = None,
    compile: bool | None = None,
    allow_partial: bool = False,
) -> Collected:
    """`collect_stats` with what the run reached and the capped-logits block; see there.

    ConfigError when an attention module or decoder layer was never reached, unless allow_partial.
    """
    collector = StatsCollector(model, k, compile)
    with tracking(model) as coverage:
        with observe(model, collector.on_logits, collector.on_hidden, collector.on_linear_input, on_lambda=collector.sinks.on_lambda), torch.inference_mode():
            for batch in batches:
                collector.run(model, batch)
                if progress is not None:
                    progress(batch.tokens)
    if coverage.ran:
        coverage.check(allow_partial)
    collector.stats.sinks = collector.sinks
    return Collected(collector.stats, coverage, collector.capped)


def collect_stats(
    model: nn.Module,
    batches: Iterable[Batch],
    k: int = DEFAULT_K,
    progress: Callable[[int], None] | None = None,
    compile: bool | None = None,
    allow_partial: bool = False,
) -> ModelStats:
    """Statistics of attention logits and hidden states of `model` (on the quantdiff backend) over `batches`.

    progress(tokens) is called after each batch. Statistics live on the model's device. compile: fuse the
    per-element work with torch.compile (None: on CUDA only). allow_partial: accept a model where some
    attention module or decoder layer was never reached (else ConfigError naming them). The attention-sink
    statistics ride along as `stats.sinks` (a SinkStats: ModelStats itself knows logits and hidden states only).
    """
    return collect(model, batches, k, progress, compile, allow_partial).stats
