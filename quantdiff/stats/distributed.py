"""Statistics under torchrun: which rank this process is, and the exact merge of every rank's statistics."""

from __future__ import annotations

import os

from quantdiff.stats.model_stats import ModelStats


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
    dist.gather_object(stats.to_dict(), gathered, dst=0)
    if rank != 0:
        return None
    merged = ModelStats.from_dict(gathered[0], stats.logits.device)
    for part in gathered[1:]:
        merged.merge(ModelStats.from_dict(part, stats.logits.device))
    return merged
