"""What stops a training run: everything checkable before its first step (so a failing run prints its one
`error:` line and nothing before it), and a loss or a weight that stops being finite (so no NaN model is saved).

Before the first step: OUT is a directory of its own (no quantdiff pair, report, export or model: `train --force`
into a pair's directory would replace two of its models and keep the third, a mixed directory); every OUT/<arm>
may be replaced by a trained model; OUT/.checkpoint, if present, carries the checkpoint marker; `bf16` runs on
CUDA only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import torch

from quantdiff.core.errors import ConfigError, QuantdiffError
from quantdiff.core.savedir import MARKER, check_target, marked_kind

CHECKPOINT = ".checkpoint"  # inside OUT; train.loop keeps its state there


class TrainingDiverged(QuantdiffError):
    """A loss or a weight became NaN or Inf: the run stops, keeping the last checkpoint written before."""


def check_out(out: Path, arm_names: Iterable[str], sources: Iterable[Path] = ()) -> None:
    """OUT and everything training will replace in it, checked before any work (see the module docstring)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out exists and is not a directory: {out}")
    if (out / MARKER).exists():
        kind = marked_kind(out) or "output"
        raise ConfigError(
            f"--out {out} is a quantdiff {kind} directory: train writes its arms (OUT/<arm>) into a directory of its own, never into a {kind}"
        )
    for name in arm_names:
        check_target(out / name, force=True, sources=list(sources), flag=f"--out's {name}/", kind="model")
    if (out / CHECKPOINT).exists():
        check_target(out / CHECKPOINT, force=True, flag=f"the training checkpoint {out / CHECKPOINT}", kind="checkpoint")


def check_dtype(dtype: str, device: torch.device) -> None:
    """bf16 is bfloat16 autocast on CUDA; on a CPU it would run and be slow, so it is refused (documented)."""
    if dtype == "bf16" and device.type != "cuda":
        raise ConfigError(f'[train] dtype = "bf16" runs on CUDA only, and this run is on {device}: use dtype = "float32"')


def _kept_step(checkpoint: Path) -> str:
    try:
        return f"the checkpoint of step {json.loads((checkpoint / 'state.json').read_text())['step']} is kept in {checkpoint}"
    except (OSError, ValueError, KeyError, TypeError):
        return "no checkpoint was written yet"


def check_loss(value: float, arm: str, step: int, checkpoint: Path) -> None:
    """Stop at the first non-finite loss (before its update reaches the weights)."""
    if not math.isfinite(value):
        raise TrainingDiverged(
            f"training diverged: {arm}'s loss is {value} at step {step + 1}; {_kept_step(checkpoint)}; "
            "lower the learning rate, then retrain with --force"
        )


def check_weights(models: dict[str, torch.nn.Module], step: int, checkpoint: Path) -> None:
    """Before a checkpoint or a model is written: every weight finite (a finite loss can still leave an Inf)."""
    for arm, model in models.items():
        bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            raise TrainingDiverged(
                f"training diverged: {arm}'s {bad} holds NaN or Inf after step {step}; {_kept_step(checkpoint)}; "
                "lower the learning rate, then retrain with --force"
            )
