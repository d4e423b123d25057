"""What a sensitivity pass costs beyond its forwards: `eval.sensitivity.sensitivity_map` (statistics hooks on the
full-precision forward, quantizing and restoring one layer per cell, float64 KL per token) against its floor, one
unquantized forward plus one quantized forward per cell (each (layer, site), and the whole-site check), the
quantization already applied and no hooks; measured in the same process, alternated round by round.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/sensitivity_bench.py --model smollm2 --sites linear --tokens 128 --seq-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sites", default="linear")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    import quantdiff
    from quantdiff.data.sources import make_batches
    from quantdiff.eval.sensitivity import sensitivity_map, site_layers
    from quantdiff.quant import sites

    model = quantdiff.load(args.model, device="cpu")
    generator = torch.Generator().manual_seed(0)
    rows = max(1, args.tokens // args.seq_len)
    ids = torch.randint(0, model.config.vocab_size, (rows, args.seq_len), generator=generator)
    batches = make_batches(ids.tolist(), 4)
    configs = [sites.parse_config("absmax", args.bits, site) for site in args.sites.split(",")]
    cells = [replace(c, layers=(layer,)) for c in configs for layer in site_layers(model, c)]
    cells += [replace(c, layers=tuple(site_layers(model, c))) for c in configs]

    def forward(batch) -> None:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)

    def floor() -> float:
        total = 0.0
        with torch.inference_mode():
            for batch in batches:
                start = time.perf_counter()
                forward(batch)
                total += time.perf_counter() - start
                for cell in cells:
                    with sites.quantized(model, cell):
                        start = time.perf_counter()
                        forward(batch)
                        total += time.perf_counter() - start
        return total

    def full_pass() -> float:
        start = time.perf_counter()
        sensitivity_map(model, batches, configs)
        return time.perf_counter() - start

    full_pass()  # warm-up: first-call allocations and lazy imports
    passes, floors = [], []
    for _ in range(args.rounds):
        floors.append(floor())
        passes.append(full_pass())
    ratio = statistics.median(p / f for p, f in zip(passes, floors))
    print(f"{args.model}, sites {args.sites}, {len(cells)} cells, {rows}×{args.seq_len} tokens, {args.rounds} rounds")
    print(f"pass {statistics.median(passes):.2f} s, floor {statistics.median(floors):.2f} s, ratio {ratio:.2f}× (median of rounds)")


if __name__ == "__main__":
    main()
