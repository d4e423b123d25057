"""Write one GGUF file for llama.cpp: the decoder-layer linears in Q8_0 or Q4_0 (`gguf_format`), or unquantized in
the source's own float type (`--bits 16`), everything else exactly as quantdiff holds it, in F32.

Names, metadata and layout follow llama.cpp's `convert_hf_to_gguf.py` for the Llama, Qwen2 and Qwen3
architectures: tensor names from the `gguf` package's own name map, Llama's Q and K rows permuted as llama.cpp's
rotary embedding wants them (transformers' GGUF loader undoes it), `<arch>.*` hyperparameters from config.json,
no `output.weight` when the embeddings are tied. The tokenizer: a GGUF source's own `tokenizer.*` fields, copied as they are; a model
directory's GPT-2 style byte-level BPE `tokenizer.json` (pre-tokenizer `gpt-2`), the one kind mapped here.
Other architectures (DiffLlama, DIFF V2, …) are refused by name: llama.cpp has no graph for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

import numpy as np
import torch
from torch import nn

from quantdiff import __version__
from quantdiff.core.atomic import atomic_file, signals_deferred
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.outputs import check_outputs
from quantdiff.core.owned import GGUF_KEY, check_replaceable
from quantdiff.models.gguf_model import read_gguf
from quantdiff.models.loading import load, load_config
from quantdiff.models.names import check_one_model, resolve
from quantdiff.models.wheels import WHEEL_MODELS, wheel_file
from quantdiff.models.source import model_source
from quantdiff.quant.export import ExportSummary, _plain_tensors, _tied_to_other, check_reloads, refuse_nonfinite
from quantdiff.quant.gguf_config import check_held, check_reloaded
from quantdiff.quant.gguf_format import UNQUANTIZED_BITS, GGUFExport
from quantdiff.quant.gguf_tokenizer import add_bpe_tokenizer, check_bpe_tokenizer
from quantdiff.quant.layer_bits import check_widths, described, module_formats, recorded
from quantdiff.quant.sites import LinearSite, linear_targets
from quantdiff.quant.transforms import Transform, check_exportable, export_transform



@dataclass(frozen=True)
class GGUFArchitecture:
    name: str  # llama.cpp's (general.architecture, and the prefix of its hyperparameter keys)
    permute_qk: bool  # Llama: Q/K rows reordered for llama.cpp's rotary embedding
    biases: bool  # linear biases are part of the architecture (Qwen2's Q/K/V)
    head_dim: int | None = None  # the only head width transformers' GGUF loader reads back (it ignores key_length)


# transformers class -> llama.cpp architecture: the ones whose graph, hyperparameters and names we map.
ARCHITECTURES = {
    "LlamaForCausalLM": GGUFArchitecture("llama", permute_qk=True, biases=False),
    "Qwen2ForCausalLM": GGUFArchitecture("qwen2", permute_qk=False, biases=True),
    "Qwen3ForCausalLM": GGUFArchitecture("qwen3", permute_qk=False, biases=False, head_dim=128),
}
_NOT_IN_LLAMA_CPP = {"DiffLlamaForCausalLM": "DiffLlama", "DiffV2ForCausalLM": "DIFF V2"}


def source_gguf_file(model: str | Path) -> Path | None:
    """The GGUF file a model name stands for (a .gguf path or a built-in GGUF model), else None."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.exists() and str(model) in WHEEL_MODELS:
        return wheel_file(str(model))
    return None


