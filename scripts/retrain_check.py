"""Does a published seed retrain to the same models? (issue 31)

Retrains one seed of recipes/bb.toml (default 0, the seed the built-in `bb` ships) with `quantdiff train` from this
checkout, in two fresh processes started with different CPU settings — the scalar kernels on one thread, and this
CPU's own kernels on two — side by side, then measures both as `quantdiff reproduce` measures every seed and
compares them with what is published:

- the weights, bit for bit, with the built-in `bb` (when the seed is the shipped one);
- the training losses with results/bb/train_logs/seed-<s>/<arm>.json;
- the per-seed statistics (Top-1 |attention logit|, Top-1 |hidden state|, sink score, and the whole stats and
  sweep documents but their paths) with results/bb/seed-<s>/.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/retrain_check.py --out runs/retrain-check   # ≈ 25 min, 2 cores
    ... --settings scalar-1-thread       # one retrain: the published run itself was started as the machine's own self

Prints a Markdown table and writes it to OUT/retrain-check.md; exit status 1 when anything differs. Bit-identity
is expected on a CPU of the vendor results/bb was trained on (MKL's code path follows the vendor,
docs/training.md); on another vendor the table says how far the seed moved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from quantdiff.core.documents import read_document
from quantdiff.train.determinism import pin_environment

pin_environment()  # measure on the kernels the published run was measured on (before torch is imported)

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "results" / "bb"
SHIPPED = ROOT / "quantdiff" / "assets" / "bb"
# The settings a process starts with; `quantdiff train` pins over both (docs/training.md, "Reproducibility").
SETTINGS = {"scalar-1-thread": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}, "native-2-threads": {"OMP_NUM_THREADS": "2"}}
LEAVE_OUT = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS")


def train_all(seed: int, out: Path, names: list[str]) -> None:
    """The settings' retrains at once, each in its own fresh `quantdiff train` process (a finished one is kept)."""
    base = {k: v for k, v in os.environ.items() if k not in LEAVE_OUT} | {"OMP_WAIT_POLICY": "PASSIVE"}
    runs = [subprocess.Popen([sys.executable, "-m", "quantdiff", "train", str(ROOT / "recipes" / "bb.toml"), "--set", f"train.seeds=[{seed}]",
                              "--out", str(out / name), "--quiet"], env=base | setting, cwd=ROOT)
            for name, setting in SETTINGS.items() if name in names]
    if any(run.wait() for run in runs):
        sys.exit("a retrain failed (its error is above)")


def measure(seed_dir: Path, out: Path) -> tuple[dict, dict]:
    """stats.json and sweep.json of one seed's arms, as `quantdiff reproduce` measures each seed."""
    from quantdiff.jobs.measure_arms import ReproduceOptions, measure_arms, reproduce_tasks
    from quantdiff.jobs.trained_runs import recipe_of_run
    from quantdiff.report.console import line_console

    recipe = recipe_of_run(seed_dir.parent)
    options = ReproduceOptions(target=str(seed_dir.parent), out=out, real_model=None)
    specs = [(name, seed_dir / name) for name in recipe.arm_names]
    with tempfile.TemporaryDirectory() as scratch:
        measure_arms(recipe, specs, reproduce_tasks(recipe, options), options, out, Path(scratch), line_console(stderr=True), plots=False)
    return json.loads((out / "stats.json").read_text()), json.loads((out / "sweep.json").read_text())


def headline(stats: dict) -> dict[str, tuple]:
    """{arm: (Top-1 |attention logit|, Top-1 |hidden state|, sink score)}."""
    def top1(block: dict) -> float:
        return max(abs(t["value"]) for t in block["topk"])
    return {m["name"]: (top1(m["attention_logits"]), top1(m["hidden_states"]), m["sinks"]["score"]) for m in stats["models"]}


def without_paths(doc: dict) -> str:
    """The document with every model's path left out (the retrain lives elsewhere), as canonical JSON."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("path", "paths", "sources")}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return json.dumps(strip(doc), sort_keys=True)


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def compare(seed: int, out: Path, names: list[str]) -> tuple[str, bool]:
    published_stats = read_document(PUBLISHED / f"seed-{seed}" / "stats.json")
    published_sweep = read_document(PUBLISHED / f"seed-{seed}" / "sweep.json")
    published = headline(published_stats)
    shipped_seed = json.loads((SHIPPED / "standard" / "train_log.json").read_text()).get("seed")
    rows, ok = [], True
    for name in names:
        seed_dir = out / name / f"seed-{seed}"
        stats, sweep = measure(seed_dir, out / f"{name}-measured")
        mine = headline(stats)
        docs_equal = without_paths(stats["models"]) == without_paths(published_stats["models"]) and without_paths(sweep["cells"]) == without_paths(published_sweep["cells"])
        for arm, values in mine.items():
            log = json.loads((seed_dir / arm / "train_log.json").read_text())
            losses = log["train_loss_curve"] == read_document(PUBLISHED / "train_logs" / f"seed-{seed}" / f"{arm}.json")["train_loss_curve"]
            weights = same_weights(seed_dir / arm, SHIPPED / arm) if shipped_seed == seed else None
            kernels = f"{log['determinism']['cpu_capability']}, {log['determinism']['threads']} thread(s), {log['determinism'].get('cpu_vendor', '?')}"
            good = values == published[arm] and losses and docs_equal and weights is not False
            ok &= good
            rows.append(f"| {name} | {kernels} | {arm} | {values[0]:.6g} / {published[arm][0]:.6g} | {values[1]:.6g} / {published[arm][1]:.6g} | "
                        f"{values[2]} / {published[arm][2]} | {'yes' if losses else 'NO'} | {'–' if weights is None else 'yes' if weights else 'NO'} | "
                        f"{'yes' if docs_equal else 'NO'} |")
    head = ("| process started with | trained on | arm | Top-1 \\|logit\\|: retrain / published | Top-1 \\|h\\|: retrain / published | "
            "sink score: retrain / published | losses equal | weights = built-in bb | stats and sweep JSON equal |\n|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *rows]), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/retrain-check"))
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"which of {', '.join(SETTINGS)} (comma-separated)")
    args = parser.parse_args()
    names = [n for n in args.settings.split(",") if n]
    if not names or any(n not in SETTINGS for n in names):
        parser.error(f"--settings takes some of {', '.join(SETTINGS)}")
    train_all(args.seed, args.out, names)
    table, ok = compare(args.seed, args.out, names)
    (args.out / "retrain-check.md").write_text(table + "\n")
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
