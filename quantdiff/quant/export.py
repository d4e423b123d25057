"""Write a quantized checkpoint: every chosen linear weight encoded by its format, atomically, verified on disk."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from quantdiff import __version__
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.manifest import MANIFEST
from quantdiff.core.atomic import json_text, signals_deferred
from quantdiff.core.savedir import MARKER, atomic_dir, check_target
from quantdiff.models.loading import PICKLE_SUFFIXES, load
from quantdiff.models.source import model_source
from quantdiff.quant.checkpoint import load as load_checkpoint, quantization_format
from quantdiff.quant.compressed_tensors import CompressedTensorsExport
from quantdiff.quant.formats import WEIGHTS_NAME, AbsmaxExport, Bnb4bitExport, ExportFormat, Tensors, check_attention_recordable
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.layer_bits import check_widths, described, module_formats, recorded
from quantdiff.quant.sites import LinearSite, QuantConfig, linear_targets
from quantdiff.quant.transforms import Transform, check_exportable, export_transform



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
    trust_remote_code: bool = False,
    transform: Transform | None = None,
    layer_bits: Mapping[int, int] | None = None,
) -> ExportSummary:
    """Quantize the source model's linear weights and write a complete model directory at `out`, atomically.

    `attention`: an attention quantization (logits or qk site) to record; `load_quantized` re-applies it.
    allow_partial: accept decoder layers without an nn.Linear to quantize (else ConfigError naming them).
    trust_remote_code: run the source's own code, and keep it (*.py, `auto_map`) in the export, which records
    the choice; without it the export carries no code.
    transform: a Hadamard rotation or SmoothQuant smoothing written into the weights first (`transforms.export_transform`),
    recorded as the section's `transform`.
    layer_bits: {decoder layer index: bits}, a mixed-precision plan (`quant.layer_bits`): each decoder layer's
    linears at its own width, lm_head (include_lm_head) at fmt's; recorded as the section's `layer_bits`.
    """
    if isinstance(fmt, GGUFExport):
        raise ConfigError("a GGUF export is one file, written by quant.gguf_export.export_gguf (quantdiff.export_quantized picks it)")
    source, out = Path(source), Path(out)
    check_target(out, force, [source], kind="export")  # before the (slow) load: a refused target costs nothing
    already = quantization_format(source)
    if already is not None:  # its linear layers hold codes, not weights: there is nothing left to quantize
        raise ConfigError(f"{source} is already quantized (format {already}): quantize the unquantized model instead")
    check_exportable(transform, isinstance(fmt, AbsmaxExport))
    if layer_bits is not None:
        check_widths(layer_bits, fmt)  # before the (slow) load; the layer indices once the model is known
    if attention is not None:
        check_attention_recordable(fmt)
        if isinstance(attention.site, LinearSite):
            raise ConfigError("only an attention quantization (site logits or qk) can be recorded with an export")
    model = load(source, device="cpu", trust_remote_code=trust_remote_code)
    refuse_nonfinite(model.named_parameters(), source)
    targets = linear_targets(model, LinearSite(include_lm_head=include_lm_head), allow_partial)
    if not targets:
        raise ConfigError(f"no nn.Linear layer to quantize in {source}")
    if isinstance(fmt, Bnb4bitExport):
        for fqn, module in targets:
            fmt.check_width(fqn, module.weight)
    formats = {fqn: fmt for fqn, _ in targets} if layer_bits is None else module_formats(model, [fqn for fqn, _ in targets], fmt, layer_bits)
    tied = _tied_to_other(model, targets)
    if tied:
        raise ConfigError(f"{tied} shares its weight with another tensor (tied embeddings): it cannot be quantized alone")
    extra = {} if transform is None else {"transform": export_transform(model, source, transform, targets, isinstance(fmt, AbsmaxExport))}
    if layer_bits is not None:
        extra.update(recorded(layer_bits, formats))
    chosen = {fqn for fqn, _ in targets}
    skipped = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in chosen]
    dtype = targets[0][1].weight.dtype
    section = {
        **described(fmt, formats.values()),
        "modules": sorted(chosen),
        "skipped_modules": skipped,
        "dtype": str(dtype).removeprefix("torch."),
        "attention": None if attention is None else attention.to_dict(),
        "quantdiff_version": __version__,
        "trust_remote_code": trust_remote_code,
        "source": model_source(source),  # a GGUF file: the export quantizes its dequantized weights
        **extra,
    }

    tensors = _plain_tensors(model, {f"{fqn}.weight" for fqn in chosen})
    quantized_bytes = bf16_bytes = 0
    for fqn, module in targets:
        encoded = formats[fqn].encode(module.weight.detach())
        _check_decodes(formats[fqn], encoded, module.weight, fqn)
        tensors.update({f"{fqn}.{key}": value.contiguous() for key, value in encoded.items()})
        quantized_bytes += sum(v.numel() * v.element_size() for v in encoded.values())
        bf16_bytes += module.weight.numel() * 2

    config = _without_code(json.loads((source / "config.json").read_text()), trust_remote_code)
    if isinstance(fmt, AbsmaxExport):
        config["quantization_config"] = {"quant_method": "quantdiff", **section}
    elif isinstance(fmt, CompressedTensorsExport):  # compressed-tensors reads its part, quantdiff its own section
        widths = {fqn: module.in_features for fqn, module in targets}
        bits = {fqn: module_fmt.bits for fqn, module_fmt in formats.items()}
        config["quantization_config"] = {**fmt.hf_config(skipped, widths, bits), "quantdiff": section}
    else:  # transformers reads the bitsandbytes part, quantdiff its own section
        config["quantization_config"] = {**fmt.hf_config(skipped, dtype), "quantdiff": section}
    metadata = {"format": "pt", "quantdiff_version": __version__, "quantization_config": json.dumps(section, sort_keys=True)}
    del model, targets  # the read-back below holds a second copy: not three
    with atomic_dir(out, force, kind="export", sources=[source]) as tmp:
        (tmp / "config.json").write_text(json_text(config, indent=2, sort_keys=True))
        _copy_side_files(source, tmp, trust_remote_code)
        with signals_deferred():  # an interrupt inside safetensors' or torch's C++ code became a TypeError
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=metadata)
            _sort_metadata(tmp / WEIGHTS_NAME)
            _verify(tmp / WEIGHTS_NAME, tensors)  # before the rename: a checkpoint that does not read back never appears
        del tensors
        # The tokenizer files are the source's bytes, as readable as there: the model is what is read back.
        check_reloads(out, lambda: load_checkpoint(tmp, device="cpu", trust_remote_code=trust_remote_code))
    source_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    out_bytes = (out / WEIGHTS_NAME).stat().st_size
    return ExportSummary(out, section, sorted(chosen), skipped, source_bytes, out_bytes, quantized_bytes, bf16_bytes)


def check_reloads(out: Path, read_back: Callable[[], Any]) -> Any:
    """Run `read_back` on the finished export before it is put in place, as `quantdiff.load` reads it: an export
    that exits 0 reloads (every format), and one that would not is one line, with nothing written. Returns what
    `read_back` read, for further checks."""
    try:
        return read_back()
    except Exception as exc:  # whatever the reader raises, the export is unreadable: that is the one message
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise LoadError(f"export check failed: {out} would not load back ({reason}); nothing was written") from None


def _check_decodes(fmt: ExportFormat, encoded: Tensors, weight: torch.Tensor, fqn: str) -> None:
    """The reload's decoding, run before anything is written: an encoding that does not decode back to the
    weight's shape never becomes an export (it would fail only when loaded, or under --eval)."""
    try:
        decoded = fmt.decode(encoded, weight.shape, weight.dtype)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise LoadError(f"export check failed: {fqn} does not decode ({' '.join(str(exc).split())})") from None
    if decoded.shape != weight.shape:
        raise LoadError(f"export check failed: {fqn} decodes to shape {list(decoded.shape)}, not {list(weight.shape)}")


