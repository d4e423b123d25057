"""Run a model over batches and collect its ModelStats.

`collect_stats(model, batches)` is used by `quantdiff stats`, `quantdiff reproduce` and the public API: hooks
from `observe` feed every logits tile and every decoder layer's output into the statistics, which stay on the
model's device. Under torchrun each rank collects its own batches; `distributed` merges them.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.attention.backend import TileContext
from quantdiff.data.sources import Batch
from quantdiff.attention.observe import observe
from quantdiff.stats.model_stats import ModelStats

DEFAULT_K = 100


def head_maps(model: nn.Module) -> list[int] | None:
    """Per head 1 or 2 for differential attention (head i pairs with i + H/2), None for standard attention."""
    taps = attention.taps(model)
    if not taps or not taps[0].differential:
        return None
    heads = model.config.num_attention_heads
    return [1] * (heads // 2) + [2] * (heads - heads // 2)


class StatsCollector:
    """Hook callbacks that know the current batch (its global sequence offset and padding)."""

    def __init__(self, model: nn.Module, k: int = DEFAULT_K, compile: bool | None = None) -> None:
        config = model.config
        device = next(model.parameters()).device
        self.stats = ModelStats.empty(len(attention.taps(model)), config.num_attention_heads, config.hidden_size, head_maps(model), k, device)
        # Compiled per-element kernels pay off on CUDA; on CPU the one-off compile outweighs them for short runs.
        self.stats.logits.fused = self.stats.hidden.fused = device.type == "cuda" if compile is None else compile
        self.batch: Batch | None = None

    def on_logits(self, logits: torch.Tensor, ctx: TileContext) -> None:
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

    def on_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        b, t, d = hidden.shape
        mask = self.batch.attention_mask
        valid = None if mask is None else mask.bool().view(b, 1, t, 1).expand(b, 1, t, d).reshape(b, 1, t * d)
        first = self.batch.first_sequence

        def locate(seq: torch.Tensor, _group: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.full_like(seq, layer), seq + first, flat // d, flat % d], dim=1)

        self.stats.hidden.update(hidden.reshape(b, 1, t * d), layer, valid, locate)  # (B, T, D) -> (B, 1, T·D)
        self.stats.channels.update(layer, hidden.reshape(b * t, d), None if mask is None else mask.bool().view(-1))

    def run(self, model: nn.Module, batch: Batch) -> None:
        """One forward of the base model (no LM head: its logits are not observed)."""
        device = self.stats.logits.device
        self.batch = batch.to(device)
        with self.stats.logits.deferred_merges(), self.stats.hidden.deferred_merges():
            model.base_model(input_ids=self.batch.input_ids, attention_mask=self.batch.attention_mask, use_cache=False)
        self.stats.tokens += batch.tokens
        self.stats.sequences += batch.input_ids.shape[0]


def collect_stats(
    model: nn.Module,
    batches: Iterable[Batch],
    k: int = DEFAULT_K,
    progress: Callable[[int], None] | None = None,
    compile: bool | None = None,
) -> ModelStats:
    """Statistics of attention logits and hidden states of `model` (on the quantdiff backend) over `batches`.

    progress(tokens) is called after each batch. Statistics live on the model's device. compile: fuse the
    per-element work with torch.compile (None: on CUDA only).
    """
    collector = StatsCollector(model, k, compile)
    with observe(model, collector.on_logits, collector.on_hidden), torch.inference_mode():
        for batch in batches:
            collector.run(model, batch)
            if progress is not None:
                progress(batch.tokens)
    return collector.stats
