"""What the pinned kernels of `quantdiff train` cost: steps/s of a recipe's arms pinned (ATEN_CPU_CAPABILITY=avx2,
MKL_CBWR=AVX2, one thread: quantdiff.train.determinism) against this machine's own kernels and all its threads,
and against the pins with MKL_CBWR=COMPATIBLE (MKL's SSE2 branch, the one Intel documents as the same on Intel and
other vendors' CPUs), each in a fresh process (the pins act only before torch is imported), alternated round by
round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/determinism_bench.py --steps 30 --rounds 3 --arms standard,diff,standard-sgd
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

CHILD = "--child"


MODES = ("pinned", "compatible", "native")


def child(recipe_path: str, arms: list[str], steps: int, mode: str) -> None:
    """Time `steps` training steps of `arms` (after one warm-up step) in this process; print steps/s as JSON."""
    pinned = mode != "native"
    if pinned:
        from quantdiff.train.determinism import pin_environment

        pin_environment()
    if mode == "compatible":
        os.environ["MKL_CBWR"] = "COMPATIBLE"
    import torch
    from rich.console import Console

    from quantdiff.train import determinism, loop
    from quantdiff.train.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    recipe = replace(recipe, arms=tuple(a for a in recipe.arms if a.name in arms), train=replace(recipe.train, seeds=()))
    if pinned:
        torch.set_num_threads(determinism.THREADS)
    with tempfile.TemporaryDirectory() as where:
        run = loop.start_run(recipe, Path(where), loop.Checkpoint(Path(where)), False, Console(file=io.StringIO()))
        loop.train_step(run, run.models, torch.autocast("cpu", enabled=False), 0)
        start = time.perf_counter()
        for step in range(1, steps + 1):
            loop.train_step(run, run.models, torch.autocast("cpu", enabled=False), step)
        print(json.dumps({"steps_per_s": steps / (time.perf_counter() - start), **determinism.settings()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/bb.toml")
    parser.add_argument("--arms", default="standard,diff,standard-sgd")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in speeds:
            out = subprocess.run([sys.executable, __file__, CHILD, args.recipe, args.arms, str(args.steps), mode], env=env,
                                 check=True, capture_output=True, text=True).stdout
            result = json.loads(out.splitlines()[-1])
            speeds[mode].append(result["steps_per_s"])
            print(f"{mode:10s} {result['cpu_capability']:6s} MKL_CBWR={result['mkl_cbwr']} {result['threads']} thread(s): {result['steps_per_s']:.2f} steps/s")
    pinned, compatible, native = (statistics.median(speeds[mode]) for mode in MODES)
    print(f"median steps/s (arms {args.arms}): pinned {pinned:.2f}, compatible {compatible:.2f}, native {native:.2f}: "
          f"pinned/native {pinned / native:.2f}x, compatible/pinned {compatible / pinned:.2f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        child(sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5])
    else:
        main()
