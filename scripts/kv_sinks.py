#!/usr/bin/env python3
"""Sink-aware KV-cache quantization (issue 34): does differential attention (or a gate, or a learned sink logit)
make sink protection unnecessary?

For every model — `--lm` (task lm; default smollm2 and gemma3) and `--bb` (task bb; built-in names or model
directories: OUT/seed-*/<arm> directories pair by seed) — two commands, through the CLI's own entry point:

    quantdiff kv-plan MODEL --policy first,massive,heads --bits 4,3,2 --calibration <not the evaluated data> --out plans/<model>
    quantdiff sweep MODEL --task T --site kv --bits 4,3,2 --kv-plan <each plan> --blocks B --limit L --json runs/<model>.json

then report.md and summary.json: per model and bit width, the accuracy lost against unquantized by uniform KIVI
and by each policy, each policy's effective bits per cached element, and the gap policy − uniform (paired by
blocks of items, or by seed when an arm has several), with Student-t 95% intervals (`report.intervals`).

    OMP_WAIT_POLICY=PASSIVE python scripts/kv_sinks.py --out results/kv-sinks --force
    python scripts/kv_sinks.py --out OUT --lm none --bb runs/bb/seed-*/standard runs/bb/seed-*/diff
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # this checkout's quantdiff
from remedies import describe_models  # noqa: E402  (the same model grouping as the remedies pipeline)

POLICIES = ("first", "massive", "heads")
CALIBRATION = {"lm": "builtin:corpus-train", "bb": "builtin:bigram-backcopy"}
SEQ_LEN = {"lm": 256, "bb": 64}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/kv-sinks"))
    parser.add_argument("--force", action="store_true", help="replace an existing report directory")
    parser.add_argument("--lm", nargs="+", default=["smollm2", "gemma3"], help="models for task lm ('none': no lm group)")
    parser.add_argument("--lm-limit", type=int, default=32, help="lm windows of 256 tokens per cell")
    parser.add_argument("--bb", nargs="+", default=["bb"], help="bb models: built-in names or directories ('none': no bb group)")
    parser.add_argument("--bb-limit", type=int, default=256, help="held-out bb sequences per cell")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of items per cell, for intervals")
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--keep-first", type=int, default=1, help="policy first: positions kept at 16 bits")
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--granularity", default="row", help="the sweeps' scales: row (causal, the default) or tensor (non-causal: the published run)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--report-only", action="store_true", help="rewrite report.md and summary.json of an existing --out from its runs")
    parser.add_argument("--update", action="store_true",
                        help="re-run only the groups given (e.g. --lm none --bb DIRS) inside an existing --out, keeping its other groups")
    return parser.parse_args(argv)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def run_model(model: dict, group: dict, tmp: Path, args: argparse.Namespace, runs: list[dict]) -> None:
    """kv-plan then sweep for one model; each command recorded with the paths it will have in --out."""
    from quantdiff.cli.app import main as quantdiff_main
    from quantdiff.quant.kv_plan import plan_file_name

    name, task = model["name"], group["task"]
    plans = f"plans/{slug(name)}"
    device = [] if args.device is None else ["--device", args.device]
    plan_argv = lambda root: ["kv-plan", name, "--policy", ",".join(POLICIES), "--bits", args.bits, "--keep-first", str(args.keep_first),  # noqa: E731
                              "--calibration", CALIBRATION[task], "--calibration-tokens", str(args.calibration_tokens),
                              "--seq-len", str(SEQ_LEN[task]), "--out", str(root / plans), "--quiet", *device]
    start = time.perf_counter()
    quantdiff_main(plan_argv(tmp))
    runs.append({"model": name, "step": "kv-plan", "command": "quantdiff " + shlex.join(plan_argv(args.out)), "wall_s": time.perf_counter() - start})
    files = [f"{plans}/{plan_file_name(p, int(b))}" for p in POLICIES for b in args.bits.split(",") if (tmp / plans / plan_file_name(p, int(b))).exists()]
    json_name = f"runs/{slug(name)}.json"
    sweep_argv = lambda root: ["sweep", name, "--task", task, "--site", "kv", "--bits", args.bits, "--method", "absmax",  # noqa: E731
                               *[x for f in files for x in ("--kv-plan", str(root / f))], "--limit", str(group["limit"]),
                               "--blocks", str(args.blocks), "--json", str(root / json_name), "--quiet",
                               "--granularity", args.granularity, *device]
    start = time.perf_counter()
    quantdiff_main(sweep_argv(tmp))
    runs.append({"model": name, "step": "sweep", "command": "quantdiff " + shlex.join(sweep_argv(args.out)), "json": json_name, "wall_s": time.perf_counter() - start})
    model["json"] = json_name


# ---- the report ---------------------------------------------------------------------------------------------


def losses(cells: list, metric: str) -> dict[tuple[str, int], dict]:
    """(variant, bits) -> {loss: pooled, blocks: per-block losses, effective_bits}; variant 'uniform' or a policy."""
    reference = next(c for c in cells if c.is_reference)
    out = {}
    for cell in cells:
        if cell.is_reference:
            continue
        variant = "uniform" if cell.kv_plan is None else cell.kv_plan["policy"]
        blocks = [r[metric] - q[metric] for r, q in zip(reference.blocks, cell.blocks)] if cell.valid else None
        eff = float(cell.bits) if cell.kv_plan is None else cell.kv_plan["effective_bits"]
        # a plan that keeps nothing and moves no bits is the uniform quantization itself: no comparison to make
        identical = cell.kv_plan is not None and not cell.kv_plan["keep_positions"] and list(cell.kv_plan["head_bits"]) == [str(cell.bits)]
        out[(variant, cell.bits)] = {"loss": None if not cell.valid else reference.metrics[metric] - cell.metrics[metric], "blocks": blocks,
                                     "effective_bits": eff, "identical": identical}
    return out


def estimate(units: list[dict], key: str, against: str | None = None) -> dict | None:
    """The mean loss (or gap to `against`) over seeds when several, else over the one run's blocks; None if missing."""
    from quantdiff.report.intervals import over_blocks, over_seeds

    def gap(u: dict) -> tuple[float, list[float]] | None:
        a, b = u.get(key), u.get(against) if against else None
        if a is None or a["loss"] is None or (against and (b is None or b["loss"] is None)):
            return None
        if against is None:
            return a["loss"], a["blocks"]
        return a["loss"] - b["loss"], [x - y for x, y in zip(a["blocks"], b["blocks"])]

    from quantdiff.across_seeds.significance import paired_t_p

    values = [gap(u) for u in units]
    if not values or any(v is None for v in values):
        return None
    units_of = [v[0] for v in values] if len(values) > 1 else values[0][1]
    out = over_seeds(units_of).to_dict() if len(values) > 1 else over_blocks(values[0][0], units_of).to_dict()
    return {**out, "p": paired_t_p(units_of)}  # the t test belonging to the t interval


