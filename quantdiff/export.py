"""Quantized checkpoints on disk: write them atomically, reload them exactly.

Formats are small config types, each knowing how to encode one linear weight into safetensors entries and
decode it back:
- `AbsmaxExport(bits)`: per-output-channel symmetric codes from `quant.absmax_quantize` (the `linear` site's
  own quantizer), densely bit-packed (`packing`), one float32 scale per channel. Our own layout.
- `LLMInt8Export(threshold)`: bitsandbytes' Linear8bitLt layout (int8 `weight`, float32 `SCB` = row absmax),
  loadable by `transformers.AutoModelForCausalLM.from_pretrained(DIR)` with bitsandbytes.
- `Bnb4bitExport(quant_type)`: bitsandbytes' Linear4bit layout (nf4 / fp4, blocks of 64), quantized by
  bitsandbytes itself, loadable the same way.

Reloaded in quantdiff (`load_quantized`), every quantized weight is decoded to the model's dtype: for absmax
and llm-int8 bit for bit the weights of `sites.fake_quant_weight`. An llm-int8 checkpoint also gets its
activations quantized at run time, as bitsandbytes does.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from . import __version__, attention, loading
from .errors import ConfigError, LoadError
from .packing import pack_codes, unpack_codes
from .quant import MAX_BITS, PerRow, absmax_quantize, check_bits, vectorwise_quantize
from .savedir import atomic_dir, check_target
from .sites import LinearSite, LLMInt8Method, QuantConfig, apply_quantization, linear_targets

WEIGHTS_NAME = "model.safetensors"
EXPORT_METHODS = ("absmax", "llm-int8", "nf4", "fp4")
ABSMAX_EXPORT_BITS = (*range(2, 9), MAX_BITS)  # 16: a near-lossless check of the pipeline
BNB_4BIT_BLOCKSIZE = 64  # bitsandbytes' Linear4bit default

Tensors = dict[str, torch.Tensor]


# ---- formats -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AbsmaxExport:
    bits: int

    name = "absmax"

    def __post_init__(self) -> None:
        if check_bits(self.bits) not in ABSMAX_EXPORT_BITS:
            raise ConfigError(f"absmax export takes bits 2–8 or 16, got {self.bits}")

    def encode(self, weight: torch.Tensor) -> Tensors:
        result = absmax_quantize(weight, self.bits, PerRow())  # the linear site's weight quantizer
        return {"weight_packed": pack_codes(result.codes, self.bits), "weight_scale": result.scale.reshape(-1)}

    def decode(self, tensors: Tensors, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_codes(tensors["weight_packed"], self.bits, shape)  # (out, in)
        return (codes.float() * tensors["weight_scale"][:, None]).to(dtype)

    def describe(self) -> dict:
        return {"method": self.name, "bits": self.bits, "granularity": "per-output-channel", "packing": "dense-lsb-first"}


@dataclass(frozen=True)
class LLMInt8Export:
    threshold: float = 6.0

    name = "llm-int8"
    bits = 8

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

    def hf_config(self, skipped: list[str], dtype: torch.dtype) -> dict:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quant_type, bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=skipped
        ).to_dict()


ExportFormat = AbsmaxExport | LLMInt8Export | Bnb4bitExport


def parse_export(method: str, bits: int | str, threshold: float = 6.0) -> ExportFormat:
    """The CLI boundary: (method name, bits) → export format; ConfigError with a one-line message."""
    if method not in EXPORT_METHODS:
        raise ConfigError(f"unknown export method {method!r} (choose from {', '.join(EXPORT_METHODS)})")
    if isinstance(bits, str):
        if not bits.strip().isdigit():
            raise ConfigError(f"bits must be an integer, got {bits!r}")
        bits = int(bits)
    if method == "absmax":
        return AbsmaxExport(bits)
    fmt: ExportFormat = LLMInt8Export(threshold) if method == "llm-int8" else Bnb4bitExport(method)
    if bits != fmt.bits:
        raise ConfigError(f"--method {method} stores {fmt.bits}-bit weights, got --bits {bits}")
    return fmt


def _format_from_section(section: dict) -> ExportFormat:
    method = section.get("method")
    if method == "absmax":
        return AbsmaxExport(section.get("bits"))
    if method == "llm-int8":
        return LLMInt8Export(section.get("threshold", 6.0))
    if method in ("nf4", "fp4"):
        return Bnb4bitExport(method)
    raise LoadError(f"unknown quantdiff export method {method!r} in config.json")


# ---- writing -----------------------------------------------------------------------------------------------


@dataclass
class ExportSummary:
    out: Path
    description: dict
    modules: list[str]
    skipped: list[str]  # nn.Linear layers left in their dtype
    source_bytes: int  # the source's safetensors files
    out_bytes: int  # the export's safetensors file
    quantized_bytes: int  # the encoded tensors of the quantized modules
    quantized_bf16_bytes: int  # the same weights in bfloat16

    @property
    def size_ratio(self) -> float:
        return self.out_bytes / self.source_bytes


def export_quantized(
    source: str | Path,
    out: str | Path,
    fmt: ExportFormat,
    include_lm_head: bool = False,
    force: bool = False,
    attention: QuantConfig | None = None,
) -> ExportSummary:
    """Quantize the source model's linear weights and write a complete model directory at `out`, atomically.

    `attention`: an attention quantization (logits or qk site) to record; `load_quantized` re-applies it.
    """
    source, out = Path(source), Path(out)
    check_target(out, force)  # before the (slow) load: a refused target costs nothing
    if attention is not None and isinstance(attention.site, LinearSite):
        raise ConfigError("only an attention quantization (site logits or qk) can be recorded with an export")
    model = loading.load(source, device="cpu")
    targets = linear_targets(model, LinearSite(include_lm_head=include_lm_head))
    if not targets:
        raise ConfigError(f"no nn.Linear layer to quantize in {source}")
    tied = _tied_to_other(model, targets)
    if tied:
        raise ConfigError(f"{tied} shares its weight with another tensor (tied embeddings): it cannot be quantized alone")
    chosen = {fqn for fqn, _ in targets}
    skipped = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in chosen]
    dtype = targets[0][1].weight.dtype
    section = {
        **fmt.describe(),
        "modules": sorted(chosen),
        "skipped_modules": skipped,
        "dtype": str(dtype).removeprefix("torch."),
        "attention": None if attention is None else attention.to_dict(),
        "quantdiff_version": __version__,
    }

    tensors = _plain_tensors(model, {f"{fqn}.weight" for fqn in chosen})
    quantized_bytes = bf16_bytes = 0
    for fqn, module in targets:
        encoded = fmt.encode(module.weight.detach())
        tensors.update({f"{fqn}.{key}": value.contiguous() for key, value in encoded.items()})
        quantized_bytes += sum(v.numel() * v.element_size() for v in encoded.values())
        bf16_bytes += module.weight.numel() * 2

    config = json.loads((source / "config.json").read_text())
    if isinstance(fmt, AbsmaxExport):
        config["quantization_config"] = {"quant_method": "quantdiff", **section}
    else:  # transformers reads the bitsandbytes part, quantdiff its own section
        config["quantization_config"] = {**fmt.hf_config(skipped, dtype), "quantdiff": section}
    metadata = {"format": "pt", "quantdiff_version": __version__, "quantization_config": json.dumps(section, sort_keys=True)}
    with atomic_dir(out, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _copy_side_files(source, tmp)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=metadata)
        _verify(tmp / WEIGHTS_NAME, tensors)  # before the rename: a checkpoint that does not read back never appears
    source_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    out_bytes = (out / WEIGHTS_NAME).stat().st_size
    return ExportSummary(out, section, sorted(chosen), skipped, source_bytes, out_bytes, quantized_bytes, bf16_bytes)


def _tied_to_other(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> str | None:
    """Name of a target whose weight is also held under another name (e.g. lm_head tied to the embeddings)."""
    names_per_param: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        names_per_param[id(param)] = names_per_param.get(id(param), 0) + 1
    return next((fqn for fqn, module in targets if names_per_param[id(module.weight)] > 1), None)


def _copy_side_files(source: Path, target: Path) -> None:
    """Tokenizer and generation settings; never weights, pickles, the weight index or the old config."""
    for file in source.iterdir():
        if file.is_file() and file.suffix not in (".safetensors", *loading.PICKLE_SUFFIXES):
            if file.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(file, target / file.name)


def _plain_tensors(model: nn.Module, exclude: set[str]) -> Tensors:
    """Every persistent tensor except `exclude`, one copy per storage (tied weights are re-tied on load)."""
    seen: set[int] = set()
    out: Tensors = {}
    for name, tensor in model.state_dict().items():
        if name in exclude:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen and tensor.numel():
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous()
    return out


def _verify(file: Path, tensors: Tensors) -> None:
    stored = load_file(str(file))
    bad = sorted(k for k in tensors if k not in stored or not torch.equal(stored[k], tensors[k]))
    if bad or stored.keys() != tensors.keys():
        raise LoadError(f"export check failed: {file} does not read back what was written ({(bad or ['keys'])[0]})")


def _module_tensors(stored: Tensors, fqn: str) -> Tensors:
    prefix = f"{fqn}."
    return {key.removeprefix(prefix): value for key, value in stored.items() if key.startswith(prefix)}


# ---- reading -----------------------------------------------------------------------------------------------


def quantdiff_section(config: dict) -> dict | None:
    """quantdiff's description of a quantized checkpoint in a config.json dict, or None."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    if qc.get("quant_method") == "quantdiff":
        return {k: v for k, v in qc.items() if k != "quant_method"}
    return qc.get("quantdiff") if isinstance(qc.get("quantdiff"), dict) else None


