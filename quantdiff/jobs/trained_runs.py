"""What `quantdiff reproduce` analyses: built-in models, a training output directory, or a recipe's runs in
runs/<recipe>/ (trained first if missing), as {seed: {arm: model directory}}.

A recipe with `[train] seeds` gives every seed's arms (OUT/seed-<s>/<arm>); every seed it lists must be trained,
so no seed is left out of a report. A built-in set ships one seed: the one its train logs name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.train.recipe import Recipe, load_recipe, parse_recipe

RUNS = Path("runs")


@dataclass(frozen=True)
class TrainedRuns:
    recipe: Recipe
    runs: dict[int, dict[str, Path]]  # seed → {arm: model directory}, in the recipe's order
    multi_seed: bool  # the OUT/seed-<s>/ layout: the report is made across seeds
    built_in: str | None = None  # the built-in name ('bb'), when the models are shipped ones

    @property
    def dirs(self) -> list[Path]:
        return [d for arms in self.runs.values() for d in arms.values()]


def logged_seed(model_dir: Path, recipe: Recipe) -> int:
    """The seed a model was trained from: its train log's, or (logs written before it was logged) the recipe's."""
    try:
        seed = json.loads((model_dir / "train_log.json").read_text(encoding="utf-8")).get("seed")
    except (OSError, ValueError, AttributeError):
        seed = None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else recipe.train.seed


def recipe_of_run(directory: Path) -> Recipe:
    """The recipe saved beside the models of a training output directory (OUT/<arm>/ or OUT/seed-<s>/<arm>/).

    Seeds may have been added to a run after others finished, so each seed's models may carry a different seed
    list: the run's list is the longest one, followed by any other seed-<s> directory found."""
    from quantdiff.train.seeds import trained_seeds

    saved = sorted(directory.glob("*/recipe.toml")) or sorted(directory.glob("seed-*/*/recipe.toml"))
    if not saved:
        raise LoadError(f"{directory} holds no trained models (no <arm>/recipe.toml or seed-<s>/<arm>/recipe.toml)")
    try:
        recipes = [parse_recipe(path.read_text(encoding="utf-8"), directory.name) for path in saved]
    except UnicodeDecodeError:
        raise LoadError(f"a recipe.toml in {directory} is not UTF-8 text (a TOML file)") from None
    recipe = max(recipes, key=lambda r: len(r.train.seeds))
    if not recipe.train.seeds:
        return recipe
    seeds = list(recipe.train.seeds) + [s for s in trained_seeds(directory) if s not in recipe.train.seeds]
    return replace(recipe, train=replace(recipe.train, seeds=seeds))


def find_runs(target: str, console) -> TrainedRuns:
    """Built-in models as shipped; an existing training output directory as it is (every seed must be trained);
    a recipe's arms in runs/<recipe>/ (trained, or their training resumed, if any seed is missing)."""
    from quantdiff.models.names import BUILT_IN, resolve
    from quantdiff.train.seeds import multi_seed, run_dirs, train_seeds, unfinished

    if target in BUILT_IN:
        dirs = resolve(target)
        recipe = load_recipe(dirs[0] / "recipe.toml")
        return TrainedRuns(recipe, {logged_seed(dirs[0], recipe): dict(zip(BUILT_IN[target], dirs))}, False, target)
    if Path(target).is_dir():
        out = Path(target)
        recipe = recipe_of_run(out)
        missing = unfinished(out, recipe)
        if missing:
            raise ConfigError(f"{missing[0]} is not fully trained: finish it with quantdiff train <recipe> --out {out}")
    else:
        recipe = load_recipe(target)
        out = RUNS / recipe.name
        if unfinished(out, recipe):
            console.print(f"no trained models (or not every seed) in {out}: training them with recipe {recipe.name!r}")
            train_seeds(recipe, out, console=console)
    runs = {seed: {name: d / name for name in recipe.arm_names} for seed, d in run_dirs(recipe, out).items()}
    return TrainedRuns(recipe, runs, multi_seed(recipe))