def gguf_architecture(config: dict, source: Path) -> GGUFArchitecture:
    """llama.cpp's name for the model's architecture, or one ConfigError line saying why there is none."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch in _NOT_IN_LLAMA_CPP:
        raise ConfigError(f"--format gguf: llama.cpp has no {_NOT_IN_LLAMA_CPP[arch]} architecture, so it could not load the file ({source})")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"--format gguf maps {', '.join(ARCHITECTURES)} to llama.cpp; {source} is {arch}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"--format gguf: rope type {rope['rope_type']!r} of {source} is not mapped (only plain RoPE)")
    spec = ARCHITECTURES[arch]
    if not spec.biases and (config.get("attention_bias") or config.get("mlp_bias")):
        raise ConfigError(f"--format gguf: {source} has linear biases, which llama.cpp's {spec.name} graph does not read")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if spec.head_dim is not None and head_dim != spec.head_dim:
        raise ConfigError(f"--format gguf: transformers reads {spec.name} files back with heads of {spec.head_dim}; {source} has {head_dim}")
    if config.get("use_sliding_window"):
        raise ConfigError(f"--format gguf: {source} uses sliding-window attention, which is not mapped")
    return spec


def export_gguf(
    model: str | Path, out: str | Path, fmt: GGUFExport, include_lm_head: bool = False, force: bool = False, allow_partial: bool = False,
    revision: str | None = None, transform: Transform | None = None, layer_bits: Mapping[int, int] | None = None,
) -> ExportSummary:
    """Quantize `model`'s decoder-layer linears (and lm_head with `include_lm_head`) to fmt's GGUF type and write
    the GGUF file `out`, atomically; it is read back and checked before it replaces anything. `model`: any name
    `quantdiff.load` takes (a GGUF source gives its own tokenizer fields); `revision` for a hub id. `transform`:
    SmoothQuant smoothing folded into the norms and weights first (a rotation is refused: llama.cpp would not
    rotate the inputs), recorded in the file's quantdiff section. `layer_bits`: {decoder layer: bits}, a
    mixed-precision plan (`quant.layer_bits`): each layer's linears in its width's type (8: Q8_0, 4: Q4_0, 16: the
    source's float type), lm_head in fmt's; `general.file_type` names fmt's, each tensor its own type."""
    source, gguf_source, out = check_one_model(model, resolve(model, revision), "MODEL"), source_gguf_file(model), Path(out)
    _check_out(out, force, [source, *([gguf_source] if gguf_source else [])])
    check_exportable(transform, own_format=False)
    if layer_bits is not None:
        check_widths(layer_bits, fmt)  # before the (slow) load; the layer indices once the model is known
    config = json.loads((source / "config.json").read_text())
    arch = gguf_architecture(config, source)
    source_config = load_config(source)
    check_held(source_config, source, arch.name)
    if gguf_source is None:  # a tokenizer the file cannot hold is refused before the (slow) load
        check_bpe_tokenizer(source)
    network = load(source, device="cpu")
    refuse_nonfinite(network.named_parameters(), source)
    targets = linear_targets(network, LinearSite(include_lm_head=include_lm_head), allow_partial)
    tied = _tied_to_other(network, targets)
    if tied:
        raise ConfigError(f"{tied} shares its weight with another tensor (tied embeddings): it cannot be quantized alone")
    source_dtype = network.get_input_embeddings().weight.dtype
    fmt = _resolved(fmt, source_dtype)
    planned = {fqn: fmt for fqn, _ in targets} if layer_bits is None else module_formats(network, [fqn for fqn, _ in targets], fmt, layer_bits)
    formats = {fqn: _resolved(module_fmt, source_dtype) for fqn, module_fmt in planned.items()}
    for fqn, module in targets:
        formats[fqn].check_width(fqn, module.weight)
    extra = {} if transform is None else {"transform": export_transform(network, source, transform, targets, own_format=False)}
    if layer_bits is not None:
        extra.update(recorded(layer_bits, formats))
    chosen = set(formats)
    skipped = [fqn for fqn, m in network.named_modules() if isinstance(m, nn.Linear) and fqn not in chosen]
    section = {
        **described(fmt, formats.values()), "modules": sorted(chosen), "skipped_modules": skipped, "dtype": "float32",
        "quantdiff_version": __version__, "source": model_source(source), **extra,
    }
    tensors, quantized_bytes = _gguf_tensors(network, config, formats, arch)
    bf16_bytes = sum(module.weight.numel() * 2 for _, module in targets)
    del network, targets  # the read-back below holds a second copy: not three
    with atomic_file(out, force, "--out") as tmp:
        with signals_deferred():
            _write(tmp, arch, config, source, gguf_source, fmt, tensors, section)
            _verify(tmp, tensors)
        del tensors
        reloaded, _, _ = check_reloads(out, lambda: read_gguf(tmp, out))  # as `quantdiff.load` converts it: model and tokenizer
        check_reloaded(source_config, reloaded.config, out)
        del reloaded
    source_bytes = gguf_source.stat().st_size if gguf_source else sum(f.stat().st_size for f in source.glob("*.safetensors"))
    return ExportSummary(out, section, sorted(chosen), skipped, source_bytes, out.stat().st_size, quantized_bytes, bf16_bytes)


def _resolved(fmt: GGUFExport, dtype: torch.dtype) -> GGUFExport:
    """`fmt`, its 16 bits (unquantized) in the source weights' own float type."""
    return GGUFExport.unquantized(dtype) if fmt.bits == UNQUANTIZED_BITS else fmt


def _check_out(out: Path, force: bool, inputs: list[Path]) -> None:
    """A `.gguf` path that is not an input, and not a directory."""
    if out.suffix.lower() != ".gguf":
        raise ConfigError(f"--out of a GGUF export must end in .gguf, got {out}")
    check_outputs({"--out": out}, inputs)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; a GGUF export is one file")
    check_replaceable(out, force, "--out")  # the one rule for files: ours, or any with --force (core.owned)


def _permute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved (convert_hf_to_gguf's `permute`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensors(network: nn.Module, config: dict, formats: dict[str, GGUFExport], arch: GGUFArchitecture) -> tuple[list[tuple], int]:
    """[(gguf name, numpy data, GGML type)] in state-dict order (tied weights once), each module of `formats`
    in its own format's type, and the quantized bytes."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.name.upper()], config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
    heads = heads if arch.permute_qk else {}
    out, quantized_bytes = [], 0
    for name, tensor in _plain_tensors(network, set()).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise LoadError(f"{name} has no llama.cpp tensor name; the file would not load")
        fqn, _, leaf = name.rpartition(".")
        role = fqn.rpartition(".")[2]
        weight = _permute_rows(tensor, heads[role]) if role in heads and leaf == "weight" else tensor
        if fqn in formats and leaf == "weight":
            blocks = formats[fqn].encode(weight)["blocks"].numpy()
            out.append((gguf_name, blocks, formats[fqn].qtype()))
            quantized_bytes += blocks.nbytes
        else:
            out.append((gguf_name, weight.detach().float().numpy(), gguf.GGMLQuantizationType.F32))
    return out, quantized_bytes


class _ReportedWrites(np.ndarray):
    """An array that the GGUF writer writes through the file object: numpy's own `tofile` reports a full disk as
    "N requested and M written", without errno, where the file's `write` raises ENOSPC, which `atomic_file`
    turns into the one `no space left on device` line every format gives."""

    def tofile(self, fid: IO[bytes], *args: object, **kwargs: object) -> None:
        fid.write(memoryview(np.ascontiguousarray(self)))


def _write(tmp: Path, arch: GGUFArchitecture, config: dict, source: Path, gguf_source: Path | None, fmt: GGUFExport, tensors: list, section: dict) -> None:
    import gguf

    writer = gguf.GGUFWriter(tmp, arch.name)
    writer.add_type("model")
    writer.add_name(_source_name(gguf_source) or source.name)
    writer.add_file_type(gguf.LlamaFileType[fmt.file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if head_dim * heads != config["hidden_size"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if gguf_source is not None:
        _copy_tokenizer(writer, gguf_source)
    else:
        add_bpe_tokenizer(writer, source, config["vocab_size"])
    writer.add_string(GGUF_KEY, json.dumps(section, sort_keys=True))
    for name, data, qtype in tensors:
        writer.add_tensor(name, data.view(_ReportedWrites), raw_dtype=qtype if qtype != gguf.GGMLQuantizationType.F32 else None)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()  # on a full disk too: the temporary's descriptor is not left open after it is deleted


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def _source_name(gguf_source: Path | None) -> str | None:
    if gguf_source is None:
        return None
    import gguf

    field = gguf.GGUFReader(gguf_source).get_field("general.name")
    return None if field is None else field.contents()


def _copy_tokenizer(writer, gguf_source: Path) -> None:
    """Every `tokenizer.*` field of the source file, with its value type: the vocabulary llama.cpp built."""
    import gguf

    for key, field in gguf.GGUFReader(gguf_source).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)


def _verify(path: Path, tensors: list) -> None:
    """The written file, read back by the `gguf` package, holds exactly these tensors, names and types."""
    import gguf
    import numpy as np

    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, data, qtype in tensors:
        t = stored.get(name)
        if t is None or t.tensor_type != qtype or not np.array_equal(np.asarray(t.data).reshape(data.shape), data):
            raise LoadError(f"export check failed: {path} does not read back {name}")
    if len(stored) != len(tensors):
        raise LoadError(f"export check failed: {path} holds {len(stored)} tensors, {len(tensors)} were written")