def fmt(e: dict | None, scale: float = 100.0) -> str:
    if e is None:
        return "—"
    if e["low"] is None:
        return f"{e['value'] * scale:+.2f}"
    return f"{e['value'] * scale:+.2f} [{e['low'] * scale:+.2f}, {e['high'] * scale:+.2f}]"


def summarize(out: Path, manifest: dict) -> dict:
    from quantdiff.core.documents import read_document
    from quantdiff.eval.sweep import cells_from_json
    from quantdiff.eval.tasks.registry import headline_metric

    summary = {"groups": []}
    for group in manifest["groups"]:
        metric = headline_metric(group["task"])
        arms: dict[str, dict] = {}
        for model in group["models"]:
            cells = cells_from_json(read_document(out / model["json"]))
            arm = arms.setdefault(model["arm"], {"arm": model["arm"], "kind": model["kind"], "units": []})
            arm["units"].append({"seed": model["seed"], **{f"{v}@{b}": l for (v, b), l in losses(cells, metric).items()}})
        rows = []
        for arm in arms.values():
            for bits in [int(b) for b in manifest["bits"].split(",")]:
                uniform = f"uniform@{bits}"
                row = {"arm": arm["arm"], "kind": arm["kind"], "bits": bits, "seeds": len(arm["units"]),
                       "uniform_loss": estimate(arm["units"], uniform)}
                for policy in POLICIES:
                    key = f"{policy}@{bits}"
                    effs = [u[key]["effective_bits"] for u in arm["units"] if key in u and u[key]["effective_bits"] is not None]
                    row[policy] = {"loss": estimate(arm["units"], key), "gap": estimate(arm["units"], key, uniform),
                                   "effective_bits": statistics.fmean(effs) if effs else None,
                                   "identical": bool(effs) and all(u[key]["identical"] for u in arm["units"])}
                rows.append(row)
        found = [found_by_calibration(out, model) for model in group["models"]]
        summary["groups"].append({"name": group["name"], "task": group["task"], "metric": metric, "rows": rows, "calibration": found})
    return summary


