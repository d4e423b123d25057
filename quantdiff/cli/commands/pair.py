"""`quantdiff pair OUT`: write an untrained, randomly initialised matched standard/Diff pair (and DIFF V2, gated, sink),
each with a byte-level tokenizer, so that every command runs on them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantdiff.cli.options import JsonOpt, QuietOpt


def pair(
    out: Annotated[Path, typer.Argument(help="Directory to create; the pair goes to OUT/standard and OUT/diff.")],
    hidden_size: Annotated[int, typer.Option(help="Model width.")] = 128,
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 4,
    heads: Annotated[int, typer.Option(help="Baseline attention heads; Diff pairs them into heads/2 differential heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention); 0 = heads.")] = 0,
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size (at least 259: each model gets a byte-level tokenizer, its 256 bytes and 3 special tokens).")] = 512,
    context: Annotated[int, typer.Option(help="Maximum positions.")] = 512,
    seed: Annotated[int, typer.Option(help="Initialisation seed (the same for both kinds).")] = 0,
    init: Annotated[str, typer.Option(help="Initialisation of every kind: 'authors' (the Diff Transformer authors': kaiming-uniform Linears, embedding N(0, 1/D) times √D, folded into the saved weights) or 'transformers' (transformers' default: N(0, 0.02)).")] = "authors",
    force: Annotated[bool, typer.Option(help="Replace OUT if quantdiff wrote it as a pair, and an existing --json file.")] = False,
    diffv2: Annotated[bool, typer.Option("--diffv2", help="Also write OUT/diffv2: DIFF Transformer V2 of the same sizes (2·heads query heads).")] = False,
    gated: Annotated[bool, typer.Option("--gated", help="Also write OUT/gated: the standard model with a head-wise sigmoid gate on each head's output (Qiu et al.'s G1).")] = False,
    sink: Annotated[bool, typer.Option("--sink", help="Also write OUT/sink: the standard model with a learned sink logit per head (GPT-OSS's sinks).")] = False,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Random matched models to try every command on (untrained: not for conclusions).

    Builds an UNTRAINED matched pair (same config; parameter counts differ only by the λ vectors), and the other
    kinds asked for, each with a byte-level tokenizer; each count is printed with its difference from the standard
    model's."""
    from quantdiff.cli.output import check_json, result_console, write_result
    from quantdiff.cli.validate import check_positive
    from quantdiff.core.errors import ConfigError
    from quantdiff.core.savedir import check_target, save_pair
    from quantdiff.models.init import check_init
    from quantdiff.models.pairs import KINDS, SizePreset, added_parameter_count, build_pair, check_seed, parameter_count
    from quantdiff.models.tokenizer import BYTES_VOCAB_SIZE, bytes_tokenizer

    check_positive(hidden_size=hidden_size, layers=layers, heads=heads, vocab_size=vocab_size, context=context)
    if kv_heads < 0:
        raise ConfigError(f"--kv-heads must be at least 0 (0 = --heads), got {kv_heads}")
    check_seed(seed, "--seed")
    check_init(init, "--init")
    if vocab_size < BYTES_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size must be at least {BYTES_VOCAB_SIZE}: the pair's byte-level tokenizer holds 256 bytes and 3 special tokens, got {vocab_size}")
    check_target(out, force, flag="OUT", kind="pair")
    check_json(json_path, [], force, [("OUT", out)])
    preset = SizePreset(hidden_size, layers, heads, kv_heads or None, None, vocab_size, context)
    extra = tuple(kind for kind, wanted in (("diffv2", diffv2), ("gated", gated), ("sink", sink)) if wanted)
    models = build_pair(preset, seed=seed, kinds=KINDS + extra, init=init)
    save_pair(models, out, force=force, tokenizer=bytes_tokenizer())
    console = result_console(json_path, quiet)
    standard = parameter_count(models["standard"])
    records = []
    for kind, model in models.items():
        count, added = parameter_count(model), added_parameter_count(model)
        records.append({"kind": kind, "path": str(out / kind), "parameters": count, "added_parameters": added})
        versus = "" if kind == "standard" else f"{count - standard:+,} vs standard, "
        console.print(f"{kind}: {count:,} parameters ({versus}{added:,} λ/gate/sink) -> {out / kind}")
    console.print("[yellow]untrained: random weights and a byte-level tokenizer, for trying the tools, not for conclusions[/yellow]")
    write_result(json_path, "pair", {"out": str(out), "trained": False, "init": init, "models": records}, force)
