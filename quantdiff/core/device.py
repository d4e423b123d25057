"""Device resolution, one rule for every job: an explicit name is checked, none means CUDA when present."""

from __future__ import annotations

import os

import torch

from quantdiff.core.errors import ConfigError

AUTO = ("auto",)
ACCELERATORS = ("cuda", "mps", "xpu")


def resolve_device(name: str | torch.device | None = None, parameter: str = "device") -> torch.device:
    """`name` as a torch.device; None/"auto": CUDA (this rank's GPU under torchrun) when available, else CPU.

    ConfigError naming `parameter` for an unknown name, or an accelerator (CUDA, MPS, XPU) or device index this
    machine does not have.
    """
    if isinstance(name, str) and not name.strip():  # as an empty --data: never silently the default
        raise ConfigError(f"{parameter} is empty: name a device (e.g. cpu, cuda, cuda:1, auto)")
    if name is None or (isinstance(name, str) and name.strip().lower() in AUTO):
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{parameter}: unknown device {str(name)!r} (e.g. cpu, cuda, cuda:1, auto)") from None
    if device.type not in ACCELERATORS + ("cpu",):
        raise ConfigError(f"{parameter}: unsupported device type {device.type!r} (use cpu, {', '.join(ACCELERATORS)})")
    if device.type == "cpu":
        return device
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    backend = getattr(torch, device.type)  # torch.cuda, torch.mps, torch.xpu: the same availability API
    if not backend.is_available():
        raise ConfigError(f"{parameter}: {str(name)!r} requested but {device.type.upper()} is not available on this machine")
    if device.index is not None and device.index >= backend.device_count():
        raise ConfigError(f"{parameter}: {str(name)!r} but only {backend.device_count()} {device.type.upper()} device(s) exist")
    return device
