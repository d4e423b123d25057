"""The quantized KV cache (`quantdiff.kv_cache`) against transformers' unquantized DynamicCache, side by side in one
run: bytes per cached token (codes, scales and full-precision rows, every layer, keys and values) and greedy
decode speed (ms per generated token, contenders alternated over rounds, medians of medians) as ratios to the
DynamicCache. transformers' own QuantizedCache is measured too when its backend (optimum-quanto or HQQ) imports.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_cache_bench.py --prompt 128 --new 32
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def contenders(model) -> dict:
    """name -> a function making a fresh cache (None: generate's own DynamicCache)."""
    import quantdiff
    from quantdiff.quant.kv_plan import KVPlan, LayerPlan, model_shape

    shape = model_shape(model.config)
    first = KVPlan("first", 4, shape, tuple(LayerPlan((4,) * kv, (0,)) for kv in shape["kv_heads"]))
    return {
        "DynamicCache (unquantized)": lambda: None,
        "kv_cache 8 bits": lambda: quantdiff.kv_cache(model, bits=8),
        "kv_cache 4 bits": lambda: quantdiff.kv_cache(model, bits=4),
        "kv_cache 4 bits, groups of 16 channels": lambda: quantdiff.kv_cache(model, bits=4, group_size=16),
        "kv_cache plan first (4 bits, position 0 kept)": lambda: quantdiff.kv_cache(model, first),
    }


def cache_bytes(cache) -> int:
    """What a cache holds: our own count for kv_cache, the key and value tensors for a DynamicCache."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    from transformers import DynamicCache

    from quantdiff.models.loading import prepare
    from quantdiff.models.pairs import SizePreset, build_pair

    preset = SizePreset(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                        vocab_size=4096, max_position_embeddings=args.prompt + args.new)
    model = prepare(build_pair(preset, seed=0, kinds=("standard",))["standard"].eval(), tile_size=None)
    ids = torch.randint(1, preset.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"model: standard d{args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} KV heads, head width "
          f"{args.hidden // args.heads}), float32, CPU {torch.get_num_threads()} thread(s); batch {args.batch}, prompt {args.prompt}, {args.new} new tokens")
    makers = contenders(model)

    def generate(make):
        cache = make() or DynamicCache()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                       pad_token_id=0, cache=cache)
        return cache

    sizes = {name: cache_bytes(generate(make)) for name, make in makers.items()}  # also the warm-up
    samples: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            start = time.perf_counter()
            generate(make)
            samples[name].append((time.perf_counter() - start) / args.new)
    tokens = args.batch * (args.prompt + args.new - 1)  # the last token generated is never written
    base_bytes = sizes["DynamicCache (unquantized)"]
    base_time = sorted(samples["DynamicCache (unquantized)"])[args.rounds // 2]
    print(f"\n| cache | bytes / cached token | ÷ DynamicCache | ms / generated token | ÷ DynamicCache |\n|---|---|---|---|---|")
    for name in makers:
        median = sorted(samples[name])[args.rounds // 2]
        print(f"| {name} | {sizes[name] / tokens:.0f} | {sizes[name] / base_bytes:.3f}× | {median * 1e3:.2f} | {median / base_time:.2f}× |")
    backends = [b for b in ("optimum.quanto", "hqq") if importlib.util.find_spec(b.split(".")[0]) is not None]
    print(f"\ntransformers' QuantizedCache: {'backends ' + ', '.join(backends) if backends else 'not measured: neither optimum-quanto nor hqq is installed'}")


if __name__ == "__main__":
    main()
