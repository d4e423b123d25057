"""Fail-loud coverage: did every attention module and decoder layer a run meant to observe take part?

A module that bypasses the quantdiff backend (custom blocks, remote code calling its own attention) would
otherwise leave statistics and quantized sweeps silently incomplete. `tracking(model)` counts backend calls
per tap and decoder-layer forwards; `Coverage.check` raises ConfigError naming what was not reached.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.core.errors import ConfigError
from quantdiff.models import structure


@dataclass
class Coverage:
    """Which attention modules (reached through the backend) and decoder layers (run) a block of forwards reached."""

    model: str
    attention: dict[str, bool] = field(default_factory=dict)
    decoder_layers: dict[str, bool] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        return [name for part in (self.attention, self.decoder_layers) for name, reached in part.items() if not reached]

    @property
    def ran(self) -> bool:
        """Did any forward pass run at all (a block without one checks nothing)."""
        return any(self.attention.values()) or any(self.decoder_layers.values())

    def to_dict(self) -> dict:
        return {
            "attention_modules": len(self.attention),
            "attention_reached": sum(self.attention.values()),
            "decoder_layers": len(self.decoder_layers),
            "decoder_layers_reached": sum(self.decoder_layers.values()),
            "missing": self.missing,
            "complete": not self.missing,
        }

    def check(self, allow_partial: bool = False) -> None:
        """ConfigError naming the modules not reached, unless allow_partial."""
        missing = self.missing
        if missing and not allow_partial:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ConfigError(
                f"{self.model}: {shown} never reached the quantdiff attention backend or never ran "
                "(allow_partial / --allow-partial accepts a partial run)"
            )


@contextmanager
def tracking(model: nn.Module) -> Iterator[Coverage]:
    """Count, during the block, the backend calls of every tapped attention module and every decoder layer's forwards."""
    modules = [(name, module) for name, module in structure.attention_modules(model) if isinstance(getattr(module, "quantdiff_tap", None), attention.Tap)]
    before = {name: module.quantdiff_tap.calls for name, module in modules}
    layers = structure.decoder_layers(model)
    ran: set[str] = set()
    handles = [layer.register_forward_hook(lambda *_, name=name: ran.add(name)) for name, layer in layers]
    coverage = Coverage(structure.model_label(model))
    try:
        yield coverage
    finally:
        for handle in handles:
            handle.remove()
        coverage.attention = {name: module.quantdiff_tap.calls > before[name] for name, module in modules}
        coverage.decoder_layers = {name: name in ran for name, _ in layers}
