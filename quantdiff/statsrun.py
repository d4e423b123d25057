"""Run a model over batches and collect its ModelStats; shard and merge them under torchrun.

`collect_stats(model, batches)` is the Python API (used by `quantdiff stats` and `quantdiff reproduce`):
hooks from `observe` feed every logits tile and every decoder layer's output into the statistics, which
stay on the model's device. Under `torchrun` each rank takes whole batches round-robin (`data.shard`) and
rank 0 merges the gathered statistics exactly.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from . import attention
from .attention import TileContext
from .data import BUILTIN_CORPUS, BUILTINS, Batch, shard
from .errors import ConfigError, DataError
from .observe import observe
from .stats import ModelStats

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

    def __init__(self, model: nn.Module, k: int = DEFAULT_K, device: torch.device | str | None = None) -> None:
        config = model.config
        device = device or next(model.parameters()).device
        self.stats = ModelStats.empty(len(attention.taps(model)), config.num_attention_heads, config.hidden_size, head_maps(model), k, device)
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
        model.base_model(input_ids=self.batch.input_ids, attention_mask=self.batch.attention_mask, use_cache=False)
        self.stats.tokens += batch.tokens
        self.stats.sequences += batch.input_ids.shape[0]


def collect_stats(
    model: nn.Module, batches: Iterable[Batch], k: int = DEFAULT_K, progress: Callable[[int], None] | None = None
) -> ModelStats:
    """Statistics of attention logits and hidden states of `model` (on the quantdiff backend) over `batches`.

    progress(tokens) is called after each batch. Statistics live on the model's device.
    """
    collector = StatsCollector(model, k)
    with observe(model, collector.on_logits, collector.on_hidden), torch.inference_mode():
        for batch in batches:
            collector.run(model, batch)
            if progress is not None:
                progress(batch.tokens)
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
    dist.gather_object(stats.to_dict(), gathered, dst=0)
    if rank != 0:
        return None
    merged = ModelStats.from_dict(gathered[0], stats.logits.device)
    for part in gathered[1:]:
        merged.merge(ModelStats.from_dict(part, stats.logits.device))
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


@dataclass(frozen=True)
class StatsOptions:
    """What `quantdiff stats` was asked for; validated as a whole by `prepare_run` before any model loads."""

    models: tuple[str, ...]
    data: str = BUILTIN_CORPUS
    tokens: int = 65536
    seq_len: int | None = None  # None: min(DEFAULT_SEQ_LEN, the model's positions)
    batch_size: int = 4
    k: int = DEFAULT_K
    tile_size: int | None = attention.DEFAULT_TILE_SIZE
    device: str | None = None
    json_path: Path | None = None
    plot_dir: Path | None = None


DEFAULT_SEQ_LEN = 1024


@dataclass
class PlannedModel:
    name: str
    path: Path
    batches: list[Batch]


def plan(options: StatsOptions) -> list[PlannedModel]:
    """Resolve models, read their configs and tokenizers and the data, check outputs: every error before any run."""
    from .data import load_sequences, make_batches
    from .loading import load_config, load_tokenizer
    from .zoo import resolve

    for flag, value in (("--tokens", options.tokens), ("--batch-size", options.batch_size), ("--top-k", options.k), ("--seq-len", options.seq_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if options.data not in BUILTINS and not Path(options.data).is_file():
        raise DataError(f"data file not found: {options.data}" if not Path(options.data).exists() else f"data path is not a file: {options.data}")
    if options.tile_size is not None and options.tile_size < 1:
        raise ConfigError(f"--tile-size must be positive (0 = no tiling), got {options.tile_size}")
    if options.json_path is not None and options.json_path.is_dir():
        raise ConfigError(f"--json path is a directory: {options.json_path}")
    if options.plot_dir is not None and options.plot_dir.exists() and not options.plot_dir.is_dir():
        raise ConfigError(f"--plot path exists and is not a directory: {options.plot_dir}")
    paths = [path for name in options.models for path in resolve(name)]
    names = _unique_names(paths)
    planned = []
    for name, path in zip(names, paths):
        config = load_config(path)
        positions = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
        seq_len = options.seq_len or min(DEFAULT_SEQ_LEN, positions)
        if seq_len > positions:
            raise DataError(f"--seq-len {seq_len} exceeds the {positions} positions of {path}")
        tokenize = None
        if not _pretokenized(options.data):
            tokenizer = load_tokenizer(path)
            tokenize = lambda text, tok=tokenizer: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        sequences = load_sequences(options.data, tokenize, options.tokens, seq_len, config.vocab_size)
        pad = getattr(config, "pad_token_id", None) or 0
        planned.append(PlannedModel(name, path, make_batches(sequences, options.batch_size, pad)))
    return planned


def _pretokenized(source: str) -> bool:
    """A JSONL file whose first record carries input_ids needs no tokenizer."""
    path = Path(source)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        return "input_ids" in json.loads(first)
    except (ValueError, OSError, TypeError):
        return False  # load_sequences reports the problem with its line number


def _unique_names(paths: list[Path]) -> list[str]:
    """Last two path parts when the last alone is ambiguous (tiny/standard vs other/standard)."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def run(options: StatsOptions, quiet: bool = False, per_layer: bool = False) -> dict | None:
    """`quantdiff stats`: plan, collect every model (sharded under torchrun), report and write on rank 0.

    Returns the JSON document on rank 0, None on other ranks.
    """
    from .loading import load
    from .report_stats import document, model_entry, render, write_json, write_plots

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one to watch
    rank, world = distributed_rank_world()
    planned = plan(options)
    device = device_for_rank(options.device)
    named, entries = [], []
    with _progress(quiet or rank != 0) as advance:
        for model in planned:
            batches = shard(model.batches, rank, world)
            advance.start(model.name, sum(b.tokens for b in batches))
            loaded = load(model.path, device=device, tile_size=options.tile_size)
            stats = gather_to_rank0(collect_stats(loaded, batches, options.k, advance), rank, world)
            del loaded
            if stats is not None:
                named.append((model.name, stats))
                entries.append(model_entry(model.name, str(model.path), stats))
    if rank != 0:
        return None
    doc = document(entries, {
        "source": options.data,
        "tokens": entries[0]["tokens"],
        "seq_len": max(b.input_ids.shape[1] for b in planned[0].batches),
        "batch_size": options.batch_size,
        "k": options.k,
        "tile_size": options.tile_size,
        "world_size": world,
    })
    if options.json_path is not None:
        write_json(options.json_path, doc)
    if options.plot_dir is not None:
        write_plots(options.plot_dir, named)
    if not quiet:
        from rich.console import Console

        render(doc, Console(width=None if sys.stdout.isatty() else 120), per_layer)  # pipes get full rows, not 80 columns
    return doc


class _Advance:
    """progress(tokens) callback driving one rich task per model; a no-op when quiet."""

    def __init__(self, progress) -> None:
        self.progress, self.task = progress, None

    def start(self, name: str, total: int) -> None:
        if self.progress is not None:
            self.task = self.progress.add_task(name, total=total)

    def __call__(self, tokens: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, tokens)


@contextmanager
def _progress(quiet: bool) -> Iterator[_Advance]:
    if quiet:
        yield _Advance(None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class TokensPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:,.0f} tok/s" if task.speed else "– tok/s")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TokensPerSecond(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        yield _Advance(progress)
