"""Does bf16 autocast slow Diff V1, and does the float32 combine remove it? (issue 58; results/gpu/README.md's lead)

The one-off H200 check behind the lead was not committed: standard and Diff V1 on Bigram-Backcopy, authors'
initialisation, 3 seeds, where standard reached held-out 1.28 in float32 and bf16 and Diff V1 1.28 in float32 but
1.64-1.81 in bf16. This script is that comparison, rebuilt: per seed, standard and Diff V1 trained on the same
Bigram-Backcopy batches in three precisions (float32; bf16 autocast with transformers' DiffLlama combine; bf16 with
the combine in float32, train/precision.py, what training now does), then each model's held-out loss. A constant
learning rate after no warm-up keeps it to the comparison (not the recipes' schedule). CPU bf16 autocast exists,
so it also runs on a CPU (slowly, and not what the lead measured).

    python benchmarks/bf16_combine_check.py --device cuda --seeds 0 1 2 --steps 120
"""

from __future__ import annotations

import argparse

import torch

from quantdiff.data import bigram_backcopy
from quantdiff.models.pairs import SizePreset, build_model, kind_configs
from quantdiff.train.loop import lm_loss, make_optimizer
from quantdiff.train.precision import keep_combine_float32
from quantdiff.train.recipe import ArmConfig, TrainConfig

PRECISIONS = ("float32", "bf16", "bf16+float32-combine")


def held_out(model: torch.nn.Module, rows: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        loss = lm_loss(model, rows[:, :-1], rows[:, 1:]).item()
    model.train()
    return loss


def train(kind: str, precision: str, seed: int, cfg: argparse.Namespace, device: torch.device) -> float:
    """Held-out loss of one `kind` model after `cfg.steps` steps in `precision` (the same batches for every run)."""
    data = bigram_backcopy.load()
    preset = SizePreset(cfg.hidden, cfg.layers, cfg.heads, None, None, data.vocab_size, cfg.seq)
    model = build_model(kind_configs(preset, (kind,))[kind], seed, "sdpa", "authors").to(device).train()
    if precision == "bf16+float32-combine":
        keep_combine_float32(model)
    optimizer = make_optimizer(model, TrainConfig(lr=cfg.lr, weight_decay=0.1, adam_beta2=0.99), ArmConfig(kind, kind))[0]
    for step in range(cfg.steps):
        rows = data.train_rows(seed, step, cfg.batch, cfg.seq + 1).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "float32"):
            loss = lm_loss(model, rows[:, :-1], rows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return held_out(model, data.held_out_rows(cfg.held_out, cfg.seq + 1).to(device))


def main(argv: list[str] | None = None) -> dict[tuple[str, str, int], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=7e-3)
    parser.add_argument("--held-out", type=int, default=256, help="held-out sequences")
    cfg = parser.parse_args(argv)
    device = torch.device(cfg.device)
    print(f"device {device}; d{cfg.hidden} L{cfg.layers} H{cfg.heads}, {cfg.steps} steps × {cfg.batch} × {cfg.seq}, lr {cfg.lr}; held-out loss")
    losses = {}
    for kind in ("standard", "diff"):
        for precision in PRECISIONS:
            if kind == "standard" and precision == "bf16+float32-combine":
                continue  # no differential combine: the same as bf16
            row = [train(kind, precision, seed, cfg, device) for seed in cfg.seeds]
            losses.update({(kind, precision, seed): loss for seed, loss in zip(cfg.seeds, row)})
            print(f"{kind:8s} {precision:22s} " + "  ".join(f"seed {s}: {loss:.3f}" for s, loss in zip(cfg.seeds, row)))
    return losses


if __name__ == "__main__":
    main()
