"""GGUF's Q8_0 and Q4_0 block formats as an export format: llama.cpp's own quantizers, through the `gguf`
package, so the weights are gguf's, not the `linear` site's; and `--bits 16`, the unquantized reference.

Both cut each row into blocks of 32 weights with one float16 scale d per block (ggml-quants.c's reference
rules, which the package reproduces bit for bit):
- Q8_0: d = absmax/127 (computed in float32, stored in float16), codes round(x/d) in [−127, 127].
- Q4_0: d = m/−8 where m is the block's value of largest magnitude, with its sign; codes
  clamp(trunc(x/d + 8.5), 0, 15) − 8 in [−8, 7]. Not our symmetric absmax: m itself maps to code −8, the
  other side of zero gets only 7 steps, and d is rounded to float16.

`--bits 16` is no quantization: every weight in the source's own float type, F32, F16 or BF16 (ggml's type
names; llama.cpp's `convert_hf_to_gguf.py --outtype f32 / f16 / bf16`), so the file reloads to exactly the
source model — the reference a llama.cpp user compares a quantized file with. A float32 source (SmolLM2 as
quantdiff holds it, the tiny models) is written as F32: rounding it to 16 bits would already change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdiff.core.errors import ConfigError
from quantdiff.core.typed import checked_class

GGUF_TYPES = {8: "Q8_0", 4: "Q4_0"}  # bits -> GGML quantization type
GGUF_BLOCK = 32  # weights per block, both types
UNQUANTIZED_BITS = 16
GGUF_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}  # --bits 16: the source's own


@checked_class
@dataclass(frozen=True)
class GGUFExport:
    """Q8_0 (bits 8), Q4_0 (bits 4), or unquantized (bits 16) in `float_type`, which `unquantized` sets to the
    source weights' own type."""

    bits: int
    float_type: str = "F32"  # bits 16 only

    name = "gguf"

    def __post_init__(self) -> None:
        if self.bits not in (*GGUF_TYPES, UNQUANTIZED_BITS):
            raise ConfigError(f"gguf export takes --bits 8 (Q8_0), 4 (Q4_0) or 16 (unquantized), got {self.bits}")
        if self.float_type not in GGUF_FLOAT_TYPES.values():
            raise ConfigError(f"unknown GGUF float type {self.float_type!r} (choose from {', '.join(GGUF_FLOAT_TYPES.values())})")

    @classmethod
    def unquantized(cls, dtype: torch.dtype) -> GGUFExport:
        """bits 16 in `dtype`'s GGUF type: the weights exactly as the source holds them."""
        if dtype not in GGUF_FLOAT_TYPES:
            raise ConfigError(f"--bits 16 writes the source's own float type; GGUF has none for {dtype}")
        return cls(UNQUANTIZED_BITS, GGUF_FLOAT_TYPES[dtype])

    @property
    def type_name(self) -> str:
        return GGUF_TYPES.get(self.bits, self.float_type)

    @property
    def file_type(self) -> str:
        """llama.cpp's `general.file_type` name (gguf.LlamaFileType)."""
        return "ALL_F32" if self.type_name == "F32" else f"MOSTLY_{self.type_name}"

    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]

    def check_width(self, fqn: str, weight: torch.Tensor) -> None:
        if self.bits in GGUF_TYPES and weight.shape[-1] % GGUF_BLOCK:
            raise ConfigError(f"{fqn} has {weight.shape[-1]} inputs, not a multiple of {self.type_name}'s blocks of {GGUF_BLOCK}")

    def encode(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"blocks": uint8 (out, bytes per row)}: the row's blocks as llama.cpp stores them (F32 / F16: the
        values themselves; BF16: their bytes)."""
        import gguf

        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), self.qtype())
        return {"blocks": torch.from_numpy(blocks)}

    def decode(self, tensors: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        import gguf

        values = gguf.quants.dequantize(tensors["blocks"].numpy(), self.qtype())  # float32, (out, in)
        return torch.from_numpy(values).reshape(shape).to(dtype)

    def describe(self) -> dict:
        if self.bits == UNQUANTIZED_BITS:
            return {"method": self.name, "bits": self.bits, "granularity": "none", "type": self.type_name,
                    "scale_rule": f"unquantized: the source's own weights, {self.type_name}"}
        rule = "d = absmax/127" if self.bits == 8 else "d = m/-8 (m: the signed value of largest magnitude)"
        return {"method": self.name, "bits": self.bits, "granularity": f"blockwise-{GGUF_BLOCK}", "type": self.type_name,
                "scale_rule": f"llama.cpp's {self.type_name}: one float16 {rule} per block of {GGUF_BLOCK}"}
