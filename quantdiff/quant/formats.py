"""Quantized checkpoints on disk: write them atomically, reload them exactly.

Formats are small config types, each knowing how to encode one linear weight into safetensors entries and
decode it back:
- `AbsmaxExport(bits, group_size)`: symmetric codes from the `linear` site's own weight quantizer, densely
  bit-packed (`packing`), one float32 scale per output channel or per group of `group_size` inputs of each
  output channel. Our own layout.
- `LLMInt8Export(threshold)`: bitsandbytes' Linear8bitLt layout (int8 `weight`, float32 `SCB` = row absmax),
  loadable by `transformers.AutoModelForCausalLM.from_pretrained(DIR)` with bitsandbytes.
- `Bnb4bitExport(quant_type)`: bitsandbytes' Linear4bit layout (nf4 / fp4, blocks of 64), quantized by
  bitsandbytes itself, loadable the same way.
- `CompressedTensorsExport(bits, group_size)` (`compressed_tensors`): our absmax weights in the layout vLLM and
  transformers read; `GGUFExport(bits)` (`gguf_format`): llama.cpp's Q8_0 / Q4_0, written by `gguf_export`.

Reloaded in quantdiff (`load_quantized`), every quantized weight is decoded to the model's dtype: for absmax
and llm-int8 bit for bit the weights of `sites.fake_quant_weight`. An llm-int8 checkpoint also gets its
activations quantized at run time, as bitsandbytes does.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.typed import checked_class
from quantdiff.quant.numerics import (
    LLM_INT8_THRESHOLD,
    MAX_BITS,
    absmax_weight_quantize,
    check_bits,
    check_group_size,
    expand_group_scales,
    vectorwise_quantize,
)
from quantdiff.quant.compressed_tensors import CompressedTensorsExport
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.packing import pack_codes, unpack_codes
from quantdiff.quant.registry import EXPORT_FORMATS, EXPORT_METHODS, check_name, parse_bit_width

WEIGHTS_NAME = "model.safetensors"
ABSMAX_EXPORT_BITS = (*range(2, 9), MAX_BITS)  # 16: a near-lossless check of the pipeline
BNB_4BIT_BLOCKSIZE = 64  # bitsandbytes' Linear4bit default
BNB_CPU_BLOCK_N = 32  # output rows bitsandbytes' CPU 4-bit kernel packs together (functional._convert_weight_packed_for_cpu)

Tensors = dict[str, torch.Tensor]


@checked_class
@dataclass(frozen=True)
class AbsmaxExport:
    """Per output channel (`weight_scale` (out,)), or with `group_size` G per group of G inputs of each output
    channel (`weight_scale` (out, ⌈in/G⌉), the last group shorter when G does not divide the width)."""

    bits: int
    group_size: int | None = None

    name = "absmax"

    def __post_init__(self) -> None:
        if check_bits(self.bits) not in ABSMAX_EXPORT_BITS:
            raise ConfigError(f"absmax export takes bits 2–8 or 16, got {self.bits}")
        if self.group_size is not None:
            check_group_size(self.group_size)

    def encode(self, weight: torch.Tensor) -> Tensors:
        # the linear site's weight quantizer (sites.fake_quant_weight)
        result = absmax_weight_quantize(weight, self.bits, self.group_size)
        scale = result.scale.reshape(weight.shape[0], -1)
        # per channel (out,); per group (out, groups), even when one group spans the whole width (G ≥ in)
        return {"weight_packed": pack_codes(result.codes, self.bits), "weight_scale": scale.squeeze(-1) if self.group_size is None else scale}

    def decode(self, tensors: Tensors, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_codes(tensors["weight_packed"], self.bits, shape)  # (out, in)
        scale = tensors["weight_scale"]
        if self.group_size is None:
            scale = scale[:, None]
        else:
            if scale.shape != (shape[0], -(-shape[1] // self.group_size)):
                raise ValueError(f"weight_scale of shape {tuple(scale.shape)} does not hold groups of {self.group_size} of {tuple(shape)}")
            scale = expand_group_scales(scale, self.group_size, shape[1])
        return (codes.float() * scale).to(dtype)

    def describe(self) -> dict:
        granularity = "per-output-channel" if self.group_size is None else f"group-{self.group_size}"
        grouped = {} if self.group_size is None else {"group_size": self.group_size}
        return {"method": self.name, "bits": self.bits, "granularity": granularity, **grouped, "packing": "dense-lsb-first"}


@checked_class
@dataclass(frozen=True)
class LLMInt8Export:
    threshold: float = LLM_INT8_THRESHOLD

    name = "llm-int8"
    bits = 8

    def __post_init__(self) -> None:
        if not math.isfinite(self.threshold) or self.threshold <= 0:  # an export that would never load back
            raise ConfigError(f"llm-int8 threshold must be a positive finite number, got {self.threshold}")

    def encode(self, weight: torch.Tensor) -> Tensors:
        result = vectorwise_quantize(weight, self.bits)  # bitsandbytes' int8_vectorwise_quant: weights have no outliers
        return {"weight": result.codes, "SCB": result.row_absmax, "weight_format": torch.tensor(0, dtype=torch.uint8)}

    def decode(self, tensors: Tensors, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        scale = tensors["SCB"][:, None] / 127  # the same float32 division as quantize_with_absmax's amax / qmax
        return (tensors["weight"].float() * scale).to(dtype)

    def describe(self) -> dict:
        return {"method": self.name, "bits": self.bits, "granularity": "per-output-channel", "threshold": self.threshold}

    def hf_config(self, skipped: list[str], dtype: torch.dtype) -> dict:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=self.threshold, llm_int8_skip_modules=skipped).to_dict()


@checked_class
@dataclass(frozen=True)
class Bnb4bitExport:
    quant_type: str  # "nf4" or "fp4"

    bits = 4

    @property
    def name(self) -> str:
        return self.quant_type

    def encode(self, weight: torch.Tensor) -> Tensors:
        import bitsandbytes.functional as bnbF

        # Quantized straight from the float weight and never run: bnb 0.50.2's CPU forward repacks the weight in
        # place and would corrupt `absmax` in a later save.
        packed, state = bnbF.quantize_4bit(
            weight.detach().contiguous(), blocksize=BNB_4BIT_BLOCKSIZE, quant_type=self.quant_type, quant_storage=torch.uint8
        )
        return {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}

    def decode(self, tensors: Tensors, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnbF

        state = bnbF.QuantState.from_dict({k.removeprefix("weight."): v for k, v in tensors.items() if k != "weight"}, torch.device("cpu"))
        return bnbF.dequantize_4bit(tensors["weight"], state).reshape(shape).to(dtype)

    def describe(self) -> dict:
        return {"method": self.name, "bits": self.bits, "granularity": f"blockwise-{BNB_4BIT_BLOCKSIZE}"}

    def check_width(self, fqn: str, weight: torch.Tensor) -> None:
        """ConfigError for a layer bitsandbytes' CPU kernel cannot run: on CPUs with AVX512-BF16, Linear4bit's
        forward repacks the weight in blocks of BNB_CPU_BLOCK_N output rows and asserts they divide the rows."""
        if weight.shape[0] % BNB_CPU_BLOCK_N:
            raise ConfigError(f"--method {self.name}: {fqn} has {weight.shape[0]} outputs, not a multiple of {BNB_CPU_BLOCK_N}, "
                              "so transformers with bitsandbytes could not run the export on a CPU (its kernel packs "
                              f"{BNB_CPU_BLOCK_N} rows at a time): use --method absmax or llm-int8 for this model")

    def hf_config(self, skipped: list[str], dtype: torch.dtype) -> dict:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quant_type, bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=skipped
        ).to_dict()


ExportFormat = AbsmaxExport | LLMInt8Export | Bnb4bitExport | CompressedTensorsExport | GGUFExport


def parse_export(
    method: str, bits: int | str, threshold: float = LLM_INT8_THRESHOLD, group_size: int | None = None, format: str = "quantdiff"
) -> ExportFormat:
    """The CLI boundary: (method name, bits[, group size][, container format]) → export format; ConfigError with
    a one-line message. `format`: "quantdiff" (a model directory in our layouts), "compressed-tensors" (a model
    directory in its layout, our absmax weights) or "gguf" (one GGUF file, llama.cpp's Q8_0 / Q4_0)."""
    check_name(format, EXPORT_FORMATS, "export format")
    check_name(method, EXPORT_METHODS, "export method")
    bits = parse_bit_width(bits)
    if threshold != LLM_INT8_THRESHOLD and (method != "llm-int8" or format != "quantdiff"):
        raise ConfigError(f"threshold is an llm-int8 export setting: --method {method} --format {format} would ignore threshold={threshold!r}")
    if format != "quantdiff" and method != "absmax":
        raise ConfigError(f"--method {method} is a layout of --format quantdiff; --format {format} has its own")
    if format == "compressed-tensors":
        return CompressedTensorsExport(bits, group_size)
    if format == "gguf":
        if group_size is not None:
            raise ConfigError("--format gguf has llama.cpp's blocks of 32 weights: no --group-size")
        return GGUFExport(bits)
    if method == "absmax":
        return AbsmaxExport(bits, group_size)
    if group_size is not None:
        raise ConfigError(f"a group size is an absmax export option; --method {method} has its own layout")
    fmt: ExportFormat = LLMInt8Export(threshold) if method == "llm-int8" else Bnb4bitExport(method)
    if bits != fmt.bits:
        raise ConfigError(f"--method {method} stores {fmt.bits}-bit weights, got --bits {bits}")
    return fmt


def check_attention_recordable(fmt: ExportFormat) -> None:
    """A recorded attention quantization is re-applied by quantdiff's loader only: a format meant for other
    loaders (compressed-tensors for vLLM and transformers, GGUF for llama.cpp) would carry it unused."""
    if isinstance(fmt, (CompressedTensorsExport, GGUFExport)):
        raise ConfigError(f"--attention-bits is recorded by --format quantdiff only: the loaders of --format {fmt.name} would not re-apply it")


def format_from_section(section: dict) -> ExportFormat:
    method = section.get("method")
    if method == "absmax":
        return AbsmaxExport(section.get("bits"), section.get("group_size"))
    if method == "llm-int8":
        return LLMInt8Export(section.get("threshold", LLM_INT8_THRESHOLD))
    if method in ("nf4", "fp4"):
        return Bnb4bitExport(method)
    if method == CompressedTensorsExport.name:
        return CompressedTensorsExport(section.get("bits"), section.get("group_size"))
    raise LoadError(f"unknown quantdiff export method {method!r} in config.json")
