"""`quantdiff kv-plan MODEL`: a per-layer, per-KV-head KV-cache precision plan from the model's own statistics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.options import BosOpt, DeviceOpt, FileForceOpt, JsonOpt, QuietOpt, RemoteOpt


def kv_plan(
    model: Annotated[str, typer.Argument(help="A model directory, built-in name (bb/standard, smollm2, gemma3 …) or hub id.")],
    out: Annotated[Path, typer.Option("--out", help="The plan file (.json) for one policy at one bit width, else a directory: one <policy>-<bits>bit.json per pair.")],
    policy: Annotated[str, typer.Option("--policy", help="Comma-separated: uniform, first (keep the first --keep-first positions at 16 bits), massive (keep the positions carrying massive activations on the calibration data), heads (sink heads at bits + step, as many non-sink heads at bits − step).")] = "first",
    bits: Annotated[str, typer.Option("--bits", help="Comma-separated budgets, each 2–16 bits.")] = "4",
    calibration: Annotated[str, typer.Option("--calibration", help="Calibration data, never the evaluation data: a text or JSONL file, builtin:corpus-train or builtin:bigram-backcopy.")] = "builtin:corpus-train",
    calibration_tokens: Annotated[int, typer.Option("--calibration-tokens", help="Tokens of the calibration pass.")] = 8192,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Calibration sequence length (and the length the plan's expected bits are given for); default 256, or the model's positions if fewer; longer than the model's positions is refused.")] = None,
    keep_first: Annotated[int, typer.Option("--keep-first", help="Policy first: positions kept at 16 bits.")] = 1,
    step: Annotated[int, typer.Option("--step", help="Policy heads: bits added to sink heads and taken from as many non-sink heads.")] = 1,
    device: DeviceOpt = None,
    json_path: JsonOpt = None,
    quiet: QuietOpt = False,
    trust_remote_code: RemoteOpt = False,
    force: FileForceOpt = False,
    bos: BosOpt = "auto",
) -> None:
    """Which KV heads and positions should a cache keep at higher precision?

    Calibrates MODEL on data no task evaluates (sink score per head, massive-activation positions), derives a plan
    per policy and budget (per layer: bits per KV head, positions kept at 16 bits) and writes it as JSON
    (schema quantdiff.kv-plan, docs/quantization.md); `eval`/`sweep --kv-plan FILE` apply it."""
    from quantdiff.core.atomic import write_json
    from quantdiff.cli.validate import check_list
    from quantdiff.jobs.kv_plan import PlanRequest, run
    from quantdiff.quant.registry import parse_bits, split_names
    from quantdiff.report.console import line_console

    for flag, text in (("--bits", bits), ("--policy", policy)):
        check_list(text, flag)
    request = PlanRequest(model, tuple(split_names(policy, "policies")), tuple(parse_bits(bits)), out, calibration,
                          calibration_tokens, seq_len, keep_first, step, bos, device, force, trust_remote_code, json_path)
    notes = line_console(stderr=True)
    written = run(request)
    for path, plan, reason in written:
        if plan is None:
            notes.print(f"[yellow]skipped {path.name}: {reason}[/yellow]")
        elif not quiet:
            length = plan.evidence["calibration"]["seq_len"]
            notes.print(f"{path}: {plan.policy} at {plan.budget_bits} bits, {plan.expected_bits(length):.3f} bits per cached element at {length} tokens")
    if json_path is not None:
        plans = [{"path": str(path), "skipped": reason} if plan is None else
                 {"path": str(path), "policy": plan.policy, "budget_bits": plan.budget_bits,
                  "expected_bits": plan.expected_bits(plan.evidence["calibration"]["seq_len"]), "seq_len": plan.evidence["calibration"]["seq_len"]}
                 for path, plan, reason in written]
        write_json(json_path, {"schema": "quantdiff.kv-plan-run", "model": model, "plans": plans}, indent=2, force=force)
