#!/usr/bin/env python3
"""The remedies pipeline (issue 24): post-hoc outlier remedies beside the architectural one, on real and bb models.

For each group of models — `--lm` (task lm; default smollm2) and `--bb` (task bb; built-in names or model
directories, any number: OUT/seed-*/<arm> directories are grouped by arm and aggregated over seeds) — it runs
four `quantdiff sweep` commands (through the CLI's own entry point, in this process), every cell also evaluated
in `--blocks` blocks of items:

    linear     absmax and LLM.int8            × 8, 6, 4 bits at site linear
    hadamard   absmax + Hadamard rotation     × 8, 6, 4 bits at site linear
    smooth     absmax + SmoothQuant (α 0.5)   × 8, 6, 4 bits at site linear
    attention  absmax at logits, qk and kv    × 8, 4 bits

then writes report.md, summary.json and plots (`quantdiff.report.remedies`), manifest.json (models, commands,
wall times) and commands.txt into OUT, atomically (a temporary sibling renamed at the end).

    OMP_WAIT_POLICY=PASSIVE python scripts/remedies.py --out results/remedies --force
    python scripts/remedies.py --out OUT --lm none --bb runs/bb/seed-*/standard runs/bb/seed-*/diff
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import time
from pathlib import Path

SEED_DIR = re.compile(r"^seed-(\d+)$")
REMEDIES = {
    "linear": ["--site", "linear", "--bits", "8,6,4", "--method", "absmax,llm-int8"],
    "hadamard": ["--site", "linear", "--bits", "8,6,4", "--method", "absmax", "--rotate", "hadamard"],
    "smooth": ["--site", "linear", "--bits", "8,6,4", "--method", "absmax", "--smooth", "0.5"],  # + --calibration-tokens
    "attention": ["--site", "logits,qk,kv", "--bits", "8,4", "--method", "absmax"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/remedies"))
    parser.add_argument("--force", action="store_true", help="replace an existing report directory")
    parser.add_argument("--lm", nargs="+", default=["smollm2"], help="models for task lm ('none': no lm group)")
    parser.add_argument("--lm-limit", type=int, default=32, help="lm windows of 256 tokens per cell")
    parser.add_argument("--bb", nargs="+", default=["bb"], help="bb models: built-in names or directories ('none': no bb group)")
    parser.add_argument("--bb-limit", type=int, default=256, help="held-out bb sequences per cell")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of items per cell, for intervals")
    parser.add_argument("--calibration-tokens", type=int, default=8192, help="tokens of SmoothQuant's calibration pass")
    parser.add_argument("--granularity", default="row", help="the sweeps' scales: row (causal, the default) or tensor (non-causal: the published run)")
    parser.add_argument("--device", default=None)
    return parser.parse_args(argv)


def describe_models(specs: list[str]) -> list[dict]:
    """Each model as `quantdiff sweep` names it, with its arm (the directory name of a directory or built-in model,
    else the name), seed (N of a seed-N parent directory) and attention kind."""
    from quantdiff.models.loading import load_config
    from quantdiff.models.names import resolve_models
    from quantdiff.models.structure import attention_kind

    out = []
    for name, path in resolve_models(specs):
        seed = SEED_DIR.match(path.parent.name)
        arm = path.name if "/" in name or seed else name
        out.append({"name": name, "path": str(path), "arm": arm, "seed": None if seed is None else int(seed.group(1)), "kind": attention_kind(load_config(path))})
    return out


def sweep_argv(specs: list[str], group: dict, remedy: str, json_path: Path, args: argparse.Namespace) -> list[str]:
    argv = ["sweep", *specs, "--task", group["task"], *REMEDIES[remedy], *group["options"], "--blocks", str(args.blocks), "--json", str(json_path), "--quiet",
            "--granularity", args.granularity]
    argv += ["--calibration-tokens", str(args.calibration_tokens)] if remedy == "smooth" else []
    return argv + ([] if args.device is None else ["--device", args.device])


def run_group(group: dict, specs: list[str], tmp: Path, args: argparse.Namespace, runs: list[dict]) -> None:
    """The four sweeps of one group, into tmp/runs/; recorded with the paths they will have in --out."""
    from quantdiff.cli.app import main as quantdiff_main

    for remedy in REMEDIES:
        json_name = f"runs/{group['name']}-{remedy}.json"
        command = "quantdiff " + shlex.join(sweep_argv(specs, group, remedy, args.out / json_name, args))
        print(command, flush=True)
        start = time.perf_counter()
        quantdiff_main(sweep_argv(specs, group, remedy, tmp / json_name, args))  # an error exits with its one line
        runs.append({"group": group["name"], "remedy": remedy, "command": command, "json": json_name, "wall_s": time.perf_counter() - start})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from quantdiff import __version__
    from quantdiff.core.savedir import atomic_dir, check_target
    from quantdiff.report.remedies import write_report

    groups = []
    if args.lm != ["none"]:
        groups.append(({"name": "lm", "task": "lm", "options": ["--limit", str(args.lm_limit)]}, args.lm))
    if args.bb != ["none"]:
        groups.append(({"name": "bb", "task": "bb", "options": ["--limit", str(args.bb_limit)]}, args.bb))
    for group, specs in groups:
        group["models"] = describe_models(specs)
    sources = [m["path"] for group, _ in groups for m in group["models"]]
    check_target(args.out, args.force, sources, flag="--out", kind="report")
    start, runs = time.perf_counter(), []
    with atomic_dir(args.out, force=args.force, kind="report", sources=sources) as tmp:
        (tmp / "runs").mkdir()
        for group, specs in groups:
            run_group(group, specs, tmp, args, runs)
        manifest = {"quantdiff_version": __version__, "blocks": args.blocks, "groups": [g for g, _ in groups], "runs": runs,
                    "wall_s": time.perf_counter() - start, "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "commands.txt").write_text("".join(run["command"] + "\n" for run in runs))
        write_report(tmp)
    print(f"report -> {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
