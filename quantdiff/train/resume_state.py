"""The state.json of a training checkpoint, checked field by field against the recipe before a run resumes.

The state decides how many steps are left and what the finished run reports (its loss and held-out curves),
so a value the run itself could not have written (a step outside 0..steps, a curve of the wrong length, a
string where a loss belongs) is refused with one line instead of training the wrong number of steps or
saving a partly trained pair as finished.

A checkpoint (or a finished seed of a multi-seed run) belongs to a recipe when that recipe trains the same
models from the same seed: the same text, or the same data, sizes, arms and [train] settings but for the `seeds`
list, so that seeds can be added to a run (`same_training`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.train.recipe import Recipe, parse_recipe

FIELDS = ("recipe", "step", "elapsed_s", "loss", "held_out")
# outliers: absent from checkpoints written before emergence tracking; seed: before multi-seed training;
# history: before provenance was recorded (train/provenance.py)
OPTIONAL_FIELDS = ("outliers", "seed", "history")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_loss(value: Any) -> bool:
    """A held-out loss: a number, or null (measured, not guarded: a NaN one, which strict JSON writes as null)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _is_start(entry: Any) -> bool:
    """One start of training as train/provenance.py writes it."""
    return (isinstance(entry, dict) and sorted(entry) == ["at", "from_step", "git_commit", "git_dirty"]
            and isinstance(entry["at"], str) and _is_int(entry["from_step"])
            and (entry["git_commit"] is None or isinstance(entry["git_commit"], str))
            and (entry["git_dirty"] is None or isinstance(entry["git_dirty"], bool)))


def _is_training_loss(value: Any) -> bool:
    """A training loss as the run logs it: always finite (train.guards stops at the first non-finite loss, before
    any checkpoint), so a null or NaN there is damage, not a diverged step."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _per_arm(state: dict, name: str, arms: tuple[str, ...]) -> dict[str, list]:
    value = state[name]
    if not isinstance(value, dict) or sorted(value) != sorted(arms) or not all(isinstance(v, list) for v in value.values()):
        named = f"{', '.join(arms[:-1])} and {arms[-1]}" if len(arms) > 1 else arms[0]
        raise ValueError(f"{name} must map {named} to lists")
    return value


def _check_fields(state: Any, recipe: Recipe) -> dict:
    """The state with logged nulls back to NaN; ValueError naming the first field that is wrong."""
    cfg = recipe.train
    if not isinstance(state, dict):
        raise ValueError("is not a JSON object")
    missing = [name for name in FIELDS if name not in state]
    unknown = sorted(set(state) - set(FIELDS) - set(OPTIONAL_FIELDS))
    if missing or unknown:
        raise ValueError(f"lacks {', '.join(missing)}" if missing else f"has unknown field {unknown[0]!r}")
    if "seed" in state and not _is_int(state["seed"]):
        raise ValueError(f"seed {state['seed']!r} is not a whole number")
    step = state["step"]
    if not _is_int(step) or not 0 <= step <= cfg.steps:
        raise ValueError(f"step {step!r} is not a whole number in 0..{cfg.steps} (the recipe's steps)")
    elapsed = state["elapsed_s"]
    if not isinstance(elapsed, (int, float)) or isinstance(elapsed, bool) or not math.isfinite(elapsed) or elapsed < 0:
        raise ValueError(f"elapsed_s {elapsed!r} is not a non-negative number of seconds")
    losses = _per_arm(state, "loss", recipe.arm_names)
    for kind, curve in losses.items():
        if len(curve) != step or not all(_is_training_loss(v) for v in curve):
            raise ValueError(f"loss of {kind} must hold one finite number per step ({step})")
    evals = list(range(cfg.eval_every, step + 1, cfg.eval_every))
    held_out = _per_arm(state, "held_out", recipe.arm_names)
    for kind, curve in held_out.items():
        pairs_ok = all(isinstance(p, list) and len(p) == 2 and _is_loss(p[1]) for p in curve)
        if not pairs_ok or [p[0] for p in curve] != evals:
            raise ValueError(f"held_out of {kind} must hold [step, loss] at steps {evals[:3]}{'…' if len(evals) > 3 else ''}")
    outliers = _per_arm(state, "outliers", recipe.arm_names) if "outliers" in state else {arm: [] for arm in recipe.arm_names}
    for kind, entries in outliers.items():
        expected = evals if cfg.outlier_sequences and "outliers" in state else []
        if not all(isinstance(e, dict) for e in entries) or [e.get("step") for e in entries] != expected:
            raise ValueError(f"outliers of {kind} must hold one entry per held-out evaluation")
    if not all(_is_start(entry) for entry in state.get("history", [])):
        raise ValueError("history must hold {at, from_step, git_commit, git_dirty} for each start")
    return {
        **state,
        "loss": {kind: [float(v) for v in curve] for kind, curve in losses.items()},
        "held_out": {kind: [[s, math.nan if v is None else float(v)] for s, v in curve] for kind, curve in held_out.items()},
        "outliers": outliers,
    }


def _training(recipe: Recipe) -> tuple:
    """What decides the trained models for a given seed: data, sizes, arms and [train] but its seed list
    ([tasks] sizes the final checks in the train log, [analysis] the later reports: neither changes a weight)."""
    return recipe.data, recipe.model, recipe.arms, dataclasses.replace(recipe.train, seed=0, seeds=[])


def same_training(saved_source: str, recipe: Recipe, seed: int | None = None) -> bool:
    """True when recipe text `saved_source` (which trained `seed`; None: the seed it names) trains what `recipe`
    trains from its [train] seed: the same text, or the same training but for its seed list."""
    if saved_source == recipe.source and seed == recipe.train.seed:
        return True
    try:
        saved = parse_recipe(saved_source, recipe.name)
    except ConfigError:
        return False
    return _training(saved) == _training(recipe) and (saved.train.seed if seed is None else seed) == recipe.train.seed


def checked_state(state: Any, recipe: Recipe, where: Path) -> dict:
    """`state` (read from `where`) if every field is one this recipe's run could have written; else one line."""
    if isinstance(state, dict) and isinstance(state.get("recipe"), str):
        seed = state.get("seed")
        if not same_training(state["recipe"], recipe, seed if _is_int(seed) else None):
            raise ConfigError(f"the checkpoint in {where} was made by a different recipe: remove it or pass --force")
    try:
        return _check_fields(state, recipe)
    except ValueError as exc:
        raise LoadError(f"corrupt training checkpoint {where}: state.json {exc}; remove it or pass --force") from None
