"""Did a confirmatory run train what its plan fixed, after the plan was fixed? (issues 43, 53, 54)

    python scripts/plan_check.py recipes/confirm-bb.toml runs/confirm-bb --out results/confirm-bb/plan_check.json

The plan is the recipe file as first committed (`git log --diff-filter=A`). The check passes when
- the recipe file is unchanged since that commit (byte for byte), and that commit is an ancestor of HEAD;
- every trained model of the run holds, in its recipe.toml, exactly the plan commit's recipe (quantdiff writes the
  recipe that trained a model beside it), and the run holds every seed × arm the plan names, no more;
- every model loads (its config.json and model.safetensors open), no two seeds of an arm hold the same weights,
  and each model's train_log.json names the seed of its directory;
- every model's train_log.json records its provenance (train/provenance.py) and it is after the plan: each start
  and resume ran code whose commit contains the plan commit (`git merge-base --is-ancestor`), with no uncommitted
  changes, and training started after the plan commit's time. A log without these fields (a run trained before
  they were recorded) fails as "provenance not recorded": file times are not evidence.
A seed directory or model file that is a symlink, or a seed directory not named seed-<integer>, is refused with
one line. It writes the commit, its date, each finding and each seed's starts and resumes to --out, and exits 1
when any finding fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from safetensors import SafetensorError, safe_open

from quantdiff.core.atomic import atomic_file
from quantdiff.core.manifest import file_sha256
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


def _run_models(run: Path) -> list[tuple[int, str]]:
    """(seed, arm) of every model directory in `run`: SystemExit on a symlink or a seed-<not an integer> folder."""
    found = []
    for seed_dir in sorted(run.glob("seed-*")):
        if seed_dir.is_symlink():
            raise SystemExit(f"error: {seed_dir} is a symlink: each seed's models must be its own files")
        if not re.fullmatch(r"seed-[0-9]+", seed_dir.name) or not seed_dir.is_dir():
            raise SystemExit(f"error: {seed_dir} is not a seed directory (seed-<integer>/): remove or rename it")
        for arm_dir in sorted(seed_dir.iterdir()):
            weights = arm_dir / "model.safetensors"
            if arm_dir.is_symlink() or weights.is_symlink():
                raise SystemExit(f"error: {arm_dir if arm_dir.is_symlink() else weights} is a symlink: each seed's models must be its own files")
            if weights.is_file():
                found.append((int(seed_dir.name.removeprefix("seed-")), arm_dir.name))
    return found


def _weights_digest(model: Path) -> str:
    """sha256 of the model's weights, once its config.json and safetensors header have opened; SystemExit if not."""
    try:
        json.loads((model / "config.json").read_text(encoding="utf-8"))["model_type"]
        with safe_open(model / "model.safetensors", framework="pt") as weights:
            if not list(weights.keys()):
                raise ValueError("no tensors")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise SystemExit(f"error: {model} is not a model: it does not load ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    return file_sha256(model / "model.safetensors")


def _train_log(model: Path) -> dict:
    try:
        log = json.loads((model / "train_log.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return log if isinstance(log, dict) else {}


def _contains(root: Path, plan: str, commit: object) -> bool:
    return isinstance(commit, str) and subprocess.run(["git", "merge-base", "--is-ancestor", plan, commit], cwd=root, capture_output=True).returncode == 0


def _utc(text: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def check(recipe_path: Path, run: Path, root: Path = ROOT) -> dict:
    """The findings of `run` against the plan `recipe_path`, a recipe committed in the git repository at `root`."""
    relative = in_repository(recipe_path, root)
    commit = plan_commit(recipe_path, root)
    planned = git(root, "show", f"{commit}:{relative}") + "\n"
    committed_at = datetime.fromtimestamp(int(git(root, "show", "-s", "--format=%ct", commit)), timezone.utc)
    recipe = load_recipe(recipe_path)
    expected = {(seed, arm) for seed in recipe.train.seeds for arm in recipe.arm_names}
    models = {(s, a): run / f"seed-{s}" / a for s, a in _run_models(run)}
    found = set(models)
    differing = sorted(f"seed-{s}/{a}" for (s, a), d in models.items() if (d / "recipe.toml").read_text(encoding="utf-8") != planned)
    digests = {key: _weights_digest(d) for key, d in models.items()}
    same = sorted(f"seed-{s}/{a}" for (s, a), h in digests.items() if any(h == g and (t, b) != (s, a) and b == a for (t, b), g in digests.items()))
    logs = {key: _train_log(d) for key, d in models.items()}
    wrong_seed = sorted(f"seed-{s}/{a}" for (s, a), log in logs.items() if log.get("seed") != s)
    unrecorded = sorted(f"seed-{s}/{a}" for (s, a), log in logs.items()
                        if not (_utc(log.get("started_at")) and _utc(log.get("finished_at")) and isinstance(log.get("history"), list) and log["history"]))
    recorded = {key: log for key, log in logs.items() if f"seed-{key[0]}/{key[1]}" not in unrecorded}
    processes = {key: [entry for entry in log["history"] if isinstance(entry, dict)] for key, log in recorded.items()}
    outside = sorted(f"seed-{s}/{a}" for (s, a), starts in processes.items() if not all(_contains(root, commit, e.get("git_commit")) for e in starts))
    dirty = sorted(f"seed-{s}/{a}" for (s, a), starts in processes.items() if any(e.get("git_dirty") is not False for e in starts))
    started = {key: _utc(log["started_at"]) for key, log in recorded.items()}
    finished = [_utc(log["finished_at"]) for log in recorded.values()]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=root).returncode == 0
    findings = {
        "recipe unchanged since the plan commit": recipe_path.read_text(encoding="utf-8") == planned,
        "plan commit is an ancestor of HEAD": ancestor,
        "every planned seed × arm trained, and nothing else": found == expected,
        "every model trained from the plan commit's recipe": not differing,
        "every model loads, and no two seeds of an arm hold the same weights": not same,
        "every model's train log names its directory's seed": not wrong_seed,
        "every model's train log records its provenance (commit, start, finish)": bool(found) and not unrecorded,
        "every start and resume ran committed code that contains the plan commit": bool(processes) and not outside and not dirty,
        "every model started training after the plan commit": bool(started) and min(started.values()) > committed_at,
    }
    return {
        "recipe": relative,
        "plan_commit": commit,
        "plan_committed_at": committed_at.isoformat(),
        "first_model_started_at": min(started.values()).isoformat() if started else None,
        "first_model_written_at": min(finished).isoformat() if finished else None,  # from finished_at, not file times
        "last_model_written_at": max(finished).isoformat() if finished else None,
        "seeds": list(recipe.train.seeds),
        "arms": list(recipe.arm_names),
        "models": len(found),
        "missing": sorted(f"seed-{s}/{a}" for s, a in expected - found),
        "unplanned": sorted(f"seed-{s}/{a}" for s, a in found - expected),
        "recipe_differs": differing,
        "identical_weights": same,
        "log_seed_differs": wrong_seed,
        "provenance_not_recorded": unrecorded,
        "code_without_plan": outside,
        "uncommitted_code": dirty,
        # per seed, per arm: each start (from step 0) and resume (from a checkpoint's step), as the log records them
        "starts": {f"seed-{s}/{a}": [{"at": e.get("at"), "from_step": e.get("from_step"), "git_commit": e.get("git_commit")} for e in starts]
                   for (s, a), starts in sorted(processes.items())},
        "findings": findings,
        "passed": all(findings.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="the confirmatory recipe (its first commit is the plan)")
    parser.add_argument("run", type=Path, help="the run directory `quantdiff train` wrote (seed-<s>/<arm>/)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    result = check(args.recipe, args.run, ROOT)
    with atomic_file(args.out, force=True) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for finding, ok in result["findings"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {finding}")
    if result["provenance_not_recorded"]:
        print(f"provenance not recorded: {len(result['provenance_not_recorded'])} of {result['models']} models (their train logs predate it)")
    for model, starts in result["starts"].items():
        # a restart from step 0 (--force, or a removed checkpoint) begins a new history: its start is started_at
        if resumes := [e["from_step"] for e in starts if e["from_step"]]:
            print(f"{model}: started {starts[0]['at']}, resumed at steps {', '.join(map(str, resumes))}")
    print(f"plan commit {result['plan_commit'][:12]} ({result['plan_committed_at']}); {result['models']} models")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
