"""`quantdiff sensitivity MODEL`: the damage of quantizing one decoder layer at a time, beside its outliers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import BosOpt, DeviceOpt, FileForceOpt, JsonOpt, QuietOpt, RemoteOpt


def sensitivity(
    model: Annotated[str, typer.Argument(help="A model directory, built-in name (tiny/diff, smollm2, gemma3 …) or hub id.")],
    bits: Annotated[str, typer.Option("--bits", help="Comma-separated bit widths, each 2–16: every layer is measured at each (a plan's candidate widths).")] = "4",
    method: Annotated[str, typer.Option("--method", help="absmax or llm-int8.")] = "absmax",
    site: Annotated[str, typer.Option("--site", help="Comma-separated sites, each quantized one layer at a time: linear (attention and FFN inputs and weights), qk, logits, kv.")] = "linear",
    granularity: Annotated[str, typer.Option("--granularity", help="row (causal, the default), tensor or column.")] = "row",
    data: Annotated[str, typer.Option("--data", help="Data the damage is measured on: a text or JSONL file, builtin:corpus-train or builtin:bigram-backcopy.")] = "builtin:corpus-train",
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens of data.")] = 4096,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length; default 256, or the model's positions if fewer.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: per site, mean KL per layer with Top-1 |input| overlaid.")] = None,
    plan_budget: Annotated[Optional[float], typer.Option("--plan-budget", help="Plan a bit width per layer, one of --bits each, minimising the summed one-layer mean KL at this mean width (from the narrowest to the widest of --bits; one --site); the whole plan is then measured on the same tokens.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the --plan-budget plan (JSON) for eval/sweep --plan.")] = None,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    trust_remote_code: RemoteOpt = False,
    force: FileForceOpt = False,
    bos: BosOpt = "auto",
) -> None:
    """Which decoder layer does quantization hurt, and is it the one with the outliers?

    Quantizes MODEL one decoder layer at a time at each site and measures the damage against MODEL in full
    precision on the same tokens (llama.cpp's KL-divergence measures, docs/damage.md), beside each layer's outlier
    statistics from the hooks of the same full-precision forwards, with Spearman's rank correlation between them
    and the check of additivity (the one-layer damages summed against the whole site's). With --plan-budget, a
    mixed-precision plan: a width per layer from --bits (docs/damage.md, "Mixed-precision plans")."""
    from quantdiff.cli.validate import check_list
    from quantdiff.jobs.sensitivity import SensitivityRequest, run
    from quantdiff.quant.registry import split_names
    from quantdiff.report.console import line_console
    from quantdiff.report.sensitivity_report import plan_lines, sensitivity_tables

    check_list(site, "--site")
    to_stdout = str(json_path) == "-"  # the JSON is stdout's whole content
    request = SensitivityRequest(model, method, bits, tuple(split_names(site, "sites")), granularity, data, tokens, seq_len, bos,
                                 device, json_path, plot, force, quiet or to_stdout, trust_remote_code, plan_budget, out)
    result = run(request)
    if not (quiet or to_stdout):
        console = line_console(stderr=False)
        for table in sensitivity_tables(result):
            console.print(table)
        for line in plan_lines(result, out):
            console.print(line, markup=False, soft_wrap=True)