def found_by_calibration(out: Path, model: dict) -> dict:
    """What a model's plans were derived from: its sink KV heads and the positions the massive policy keeps."""
    plans = sorted((out / "plans" / slug(model["name"])).glob("*.json"))
    first = json.loads(plans[0].read_text())
    scores = [s for row in first["evidence"]["kv_head_sink_mass"] for s in row]
    massive = next((json.loads(p.read_text()) for p in plans if p.name.startswith("massive-")), None)
    kept = [] if massive is None else massive["layers"][0]["keep_positions"]
    return {"model": model["name"], "arm": model["arm"], "kind": model["kind"], "seed": model["seed"], "kv_heads": len(scores),
            "sink_kv_heads": sum(s > first["evidence"]["sink_epsilon"] for s in scores), "max_sink_mass": max(scores), "massive_positions": kept}


DIFFERENT_KINDS = ("diff", "diffv2", "gated", "sink")


def verdict(helped_by_kind: dict[str, list[str]]) -> str:
    """The answer in one sentence, from which models protection helped significantly."""
    standard = [m for kind, models in helped_by_kind.items() if kind == "standard" for m in models]
    others = [m for kind, models in helped_by_kind.items() if kind in DIFFERENT_KINDS for m in models]
    if others and standard:
        return (f"**No**: sink protection reduced the loss of {', '.join(others)} significantly, as it did for {', '.join(standard)} (standard "
                "attention): a differential map, a gate or a sink logit did not make it unnecessary here.")
    if others:
        return (f"**No, and not in the expected direction**: sink protection reduced the loss of {', '.join(others)} significantly, and of no "
                "standard-attention model after correction: a differential map, a gate or a sink logit did not make it unnecessary here.")
    if standard:
        return (f"**Yes, on this evidence**: protection helped {', '.join(standard)} (standard attention) significantly and none of "
                "the differential, gated or sink-logit models; a gap that is not significant is not proof of no effect.")
    return ("**Not decided by this run**: no policy reduced any model's loss significantly, standard attention included, so the "
            "run cannot tell whether the other architectures make protection unnecessary.")


def answer(summary: dict) -> list[str]:
    """The question's answer: per model, the policy gaps to uniform whose paired t test survives Holm's correction
    over every gap of the run (the family), then `verdict`."""
    from quantdiff.across_seeds.significance import holm

    family = [(g, r, p) for g in summary["groups"] for r in g["rows"] for p in POLICIES
              if r[p]["gap"] is not None and r[p]["gap"]["p"] is not None and not r[p]["identical"]]
    adjusted = dict(zip(((id(r), p) for _, r, p in family), holm([r[p]["gap"]["p"] for _, r, p in family])))
    lines, helped_by_kind = [], {}
    for group in summary["groups"]:
        for arm in dict.fromkeys(r["arm"] for r in group["rows"]):
            rows = [r for r in group["rows"] if r["arm"] == arm]
            helped, hurt = [], []
            for row in rows:
                for policy in POLICIES:
                    gap, p = row[policy]["gap"], adjusted.get((id(row), policy))
                    if p is not None and p < 0.05:
                        (helped if gap["value"] < 0 else hurt).append(f"{policy} at {row['bits']} bits ({fmt(gap)}, Holm p {p:.3g})")
            kind = rows[0]["kind"]
            if helped:
                helped_by_kind.setdefault(kind, []).append(f"{arm} ({group['task']})")
            said = ("protection reduced the loss: " + "; ".join(helped)) if helped else "no policy reduced the loss significantly"
            lines.append(f"- **{arm}** ({kind}, task {group['task']}): {said}" + (f"; it increased it: {'; '.join(hurt)}" if hurt else "") + ".")
    caveat = (f"Significance: the paired t test of each gap (over seeds, else over blocks of items), Holm-corrected over the run's {len(family)} "
              "gaps (plans identical to uniform, marked `= uniform` in the tables, are no comparison and left out). `first` and `massive` "
              "buy their gains with more bits than uniform (the effective-bits column: (16 − b) · kept / length more), `heads` with exactly as many.")
    return lines + ["", verdict(helped_by_kind), "", caveat]


