"""Where a training step of a recipe's arms spends its time, and what running seeds side by side buys.

Sections (each measures its contenders side by side in this one run, alternating, and prints ratios):
1. a step's breakdown: batch generation, each arm's forward, backward and optimizer step, and the eval and
   checkpoint work amortised at the recipe's cadence;
2. threads: one step of every arm with 1 thread vs all threads (how much a second core helps inside a process);
3. seeds: two seeds trained one after another in this process (all threads) vs `--jobs 2` (two worker
   processes, one thread each), through `train.seeds.train_seeds` on the recipe cut to --steps steps;
4. torch.compile: each arm kind's step eager vs compiled (after the compile, whose time is printed), and how far
   the compiled losses drift from the eager ones over --steps steps from the same weights.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/seeds_bench.py                       # recipes/bb.toml, all sections
    OMP_WAIT_POLICY=PASSIVE python benchmarks/seeds_bench.py --sections 1,2 --steps 40
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from quantdiff.train import loop
from quantdiff.train.recipe import Recipe, load_recipe
from quantdiff.train.seeds import train_seeds

QUIET = Console(file=io.StringIO())


def _clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def start(recipe: Recipe, where: Path) -> loop.Run:
    return loop.start_run(recipe, where, loop.Checkpoint(where), False, QUIET)


def breakdown(recipe: Recipe, where: Path, steps: int) -> dict[str, float]:
    """Median seconds per step of each part, eval and checkpoint amortised at the recipe's cadence."""
    run = start(recipe, where / "breakdown")
    times: dict[str, list[float]] = {}
    for step in range(steps):
        batch: list = []
        times.setdefault("batch", []).append(_clock(lambda: batch.extend(loop.make_batch(step, run.data, recipe))))
        for arm in recipe.arms:
            model, (optimizer, _) = run.models[arm.name], run.optimizers[arm.name]
            loss: list = []
            times.setdefault(f"{arm.name} forward", []).append(_clock(lambda: loss.append(loop.lm_loss(model, *batch))))
            times.setdefault(f"{arm.name} backward", []).append(_clock(lambda: loss[0].backward()))
            times.setdefault(f"{arm.name} optimizer", []).append(_clock(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True))))
    run.state["step"] = recipe.train.eval_every
    evals = [_clock(lambda: loop.evaluate_step(run)) for _ in range(2)]
    checkpoint = loop.Checkpoint(where / "breakdown")
    saves = [_clock(lambda: checkpoint.save(run.data.tokenizer, run.models, run.optimizers, run.state)) for _ in range(2)]
    medians = {part: statistics.median(values[2:] or values) for part, values in times.items()}
    medians["eval (amortised)"] = min(evals) / recipe.train.eval_every
    medians["checkpoint (amortised)"] = min(saves) / recipe.train.checkpoint_every
    return medians


def print_breakdown(medians: dict[str, float]) -> float:
    total = sum(medians.values())
    print(f"\n1. one step of every arm: {total * 1000:.0f} ms (sum of medians)")
    for part, seconds in sorted(medians.items(), key=lambda kv: -kv[1]):
        print(f"   {part:28s} {seconds * 1000:8.1f} ms  {seconds / total:6.1%}")
    return total


def threads(recipe: Recipe, where: Path, steps: int) -> None:
    """A training step of every arm at 1 thread vs all threads (two runs from the same weights, interleaved
    step by step), and how far their losses drift apart (the log's 5 decimals)."""
    most = torch.get_num_threads()
    runs = {1: start(recipe, where / "threads-1"), most: start(recipe, where / f"threads-{most}")}
    times: dict[int, list[float]] = {1: [], most: []}
    for step in range(steps):
        for count in (1, most) if step % 2 else (most, 1):
            torch.set_num_threads(count)
            times[count].append(_clock(lambda: loop.train_step(runs[count], runs[count].models, torch.autocast("cpu", enabled=False), step)))
    torch.set_num_threads(most)
    one, many = statistics.median(times[1][2:]), statistics.median(times[most][2:])
    drift = {arm: max(abs(a - b) for a, b in zip(runs[1].state["loss"][arm], runs[most].state["loss"][arm])) for arm in recipe.arm_names}
    print(f"\n2. a step of every arm: 1 thread {one * 1000:.0f} ms, {most} threads {many * 1000:.0f} ms: "
          f"{most} threads are {one / many:.2f}× as fast as 1 (per process); largest |Δ loss| between the two over {steps} steps: "
          + ", ".join(f"{arm} {d:.0e}" for arm, d in drift.items()))


def _loop_seconds(out: Path, recipe: Recipe) -> list[float]:
    """Each seed's time inside the training loop (its train log's wall_time_s): no start-up, no final evaluation."""
    arm = recipe.arm_names[0]
    return [json.loads((seed_dir / arm / "train_log.json").read_text())["wall_time_s"] for seed_dir in sorted(out.glob("seed-*"))]


