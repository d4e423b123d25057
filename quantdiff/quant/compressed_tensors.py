"""The compressed-tensors layout (what llm-compressor writes; vLLM, SGLang and transformers load it), holding
exactly the `linear` site's quantized weights.

- W4A16 (`pack-quantized`): `weight_packed` int32 (out, ⌈in/8⌉), eight 4-bit codes per int32, each stored as
  code + 8, the first in the least significant bits; `weight_scale` (out, 1) per channel or (out, in/G) per
  group; `weight_shape` (out, in).
- W8A8 (`int-quantized`): int8 `weight` and `weight_scale` (out, 1); the config declares dynamic per-token int8
  activations, quantized at run time by each engine: transformers (the package's own forward) and
  `quantdiff.load` with the package's rule, absmax/127.5 clamped to [−128, 127] (`checkpoint.compressed_tensors_inputs`);
  vLLM's int8 kernels with absmax/127.

The scale rule is ours, not the package's: scale = absmax / 7 (int4) or / 127 (int8), codes in [−7, 7] /
[−127, 127] (the package's own compressor divides by 7.5 / 127.5 and uses −8 / −128 too). Our codes are valid
codes of the format, so the file decodes — through the package's decompressor as through ours — to the
`linear` site's fake-quantized weights. Scales are stored in float32, which keeps them exact.

compressed-tensors needs a group size that divides the layer's width. Where ours does not (SmolLM2's 576
inputs with G = 128 end in a group of 64), the layer is written with group size g = gcd(G, width), each of
our scales repeated G / g times: the same weights, in a layout the format accepts. A G at least the width is
one scale per row, written as the `channel` strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from quantdiff.core.errors import ConfigError
from quantdiff.core.typed import checked_class
from quantdiff.quant.numerics import absmax_weight_quantize, check_group_size, expand_group_scales

# The compressed-tensors release this layout was written for and checked against (its `version` field).
COMPRESSED_TENSORS_VERSION = "0.20.0"
CT_BITS = {4: "pack-quantized", 8: "int-quantized"}  # bits -> compressed-tensors format
MIXED_FORMAT = "mixed-precision"  # the package's CompressionFormat.mixed_precision: each config group names its format
_OFFSET = 8  # a 4-bit code c is stored as c + 8 (the format's unsigned offset, 2^(bits-1))
_PER_INT32 = 8  # 4-bit codes per int32 word
# W8A8's run-time activations, as quantdiff's reload and transformers compute them (numerics.compressed_tensors_token_fake_quantize)
ACTIVATION_RULE = "compressed-tensors' dynamic per-token int8: absmax/127.5, clamp [-128, 127], round half to even, in the model's dtype"


@checked_class
@dataclass(frozen=True)
class CompressedTensorsExport:
    """W4A16 (bits 4, per channel or per group of `group_size` inputs) or W8A8 (bits 8, per channel)."""

    bits: int
    group_size: int | None = None

    name = "compressed-tensors"

    def __post_init__(self) -> None:
        if self.bits not in CT_BITS:
            raise ConfigError(f"compressed-tensors export takes --bits 4 (W4A16) or 8 (W8A8), got {self.bits}")
        if self.group_size is not None:
            check_group_size(self.group_size)
            if self.bits == 8:
                raise ConfigError("compressed-tensors W8A8 has per-channel weight scales: no --group-size")

    def stored_group(self, width: int) -> int | None:
        """The group size written for a layer with `width` inputs; None is the channel strategy."""
        if self.group_size is None or self.group_size >= width:
            return None
        return math.gcd(self.group_size, width)

    def encode(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out, width = weight.shape
        group = None if self.group_size is None or self.group_size >= width else self.group_size
        result = absmax_weight_quantize(weight, self.bits, group)
        scale = result.scale.reshape(out, -1)
        stored = self.stored_group(width)
        if stored is not None:  # one scale per stored group: ours repeated G / g times
            scale = expand_group_scales(scale, self.group_size, width)[:, ::stored]
        if self.bits == 8:
            return {"weight": result.codes, "weight_scale": scale.contiguous()}
        shape = torch.tensor([out, width], dtype=torch.int64)
        return {"weight_packed": pack_int4(result.codes), "weight_scale": scale.contiguous(), "weight_shape": shape}

    def decode(self, tensors: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.bits == 8:
            codes = tensors["weight"]
        else:
            if tensors["weight_shape"].tolist() != list(shape):
                raise ValueError(f"weight_shape {tensors['weight_shape'].tolist()} is not the layer's {list(shape)}")
            codes = unpack_int4(tensors["weight_packed"], shape)
        scale = tensors["weight_scale"]
        stored = self.stored_group(shape[1])
        expected = (shape[0], 1 if stored is None else shape[1] // stored)
        if tuple(scale.shape) != expected:
            raise ValueError(f"weight_scale of shape {tuple(scale.shape)}, expected {expected}")
        if stored is not None:
            scale = expand_group_scales(scale, stored, shape[1])
        return (codes.float() * scale).to(dtype)

    def describe(self) -> dict:
        granularity = "per-output-channel" if self.group_size is None else f"group-{self.group_size}"
        grouped = {} if self.group_size is None else {"group_size": self.group_size}
        scheme = "W4A16" if self.bits == 4 else "W8A8 (dynamic per-token int8 activations)"
        activations = {} if self.bits == 4 else {"activation_rule": ACTIVATION_RULE}
        return {"method": self.name, "bits": self.bits, "granularity": granularity, **grouped, "scheme": scheme,
                "scale_rule": f"absmax/{2 ** (self.bits - 1) - 1} (quantdiff's; the package's own is absmax/{2 ** (self.bits - 1) - 0.5})",
                **activations}

    def hf_config(self, skipped: list[str], widths: dict[str, int], bits: Mapping[str, int] | None = None) -> dict:
        """The `quantization_config` compressed-tensors reads: one config group per (bits, stored group size),
        each naming its modules in `targets`. `bits`: each module's width where they differ (a mixed-precision
        plan, `quant.layer_bits`); the config's `format` is then "mixed-precision" and each group names its own,
        as the package's ModelCompressor writes a model of several schemes."""
        bits = bits or {}
        by_group: dict[tuple[int, int | None], list[str]] = {}
        for fqn, width in widths.items():
            by_group.setdefault((bits.get(fqn, self.bits), self.stored_group(width)), []).append(fqn)
        single = len(by_group) == 1  # the usual case: every quantized Linear, minus the ignore list
        groups = {
            f"group_{i}": replace(self, bits=at)._scheme(["Linear"] if single else sorted(names), group)
            for i, ((at, group), names) in enumerate(sorted(by_group.items(), key=lambda item: (item[0][0], item[0][1] or 0)))
        }
        formats = {CT_BITS[at] for at, _ in by_group}
        return {
            "quant_method": "compressed-tensors",
            "format": formats.pop() if len(formats) == 1 else MIXED_FORMAT,
            "config_groups": groups,
            "ignore": list(skipped),
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "moe_sparsity_config": None,  # written by the package's own ModelCompressor.update_config (0.20.0)
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        }

    def _scheme(self, targets: list[str], group: int | None) -> dict:
        weights = {"num_bits": self.bits, "type": "int", "symmetric": True, "dynamic": False,
                   "strategy": "channel" if group is None else "group", "group_size": group}
        inputs = None
        if self.bits == 8:  # what vLLM runs for W8A8: int8 activations, one scale per token, computed at run time
            inputs = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token", "group_size": None}
        return {"targets": targets, "weights": weights, "input_activations": inputs, "output_activations": None,
                "format": CT_BITS[self.bits]}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit codes (out, in) → int32 (out, ⌈in/8⌉): code + 8 in bits 4j..4j+3 of word j // 8, rows
    zero-padded to a multiple of eight codes (a padding nibble is 0, i.e. code −8, never read back)."""
    out, width = codes.shape
    words = -(-width // _PER_INT32)
    unsigned = torch.nn.functional.pad(codes.to(torch.int64) + _OFFSET, (0, words * _PER_INT32 - width))
    shifts = 4 * torch.arange(_PER_INT32, dtype=torch.int64)
    packed = (unsigned.view(out, words, _PER_INT32) << shifts).sum(dim=-1)  # < 2^32: fits int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


def unpack_int4(packed: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Inverse of pack_int4: int8 codes of `shape`."""
    out, width = shape
    if packed.dtype != torch.int32 or tuple(packed.shape) != (out, -(-width // _PER_INT32)):
        raise ValueError(f"weight_packed {packed.dtype} {tuple(packed.shape)} does not hold {out}×{width} 4-bit codes")
    shifts = 4 * torch.arange(_PER_INT32, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> shifts) & 0xF  # (out, words, 8), least significant first
    return (nibbles.reshape(out, -1)[:, :width] - _OFFSET).to(torch.int8)