def scales_sentence(granularity: str) -> str:
    """The cache's scales, said in the report (a manifest from before `--granularity` existed ran per sequence)."""
    if granularity == "tensor":
        return ("Scales: granularity `tensor`, **non-causal**: keys per channel over the whole sequence and values per token "
                "(KIVI), so later tokens set earlier keys' scales; no cache quantizes so (each token is written before the next exists).")
    return "Scales: granularity `row` (causal): keys and values per token and KV head, as `quantdiff.kv_cache` stores them."


def write_report(out: Path) -> None:
    from quantdiff.core.atomic import write_json
    from quantdiff.report.markdown import md_table

    manifest = json.loads((out / "manifest.json").read_text())
    (out / "commands.txt").write_text("".join(run["command"] + "\n" for run in manifest["runs"]))  # every group's, kept ones too
    summary = summarize(out, manifest)
    write_json(out / "summary.json", {"schema": "quantdiff.kv-sinks", **summary}, indent=1, force=True)
    parts = ["# Sink-aware KV-cache quantization: uniform KIVI against sink protection at the same bits\n",
             "Generated by `scripts/kv_sinks.py` (commands in `commands.txt`, wall times in `manifest.json`). Loss = unquantized "
             "minus quantized headline metric, in points (×100); gap = policy loss − uniform loss at the same budget (negative: the "
             "policy loses less). Intervals: Student-t 95% over seeds when an arm has several, else over the blocks of items of one "
             "evaluation (batch means; blocks paired between cells). Effective bits: measured average bits per cached element, kept "
             "positions counted at 16 (scales not counted). `heads` at 2 bits does not exist (it would need 1-bit heads).\n\n",
             f"Settings: blocks {manifest['blocks']}, keep-first {manifest['keep_first']}, calibration {manifest['calibration_tokens']} tokens "
             f"({', '.join(f'{t}: {c}' for t, c in CALIBRATION.items())}), never the evaluated items; {manifest['setting']}. "
             f"{scales_sentence(manifest.get('granularity', 'tensor'))} "
             f"Run as `OMP_WAIT_POLICY=PASSIVE {manifest['command']}` in {manifest['wall_s'] / 60:.0f} min on {manifest['machine']}.\n\n"]
    for group in summary["groups"]:
        parts.append(f"\n## Task {group['task']} ({group['metric']})\n\n")
        seeds = sorted({f["seed"] for f in group["calibration"] if f["seed"] is not None})
        if group["task"] == "bb":
            parts.append(f"Seeds: {', '.join(map(str, seeds))} (paired by seed).\n\n" if seeds else
                         "Seeds: the shipped arms only (`bb`: seed 0 of results/bb). The per-seed weights of results/bb (runs/bb/seed-*) are not in "
                         "the repository, so the bb intervals are over blocks of items of one seed, not over seeds; "
                         "`--bb runs/bb/seed-*/<arm>` runs all eight where they exist.\n\n")
        parts.append("What the calibration found (sink KV head: largest first-position mass of its query heads above ε = 0.3):\n\n")
        parts.append(md_table(["model", "kind", "sink KV heads", "largest mass", "positions the massive policy keeps"],
                              [[f["model"], f["kind"], f"{f['sink_kv_heads']} / {f['kv_heads']}", f"{f['max_sink_mass']:.2f}", str(f["massive_positions"]) or "none"]
                               for f in group["calibration"]]) + "\n\n")
        header = ["model", "kind", "bits", "uniform loss"] + [f"{p}: bits · loss · gap" for p in POLICIES]
        rows = []
        for r in group["rows"]:
            cols = []
            for p in POLICIES:
                eff = r[p]["effective_bits"]
                cols.append("—" if eff is None else "= uniform" if r[p]["identical"] else f"{eff:.3f} · {fmt(r[p]['loss'])} · {fmt(r[p]['gap'])}")
            rows.append([r["arm"], r["kind"], str(r["bits"]), fmt(r["uniform_loss"]), *cols])
        parts.append("Loss and gap by bit width:\n\n" + md_table(header, rows) + "\n")
    parts.append("\n## Does differential attention (or a gate, or a sink logit) make sink protection unnecessary?\n\n")
    parts.append("Per model, the policies whose gap to uniform is significant after correction for the run's many comparisons:\n\n")
    parts.append("\n".join(answer(summary)) + "\n")
    parts.append("\n## Limits\n\n"
                 "- `massive` is a position rule: positions that carried a massive activation in at least half of the calibration sequences. "
                 "Massive activations that follow content (a delimiter token wherever it falls) do not pass it; a rule by token identity "
                 "(PrefixQuant's outlier tokens) would need the token ids at the cache, which the kv site does not see.\n"
                 "- The bb arms are the shipped seed-0 models unless per-seed directories are given; their intervals are then over blocks of "
                 "items, which measure the evaluation's sampling error, not the training run's.\n"
                 "- Scales are not counted in the effective bits; a kept position also needs no scale, which this accounting ignores.\n")
    (out / "report.md").write_text("".join(parts))


