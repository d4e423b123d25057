"""Training-step throughput of the matched pair: tokens/s for standard and Diff, measured side by side.

Defaults are the tiny recipe's size.
The paper reports Diff Transformer costing 5–12% throughput (Table 7, with FlashAttention kernels on GPU).
Here both kinds run the same forward + backward + AdamW step on the same random batch, alternating
kind every repeat so machine noise hits both alike; the median step time of each is reported.
On CUDA in bf16 it also reports model FLOPs utilisation (MFU): 6·N·tokens + attention FLOPs, over the GPU's
dense bf16 peak (pass --peak-tflops for a GPU not in the table).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/train_bench.py                  # tiny recipe size, CPU
    python benchmarks/train_bench.py --hidden 768 --layers 12 --heads 12 --seq 1024 --batch 16 --vocab 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantdiff.models.pairs import SizePreset, build_pair, parameter_count
from quantdiff.train.recipe import ArmConfig, TrainConfig
from quantdiff.train.loop import lm_loss, make_optimizer
from quantdiff.train.precision import keep_combine_float32

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def step_flops(params: int, cfg: argparse.Namespace) -> float:
    """Training FLOPs per step: 6·N per token for the matmuls, plus causal attention (QKᵀ and AV, ×3 for backward)."""
    tokens = cfg.batch * cfg.seq
    attention = 3 * 2 * 2 * cfg.layers * cfg.seq * cfg.hidden * tokens / 2  # causal: half the N² entries
    return 6 * params * tokens + attention


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1536)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per kind (after 3 warm-up steps)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast (default: on CUDA)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models first")
    parser.add_argument("--float32-combine", action=argparse.BooleanOptionalAction, default=True,
                        help="Diff's λ, A1 − λ·A2 and head norm in float32 under bf16 (train/precision.py, as training does)")
    parser.add_argument("--fused-adamw", action="store_true", help="AdamW's fused kernel ([train] fused_adamw)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    cfg = parser.parse_args()
    device = torch.device(cfg.device)
    bf16 = device.type == "cuda" if cfg.bf16 is None else cfg.bf16

    preset = SizePreset(cfg.hidden, cfg.layers, cfg.heads, None, None, cfg.vocab, cfg.seq)
    models = {kind: model.to(device).train() for kind, model in build_pair(preset, attn_implementation="sdpa").items()}
    if bf16 and cfg.float32_combine:
        keep_combine_float32(models["diff"])
    optimizers = {kind: make_optimizer(model, TrainConfig(fused_adamw=cfg.fused_adamw), ArmConfig(kind, kind))[0] for kind, model in models.items()}
    runners = {kind: torch.compile(model) if cfg.compile else model for kind, model in models.items()}
    batch = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(kind: str) -> float:
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(runners[kind], batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizers[kind].step()
        optimizers[kind].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    times = {kind: [] for kind in models}
    for repeat in range(3 + cfg.repeats):
        for kind in models if repeat % 2 == 0 else reversed(list(models)):
            elapsed = step(kind)
            if repeat >= 3:
                times[kind].append(elapsed)

    tokens = cfg.batch * cfg.seq
    print(f"device {device}{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}, threads {torch.get_num_threads()}, "
          f"bf16 {bf16} (float32 combine {bf16 and cfg.float32_combine}), compile {cfg.compile}, fused AdamW {cfg.fused_adamw}; d{cfg.hidden} L{cfg.layers} H{cfg.heads} V{cfg.vocab}, batch {cfg.batch} × seq {cfg.seq}")
    speed = {}
    peak = peak_tflops(cfg.peak_tflops) if device.type == "cuda" and bf16 else None  # the table's peaks are bf16's
    for kind, model in models.items():
        median = statistics.median(times[kind])
        speed[kind] = tokens / median
        line = f"{kind:8s} {parameter_count(model):>12,} params  {median * 1000:8.1f} ms/step  {speed[kind]:>10,.0f} tok/s"
        if peak:
            line += f"  MFU {step_flops(parameter_count(model), cfg) / median / (peak * 1e12):.1%}"
        print(line)
    print(f"Diff / standard throughput: {speed['diff'] / speed['standard']:.3f} (cost {1 - speed['diff'] / speed['standard']:+.1%}; paper: 5-12% cost)")


if __name__ == "__main__":
    main()
