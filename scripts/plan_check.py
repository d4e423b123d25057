"""Did a confirmatory run train what its plan fixed, after the plan was fixed? (issue 43)

    python scripts/plan_check.py recipes/confirm-bb.toml runs/confirm-bb --out results/confirm-bb/plan_check.json

The plan is the recipe file as first committed (`git log --diff-filter=A`). The check passes when
- the recipe file is unchanged since that commit (byte for byte), and that commit is an ancestor of HEAD;
- every trained model of the run holds, in its recipe.toml, exactly the plan commit's recipe (quantdiff writes the
  recipe that trained a model beside it), and the run holds every seed × arm the plan names, no more;
- every model was written after the plan commit's time (the file times of the run's weights).
It writes the commit, its date and each finding to --out, and exits 1 when any finding fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from quantdiff.core.atomic import atomic_file
from quantdiff.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def in_repository(recipe: Path, root: Path) -> str:
    """The recipe's path relative to the repository at `root`."""
    if not recipe.resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"error: {recipe} is not inside the repository {root}: there is no plan to check against")
    return str(recipe.resolve().relative_to(root.resolve()))


def plan_commit(recipe: Path, root: Path = ROOT) -> str:
    """The commit that added the recipe file to the repository at `root`."""
    added = git(root, "log", "--diff-filter=A", "--format=%H", "--", in_repository(recipe, root)).splitlines()
    if not added:
        raise SystemExit(f"error: {recipe} was never committed: there is no plan to check against")
    return added[-1]


def check(recipe_path: Path, run: Path, root: Path = ROOT) -> dict:
    """The findings of `run` against the plan `recipe_path`, a recipe committed in the git repository at `root`."""
    relative = in_repository(recipe_path, root)
    commit = plan_commit(recipe_path, root)
    planned = git(root, "show", f"{commit}:{relative}") + "\n"
    committed_at = datetime.fromtimestamp(int(git(root, "show", "-s", "--format=%ct", commit)), timezone.utc)
    recipe = load_recipe(recipe_path)
    expected = {(seed, arm) for seed in recipe.train.seeds for arm in recipe.arm_names}
    found = {(int(d.parent.name.removeprefix("seed-")), d.name) for d in run.glob("seed-*/*") if (d / "model.safetensors").is_file()}
    differing = sorted(f"seed-{s}/{a}" for s, a in found if (run / f"seed-{s}" / a / "recipe.toml").read_text(encoding="utf-8") != planned)
    written = [datetime.fromtimestamp((run / f"seed-{s}" / a / "model.safetensors").stat().st_mtime, timezone.utc) for s, a in found]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=root).returncode == 0
    findings = {
        "recipe unchanged since the plan commit": recipe_path.read_text(encoding="utf-8") == planned,
        "plan commit is an ancestor of HEAD": ancestor,
        "every planned seed × arm trained, and nothing else": found == expected,
        "every model trained from the plan commit's recipe": not differing,
        "every model written after the plan commit": bool(written) and min(written) > committed_at,
    }
    return {
        "recipe": relative,
        "plan_commit": commit,
        "plan_committed_at": committed_at.isoformat(),
        "first_model_written_at": min(written).isoformat() if written else None,
        "last_model_written_at": max(written).isoformat() if written else None,
        "seeds": list(recipe.train.seeds),
        "arms": list(recipe.arm_names),
        "models": len(found),
        "missing": sorted(f"seed-{s}/{a}" for s, a in expected - found),
        "unplanned": sorted(f"seed-{s}/{a}" for s, a in found - expected),
        "recipe_differs": differing,
        "findings": findings,
        "passed": all(findings.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="the confirmatory recipe (its first commit is the plan)")
    parser.add_argument("run", type=Path, help="the run directory `quantdiff train` wrote (seed-<s>/<arm>/)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    result = check(args.recipe, args.run)
    with atomic_file(args.out, force=True) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for finding, ok in result["findings"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {finding}")
    print(f"plan commit {result['plan_commit'][:12]} ({result['plan_committed_at']}); {result['models']} models")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
