"""llama.cpp on a GGUF file beside quantdiff's forward of the same file, through node-llama-cpp (issue 53).

No llama-cpp-python wheel installs on this machine (its prebuilt wheels need glibc 2.38, and the source build
takes two hours here); node-llama-cpp ships a prebuilt llama.cpp CPU binary in the npm registry.
`scripts/install_llama_engine.sh` installs it in a tool folder (`engine_dir()`), and `scripts/llama_cpp_check.mjs`
evaluates token windows with it and writes llama.cpp's next-token probabilities of the whole vocabulary.

`engine_distributions` runs it; `agreement` compares those distributions with quantdiff's own logits on the same
windows, with quantdiff.damage's measures (llama.cpp's own `perplexity --kl-divergence` statistics,
quantdiff/eval/damage.py): quantdiff's forward is the reference p, llama.cpp's the compared q.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

ENGINE_ENV = "QUANTDIFF_LLAMA_NODE"  # the folder scripts/install_llama_engine.sh installed node-llama-cpp in
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llama_cpp_check.mjs"
INSTALL = "bash scripts/install_llama_engine.sh"
# ggml's float32 softmax underflows to 0 beyond about 103 nats below the top logit; such an entry is read as the
# smallest float32, so ln q stays finite. It carries p < e^-100 of quantdiff's mass unless the two engines
# disagree by ~100 nats there, which the divergence then shows anyway.
SMALLEST_FLOAT32 = float(np.finfo(np.float32).smallest_subnormal)


def engine_dir() -> Path:
    """$QUANTDIFF_LLAMA_NODE, else quantdiff's cache's engines/node-llama-cpp (where the install script puts it)."""
    from quantdiff.core.cache import cache_dir

    return Path(os.environ.get(ENGINE_ENV) or cache_dir() / "engines" / "node-llama-cpp")


def missing(engine: Path) -> str | None:
    """Why llama.cpp cannot run from `engine`, or None when node and the installed package are there."""
    if shutil.which("node") is None:
        return f"node is not on PATH (Node.js 20 or newer, then `{INSTALL}`)"
    if not (engine / "node_modules" / "node-llama-cpp" / "package.json").is_file():
        return f"node-llama-cpp is not installed in {engine}: run `{INSTALL}` (or set {ENGINE_ENV} to its folder)"
    return None


def engine_distributions(file: Path, windows: list[list[int]], engine: Path) -> tuple[list[np.ndarray], str]:
    """llama.cpp's next-token log-probabilities on each window: (len(window) − 1, vocab) float64 per window, and
    the engine's version. RuntimeError (its one line) when the run fails."""
    reason = missing(engine)
    if reason is not None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory() as tmp:
        windows_file, out = Path(tmp) / "windows.json", Path(tmp) / "probabilities.f32"
        windows_file.write_text(json.dumps(windows))
        done = subprocess.run(["node", str(SCRIPT), str(engine), str(file), str(windows_file), str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            raise RuntimeError(f"llama.cpp (node-llama-cpp) failed on {file}: {lines[-1] if lines else f'exit {done.returncode}'}")
        meta = json.loads(done.stdout.strip().splitlines()[-1])
        probabilities = np.fromfile(out, dtype=np.float32).astype(np.float64)
    sizes = [n * meta["vocab"] for n in meta["positions"]]
    if probabilities.size != sum(sizes):
        raise RuntimeError(f"llama.cpp wrote {probabilities.size} probabilities, expected {sum(sizes)}")
    rows = np.split(probabilities, np.cumsum(sizes)[:-1])
    logprobs = [np.log(np.maximum(row, SMALLEST_FLOAT32)).reshape(n, meta["vocab"]) for row, n in zip(rows, meta["positions"])]
    return logprobs, meta["engine"]


def quantdiff_logits(file: Path, windows: list[list[int]]) -> list[torch.Tensor]:
    """quantdiff's reload of `file` (its dequantized weights, float32), one (len(window), vocab) logits per window."""
    from quantdiff.api import load

    model = load(file, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([window])).logits[0].float() for window in windows]


def agreement(reference: list[torch.Tensor], engine: list[np.ndarray], windows: list[list[int]]) -> dict:
    """quantdiff.damage's fields (KL(p_quantdiff ‖ p_llama.cpp) mean/median/p99/max, Δp, same top-1, Δ loss)
    with quantdiff's logits `reference` as p and llama.cpp's log-probabilities `engine` as q, over every scored
    position of `windows`; plus the largest |Δ log-probability| of the actual next token."""
    from quantdiff.data.sources import Batch
    from quantdiff.eval.damage import PER_TOKEN, per_token, summarize

    if [len(e) for e in engine] != [len(w) - 1 for w in windows] or len(reference) != len(windows):
        raise ValueError(f"llama.cpp scored {[len(e) for e in engine]} positions per window, the windows have {[len(w) - 1 for w in windows]}")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in PER_TOKEN}
    for logits, theirs, window in zip(reference, engine, windows):
        # per_token scores positions 0 … T−2; llama.cpp's rows are those positions, padded with one unscored row
        quant = torch.cat([torch.from_numpy(theirs), torch.zeros(1, theirs.shape[1], dtype=torch.float64)])
        values = per_token(logits[None], quant[None], Batch(torch.tensor([window]), None, 0))
        for name, value in values.items():
            parts[name].append(value)
    result = summarize({name: torch.cat(value) for name, value in parts.items()})
    result["max_logprob_gap"] = float((torch.cat(parts["nll_full"]) - torch.cat(parts["nll_quant"])).abs().max())
    return result


def main() -> None:
    """One GGUF file in llama.cpp beside quantdiff's forward of it: `python benchmarks/llama_node.py FILE.gguf
    --tokens-of smollm2` (e.g. a `quantize --plan` export), on the `lm` task's first held-out windows."""
    import argparse
    import sys

    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # run as a script: `benchmarks.` resolves from the repo root
    from benchmarks.engine_check import held_out_windows

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("file", type=Path)
    parser.add_argument("--tokens-of", required=True, help="the model whose tokenizer and BOS make the windows (the file's source)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    engine = engine_dir()
    if missing(engine) is not None:
        raise SystemExit(f"error: {missing(engine)}")
    windows = held_out_windows(args.tokens_of, args.windows, args.context)
    theirs, version = engine_distributions(args.file, windows, engine)
    result = agreement(quantdiff_logits(args.file, windows), theirs, windows)
    print(json.dumps({"file": str(args.file), "engine": version, **result}, indent=1))


if __name__ == "__main__":
    main()
