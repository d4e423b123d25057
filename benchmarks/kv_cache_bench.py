"""The quantized KV cache (`quantdiff.kv_cache`) against transformers' DynamicCache and its QuantizedCache (quanto,
HQQ, fp8), side by side in one process, on a real model:

- damage: a real text's prompt prefilled through each cache, then teacher-forced decode steps, one token a step;
  mean KL(unquantized ‖ cache) of the next-token distributions and top-1 agreement with the unquantized run
  (DynamicCache), at 8, 4 and 2 bits (a backend's refused width is listed as refused); with `--policies`, also the
  kv-plan policies `massive` and `heads` as `quantdiff kv-plan` derives them (its default calibration) at each
  budget, beside `plan first`, and the engines' exact modes (vLLM's int8 / int4 / fp8 per token-head, fp8 per tensor);
  `--only TEXT …` keeps the contenders whose name holds one of the TEXTs (the reference always runs);
- speed and bytes: ms per decode step at a context of 256, 1024, 2048 tokens (every contender given the same
  prompt keys and values, then decode steps alternated between contenders over rounds; medians), and bytes held.
- `--window`: Gemma 3's sliding-window layers: bytes after a long prompt against DynamicCache, and greedy tokens
  against the unquantized run.

transformers' QuantizedCache backends are installed for the benchmark only (never runtime dependencies):

    pip install 'quantdiff[bench]'   # optimum-quanto 0.2.7, hqq 0.2.8.post1
    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_cache_bench.py --damage --speed        # SmolLM2, CPU, 1 thread
    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_cache_bench.py --damage --policies
    OMP_WAIT_POLICY=PASSIVE python benchmarks/kv_cache_bench.py --model gemma3 --window 6144
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]


def makers(model, bits: int) -> dict:
    """name -> a function making a fresh cache at `bits` (None: the width is refused by that backend)."""
    from transformers import DynamicCache, QuantizedCache

    import quantdiff
    from quantdiff.quant.kv_plan import KVPlan, LayerPlan, model_shape

    shape = model_shape(model.config)
    first = KVPlan("first", bits, shape, tuple(LayerPlan((bits,) * kv, (0,)) for kv in shape["kv_heads"]))
    out = {
        "DynamicCache (unquantized)": lambda: DynamicCache(config=model.config),
        "kv_cache kivi (default)": lambda: quantdiff.kv_cache(model, bits=bits),
        "kv_cache kivi, plan first (position 0 kept)": lambda: quantdiff.kv_cache(model, first),
        "kv_cache token (former default)": lambda: quantdiff.kv_cache(model, bits=bits, layout="token"),
        "kv_cache llama.cpp q8_0 / q4_0": (lambda: quantdiff.kv_cache(model, bits=bits, layout={8: "q8_0", 4: "q4_0"}[bits])) if bits in (8, 4) else None,
    }
    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
        out["QuantizedCache quanto"] = (lambda: QuantizedCache("quanto", model.config, nbits=bits)) if bits in (2, 4) else None
    if importlib.util.find_spec("hqq") is not None:
        out["QuantizedCache hqq"] = (lambda: QuantizedCache("hqq", model.config, nbits=bits)) if bits in (2, 4, 8) else None
    out["QuantizedCache fp8"] = (lambda: QuantizedCache("fp8", model.config)) if bits == 8 else None
    return out


POLICIES = ("massive", "heads")  # beside makers()' `plan first`, which is what kv-plan's `first` derives (position 0 kept)


def damage_makers(model, bits: int, plans: dict) -> dict:
    """The damage table's own contenders: the kv-plan policies at a budget of `bits` (`plans`: (policy, bits) -> a
    plan, or the reason it cannot be met) and the engines' exact modes. None: refused at that width."""
    import quantdiff

    out = {}
    for policy in POLICIES:
        plan = plans[policy, bits]
        if isinstance(plan, str):
            out[f"kv_cache kivi, kv-plan {policy} ({plan})"] = None
            continue
        widths = sorted({b for layer in plan.layers for b in layer.kv_bits})
        name = f"kv_cache kivi, kv-plan {policy} (kept {list(plan.layers[0].keep_positions)}, head widths {widths})"
        out[name] = lambda plan=plan: quantdiff.kv_cache(model, plan)
    out["kv_cache vLLM int8 / int4 per token-head"] = (lambda: quantdiff.kv_cache(model, bits=bits, layout={8: "vllm-int8-head", 4: "vllm-int4-head"}[bits])) if bits in (8, 4) else None
    out["kv_cache vLLM fp8 per token-head"] = (lambda: quantdiff.kv_cache(model, bits=bits, layout="vllm-fp8-head")) if bits == 8 else None
    out["kv_cache vLLM fp8 per tensor, calculated scales"] = (lambda: quantdiff.kv_cache(model, bits=bits, layout="vllm-fp8-tensor")) if bits == 8 else None
    return out


