#!/usr/bin/env bash
# Install llama.cpp for the engine check (tests/test_real_exports.py, benchmarks/engine_check.py): node-llama-cpp's
# prebuilt CPU binary from the npm registry, in a tool folder outside the repository and outside quantdiff's Python
# environment. Nothing is compiled or downloaded past npm: no install scripts run (node-llama-cpp's postinstall
# would offer to build from source), and the optional GPU builds (CUDA, Vulkan: 650 MB) are left out.
#
#   bash scripts/install_llama_engine.sh      # needs node >= 20 and npm
#
# The folder: $QUANTDIFF_LLAMA_NODE, else quantdiff's cache's engines/node-llama-cpp (where the check looks).
set -euo pipefail
version=3.21.1  # tested here; newer releases may fail `npm ci`
dir="${QUANTDIFF_LLAMA_NODE:-${QUANTDIFF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quantdiff}/engines/node-llama-cpp}"
for tool in node npm; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found: install Node.js 20 or newer with npm" >&2; exit 1; }
done
# node-llama-cpp's binary packages are named linux-x64, linux-arm64, mac-x64, mac-arm64-metal, win-x64
binary=$(node -p 'const os = {darwin: "mac", win32: "win"}[process.platform] ?? process.platform;
                  os + "-" + process.arch + (os === "mac" && process.arch === "arm64" ? "-metal" : "")')
mkdir -p "$dir"
cd "$dir"
npm install --save-exact --ignore-scripts --omit=optional --no-audit --no-fund \
    "node-llama-cpp@$version" "@node-llama-cpp/$binary@$version"
echo "llama.cpp engine installed in $dir"
