"""Per-token cost of the KV-cache policies (`quant.kv_plan`) against the plain `kv` site, side by side in one run.

A whole model forward (SmolLM2 by default, or a small synthetic pair with --synthetic) with its KV cache
fake-quantized: the plain `kv` site (one width, default causal granularity), a uniform plan (the same
quantization through the plan's quantizer), `first` (IntactKV: position 0 kept), `massive` (positions 0 and 1 kept, as a calibrated plan would)
and `heads` (half the KV heads at bits + 1, half at bits − 1), all at 4 bits, plus the unquantized forward. The
contenders alternate over rounds (medians of medians); ms per token and the ratio to the plain `kv` site. Then the
cache quantizers alone (keys and values of every layer, the model's cache shape), where the policies' own cost is
not diluted by the rest of the forward. `--quantizers-only` skips the whole forwards.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_policies_bench.py --batch 1 --seq 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from quant_bench import interleaved  # noqa: E402  (the alternating-medians timer of the other benchmarks)

BITS = 4


def contenders(model) -> dict:
    from quantdiff.quant.kv_plan import KVPlan, LayerPlan, model_shape
    from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, parse_config

    shape = model_shape(model.config)

    def plan(policy: str, bits_of, keep: tuple[int, ...]) -> QuantConfig:
        layers = tuple(LayerPlan(tuple(bits_of(h) for h in range(kv)), keep) for kv in shape["kv_heads"])
        return QuantConfig(AbsmaxMethod(BITS), KVSite(KVPlan(policy, BITS, shape, layers)))

    heads = shape["kv_heads"][0]
    return {
        "unquantized": None,
        "kv site": parse_config("absmax", BITS, "kv"),
        "plan uniform": plan("uniform", lambda h: BITS, ()),
        "plan first (pos 0)": plan("first", lambda h: BITS, (0,)),
        "plan massive (pos 0, 1)": plan("massive", lambda h: BITS, (0, 1)),
        "plan heads (±1 bit)": plan("heads", lambda h: BITS + 1 if h < heads // 2 else BITS - 1 if h >= heads - heads // 2 else BITS, ()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--synthetic", action="store_true", help="a d256, 4-layer, 8-head (4 KV heads) standard model instead")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quantizers-only", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    from quantdiff.quant.sites import quantized

    if args.synthetic:
        from quantdiff.models.loading import prepare
        from quantdiff.models.pairs import SizePreset, build_pair

        preset = SizePreset(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=4096, max_position_embeddings=args.seq)
        model, name = prepare(build_pair(preset, seed=0, kinds=("standard",))["standard"].eval()), "synthetic d256"
    else:
        from quantdiff.models.names import resolve_models
        from quantdiff.quant.checkpoint import load

        [(name, path)] = resolve_models([args.model])
        model = load(path, device="cpu").eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def forward(config):
        def run() -> None:
            with quantized(model, config):
                model(input_ids=ids, use_cache=False)
        return run

    configs = contenders(model)
    tokens = args.batch * args.seq
    print(f"{name}, {args.batch} × {args.seq} tokens, {BITS}-bit KV, {torch.get_num_threads()} threads; medians over {args.rounds} rounds of {args.repeats}")
    if not args.quantizers_only:
        table("whole forward", interleaved({label: forward(config) for label, config in configs.items()}, torch.device("cpu"), args.repeats, args.rounds), tokens)
    table("cache quantizers alone", interleaved(quantizer_runs(model, configs, args.batch, args.seq), torch.device("cpu"), args.repeats * 10, args.rounds), tokens)


def quantizer_runs(model, configs: dict, batch: int, seq: int) -> dict:
    """Per contender with a quantizer: keys then values of every layer through that contender's quantizers, on
    random tensors of the model's cache shape (B, Hkv, S, head width)."""
    from quantdiff.quant.kv_plan import model_shape, plan_quantizers
    from quantdiff.quant.sites import KVQuantizer

    shape = model_shape(model.config)
    g = torch.Generator().manual_seed(0)
    cache = [(torch.randn(batch, kv, seq, shape["head_dim"], generator=g), torch.randn(batch, kv, seq, shape["head_dim"], generator=g)) for kv in shape["kv_heads"]]
    runs = {}
    for label, config in configs.items():
        if config is None:
            continue
        plan = config.site.plan
        quantizers = [KVQuantizer(BITS)] * len(cache) if plan is None else plan_quantizers(model, plan)

        def run(quantizers=quantizers) -> None:
            for quantizer, (key, value) in zip(quantizers, cache):
                quantizer.keys(key, None)
                quantizer.values(value)
        runs[label] = run
    return runs


def table(title: str, times: dict[str, float], tokens: int) -> None:
    base = times["kv site"]
    print(f"\n{title}\n\n| contender | ms | ms / token | ÷ kv site |\n|---|---|---|---|")
    for label, seconds in times.items():
        print(f"| {label} | {seconds * 1e3:.2f} | {seconds * 1e3 / tokens:.4f} | {seconds / base:.2f}× |")


if __name__ == "__main__":
    main()
