"""Statistics under torchrun: which rank this process is, and the exact merge of every rank's statistics."""

from __future__ import annotations

import os

from quantdiff.stats.absstats import AbsStats
from quantdiff.stats.model_stats import ModelStats
from quantdiff.stats.sinks import SinkStats


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
    """Exact merge of every rank's statistics (and their `sinks`) on rank 0, in rank order; None on other ranks."""
    merged = _gather(stats, ModelStats, stats.logits.device, rank, world)
    sinks = getattr(stats, "sinks", None)
    if sinks is not None and world > 1:
        merged_sinks = _gather(sinks, SinkStats, None, rank, world)
        if merged is not None:
            merged.sinks = merged_sinks
    return merged


def gather_capped_to_rank0(capped: AbsStats | None, rank: int, world: int) -> AbsStats | None:
    """The capped-logits block of soft-capping models, merged like `gather_to_rank0` (None stays None)."""
    return None if capped is None else _gather(capped, AbsStats, capped.device, rank, world)


def _gather(part, cls, device, rank: int, world: int):
    if world == 1:
        return part
    import torch.distributed as dist

    gathered = [None] * world if rank == 0 else None
    dist.gather_object(part.to_dict(), gathered, dst=0)
    if rank != 0:
        return None
    load = (lambda data: cls.from_dict(data)) if device is None else (lambda data: cls.from_dict(data, device))
    merged = load(gathered[0])
    for other in gathered[1:]:
        merged.merge(load(other))
    return merged