def derive_plans(model, tokenizer, path, bits_list: list[int]) -> dict:
    """(policy, bits) -> the plan `quantdiff kv-plan` writes with its defaults (calibration builtin:corpus-train,
    8,192 tokens in sequences of 256, the model's BOS choice), or the reason it cannot be met."""
    from quantdiff.core.errors import ConfigError
    from quantdiff.models.bos import decide_bos
    from quantdiff.quant.kv_plan import calibrate_kv, derive_plan
    from quantdiff.quant.smoothing import Calibration

    calibrated = calibrate_kv(model, tokenizer, Calibration("builtin:corpus-train", 8192), decide_bos(path, tokenizer, "auto").token_id)
    plans = {}
    for policy in POLICIES:
        for bits in bits_list:
            try:
                plans[policy, bits] = derive_plan(calibrated, policy, bits)
            except ConfigError as exc:
                plans[policy, bits] = str(exc)
    return plans


def cache_bytes(cache) -> int:
    """What a cache holds: our own count for kv_cache; else every tensor its layers hold (codes, scales, residual)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            for t in _tensors(value):
                total += t.numel() * t.element_size()
    return total


def _tensors(value) -> list[torch.Tensor]:
    """The plain tensors inside a layer attribute; a tensor subclass (quanto's QTensor, its PackedTensor) by the
    tensors it wraps, not by the float size it poses as."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "__tensor_flatten__"):
            return [t for name in value.__tensor_flatten__()[0] for t in _tensors(getattr(value, name))]
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def text_ids(tokenizer, count: int) -> torch.Tensor:
    from quantdiff.data.bigram_backcopy import corpus_text

    ids = tokenizer(corpus_text()[:200_000], add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[10_000 : 10_000 + count]).unsqueeze(0)  # past the front matter


def damage(model, ids: torch.Tensor, prompt: int, bits_list: list[int], plans: dict | None = None, only: list[str] | None = None) -> None:
    """Mean KL and top-1 agreement of teacher-forced decode steps against DynamicCache's; `plans` (`derive_plans`):
    the kv-plan policies and engine modes too; `only`: the contenders whose name holds one of these texts."""
    def run(make) -> torch.Tensor:
        cache = make()
        out = model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(prompt, ids.shape[1] - 1):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        return torch.cat(logits).float().log_softmax(-1)

    steps = ids.shape[1] - prompt
    print(f"\n### Damage: {prompt}-token prompt, {steps} teacher-forced steps, against the unquantized forward (DynamicCache)\n")
    print("| cache | bits | mean KL | top-1 agreement |\n|---|---|---|---|")
    reference = None
    for bits in bits_list:
        contenders = {**makers(model, bits), **({} if plans is None else damage_makers(model, bits, plans))}
        for name, make in contenders.items():
            if name.startswith("DynamicCache"):
                if reference is None:
                    reference = run(make)
                continue
            if only is not None and not any(text in name for text in only):
                continue
            if make is None:
                print(f"| {name} | {bits} | refused by the backend | |")
                continue
            got = run(make)
            kl = (reference.exp() * (reference - got)).sum(-1).mean()
            agree = (reference.argmax(-1) == got.argmax(-1)).float().mean()
            print(f"| {name} | {bits} | {float(kl):.4f} | {float(agree):.3f} |", flush=True)


def speed(model, ids: torch.Tensor, contexts: list[int], bits_list: list[int], steps: int, rounds: int) -> None:
    """ms per decode step and bytes at each context, every contender given the same prompt keys and values."""
    from transformers import DynamicCache

    print(f"\n### Decode speed and bytes ({steps} steps a round, {rounds} rounds alternated, medians; 1 thread)\n")
    print("| context | cache | bits | bytes | ÷ DynamicCache | ms / step | ÷ DynamicCache, paired [95% CI] |\n|---|---|---|---|---|---|---|")
    for context in contexts:
        prefilled = DynamicCache(config=model.config)
        model(ids[:, :context], past_key_values=prefilled, use_cache=True)
        caches = {}
        for bits in bits_list:
            for name, make in makers(model, bits).items():
                if make is None or (name.startswith("DynamicCache") and name in caches):
                    continue
                cache = make()
                for index, layer in enumerate(prefilled.layers):
                    cache.update(layer.keys, layer.values, index)
                caches[name if name.startswith("DynamicCache") else (name, bits)] = cache
        samples = {key: [] for key in caches}
        token = ids[:, context : context + 1]
        for _ in range(rounds):
            for key, cache in caches.items():
                start = time.perf_counter()
                for _ in range(steps):
                    model(token, past_key_values=cache, use_cache=True)
                samples[key].append((time.perf_counter() - start) / steps)
        base = samples["DynamicCache (unquantized)"]
        base_bytes = cache_bytes(caches["DynamicCache (unquantized)"])
        for key, cache in caches.items():
            name, bits = (key, 32) if isinstance(key, str) else key
            ratio, low, high = median_interval([t / b for t, b in zip(samples[key], base)])
            size = cache_bytes(cache)
            print(f"| {context} | {name} | {bits} | {size / 2**20:.2f} MiB | {size / base_bytes:.3f}× | {statistics.median(samples[key]) * 1e3:.1f} "
                  f"| {ratio:.2f}× [{low:.2f}, {high:.2f}] |", flush=True)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and its distribution-free confidence interval: the order statistics k and n − k + 1,
    k the largest with P(Binomial(n, ½) < k) ≤ (1 − level) / 2 (Conover, Practical Nonparametric Statistics, §3.2).
    Here the values are each round's step time over DynamicCache's in the same round (paired: a load change between
    rounds moves both)."""
    from quantdiff.across_seeds.significance import binomial_cdf

    ordered, n = sorted(values), len(values)
    k = max([j for j in range(1, n // 2 + 1) if binomial_cdf(j - 1, n) <= (1 - level) / 2], default=1)
    return statistics.median(ordered), ordered[k - 1], ordered[n - k]


def window(model, tokenizer, length: int, new: int) -> None:
    """Sliding-window layers keep their window: bytes after `length` tokens, and greedy tokens, against DynamicCache."""
    import quantdiff
    from transformers import DynamicCache

    ids = text_ids(tokenizer, length - new + 1)
    results = {}
    for name, make in {"DynamicCache (unquantized)": lambda: DynamicCache(config=model.config),
                       "kv_cache kivi 8 bits": lambda: quantdiff.kv_cache(model, bits=8)}.items():
        cache = make()
        sequence = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  past_key_values=cache)
        results[name] = (sequence[0, ids.shape[1] :].tolist(), cache_bytes(cache), cache.get_seq_length())
    base = results["DynamicCache (unquantized)"]
    print(f"\n### Sliding windows: {length} tokens ({new} generated greedily)\n")
    print("| cache | tokens seen | bytes | ÷ DynamicCache | generated tokens equal |\n|---|---|---|---|---|")
    for name, (tokens, size, seen) in results.items():
        print(f"| {name} | {seen} | {size / 2**20:.2f} MiB | {size / base[1]:.3f}× | {tokens == base[0]} |")


def gap(model, ids: torch.Tensor, prompt: int, new: int) -> None:
    """What "causal" buys on a real model: greedy decoding through the `token`-layout cache against a full forward
    under the `kv` site (same codes, other matmul shapes), and the site's own forwards at two lengths."""
    import quantdiff
    from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, quantized
    from quantdiff.quant.kv_layout import TOKEN

    print(f"\n### Causal is exact at equal shapes only: {prompt}-token prompt, {new} greedy steps\n")
    print("| bits | max abs Δ logit, cache vs kv-site forward | argmax differs | kv site: max abs Δ logit, {0} vs {1} tokens, shared positions |".format(prompt, prompt + new)
          + "\n|---|---|---|---|")
    head = ids[:, :prompt]
    for bits in (8, 4):
        cache = quantdiff.kv_cache(model, bits=bits, layout="token")
        out = model.generate(head, attention_mask=torch.ones_like(head), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, past_key_values=cache)
        steps = torch.stack(out.logits, dim=1)
        with quantized(model, QuantConfig(AbsmaxMethod(bits), KVSite(layout=TOKEN))):
            full = model(out.sequences).logits
            short = model(out.sequences[:, : prompt]).logits
        at_steps = full[:, prompt - 1 : -1]
        print(f"| {bits} | {float((steps - at_steps).abs().max()):.3f} | {int((steps.argmax(-1) != at_steps.argmax(-1)).sum())} of {new} "
              f"| {float((short - full[:, :prompt]).abs().max()):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--damage", action="store_true")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--policies", action="store_true", help="damage: also the kv-plan policies massive and heads and the vLLM modes")
    parser.add_argument("--only", nargs="+", default=None, help="damage: only the contenders whose name holds one of these texts")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--speed-bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=None, help="tokens for the sliding-window check (Gemma 3)")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--gap", action="store_true", help="the cache against a full forward under the kv site (token layout)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    import transformers

    import quantdiff.quant.kv_cache  # noqa: F401  (every module this run measures, loaded now, not midway)
    from quantdiff.models.names import resolve_models
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.quant.checkpoint import load

    [(name, path)] = resolve_models([args.model])
    model = load(path, device="cpu").eval()
    tokenizer = load_tokenizer(path)
    versions = {p: getattr(importlib.import_module(m), "__version__", "?") for p, m in (("optimum-quanto", "optimum.quanto"), ("hqq", "hqq"))
                if importlib.util.find_spec(m.split(".")[0]) is not None and importlib.util.find_spec(m) is not None}
    print(f"model {name}, {model.config.torch_dtype or model.dtype}, CPU {torch.get_num_threads()} thread; transformers {transformers.__version__}; "
          + ", ".join(f"{p} {v}" for p, v in versions.items()))
    if args.damage:
        plans = derive_plans(model, tokenizer, path, args.bits) if args.policies else None
        damage(model, text_ids(tokenizer, args.prompt + args.steps), args.prompt, args.bits, plans, args.only)
    if args.speed:
        speed(model, text_ids(tokenizer, max(args.contexts) + 1), args.contexts, args.speed_bits, args.decode_steps, args.rounds)
    if args.gap:
        gap(model, text_ids(tokenizer, 200), 200, args.new)
    if args.window:
        window(model, tokenizer, args.window, args.new)


if __name__ == "__main__":
    main()
