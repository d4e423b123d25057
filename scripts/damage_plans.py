#!/usr/bin/env python3
"""Mixed-precision plans at an equal average width (issue 55, item 5; results/damage/plan-comparison.md).

Per model and method, at site linear with candidate widths {4, 8} and a budget of 5 bits:

1. the sensitivity map and its plan on calibration tokens, as `quantdiff sensitivity` makes them
   (`jobs.sensitivity.run`, the command's own job):
       quantdiff sensitivity MODEL --bits 4,8 --method M --site linear --tokens 128 --seq-len 64 --plan-budget 5 --out plan.json
2. the arms measured with `quantdiff.damage`'s measures (`eval.damage.damages`) on held-out tokens (builtin:corpus):
   uniform 5 bits; the sensitivity plan; the stats-only plan (the k layers with the largest Top-1 |input|, from
   the map's outlier fields alone, at 8 bits); random plans of k layers at 8 bits (seeds 0–9); and, as context,
   uniform 4 and uniform 8. k = ⌊n·(budget − 4)/(8 − 4)⌋, the same for every plan arm.

Writes results/damage/plan-comparison.json (atomically) and prints a markdown table.

    OMP_WAIT_POLICY=PASSIVE python scripts/damage_plans.py --force
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quantdiff

RUNS = (("smollm2", "absmax"), ("gemma3", "absmax"), ("smollm2", "llm-int8"))
CANDIDATES = (4, 8)
METRICS = ("kld_mean", "kld_p99", "same_top1", "delta_loss")
CALIBRATION = "builtin:corpus-train"
EVALUATION = "builtin:corpus"  # the held-out split: the plans are judged on tokens they were not fitted on


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/damage/plan-comparison.json"))
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--calibration-tokens", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--draws", type=int, default=10, help="random plans, seeds 0..draws-1")
    parser.add_argument("--runs", default=",".join(f"{m}:{q}" for m, q in RUNS), help="model:method pairs")
    return parser.parse_args(argv)


def plan_bits(n: int, protected: list[int]) -> list[int]:
    return [CANDIDATES[1] if layer in protected else CANDIDATES[0] for layer in range(n)]


def one_run(model_name: str, method: str, args: argparse.Namespace) -> dict:
    """The map and plan on calibration tokens, then every arm on the evaluation tokens."""
    from dataclasses import replace

    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.eval.damage import damages
    from quantdiff.jobs.sensitivity import SensitivityRequest, run
    from quantdiff.models.bos import decide_bos
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.models.names import resolve_models
    from quantdiff.quant.checkpoint import load
    from quantdiff.quant.precision_plan import load_plan, plan_from_map, planned_config
    from quantdiff.quant.sites import parse_config

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        request = SensitivityRequest(model_name, method, ",".join(map(str, CANDIDATES)), ("linear",), "row", CALIBRATION, args.calibration_tokens,
                                     args.seq_len, "auto", "cpu", None, None, False, True, plan_budget=args.budget, out=plan_path)
        result = run(request)
        plan = load_plan(plan_path)  # the file, as eval --plan reads it
    by_bits = {site["bits"]: site for site in result["sites"]}
    n = plan.model["decoder_layers"]
    k = math.floor(n * (args.budget - CANDIDATES[0]) / (CANDIDATES[1] - CANDIDATES[0]) + 1e-9)
    outliers = [e["outliers"]["input_top1"] for e in by_bits[CANDIDATES[0]]["layers"]]
    stats_layers = sorted(np.argsort(outliers, kind="stable")[::-1][:k].tolist())
    common = (plan.model, method, "row", plan.calibration)
    arms = {"sensitivity plan": plan,
            "stats-only plan": plan_from_map(by_bits, args.budget, *common, bits=plan_bits(n, stats_layers))}
    for seed in range(args.draws):
        drawn = np.random.default_rng(seed).choice(n, size=k, replace=False).tolist()
        arms[f"random {seed}"] = plan_from_map(by_bits, args.budget, *common, bits=plan_bits(n, drawn))
    uniform = dict.fromkeys(([int(args.budget)] if float(args.budget).is_integer() else []) + list(CANDIDATES))  # uniform B, then the context rows
    configs = {f"uniform {b}": parse_config(method, b, "linear", "row") for b in uniform}
    configs.update({name: planned_config(p) for name, p in arms.items()})

    [(_, path)] = resolve_models([model_name])
    tokenizer = load_tokenizer(path)
    bos = decide_bos(path, tokenizer, "auto")
    model = load(path, device="cpu")
    sequences = load_sequences(EVALUATION, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], args.eval_tokens, args.seq_len,
                               model.config.vocab_size, bos.token_id, tokenizer)
    batches = make_batches(sequences, 4, getattr(model.config, "pad_token_id", None) or 0)
    measured, _ = damages(model, batches, list(configs.values()))
    evaluation = {name: {**{m: d[m] for m in METRICS}, "tokens": d["tokens"]} for name, d in zip(configs, measured)}
    # the additivity check on the calibration tokens, for the stats-only plan too (the sensitivity plan's is in its file)
    calibration_batches = make_batches(load_sequences(CALIBRATION, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                                      args.calibration_tokens, args.seq_len, model.config.vocab_size, bos.token_id, tokenizer),
                                       4, getattr(model.config, "pad_token_id", None) or 0)
    [stats_measured], _ = damages(model, calibration_batches, [planned_config(arms["stats-only plan"])])
    arms["stats-only plan"] = replace(arms["stats-only plan"], measured_kld_mean=stats_measured["kld_mean"])
    return {
        "model": model_name, "method": method, "decoder_layers": n, "protected_layers": k, "bos": result["bos"],
        "calibration": plan.calibration, "evaluation_data": {"source": EVALUATION, "tokens": args.eval_tokens, "seq_len": args.seq_len},
        "one_layer_kld_mean": {str(b): [e["damage"]["kld_mean"] for e in site["layers"]] for b, site in by_bits.items()},
        "input_top1": outliers,
        "plans": {name: {"bits": list(p.bits), "average_bits": p.average_bits, "predicted_kld_mean": p.predicted_kld_mean,
                         **({} if math.isnan(p.measured_kld_mean) else {"measured_kld_mean_calibration": p.measured_kld_mean})}
                  for name, p in arms.items()},
        "evaluation": evaluation,
        "seconds": round(time.time() - started, 1),
    }


def summary_rows(run: dict) -> list[str]:
    """Markdown rows: each arm's metrics on the evaluation tokens; the random plans as mean [min, max]."""
    ev = run["evaluation"]
    randoms = [name for name in ev if name.startswith("random")]
    rows = []
    for name in [n for n in ev if not n.startswith("random")] + ["random (mean [min, max])"]:
        if name.startswith("random"):
            cells = [f"{np.mean([ev[r][m] for r in randoms]):.4g} [{min(ev[r][m] for r in randoms):.4g}, {max(ev[r][m] for r in randoms):.4g}]" for m in METRICS]
            average = np.mean([run["plans"][r]["average_bits"] for r in randoms])
        else:
            cells = [f"{ev[name][m]:.4g}" for m in METRICS]
            average = run["plans"][name]["average_bits"] if name in run["plans"] else float(name.split()[-1])
        rows.append(f"| {run['model']} | {run['method']} | {name} | {average:.3f} | " + " | ".join(cells) + " |")
    beaten = sum(ev["sensitivity plan"]["kld_mean"] < ev[r]["kld_mean"] for r in randoms)
    rows.append(f"| {run['model']} | {run['method']} | sensitivity plan beats random on kld_mean | | {beaten} of {len(randoms)} | | | |")
    return rows


def main(argv: list[str] | None = None) -> None:
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from quantdiff.core.atomic import write_json

    args = parse_args(argv)
    runs = []
    for pair in args.runs.split(","):
        model_name, method = pair.split(":")
        print(f"{model_name} {method} …", file=sys.stderr, flush=True)
        runs.append(one_run(model_name, method, args))
        print(f"  {runs[-1]['seconds']} s", file=sys.stderr, flush=True)
    doc = {"schema": "quantdiff.damage-plans", "candidates": list(CANDIDATES), "budget_bits": args.budget, "site": "linear", "granularity": "row",
           "draws": args.draws, "runs": runs}
    write_json(args.out, doc, indent=1, force=args.force, flag="--out")
    print("| model | method | arm | average bits | " + " | ".join(METRICS) + " |")
    print("|---|---|---|---|" + "---|" * len(METRICS))
    for run in runs:
        print("\n".join(summary_rows(run)))


if __name__ == "__main__":
    main()
