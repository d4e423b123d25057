"""`quantdiff stats MODEL [MODEL ...]`: the paper's Table 5 (largest |attention logits| and |hidden states|), exact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import MODELS_HELP, BosOpt, DeviceOpt, FileForceOpt, JsonOpt, PartialOpt, QuietOpt, RemoteOpt


def stats(
    models: Annotated[list[str], typer.Argument(help=MODELS_HELP)],
    data: Annotated[str, typer.Option(help="UTF-8 text file, JSONL with 'text' or 'input_ids', builtin:corpus or builtin:retrieval.")] = "builtin:corpus",
    tokens: Annotated[int, typer.Option(help="Total tokens to observe per model.")] = 65536,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (default: min(1024, the model's positions)).")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 4,
    top_k: Annotated[int, typer.Option(help="Largest values kept, with locations, per layer/head/model.")] = 100,
    tile_size: Annotated[int, typer.Option(help="Key tile of the logits pass (memory ∝ seq_len × tile); 0 = one tile.")] = 512,
    device: DeviceOpt = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also print per-layer tables.")] = False,
    json_path: JsonOpt = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write PNG plots (per-layer Top-1, |x| CCDF) into this directory.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="Fuse per-element statistics with torch.compile (default: on CUDA only).")] = None,
    quiet: QuietOpt = False,
    allow_partial: PartialOpt = False,
    trust_remote_code: RemoteOpt = False,
    force: FileForceOpt = False,
    bos: BosOpt = "auto",
) -> None:
    """Where are a model's activation outliers, and how large are they?

    The paper's Table 5, exact: Top-1 … Top-100 and median of |attention logits| and |hidden states| with where
    each occurs, the massive activation, attention sinks and LLM.int8 outlier features, models side by side.
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
