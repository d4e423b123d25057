"""One model, its decoder-layer weights in every export format side by side: task figures, weight error and bytes
per weight (a quality comparison, not a timing one).

Each row decodes the weights exactly as its export stores them (`stored_weights`; tests/test_export_formats.py
checks that the written files decode to these same weights, through compressed-tensors, gguf and transformers).
`--transformers` also writes the compressed-tensors W4A16 export and evaluates it as transformers loads it with
the compressed-tensors package (its own attention, not quantdiff's backend).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/export_formats.py [--model smollm2] [--limit 8] [--transformers]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

from quantdiff.eval.tasks.lm import LMTask
from quantdiff.models import loading
from quantdiff.models.names import resolve
from quantdiff.quant.compressed_tensors import CompressedTensorsExport
from quantdiff.quant.export import export_quantized, stored_weights
from quantdiff.quant.formats import AbsmaxExport, ExportFormat
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.checkpoint import compressed_tensors_inputs
from quantdiff.quant.sites import LinearSite, linear_targets

ROWS: list[tuple[str, ExportFormat | None]] = [
    ("unquantized", None),
    ("absmax 4-bit G128 (quantdiff)", AbsmaxExport(4, 128)),
    ("compressed-tensors W4A16 G128", CompressedTensorsExport(4, 128)),
    ("absmax 4-bit G32 (quantdiff)", AbsmaxExport(4, 32)),
    ("GGUF Q4_0 (blocks of 32)", GGUFExport(4)),
    ("absmax 8-bit G32 (quantdiff)", AbsmaxExport(8, 32)),
    ("GGUF Q8_0 (blocks of 32)", GGUFExport(8)),
    ("compressed-tensors W8A8 (int8 inputs per token, the package's rule)", CompressedTensorsExport(8)),
]


def weight_profile(model: torch.nn.Module, fmt: ExportFormat) -> tuple[float, float]:
    """(relative RMS error of the decoded weights over all quantized linears, stored bits per weight)."""
    err = ref = bits = count = 0.0
    for _, module in linear_targets(model, LinearSite()):
        w = module.weight.detach()
        encoded = fmt.encode(w)
        decoded = fmt.decode(encoded, w.shape, torch.float32)
        err += float((decoded - w.float()).square().sum())
        ref += float(w.float().square().sum())
        bits += 8 * sum(t.numel() * t.element_size() for k, t in encoded.items() if k != "weight_shape")
        count += w.numel()
    return math.sqrt(err / ref), bits / count


def evaluate(model, fmt, task, prepared) -> dict:
    """W8A8 rows quantize the inputs as the export's reload and transformers do (`compressed_tensors_inputs`)."""
    with (stored_weights(model, fmt) if fmt is not None else nullcontext()), torch.no_grad():
        if not (isinstance(fmt, CompressedTensorsExport) and fmt.bits == 8):
            return task.evaluate(model, prepared)
        handle = compressed_tensors_inputs(model, [fqn for fqn, _ in linear_targets(model, LinearSite())])
        try:
            return task.evaluate(model, prepared)
        finally:
            handle.remove()


def line(name: str, metrics: dict, profile: tuple[float, float] | None) -> str:
    acc, n = metrics["accuracy"], metrics["tokens"]
    se = math.sqrt(acc * (1 - acc) / n)
    weights = "— | —" if profile is None else f"{profile[0]:.4f} | {profile[1]:.2f}"
    return f"| {name} | {acc:.3f} ± {se:.3f} | {metrics['perplexity']:.1f} | {weights} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--limit", type=int, default=8, help="lm windows of 256 held-out corpus tokens")
    parser.add_argument("--transformers", action="store_true", help="also evaluate the written W4A16 G128 export in transformers")
    args = parser.parse_args()
    source = resolve(args.model)[0]
    model = loading.load(source, device="cpu")
    tokenizer = loading.load_tokenizer(source)
    task = LMTask()
    prepared = task.prepare(tokenizer, args.limit)
    print(f"{args.model}, task lm, {args.limit} windows of {task.context} tokens")
    print("| weights | next-token accuracy ± SE | perplexity | weight rel. RMS error | stored bits/weight |")
    print("|---|---|---|---|---|")
    for name, fmt in ROWS:
        print(line(name, evaluate(model, fmt, task, prepared), None if fmt is None else weight_profile(model, fmt)), flush=True)
    if args.transformers:
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ct"
            export_quantized(source, out, CompressedTensorsExport(4, 128))
            served = AutoModelForCausalLM.from_pretrained(out).eval()
            with torch.no_grad():
                print(line("compressed-tensors W4A16 G128, loaded by transformers", task.evaluate(served, prepared), None))


if __name__ == "__main__":
    main()
