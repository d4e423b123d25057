"""`quantdiff stats MODEL [MODEL ...]`: the paper's Table 5 (largest |attention logits| and |hidden states|), exact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def stats(
    models: Annotated[list[str], typer.Argument(help="Model directories, GGUF files (statistics of the dequantized model), built-in names ('tiny' = its standard and diff models; 'smollm2', 'gemma3': real GGUF models) or hub ids (org/name, org/name@revision).")],
    data: Annotated[str, typer.Option(help="UTF-8 text file, JSONL with 'text' or 'input_ids', builtin:corpus or builtin:retrieval.")] = "builtin:corpus",
    tokens: Annotated[int, typer.Option(help="Total tokens to observe per model.")] = 65536,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (default: min(1024, the model's positions)).")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 4,
    top_k: Annotated[int, typer.Option(help="Largest values kept, with locations, per layer/head/model.")] = 100,
    tile_size: Annotated[int, typer.Option(help="Key tile of the logits pass (memory ∝ seq_len × tile); 0 = one tile.")] = 512,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:1 … (default: CUDA if available).")] = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also print per-layer tables.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every statistic to this JSON file; '-' writes it to stdout (tables then go to stderr).")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write PNG plots (per-layer Top-1, |x| CCDF) into this directory.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Fuse per-element statistics with torch.compile (default: on CUDA only).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar and no tables.")] = False,
    allow_partial: Annotated[bool, typer.Option("--allow-partial", help="Accept models where some attention module or decoder layer is never reached (recorded in the JSON's coverage).")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Run the model's own Python code (off by default; recorded in the JSON).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace existing output files that quantdiff did not write (it replaces its own without asking).")] = False,
    bos: Annotated[str, typer.Option("--bos", help="BOS first in every sequence cut from text: auto (as each model was trained: its recipe, its GGUF file's add_bos_token, else its tokenizer), always, never. input_ids records stay as given. Recorded in the JSON.")] = "auto",
) -> None:
    """Largest |attention logits| and |hidden states| (Top-1 … Top-100, median) with where they occur.

    Runs unchanged under `torchrun --nproc-per-node N`: ranks split the batches, rank 0 merges and writes.
    """
    from quantdiff.cli.validate import refuse_unused
    from quantdiff.core.device import resolve_device
    from quantdiff.jobs.stats import StatsOptions, run
    from quantdiff.models.bos import check_mode

    check_mode(bos)
    if device is not None:
        resolve_device(device, "--device")
    if quiet:
        refuse_unused("with --quiet (it prints no tables)", per_layer=per_layer)
    options = StatsOptions(
        models=tuple(models),
        data=data,
        tokens=tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        k=top_k,
        tile_size=tile_size or None,
        device=device,
        json_path=json_path,
        plot_dir=plot,
        compile=compile,
        allow_partial=allow_partial,
        trust_remote_code=trust_remote_code,
        force=force,
        bos=bos,
    )
    run(options, quiet=quiet, per_layer=per_layer)