def _tied_to_other(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> str | None:
    """Name of a target whose weight is also held under another name (e.g. lm_head tied to the embeddings)."""
    names_per_param: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        names_per_param[id(param)] = names_per_param.get(id(param), 0) + 1
    return next((fqn for fqn, module in targets if names_per_param[id(module.weight)] > 1), None)


def refuse_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]], source: Path, action: str = "quantize") -> None:
    """NaN/Inf weights have no absmax scale: their export would be meaningless (and NaN never reads back equal);
    measured, they give null accuracies. `tensors`: a model's named parameters, or a directory's stored tensors."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise LoadError(f"{name} in {source} holds NaN or Inf values: refusing to {action} a model with non-finite weights")


def _without_code(settings: dict, trust_remote_code: bool) -> dict:
    """`settings` without `auto_map` (which names the model's own code) unless that code is trusted."""
    return settings if trust_remote_code else {k: v for k, v in settings.items() if k != "auto_map"}


def _copy_side_files(source: Path, target: Path, trust_remote_code: bool) -> None:
    """Tokenizer and generation settings; never weights, pickles, the weight index, the old config or marker,
    and the model's own code (*.py, `auto_map` entries) only when it is trusted."""
    for file in source.iterdir():
        if not file.is_file() or file.suffix in (".safetensors", *PICKLE_SUFFIXES):
            continue
        if file.name in ("config.json", "model.safetensors.index.json", MARKER, MANIFEST) or (file.suffix == ".py" and not trust_remote_code):
            continue
        settings = _json_object(file) if file.suffix == ".json" else None
        if settings is not None and "auto_map" in settings and not trust_remote_code:
            (target / file.name).write_text(json_text(_without_code(settings, False), indent=2))
        else:
            shutil.copyfile(file, target / file.name)


def _json_object(file: Path) -> dict | None:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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


def _sort_metadata(file: Path) -> None:
    """Rewrite the header with `__metadata__` keys sorted: safetensors writes them in random (hash map) order,
    and an export must be byte-identical for the same input. Same keys, same length: rewritten in place."""
    with open(file, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        raw = f.read(length)
        header = json.loads(raw)
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) != len(raw.rstrip(b" ")):
            raise LoadError(f"export check failed: cannot canonicalise the header of {file}")
        f.seek(8)
        f.write(text.ljust(length, b" "))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals itself), for tensors of one dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def _verify(file: Path, tensors: Tensors) -> None:
    stored = load_file(str(file))
    bad = sorted(k for k in tensors if k not in stored or not _same_bits(stored[k], tensors[k]))
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
