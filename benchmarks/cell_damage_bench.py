"""What do the damage fields of eval/sweep cells cost? (issue 55 item 1; docs/damage.md, "On eval and sweep cells")

In one process, round by round: a model's cells without damage (`eval.sweep.run_model_cells`), then the damage pass
alone (`eval.cell_damage.cell_damages`: one full-precision forward per batch, one quantized forward per config), on the
same prepared task data and configs (absmax at 8 and 4 bits, sites linear and kv). Prints both times and the ratio
(cells + damage) / cells, what `eval`/`sweep` without `--no-damage` cost against with it.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cell_damage_bench.py --model smollm2 --task lm --limit 4 --rounds 2
"""

from __future__ import annotations

import argparse
import time

import quantdiff
from quantdiff.eval.cell_damage import cell_damages
from quantdiff.eval.sweep import run_model_cells
from quantdiff.eval.tasks.registry import make_task
from quantdiff.quant.sites import parse_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny/diff")
    parser.add_argument("--task", default="lm", choices=("lm", "choice"))
    parser.add_argument("--limit", type=int, default=16, help="windows (lm) or items (choice)")
    parser.add_argument("--context", type=int, default=128, help="lm window length")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = quantdiff.load(args.model, device="cpu"), quantdiff.load_tokenizer(args.model)
    task = make_task(args.task, **({"context": args.context} if args.task == "lm" else {}))
    prepared = task.prepare(tokenizer, args.limit, tokenizer.bos_token_id)
    configs = [parse_config("absmax", bits, site) for site in ("linear", "kv") for bits in (8, 4)]
    for round_ in range(args.rounds):
        start = time.perf_counter()
        run_model_cells(args.model, model, task, prepared, configs)
        cells = time.perf_counter() - start
        start = time.perf_counter()
        cell_damages(model, task, prepared, configs, task.batch_size)
        damage = time.perf_counter() - start
        print(f"{args.model} {args.task} limit {args.limit} round {round_}: cells {cells:.1f} s, damage {damage:.1f} s, "
              f"(cells + damage) / cells {(cells + damage) / cells:.2f}", flush=True)


if __name__ == "__main__":
    main()
