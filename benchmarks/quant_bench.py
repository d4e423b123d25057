"""Fake-quantization overhead, measured side by side in one run.

1. A whole model forward with attention logits fake-quantized (absmax 8-bit per tensor, through the quantdiff
   backend: absmax pre-pass + tiled online softmax) vs the same model on transformers' unquantized "eager"
   attention. Target: ≤ 1.5×.
2. Our 8-bit LLM.int8 linear (the `linear` site: fake-quantized float matmul) vs bitsandbytes' Linear8bitLt
   in eval mode.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/quant_bench.py [--device cuda]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Callable

import torch
from torch import nn


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, rounds: int = 3) -> dict[str, float]:
    """Median over rounds of each function's median, alternating so that machine noise hits both alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_seconds(fn, device, repeats))
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_attention(args: argparse.Namespace, device: torch.device) -> None:
    from quantdiff.models.loading import prepare
    from quantdiff.models.pairs import SizePreset, build_pair
    from quantdiff.quant.sites import AbsmaxMethod, LogitsSite, QuantConfig, quantized

    preset = SizePreset(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, vocab_size=4096,
                        max_position_embeddings=args.seq)
    ids = torch.randint(0, preset.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    config = QuantConfig(AbsmaxMethod(8), LogitsSite())
    print(f"attention: d{args.hidden}, {args.layers} layers, {args.heads} heads, batch {args.batch} × seq {args.seq}, {device}")
    for kind, model in build_pair(preset, seed=0, attn_implementation="eager").items():
        model.to(device).eval()
        forward = torch.no_grad()(lambda model=model: model(ids).logits)
        prepare(model, tile_size=args.tile)  # same weights, now on the quantdiff backend

        def fake_quant(model=model, forward=forward):
            with quantized(model, config):
                return forward()

        def run_eager(model=model, forward=forward):
            model.set_attn_implementation("eager")
            try:
                return forward()
            finally:
                model.set_attn_implementation("quantdiff")

        times = interleaved({"eager": run_eager, "fake-quant": fake_quant}, device, args.repeats)
        ratio = times["fake-quant"] / times["eager"]
        print(f"  {kind:8s}  eager {times['eager'] * 1e3:8.1f} ms   fake-quant logits int8 {times['fake-quant'] * 1e3:8.1f} ms"
              f"   ratio {ratio:.2f}×  (target ≤ 1.5×)")


def bench_linear(args: argparse.Namespace, device: torch.device) -> None:
    import bitsandbytes as bnb

    from quantdiff.quant.sites import LinearSite, LLMInt8Method, QuantConfig, apply_quantization

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    torch.manual_seed(0)
    layer = nn.Linear(args.features, args.features).to(device)
    x = (torch.randn(1, args.seq, args.features, device=device) * 2).half().float()  # ~1% of entries ≥ 6: outliers
    if device.type == "cuda":
        x = x.half()
        layer.half()
    int8 = bnb.nn.Linear8bitLt(args.features, args.features, has_fp16_weights=False, threshold=6.0)
    int8.load_state_dict(layer.state_dict())
    int8 = int8.to(device).eval()
    wrapper = nn.Sequential(layer)
    config = QuantConfig(LLMInt8Method(8), LinearSite(filter=lambda m, fqn: True))

    def ours():
        with torch.no_grad():
            return wrapper(x)

    def theirs():
        with torch.no_grad():
            return int8(x)

    handle = apply_quantization(wrapper, config)  # the weight is quantized once, as bnb's is
    try:
        times = interleaved({"quantdiff": ours, "bitsandbytes": theirs}, device, args.repeats)
    finally:
        handle.remove()
    print(f"linear: {args.features}×{args.features}, input 1 × {args.seq}, threshold 6.0, {device}")
    print(f"  quantdiff LLM.int8 (fake-quant) {times['quantdiff'] * 1e3:8.2f} ms   bnb Linear8bitLt {times['bitsandbytes'] * 1e3:8.2f} ms"
          f"   ratio {times['quantdiff'] / times['bitsandbytes']:.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--tile", type=int, default=512, help="quantdiff key tile size")
    parser.add_argument("--features", type=int, default=1024, help="linear benchmark width")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    bench_attention(args, device)
    bench_linear(args, device)


if __name__ == "__main__":
    main()
