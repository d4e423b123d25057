"""The memory a device has, so that a size asked for (a model width, a vocabulary, a top-k) is refused with one
line before anything is allocated, instead of failing deep inside torch with "tried to allocate … bytes"."""

from __future__ import annotations

import os

import torch

from quantdiff.core.errors import ConfigError


def device_memory(device: torch.device | str = "cpu") -> int:
    """Total bytes of `device`: physical RAM for the CPU, the accelerator's own memory otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory() -> int:
    """Bytes of RAM this machine can still give now (what loading a checkpoint may take; psutil comes with
    accelerate), where `device_memory` is the total that bounds sizes asked for."""
    import psutil

    return int(psutil.virtual_memory().available)


def readable_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable: the loop returns at PiB


def check_fits(nbytes: int, what: str, device: torch.device | str = "cpu") -> None:
    """ConfigError if `what` (needing at least `nbytes`) exceeds the total memory of `device`."""
    limit = device_memory(device)
    if nbytes > limit:
        raise ConfigError(f"{what} needs at least {readable_bytes(nbytes)}, more than the {readable_bytes(limit)} of memory of this machine's {torch.device(device).type}")
