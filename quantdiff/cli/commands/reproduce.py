"""`quantdiff reproduce`: the main job — statistics and the accuracy sweep on a matched pair, as one report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import DeviceOpt, JsonOpt, QuietOpt


def reproduce(
    target: Annotated[str, typer.Argument(help="'tiny' or 'bb' (shipped models), a recipe name/path (its arms, every seed, are trained into runs/ if missing), or a training output directory.")] = "tiny",
    out: Annotated[Path, typer.Option("--out", help="Report directory (report.md, JSON, PNG plots).")] = Path("report"),
    tasks: Annotated[Optional[str], typer.Option("--tasks", help="Comma-separated tasks to sweep: lm, choice, retrieval, bb (the linear site is swept on lm and bb only); default lm,choice,retrieval, or bb for bigram-backcopy models.")] = None,
    stats_tokens: Annotated[Optional[int], typer.Option("--stats-tokens", help="Held-out tokens per model for the statistics (default: the recipe's).")] = None,
    items: Annotated[Optional[int], typer.Option("--items", help="Cap on items per task (quick runs); default: the recipe's sizes.")] = None,
    device: DeviceOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it holds an earlier report (never anything else), and an existing --json file.")] = False,
    real_model: Annotated[str, typer.Option("--real-model", help="Real pretrained models measured too, side by side, comma-separated (built-in names or model directories): statistics, lm sweep at linear and qk, weight-only formats. 'none' skips them.")] = "smollm2,gemma3",
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Does differential attention give smaller outliers and survive fewer bits? The whole analysis, as one report.

    The paper's Table 5 and Figure 8 on matched models (a standard/Diff pair or a recipe's arms; over several
    seeds, with 95% intervals), beside the paper's numbers, and real pretrained models side by side."""
    from quantdiff.train.determinism import pin_environment

    # Before torch is imported: the kernels training pins. A quantized cell of a massive-activation model moves by
    # about one standard error between AVX2, AVX512 and scalar kernels (docs/results.md), so a published report
    # regenerates only on pinned ones.
    notes = pin_environment()
    from quantdiff.cli.output import check_json, result_console, write_result
    from quantdiff.cli.validate import check_list, check_positive
    from quantdiff.core.device import resolve_device
    from quantdiff.jobs.reproduce import ReproduceOptions, given_inputs, reproduce as run
    from quantdiff.report.console import line_console

    check_positive(stats_tokens=stats_tokens, items=items)
    if tasks is not None:
        check_list(tasks, "--tasks")
    if real_model != "none":
        check_list(real_model, "--real-model")
    if device is not None:
        resolve_device(device, "--device")
    names = None if tasks is None else tuple(t.strip() for t in tasks.split(",") if t.strip())
    options = ReproduceOptions(target, out, stats_tokens, items, names, device, force, None if real_model == "none" else real_model)
    check_json(json_path, given_inputs(options), force, [("--out", out)])
    for note in notes:  # after every check of the options: a failing run prints only its error line
        line_console(stderr=True).print(note)
    report = run(options, line_console(stderr=True, quiet=quiet))
    result_console(json_path, quiet).print(f"report -> {report}")
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*") if path.is_file())
    write_result(json_path, "reproduce", {"target": target, "out": str(out), "report": str(report), "files": files}, force)
