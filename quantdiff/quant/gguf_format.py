"""GGUF's Q8_0 and Q4_0 block formats as an export format: llama.cpp's own quantizers, through the `gguf`
package, so the weights are gguf's, not the `linear` site's.

Both cut each row into blocks of 32 weights with one float16 scale d per block (ggml-quants.c's reference
rules, which the package reproduces bit for bit):
- Q8_0: d = absmax/127 (computed in float32, stored in float16), codes round(x/d) in [−127, 127].
- Q4_0: d = m/−8 where m is the block's value of largest magnitude, with its sign; codes
  clamp(trunc(x/d + 8.5), 0, 15) − 8 in [−8, 7]. Not our symmetric absmax: m itself maps to code −8, the
  other side of zero gets only 7 steps, and d is rounded to float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdiff.core.errors import ConfigError

GGUF_TYPES = {8: "Q8_0", 4: "Q4_0"}  # bits -> GGML quantization type
GGUF_BLOCK = 32  # weights per block, both types


@dataclass(frozen=True)
class GGUFExport:
    bits: int

    name = "gguf"

    def __post_init__(self) -> None:
        if self.bits not in GGUF_TYPES:
            raise ConfigError(f"gguf export takes --bits 8 (Q8_0) or 4 (Q4_0), got {self.bits}")

    @property
    def type_name(self) -> str:
        return GGUF_TYPES[self.bits]

    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]

    def check_width(self, fqn: str, weight: torch.Tensor) -> None:
        if weight.shape[-1] % GGUF_BLOCK:
            raise ConfigError(f"{fqn} has {weight.shape[-1]} inputs, not a multiple of {self.type_name}'s blocks of {GGUF_BLOCK}")

    def encode(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"blocks": uint8 (out, bytes per row)}: the row's blocks as llama.cpp stores them."""
        import gguf

        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), self.qtype())
        return {"blocks": torch.from_numpy(blocks)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        import gguf

        values = gguf.quants.dequantize(tensors["blocks"].numpy(), self.qtype())  # float32, (out, in)
        return torch.from_numpy(values).reshape(shape).to(dtype)

    def describe(self) -> dict:
        rule = "d = absmax/127" if self.bits == 8 else "d = m/-8 (m: the signed value of largest magnitude)"
        return {"method": self.name, "bits": self.bits, "granularity": f"blockwise-{GGUF_BLOCK}", "type": self.type_name,
                "scale_rule": f"llama.cpp's {self.type_name}: one float16 {rule} per block of {GGUF_BLOCK}"}