def seeds(recipe: Recipe, where: Path, steps: int, rounds: int) -> None:
    """Two seeds sequential (this process, all threads) vs two worker processes: wall time, and the training
    loops alone (sequential: the two loops' sum; workers: the longer loop, as they overlap)."""
    short = replace(recipe, train=replace(recipe.train, steps=steps, seeds=[1, 2], checkpoint_every=min(steps, recipe.train.checkpoint_every)))
    walls: dict[str, list[float]] = {"sequential": [], "jobs 2": []}
    loops: dict[str, list[float]] = {"sequential": [], "jobs 2": []}
    for r in range(rounds):
        for mode in ("sequential", "jobs 2") if r % 2 == 0 else ("jobs 2", "sequential"):
            out = where / f"seeds-{mode.replace(' ', '')}-{r}"
            walls[mode].append(_clock(lambda: train_seeds(short, out, jobs=1 if mode == "sequential" else 2, console=QUIET)))
            loop_s = _loop_seconds(out, short)
            loops[mode].append(sum(loop_s) if mode == "sequential" else max(loop_s))
    wall = {mode: statistics.median(v) for mode, v in walls.items()}
    loop_time = {mode: statistics.median(v) for mode, v in loops.items()}
    print(f"\n3. two seeds of {steps} steps, all arms: wall time (start-up and final evaluation included) sequential {wall['sequential']:.0f} s, "
          f"--jobs 2 {wall['jobs 2']:.0f} s: --jobs 2 is {wall['sequential'] / wall['jobs 2']:.2f}× as fast; training loops alone "
          f"{loop_time['sequential']:.0f} s vs {loop_time['jobs 2']:.0f} s: {loop_time['sequential'] / loop_time['jobs 2']:.2f}× "
          f"(rounds, wall: {[round(w) for w in walls['sequential']]} vs {[round(w) for w in walls['jobs 2']]})")


def compiled(recipe: Recipe, where: Path, steps: int) -> None:
    """Each kind's step eager vs compiled, and the compiled losses' drift from the eager ones."""
    run = start(recipe, where / "compile")
    print(f"\n4. torch.compile ({steps} steps per arm kind, same initial weights and batches)")
    for arm in {arm.kind: arm for arm in recipe.arms}.values():
        eager = run.models[arm.name]
        twin = copy.deepcopy(eager)
        optimizers = {"eager": loop.make_optimizer(eager, recipe.train, arm)[0], "compiled": loop.make_optimizer(twin, recipe.train, arm)[0]}
        models = {"eager": eager, "compiled": torch.compile(twin)}
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        losses: dict[str, list[float]] = {"eager": [], "compiled": []}
        for step in range(steps):
            inputs, targets = loop.make_batch(step, run.data, recipe)
            for mode in ("eager", "compiled") if step % 2 else ("compiled", "eager"):
                def one_step() -> None:
                    loss = loop.lm_loss(models[mode], inputs, targets)
                    loss.backward()
                    optimizers[mode].step()
                    optimizers[mode].zero_grad(set_to_none=True)
                    losses[mode].append(loss.item())
                times[mode].append(_clock(one_step))
        first = times["compiled"][0]
        eager_s, compiled_s = statistics.median(times["eager"][2:]), statistics.median(times["compiled"][2:])
        drift = [abs(a - b) for a, b in zip(losses["eager"], losses["compiled"])]
        print(f"   {arm.kind:10s} eager {eager_s * 1000:6.1f} ms, compiled {compiled_s * 1000:6.1f} ms: {eager_s / compiled_s:.2f}× as fast; "
              f"first compiled step (compile) {first:.0f} s, break-even after {first / max(1e-9, eager_s - compiled_s):.0f} steps; "
              f"|Δ loss| at the first step {drift[0]:.1e}, largest over {steps} steps {max(drift):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/bb.toml")
    parser.add_argument("--sections", default="1,2,3,4")
    parser.add_argument("--steps", type=int, default=40, help="steps per measurement (section 3: per seed)")
    parser.add_argument("--rounds", type=int, default=2, help="section 3: alternating rounds of each mode")
    cfg = parser.parse_args()
    hf_logging.disable_progress_bar()  # save_pretrained's bars
    recipe = load_recipe(cfg.recipe)
    sections = {int(s) for s in cfg.sections.split(",")}
    print(f"recipe {recipe.name}: {len(recipe.arms)} arms ({', '.join(recipe.arm_names)}), batch {recipe.train.batch_size} × "
          f"{recipe.train.seq_len}; torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        if 1 in sections:
            print_breakdown(breakdown(recipe, where, cfg.steps))
        if 2 in sections:
            threads(recipe, where, cfg.steps)
        if 3 in sections:
            seeds(recipe, where, cfg.steps, cfg.rounds)
        if 4 in sections:
            compiled(recipe, where, cfg.steps)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
