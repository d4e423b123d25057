"""`quantdiff stats` as a job: validate every input, collect every model (sharded under torchrun), report.

Everything that can fail on bad input (options, model directories, tokenizers, data, output paths) is checked
by `plan` before any model runs; outputs are written atomically by rank 0 only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import quantdiff.attention.backend as attention
from quantdiff.data.sources import BUILTIN_CORPUS, BUILTINS, Batch, check_data_file, shard
from quantdiff.core.atomic import STDOUT, writable_target
from quantdiff.core.outputs import check_outputs
from quantdiff.core.errors import ConfigError
from quantdiff.core.device import resolve_device
from quantdiff.core.memory import check_fits
from quantdiff.eval.bounds import check_positions
from quantdiff.core.progress import rate_column, task_bars
from quantdiff.models.bos import BosChoice, check_mode, decide_bos
from quantdiff.stats.collect import DEFAULT_K, collect
from quantdiff.stats.model_stats import ModelStats
from quantdiff.stats.distributed import distributed_rank_world, gather_capped_to_rank0, gather_to_rank0


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
    compile: bool | None = None  # None: on CUDA only
    force: bool = False  # replace existing --json / plot files quantdiff did not write
    allow_partial: bool = False  # accept attention modules / decoder layers never reached (recorded as coverage)
    trust_remote_code: bool = False
    bos: str = "auto"  # BOS first in every sequence cut from text: as each model was trained (models.bos), always, never


DEFAULT_SEQ_LEN = 1024


@dataclass
class PlannedModel:
    name: str
    path: Path
    batches: list[Batch]
    bos: BosChoice


def plan(options: StatsOptions) -> list[PlannedModel]:
    """Resolve models, read their configs and tokenizers and the data, check outputs: every error before any run."""
    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.models.loading import load_config, load_tokenizer
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.names import resolve_models
    from quantdiff.report.stats_report import check_plot_dir

    for flag, value in (("--tokens", options.tokens), ("--batch-size", options.batch_size), ("--top-k", options.k), ("--seq-len", options.seq_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    check_mode(options.bos)
    if options.data not in BUILTINS:
        check_data_file(options.data)
    if options.tile_size is not None and options.tile_size < 1:
        raise ConfigError(f"--tile-size must be positive (0 = no tiling), got {options.tile_size}")
    json_file = options.json_path is not None and str(options.json_path) != STDOUT
    if json_file:
        writable_target(options.json_path, flag="--json")  # not a directory, device, FIFO or socket: refused before any work
    named = resolve_models(options.models)  # the same model names as `quantdiff sweep` gives
    data_files = [] if options.data in BUILTINS else [options.data]
    check_outputs({"--json": options.json_path, "--plot": options.plot_dir}, model_inputs(options.models, [p for _, p in named]) + data_files)
    if json_file:
        writable_target(options.json_path, options.force, "--json")  # an existing file: quantdiff's, or --force
    if options.plot_dir is not None:
        check_plot_dir(options.plot_dir, options.force)
    planned = []
    device = resolve_device(options.device, "--device")
    for name, path in named:
        config = load_config(path, options.trust_remote_code)
        layers, heads = getattr(config, "num_hidden_layers", 1), getattr(config, "num_attention_heads", 1)
        check_fits(ModelStats.topk_bytes(layers, heads, options.k), f"--top-k {options.k:,} for {name}", device)
        positions = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
        seq_len = options.seq_len or min(DEFAULT_SEQ_LEN, positions)
        check_positions(seq_len, config, f"--seq-len of {path}")
        tokenizer, tokenize, bos = None, None, BosChoice(None, None, options.bos, "input_ids records used as given")
        if not _pretokenized(options.data):
            tokenizer = load_tokenizer(path)
            tokenize = lambda text, tok=tokenizer: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
            bos = decide_bos(path, tokenizer, options.bos)
        sequences = load_sequences(options.data, tokenize, options.tokens, seq_len, config.vocab_size, bos.token_id, tokenizer)
        pad = getattr(config, "pad_token_id", None) or 0
        planned.append(PlannedModel(name, path, make_batches(sequences, options.batch_size, pad), bos))
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


def run(options: StatsOptions, quiet: bool = False, per_layer: bool = False) -> dict | None:
    """`quantdiff stats`: plan, collect every model (sharded under torchrun), report and write on rank 0.

    Returns the JSON document on rank 0, None on other ranks.
    """
    from quantdiff.core.atomic import write_json
    from quantdiff.models.source import model_source
    from quantdiff.models.structure import attention_kind
    from quantdiff.quant.checkpoint import load
    from quantdiff.report.stats_report import render, warn_nonfinite, write_plots
    from quantdiff.stats.schema import document, model_entry

    rank, world = distributed_rank_world()
    planned = plan(options)
    to_stdout = str(options.json_path) == STDOUT  # the JSON is the output: tables go to stderr, no bars
    quiet_bars = quiet or to_stdout
    device = resolve_device(options.device, "--device")
    named, entries = [], []
    with task_bars(quiet_bars or rank != 0, rate_column("tok")) as start:
        for model in planned:
            batches = shard(model.batches, rank, world)
            advance = start(model.name, sum(b.tokens for b in batches)) if start is not None else None
            loaded = load(model.path, device=device, tile_size=options.tile_size, trust_remote_code=options.trust_remote_code)
            collected = collect(loaded, batches, options.k, advance, options.compile, options.allow_partial)
            kind = attention_kind(loaded)
            stats = gather_to_rank0(collected.stats, rank, world)
            capped = gather_capped_to_rank0(collected.capped_logits, rank, world)
            del loaded
            if stats is not None:
                named.append((model.name, stats))
                entry = {**model_entry(model.name, str(model.path), stats, kind), "source": model_source(model.path), "bos": model.bos.to_dict()}
                entries.append(_with_definitions(entry, collected, capped, options))
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
        write_json(options.json_path, doc, force=options.force)
    if options.plot_dir is not None:
        write_plots(options.plot_dir, named, options.force)
    warn_nonfinite(doc)
    if not quiet:
        render(doc, per_layer=per_layer, stderr=to_stdout)  # its console prints whole rows when piped
    return doc


def _with_definitions(entry: dict, collected, capped, options: StatsOptions) -> dict:
    """What the run reached (and whether a partial run was allowed), whether the model's own code ran, and, for
    soft-capping models, the capped logits that enter softmax as their own block (`attention_logits` stays
    QKᵀ·scaling before capping, the paper's definition)."""
    entry["coverage"] = {**collected.coverage.to_dict(), "allow_partial": options.allow_partial}
    entry["trust_remote_code"] = options.trust_remote_code
    if capped is not None:
        entry["attention_logits_capped"] = capped.pooled().summary()
    return entry

