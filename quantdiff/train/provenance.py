"""Where a trained model came from: the code's git commit (and whether the tree had uncommitted changes) and
the UTC times at which its training started, resumed and finished.

A confirmatory run is judged by its order in the history: the plan's commit must precede every model
(scripts/plan_check.py reads these fields). File times say nothing once files are copied, so each train_log.json
carries them itself.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from pathlib import Path

import quantdiff

# The repository holding the quantdiff package that runs (an installed wheel has none: the fields are then null).
_SOURCE = Path(quantdiff.__file__).resolve().parents[1]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _git(*args: str) -> str | None:
    try:
        # --no-optional-locks: `git status` would otherwise refresh the index under index.lock, and a write that
        # fails there (a file-size limit, a full disk) leaves the lock behind and blocks the user's own git
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(_SOURCE), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def code_version() -> dict:
    """{"git_commit": the checkout's HEAD or None, "git_dirty": tracked files differ from it (None without git)}.
    Untracked files (runs/, reports) do not count: they are not the code."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit.strip(), "git_dirty": None if status is None else bool(status.strip())}


def start_entry(step: int) -> dict:
    """One start of a training process: when, from which step (0: from the beginning), on which code."""
    return {"at": utc_now(), "from_step": step, **code_version()}
