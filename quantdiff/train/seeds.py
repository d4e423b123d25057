"""Multi-seed training: each of a recipe's `seeds` trains every arm, into OUT/seed-<s>/<arm>/.

A seed is an ordinary run of `train.loop` with `[train] seed = s` (its arms in lockstep on that seed's batches,
its checkpoint in OUT/seed-<s>/.checkpoint), so it gives the models that recipe alone gives, bit for bit. A
recipe without `seeds` keeps the single-run layout OUT/<arm>/.

Seeds run one after another in this process, or `jobs` at a time in worker processes, one thread each as every
run trains (train.determinism; a small model gains little from a second thread: `benchmarks/seeds_bench.py`). The workers start
with the pinned kernels of train.determinism, whatever this process was started with. A finished seed is left as it is
(after checking that the same recipe trained it: seeds may be added to a finished run); an interrupted one
resumes from its checkpoint; `force` retrains every seed from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from pathlib import Path

from quantdiff.core.errors import ConfigError
from quantdiff.core.manifest import manifest_mismatch
from quantdiff.train import determinism
from quantdiff.train.loop import Checkpoint, arms_exist, train_pair
from quantdiff.train.recipe import Recipe
from quantdiff.train.resume_state import same_training

OUTPUT_LOG = "train_output.txt"  # a worker's console output, inside its seed's directory


def multi_seed(recipe: Recipe) -> bool:
    """True when the recipe lists `seeds` (the OUT/seed-<s>/ layout, even for one seed)."""
    return bool(recipe.train.seeds)


def seed_list(recipe: Recipe) -> tuple[int, ...]:
    return tuple(recipe.train.seeds) or (recipe.train.seed,)


def for_seed(recipe: Recipe, seed: int) -> Recipe:
    """The recipe one seed of a multi-seed run trains with."""
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, seed=seed))


def seed_dir(out: Path, seed: int) -> Path:
    return Path(out) / f"seed-{seed}"


def run_dirs(recipe: Recipe, out: str | Path) -> dict[int, Path]:
    """{seed: the directory holding that seed's arms}: OUT itself for a single-seed recipe."""
    out = Path(out)
    if not multi_seed(recipe):
        return {recipe.train.seed: out}
    return {seed: seed_dir(out, seed) for seed in seed_list(recipe)}


def unfinished(out: str | Path, recipe: Recipe) -> list[Path]:
    """The seed directories whose arms are not all trained, or whose training left a checkpoint to resume;
    ConfigError when a different recipe trained one of them."""
    return [d for seed, d in run_dirs(recipe, out).items() if not finished(for_seed(recipe, seed), d)]


def trained_seeds(out: str | Path) -> list[int]:
    """The seeds that have a seed-<s> directory in OUT, in increasing order."""
    names = (p.name.removeprefix("seed-") for p in Path(out).glob("seed-*") if p.is_dir())
    return sorted(int(n) for n in names if n.isdigit())


def finished(recipe: Recipe, directory: Path) -> bool:
    """True when `directory` holds this seed's trained arms; ConfigError when a different recipe trained them."""
    if not arms_exist(directory, recipe) or Checkpoint(directory).exists():
        return False
    saved = directory / recipe.arms[0].name / "recipe.toml"
    try:
        source = saved.read_text(encoding="utf-8")
        seed = json.loads((saved.parent / "train_log.json").read_text(encoding="utf-8")).get("seed")
    except (OSError, ValueError, AttributeError):
        source, seed = "", None
    if not same_training(source, recipe, seed if isinstance(seed, int) else None):
        raise ConfigError(f"{directory} holds models trained by a different recipe (see {saved}): remove it, or retrain with quantdiff train --force")
    for arm in recipe.arm_names:  # never skipped, nor measured, unchecked: weights changed since training are refused
        changed = manifest_mismatch(directory / arm)
        if changed is not None:
            raise ConfigError(f"seed {recipe.train.seed}: {directory / arm} is not what training wrote ({changed}): remove {directory}, or retrain with quantdiff train --force")
    return True


def train_seeds(recipe: Recipe, out: str | Path, *, force: bool = False, jobs: int = 1, stop_after: int | None = None,
                console=None) -> dict[int, dict[str, Path]] | None:
    """Train every seed's arms (skipping finished seeds unless `force`); returns {seed: {arm: path}}.

    `stop_after=k` (one job only) stops the first unfinished seed after step k, checkpoint saved, as an
    interruption would (returns None)."""
    from quantdiff.report.console import line_console

    console = console or line_console(stderr=True)
    if jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    dirs = run_dirs(recipe, out)
    if not multi_seed(recipe):  # one run, as train_pair always did it (trained models there: an error without force)
        paths = train_pair(recipe, out, force=force, stop_after=stop_after, console=console)
        return None if paths is None else {recipe.train.seed: paths}
    pending = {seed: d for seed, d in dirs.items() if force or not finished(for_seed(recipe, seed), d)}
    for seed, directory in pending.items():  # a bad checkpoint is refused before any seed trains
        if not force and Checkpoint(directory).exists():
            Checkpoint(directory).load_state(for_seed(recipe, seed))
    done = [seed for seed in dirs if seed not in pending]
    if done:
        console.print(f"seeds already trained, left as they are: {', '.join(map(str, done))}")
    jobs = min(jobs, len(pending)) or 1
    if jobs == 1:
        for number, (seed, directory) in enumerate(pending.items(), 1):
            console.print(f"seed {seed} ({number} of {len(pending)} to train) -> {directory}")
            if train_pair(for_seed(recipe, seed), directory, force=force, stop_after=stop_after, console=console) is None:
                return None
    elif stop_after is not None:
        raise ValueError("stop_after needs jobs = 1")
    else:
        _train_in_workers(recipe, pending, force, jobs, console)
    return {seed: {name: d / name for name in recipe.arm_names} for seed, d in dirs.items()}


def _train_in_workers(recipe: Recipe, pending: dict[int, Path], force: bool, jobs: int, console) -> None:
    """`jobs` worker processes, each training one seed at a time on one thread."""
    console.print(f"training seeds {', '.join(map(str, pending))}: {jobs} worker processes, {determinism.THREADS} thread(s) each; "
                  f"each seed's output goes to OUT/seed-<s>/{OUTPUT_LOG}")
    tasks = [(for_seed(recipe, seed), directory, force) for seed, directory in pending.items()]
    started = time.perf_counter()
    with determinism.pinned_children():  # spawned workers (one per seed) import torch afresh, under the pinned kernels
        pool = multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1)
        try:
            for number, seed in enumerate(pool.imap_unordered(_train_one, tasks), 1):
                console.print(f"seed {seed} trained ({number} of {len(tasks)}, {time.perf_counter() - started:.0f} s since the start)")
            pool.close()
        finally:
            pool.terminate()  # on an error or an interrupt the other seeds stop too (their checkpoints stay)
            pool.join()


def _train_one(task: tuple[Recipe, Path, bool]) -> int:
    """A worker's job: one seed, its console output appended to OUT/seed-<s>/train_output.txt."""
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bars would cross the other workers' on the shared stderr
    recipe, directory, force = task
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / OUTPUT_LOG, "a", encoding="utf-8") as log:
        train_pair(recipe, directory, force=force, console=Console(file=log, highlight=False, soft_wrap=True, width=120))
    return recipe.train.seed