def kept_groups(args: argparse.Namespace, rerun: set[str]) -> dict | None:
    """With --update, the existing report's manifest with only the groups not re-run (None without --update)."""
    if not args.update:
        return None
    try:
        manifest = json.loads((args.out / "manifest.json").read_text())
    except (OSError, ValueError):
        sys.exit(f"error: --update needs an existing report in {args.out} (its manifest.json could not be read)")
    if manifest["blocks"] != args.blocks or manifest["bits"] != args.bits or manifest["keep_first"] != args.keep_first or manifest["calibration_tokens"] != args.calibration_tokens:
        sys.exit(f"error: --update must use the settings of {args.out} (blocks {manifest['blocks']}, bits {manifest['bits']}, "
                 f"keep-first {manifest['keep_first']}, calibration tokens {manifest['calibration_tokens']})")
    return {**manifest, "groups": [g for g in manifest["groups"] if g["name"] not in rerun]}


def copy_kept(out: Path, tmp: Path, kept: dict | None) -> None:
    """The kept groups' runs and plans, copied into the new report directory."""
    import shutil

    (tmp / "runs").mkdir(exist_ok=True)
    for group in (kept or {}).get("groups", []):
        for model in group["models"]:
            shutil.copy2(out / model["json"], tmp / model["json"])
            shutil.copytree(out / "plans" / slug(model["name"]), tmp / "plans" / slug(model["name"]))


def merged_manifest(kept: dict, new: dict) -> dict:
    """One manifest for the report: the kept groups first, each run recorded with the command that made it."""
    old_runs = [r | {"by": kept["command"]} for r in kept["runs"] if any(r["model"] == m["name"] for g in kept["groups"] for m in g["models"])]
    return new | {"groups": kept["groups"] + new["groups"], "runs": old_runs + [r | {"by": new["command"]} for r in new["runs"]],
                  "command": f"{kept['command']}; then {new['command']}", "setting": f"{kept['setting']} (first command); {new['setting']} (then)",
                  "wall_s": sum(r["wall_s"] for r in old_runs) + new["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.report_only:
        write_report(args.out)
        print(f"report -> {args.out / 'report.md'}")
        return 0
    from quantdiff import __version__
    from quantdiff.core.savedir import atomic_dir, check_target

    groups = []
    if args.lm != ["none"]:
        groups.append({"name": "lm", "task": "lm", "limit": args.lm_limit, "models": describe_models(args.lm)})
    if args.bb != ["none"]:
        groups.append({"name": "bb", "task": "bb", "limit": args.bb_limit, "models": describe_models(args.bb)})
    sources = [m["path"] for g in groups for m in g["models"]]
    kept = kept_groups(args, {g["name"] for g in groups})
    check_target(args.out, args.force or args.update, sources, flag="--out", kind="report")
    start, runs = time.perf_counter(), []
    command = "python scripts/kv_sinks.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    with atomic_dir(args.out, force=args.force or args.update, kind="report", sources=sources) as tmp:
        copy_kept(args.out, tmp, kept)
        for group in groups:
            for model in group["models"]:
                run_model(model, group, tmp, args, runs)
        sizes = {"lm": f"lm: {args.lm_limit} windows of 256 tokens per cell (script default 32)", "bb": f"bb: {args.bb_limit} sequences per cell"}
        setting = "; ".join(sizes[g["name"]] for g in groups)
        manifest = {"quantdiff_version": __version__, "command": command, "blocks": args.blocks, "bits": args.bits, "keep_first": args.keep_first,
                    "calibration_tokens": args.calibration_tokens, "granularity": args.granularity, "setting": setting, "groups": groups, "runs": runs,
                    "wall_s": time.perf_counter() - start, "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"}
        if kept:
            manifest = merged_manifest(kept, manifest)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        write_report(tmp)
    print(f"report -> {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
