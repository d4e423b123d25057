"""Write a quantized checkpoint: every chosen linear weight encoded by its format, atomically, verified on disk."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from quantdiff import __version__
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.atomic import json_text
from quantdiff.core.savedir import MARKER, atomic_dir, check_target
from quantdiff.models.loading import PICKLE_SUFFIXES, load
from quantdiff.models.source import model_source
from quantdiff.quant.formats import WEIGHTS_NAME, AbsmaxExport, ExportFormat, Tensors
from quantdiff.quant.sites import LinearSite, QuantConfig, linear_targets



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
    allow_partial: bool = False,
) -> ExportSummary:
    """Quantize the source model's linear weights and write a complete model directory at `out`, atomically.

    `attention`: an attention quantization (logits or qk site) to record; `load_quantized` re-applies it.
    allow_partial: accept decoder layers without an nn.Linear to quantize (else ConfigError naming them).
    """
    source, out = Path(source), Path(out)
    check_target(out, force, [source])  # before the (slow) load: a refused target costs nothing
    if attention is not None and isinstance(attention.site, LinearSite):
        raise ConfigError("only an attention quantization (site logits or qk) can be recorded with an export")
    model = load(source, device="cpu")
    targets = linear_targets(model, LinearSite(include_lm_head=include_lm_head), allow_partial)
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
        "source": model_source(source),  # a GGUF file: the export quantizes its dequantized weights
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
    with atomic_dir(out, force, kind="export", sources=[source]) as tmp:
        (tmp / "config.json").write_text(json_text(config, indent=2, sort_keys=True))
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
    """Tokenizer and generation settings; never weights, pickles, the weight index, the old config or marker."""
    for file in source.iterdir():
        if file.is_file() and file.suffix not in (".safetensors", *PICKLE_SUFFIXES):
            if file.name not in ("config.json", "model.safetensors.index.json", MARKER):
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


@contextmanager
def stored_weights(model: nn.Module, fmt: ExportFormat, include_lm_head: bool = False) -> Iterator[nn.Module]:
    """`model` inside the block with its linear weights as an export in `fmt` stores and `load_quantized` decodes
    them (weight-only: activations stay in float, also for llm-int8); the original Parameters come back after."""
    originals = []
    try:
        for _, module in linear_targets(model, LinearSite(include_lm_head=include_lm_head)):
            weight = module.weight
            originals.append((module, weight))
            decoded = fmt.decode(fmt.encode(weight.detach()), weight.shape, weight.dtype)
            module.weight = nn.Parameter(decoded.to(weight.device), requires_grad=False)
        yield model
    finally:
        for module, weight in originals:
            module.weight = weight
