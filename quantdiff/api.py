"""The public Python API behind `quantdiff.<name>`: the same model names as the CLI, errors naming parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from quantdiff.core.errors import LoadError
from quantdiff.data.sources import Batch, make_batches
from quantdiff.models import loading
from quantdiff.models.names import resolve
from quantdiff.quant import checkpoint, export
from quantdiff.quant.formats import ExportFormat
from quantdiff.stats.collect import DEFAULT_K
from quantdiff.stats.collect import collect_stats as collect_batches
from quantdiff.stats.model_stats import ModelStats


def _one_model(model: str | Path) -> Path:
    paths = resolve(model)
    if len(paths) != 1:
        raise LoadError(f"model={str(model)!r} names {len(paths)} models; load one at a time (e.g. {model}/diff)")
    return paths[0]


def load(model: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None, **kwargs) -> nn.Module:
    """A built-in name ('tiny/diff', 'smollm2', 'gemma3'), a local model directory, a GGUF file (its dequantized copy), a
    hub id or a quantdiff export, on the quantdiff backend.

    device: default CUDA when present, else CPU; other keywords (`device_map`, `tile_size`) as `checkpoint.load`.
    """
    return checkpoint.load(_one_model(model), device=device, dtype=dtype, **kwargs)


def load_tokenizer(model: str | Path):
    """The tokenizer stored with a model (any name `load` takes)."""
    return loading.load_tokenizer(_one_model(model))


def collect_stats(
    model: nn.Module,
    data: torch.Tensor | Sequence[Batch],
    k: int = DEFAULT_K,
    batch_size: int = 4,
    compile: bool | None = None,
) -> ModelStats:
    """Attention-logit and hidden-state statistics of `model` over `data`: token ids (B, T) (or (T,)) cut into
    batches of `batch_size` rows, or ready `Batch`es. The result is what `quantdiff stats --json` writes
    (`ModelStats.summary()`), and merges exactly with statistics of other data."""
    if isinstance(data, torch.Tensor):
        if data.dim() not in (1, 2) or data.numel() == 0 or data.is_floating_point():
            raise ValueError(f"data must be integer token ids of shape (T,) or (B, T), got {tuple(data.shape)} {data.dtype}")
        rows = data.view(1, -1) if data.dim() == 1 else data
        data = make_batches(rows.tolist(), batch_size)
    return collect_batches(model, data, k, compile=compile)


def export_quantized(model: str | Path, out: str | Path, fmt: ExportFormat, **kwargs) -> export.ExportSummary:
    """Quantize a model's linear weights and write a model directory at `out` (see `quant.export`)."""
    return export.export_quantized(_one_model(model), out, fmt, **kwargs)


