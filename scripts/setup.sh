#!/usr/bin/env bash
# Creates .venv in the repository root and installs quantdiff with its extras.
# torch is installed FIRST with an exact pin: bitsandbytes (or any unpinned torch requirement)
# installed into an empty venv pulls a multi-GB CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.quantdiff-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,eval]"
# The corpus (public-domain Jane Austen novels) comes from Debian; it is read at run time, never committed.
if [ ! -f /usr/lib/R/site-library/janeaustenr/R/sysdata.rdb ] && [ ! -d "${QUANTDIFF_CORPUS_DIR:-$HOME/.cache/quantdiff/corpus}/janeaustenr" ]; then
  .venv/bin/python -m quantdiff.corpus --install || echo "warning: corpus not installed; corpus tasks will explain how" >&2
fi
touch "$stamp"
