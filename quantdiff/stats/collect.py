"""Run a model over batches and collect its ModelStats; shard and merge them under torchrun.

`collect_stats(model, batches)` is the Python API (used by `quantdiff stats` and `quantdiff reproduce`):
hooks from `observe` feed every logits tile and every decoder layer's output into the statistics, which
stay on the model's device. Under `torchrun` each rank takes whole batches round-robin (`data.shard`) and
rank 0 merges the gathered statistics exactly.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.attention.backend import TileContext
from quantdiff.data.sources import Batch
from quantdiff.attention.observe import observe
from quantdiff.stats.engine import ModelStats
from quantdiff.stats.sinks import SinkStats, layer_lambdas

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
        self.sinks = SinkStats.empty(len(attention.taps(model)), config.num_attention_heads, layer_lambdas(model))
        self.batch: Batch | None = None

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
        self.sinks.end_batch(self.batch.attention_mask)
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
    per-element work with torch.compile (None: on CUDA only). The attention-sink statistics ride along as
    `stats.sinks` (a SinkStats: ModelStats itself knows logits and hidden states only).
    """
    collector = StatsCollector(model, k, compile)
    with observe(model, collector.on_logits, collector.on_hidden), torch.inference_mode():
        for batch in batches:
            collector.run(model, batch)
            if progress is not None:
                progress(batch.tokens)
    collector.stats.sinks = collector.sinks
    return collector.stats


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group (gloo) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # statistics travel as plain dicts: gloo carries them on CPU and GPU runs
    return dist.get_rank(), dist.get_world_size()


def gather_to_rank0(stats: ModelStats, rank: int, world: int) -> ModelStats | None:
    """Exact merge of every rank's statistics on rank 0 (in rank order); None on other ranks."""
    if world == 1:
        return stats
    import torch.distributed as dist

    gathered = [None] * world if rank == 0 else None
    dist.gather_object({"stats": stats.to_dict(), "sinks": stats.sinks.to_dict()}, gathered, dst=0)
    if rank != 0:
        return None
    merged = ModelStats.from_dict(gathered[0]["stats"], stats.logits.device)
    merged.sinks = SinkStats.from_dict(gathered[0]["sinks"])
    for part in gathered[1:]:
        merged.merge(ModelStats.from_dict(part["stats"], stats.logits.device))
        merged.sinks.merge(SinkStats.from_dict(part["sinks"]))
    return merged


def device_for_rank(requested: str | None) -> torch.device:
    """--device, else CUDA (this rank's GPU under torchrun) when available, else CPU."""
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
