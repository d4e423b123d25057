"""Benchmark of `quantdiff stats`; every ratio is measured side by side in one run.

1. Stats pass (quantdiff backend, hooks, all statistics) vs a plain forward of the same model with eager
   and with sdpa attention (base model, no LM head, inference mode).
2. Median accuracy: histogram median vs the exact median (torch.kthvalue) of the same logits.
3. Peak memory of the stats pass at 2K/8K/32K context, tiled vs one tile (each case in a fresh process:
   peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA). A case whose untiled T×T logits alone would
   exceed half the memory is skipped and reported as such.
4. Statistic update throughput vs torch.ao.quantization.HistogramObserver on the same tensors.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/stats_bench.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from quantdiff.data.sources import Batch
from quantdiff.models.loading import prepare
from quantdiff.models.pairs import SizePreset, build_model, pair_configs
from quantdiff.stats.absstats import AbsStats
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR
from quantdiff.attention.observe import observe
from quantdiff.stats.collect import StatsCollector, collect_stats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, called round-robin (after one warm-up each) so that
    background load on a shared machine hits them all alike."""
    for fn in fns.values():
        fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def model_for(kind: str, preset: SizePreset, attn: str, device: torch.device):
    return build_model(pair_configs(preset)[kind], seed=0, attn_implementation=attn).to(device).eval()


def throughput(args, device: torch.device) -> None:
    """Per-batch time of a long stats run (statistics already filled by earlier batches) vs plain forwards."""
    preset = SizePreset(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, vocab_size=4096,
                        max_position_embeddings=args.seq_len)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 4096, (args.batch, args.seq_len), generator=g).to(device) for _ in range(args.repeats + 2)]
    tokens = batches[0].numel()
    print(f"## 1. stats pass vs plain forward (d={args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"batch {args.batch} × {args.seq_len} tokens, tile {args.tile}, {device}; per batch, a new batch each call)")
    for kind in ("standard", "diff"):
        eager, sdpa = model_for(kind, preset, "eager", device), model_for(kind, preset, "sdpa", device)
        observed = prepare(model_for(kind, preset, "eager", device), args.tile)
        collector = StatsCollector(observed, compile=args.compile)
        feed = iter(batches)

        def forward(model):
            with torch.inference_mode():
                model.base_model(input_ids=batches[0], use_cache=False)

        def stats_batch():
            collector.run(observed, Batch(next(feed), None, 0))

        with observe(observed, collector.on_logits, collector.on_hidden), torch.inference_mode():
            times = timed({"eager": lambda: forward(eager), "sdpa": lambda: forward(sdpa), "stats": stats_batch}, device, args.repeats)
        print(f"{kind:8s} eager {times['eager'] * 1e3:8.1f} ms  sdpa {times['sdpa'] * 1e3:8.1f} ms  "
              f"stats {times['stats'] * 1e3:8.1f} ms ({tokens / times['stats']:,.0f} tok/s)  "
              f"stats/eager {times['stats'] / times['eager']:.2f}×  stats/sdpa {times['stats'] / times['sdpa']:.2f}×")


def median_accuracy(args, device: torch.device) -> None:
    """Logits of one layer materialised (T×T), their exact median vs the statistics' median."""
    t = min(args.seq_len, 1024)
    preset = SizePreset(hidden_size=args.hidden, num_layers=1, num_heads=args.heads, vocab_size=4096, max_position_embeddings=t)
    model = prepare(model_for("standard", preset, "eager", device), None)
    ids = torch.randint(0, 4096, (1, t), generator=torch.Generator().manual_seed(1)).to(device)
    captured = []
    with observe(model, lambda logits, ctx: captured.append(logits[ctx.valid.expand_as(logits)].abs().double())):
        stats = collect_stats(model, [Batch(ids, None, 0)])
    values = torch.cat(captured)
    exact = values.kthvalue(int(0.5 * (values.numel() - 1)) + 1).values.item()
    got = stats.logits.pooled().summary()["median"]
    print(f"## 2. median accuracy: {values.numel():,} causal logits, exact {exact:.6g}, histogram {got:.6g}, "
          f"relative error {abs(got - exact) / exact:.2e} (stated bound {QUANTILE_RELATIVE_ERROR:.2e})")


def memory_case(t: int, tile: int | None, device: torch.device) -> dict:
    """Run in a fresh process: peak memory of one stats pass at context t."""
    preset = SizePreset(hidden_size=128, num_layers=2, num_heads=4, vocab_size=4096, max_position_embeddings=t)
    model = prepare(model_for("diff", preset, "eager", device), tile)
    ids = torch.randint(0, 4096, (1, t), generator=torch.Generator().manual_seed(2)).to(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    collect_stats(model, [Batch(ids, None, 0)])
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak, "base_bytes": base, "seconds": seconds}


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory(args, device: torch.device) -> None:
    print(f"## 3. peak memory of the stats pass (d=128, 2 layers, 4 heads, batch 1, {device}; "
          f"{'max_memory_allocated' if device.type == 'cuda' else 'peak RSS'} minus the loaded model)")
    heads = 4
    for t in args.contexts:
        row = []
        for tile in (args.tile, None):
            untiled_logits = heads * t * t * 4
            if tile is None and 4 * untiled_logits > available_bytes(device) // 2:  # logits + abs/mask/where temporaries
                row.append(f"one tile: skipped (T×T logits need ≥ {4 * untiled_logits / 2**30:.0f} GiB with temporaries)")
                continue
            cmd = [sys.executable, __file__, "--memory-case", str(t), str(tile or 0), "--device", str(device)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                row.append(f"{'tile ' + str(tile) if tile else 'one tile'}: failed ({result.stderr.strip().splitlines()[-1]})")
                continue
            case = json.loads(result.stdout.strip().splitlines()[-1])
            used = (case["peak_bytes"] - case["base_bytes"]) / 2**20
            row.append(f"{'tile ' + str(tile) if tile else 'one tile'}: {used:,.0f} MiB in {case['seconds']:.1f} s")
        print(f"T={t:>6}: " + "; ".join(row))


def observer_throughput(args, device: torch.device) -> None:
    from torch.ao.quantization import HistogramObserver

    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(1, 1, 1 << 20, generator=g) * 3).to(device) for _ in range(args.observer_tensors)]
    stats = AbsStats.empty(1, 100, ("row", "group", "flat"), device)
    observer = HistogramObserver().to(device)
    times = timed({"ours": lambda: [stats.update(x) for x in tensors], "theirs": lambda: [observer(x) for x in tensors]}, device, 3)
    ours, theirs = times["ours"], times["theirs"]
    n = sum(x.numel() for x in tensors)
    print(f"## 4. update throughput on {len(tensors)} tensors of 1M elements: AbsStats {n / ours / 1e6:,.1f} M/s, "
          f"HistogramObserver {n / theirs / 1e6:,.1f} M/s, ratio {theirs / ours:.2f}× "
          "(AbsStats also keeps top-100 with locations, moments and non-finite counts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--observer-tensors", type=int, default=16)
    parser.add_argument("--sections", default="1234", help="which sections to run, e.g. 13")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fused per-element statistics via torch.compile (default: on CUDA only)")
    parser.add_argument("--memory-case", type=int, nargs=2, metavar=("T", "TILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.memory_case:
        t, tile = args.memory_case
        print(json.dumps(memory_case(t, tile or None, device)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    sections = {"1": throughput, "2": median_accuracy, "3": memory, "4": observer_throughput}
    for key in args.sections:
        sections[key](args, device)


if __name__ == "__main__":
    main()
