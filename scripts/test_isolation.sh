#!/usr/bin/env bash
# Order dependence made visible (issue 53): a test that passes only after another test has left state behind
# fails here. `make test` keeps its own order (tests/scheduling.py), which hid such a test; CI runs this too.
#  1. The quick tests (-m "not slow") in a random order (pytest-randomly: modules, and tests within each module,
#     shuffled by a seed printed first; QUANTDIFF_TEST_SEED=N reruns that order), dealt test by test to the
#     workers (--dist load), so tests of one module run on different workers, in any order.
#  2. Every test module alone, slow tests included, in a fresh process of one thread, one per core.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
seed=${QUANTDIFF_TEST_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
base=${QUANTDIFF_TEST_BASETEMP:-/tmp/quantdiff-isolation-$(id -u)}
mkdir -p "$base"  # pytest makes --basetemp itself, not its parent
echo "test order seed: $seed (rerun: QUANTDIFF_TEST_SEED=$seed make test-isolation)"
"$py" -m pytest -q -p randomly -p no:cacheprovider --randomly-seed="$seed" -m "not slow" -n auto --dist load --basetemp="$base/random"

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
alone() {  # one module in its own pytest process; exit 5 (every test deselected) cannot happen without -m
  local module=$1 name
  name=$(basename "$module" .py)
  if OMP_NUM_THREADS=1 "$py" -m pytest -q -p no:randomly -p no:cacheprovider -n 0 --basetemp="$base/$name" "$module" >"$logs/$name.log" 2>&1; then
    echo "alone: $module passed ($(tail -n 1 "$logs/$name.log"))"
  else
    echo "alone: $module FAILED"; tail -n 30 "$logs/$name.log"; return 1
  fi
}
export -f alone; export py base logs
ls tests/test_*.py | xargs -P "$(nproc)" -I{} bash -c 'alone {}'