def is_quantdiff_checkpoint(path: str | Path) -> bool:
    file = Path(path) / "config.json"
    try:
        return quantdiff_section(json.loads(file.read_text())) is not None
    except (OSError, ValueError):
        return False


def load_quantized(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tile_size: int | None = attention.DEFAULT_TILE_SIZE,
) -> nn.Module:
    """A quantdiff export as a float model (weights decoded) on the quantdiff backend, in eval mode.

    dtype: cast the decoded model (default: the dtype it was exported from, which keeps weights bit-exact).

    An llm-int8 export also quantizes linear inputs at run time (LLM.int8 with the stored threshold); a
    recorded attention quantization is re-applied. Their handles are in `model.quantdiff_handles`.
    Only model.safetensors is read: pickled files beside it are never opened.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = loading.check_model_dir(path)
    section = quantdiff_section(json.loads((path / "config.json").read_text()))
    if section is None:
        raise LoadError(f"{path} is not a quantdiff quantized checkpoint (no quantdiff quantization_config)")
    fmt = _format_from_section(section)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise LoadError(f"no {WEIGHTS_NAME} in {path}")
    with safe_open(str(file), framework="pt") as f:
        stored_section = (f.metadata() or {}).get("quantization_config")
    if stored_section is None or json.loads(stored_section) != section:
        raise LoadError(f"{file} does not belong to this config.json (its quantization metadata differs)")

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    del config.quantization_config  # the skeleton is a plain float model; we decode the weights ourselves
    stored_dtype = getattr(torch, str(section.get("dtype", "float32")), None)
    if not isinstance(stored_dtype, torch.dtype) or not stored_dtype.is_floating_point:
        raise LoadError(f"unknown weight dtype {section.get('dtype')!r} in {path / 'config.json'}")
    model = AutoModelForCausalLM.from_config(config, dtype=stored_dtype)
    stored = load_file(str(file))
    state: Tensors = {}
    modules = dict(model.named_modules())
    for fqn in section["modules"]:
        module = modules.get(fqn)
        if not isinstance(module, nn.Linear):
            raise LoadError(f"quantized module {fqn} is not a linear layer of {type(model).__name__}")
        encoded = _module_tensors(stored, fqn)
        for key in encoded:
            del stored[f"{fqn}.{key}"]
        try:
            state[f"{fqn}.weight"] = fmt.decode(encoded, module.weight.shape, stored_dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise LoadError(f"cannot decode {fqn} in {file}: {exc}") from None
    state.update(stored)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise LoadError(f"{file} does not fit {type(model).__name__}: missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.to(device=device or loading.default_device(), dtype=dtype)
    loading.prepare(model, tile_size)

    handles = []
    if isinstance(fmt, LLMInt8Export):
        chosen = set(section["modules"])
        inputs = LinearSite(filter=lambda m, fqn: fqn in chosen, weights=False)
        handles.append(apply_quantization(model, QuantConfig(LLMInt8Method(8, fmt.threshold), inputs)))
    if section.get("attention") is not None:
        handles.append(apply_quantization(model, QuantConfig.from_dict(section["attention"])))
    model.quantdiff_handles = handles
    return model
