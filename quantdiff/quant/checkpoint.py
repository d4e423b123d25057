"""Read checkpoints: quantdiff's quantized exports (weights decoded exactly) and plain ones, one `load` for both."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from quantdiff.attention.backend import DEFAULT_TILE_SIZE
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import LoadError
from quantdiff.models import loading
from quantdiff.models.source import model_source
from quantdiff.quant.compressed_tensors import CompressedTensorsExport
from quantdiff.quant.formats import WEIGHTS_NAME, LLMInt8Export, Tensors, format_from_section
from quantdiff.quant.layer_bits import MODULES_KEY, stored_formats
from quantdiff.quant.numerics import PerTensor, compressed_tensors_token_fake_quantize
from quantdiff.quant.sites import LinearSite, LLMInt8Method, QuantConfig, QuantizationHandle, apply_quantization
from quantdiff.quant.transforms import rotate_inputs



def recorded_quantization(section: dict) -> list[dict]:
    """What a quantdiff export's loader quantizes at run time besides its stored weights, one description per
    quantizer in the order `load_quantized` applies them ({method, bits, site, granularity}, as a sweep cell
    names its own): an llm-int8 export's inputs (bitsandbytes' outlier columns over the whole prompt: granularity
    tensor, non-causal), a W8A8 compressed-tensors export's inputs (per token: row), and a recorded attention
    quantization. A cell of such a model is labelled with them (`eval.sweep.Cell.recorded`)."""
    from quantdiff.quant.registry import granularity_name

    fmt = format_from_section(section)
    found = []
    if isinstance(fmt, LLMInt8Export):
        found.append({"method": "llm-int8", "bits": 8, "site": "linear", "granularity": "tensor"})
    if isinstance(fmt, CompressedTensorsExport) and (fmt.bits == 8 if MODULES_KEY not in section else _w8a8_modules(section, fmt)):
        found.append({"method": "compressed-tensors", "bits": 8, "site": "linear", "granularity": "row"})
    if section.get("attention") is not None:
        attention = QuantConfig.from_dict(section["attention"])
        names = attention.to_dict()
        found.append({"method": names["method"]["name"], "bits": names["method"]["bits"], "site": names["site"]["name"],
                      "granularity": granularity_name(attention.method.granularity)})
    return found


def _w8a8_modules(section: dict, fmt: CompressedTensorsExport) -> list[str]:
    """The modules of a compressed-tensors export stored as W8A8 (whose inputs are quantized at run time): every
    one at 8 bits, of a plan's too."""
    return [fqn for fqn, module_fmt in stored_formats(section, fmt).items() if module_fmt.bits == 8]


def recorded_in(path: str | Path) -> list[dict]:
    """`recorded_quantization` of the model directory `path` (none for a model that is not a quantdiff export),
    read from its config.json before any weights load."""
    file = Path(path) / "config.json"
    section = quantdiff_section(json.loads(file.read_text())) if file.is_file() else None
    return [] if section is None else recorded_quantization(section)


def recorded_plan(path: str | Path) -> dict[str, int] | None:
    """The per-layer bits ({"0": 8, ...}) a mixed-precision export at `path` records, else None: a quantdiff or
    compressed-tensors export's section, or a GGUF export's (its dequantized directory's source record)."""
    file = Path(path) / "config.json"
    section = quantdiff_section(json.loads(file.read_text())) if file.is_file() else None
    return (section or model_source(path) or {}).get("layer_bits")


def _module_tensors(stored: Tensors, fqn: str) -> Tensors:
    """The encoded weight of one quantized linear layer; its bias stays an ordinary tensor."""
    prefix = f"{fqn}."
    return {key.removeprefix(prefix): value for key, value in stored.items() if key.startswith(prefix) and key != f"{prefix}bias"}


def quantdiff_section(config: dict) -> dict | None:
    """quantdiff's description of a quantized checkpoint in a config.json dict, or None."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    if qc.get("quant_method") == "quantdiff":
        return {k: v for k, v in qc.items() if k != "quant_method"}
    return qc.get("quantdiff") if isinstance(qc.get("quantdiff"), dict) else None


def quantization_format(path: str | Path) -> str | None:
    """How the model directory `path` is quantized, in words ('quantdiff absmax 4-bit', 'bitsandbytes nf4',
    'gptq'), or None for an unquantized one (no quantization_config in its config.json)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return None
    section = quantdiff_section(config)
    if section is not None:
        return f"quantdiff {section.get('method')} {section.get('bits')}-bit"
    method = str(qc.get("quant_method", "unknown"))
    if method == "bitsandbytes":
        return f"bitsandbytes {qc.get('bnb_4bit_quant_type', 'nf4')}" if qc.get("load_in_4bit") else "bitsandbytes llm-int8"
    return method


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
    tile_size: int | None = DEFAULT_TILE_SIZE,
) -> nn.Module:
    """A quantdiff export as a float model (weights decoded) on the quantdiff backend, in eval mode.

    dtype: cast the decoded model (default: the dtype it was exported from, which keeps weights bit-exact).

    An llm-int8 export also quantizes linear inputs at run time (LLM.int8 with the stored threshold), a
    compressed-tensors W8A8 one per token as the compressed-tensors package does (`compressed_tensors_inputs`);
    a recorded attention quantization is re-applied, and a recorded Hadamard rotation rotates the inputs of the
    modules whose weights it stores rotated. Their handles are in `model.quantdiff_handles`.
    Only model.safetensors is read: pickled files beside it are never opened.
    """
    from transformers import AutoModelForCausalLM

    path = loading.check_model_dir(path)
    section = quantdiff_section(json.loads((path / "config.json").read_text()))
    if section is None:
        raise LoadError(f"{path} is not a quantdiff quantized checkpoint (no quantdiff quantization_config)")
    fmt = format_from_section(section)
    formats = stored_formats(section, fmt)  # each module's own width (a mixed-precision plan's)
    file = path / WEIGHTS_NAME
    if not file.is_file():
        raise LoadError(f"no {WEIGHTS_NAME} in {path}")
    with safe_open(str(file), framework="pt") as f:
        stored_section = (f.metadata() or {}).get("quantization_config")
    if stored_section is None or json.loads(stored_section) != section:
        raise LoadError(f"{file} does not belong to this config.json (its quantization metadata differs)")

    config = loading.load_config(path)  # its sizes and transformers' validation as one line, never a raw exception
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
            state[f"{fqn}.weight"] = formats[fqn].decode(encoded, module.weight.shape, stored_dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise LoadError(f"cannot decode {fqn} in {file}: {exc}") from None
    state.update(stored)
    loading.check_tensors(model, {name: tuple(t.shape) for name, t in state.items()}, file)
    model.load_state_dict(state, strict=False)  # strict=False: a tied weight is stored once, re-tied below
    model.tie_weights()
    model.to(device=resolve_device(device), dtype=dtype)
    loading.prepare(model, tile_size)

    handles = []
    if (section.get("transform") or {}).get("name") == "hadamard":  # before any input quantizer: it sees xH
        handles.append(QuantizationHandle(rotate_inputs(model, section["transform"]["modules"])))
    if isinstance(fmt, LLMInt8Export):  # bitsandbytes quantizes the inputs at run time, with the stored threshold
        chosen = set(section["modules"])
        inputs = LinearSite(filter=lambda m, fqn: fqn in chosen, weights=False)
        # bitsandbytes picks a forward's outlier columns over all its tokens (a prompt: non-causal), so the reload
        # does too (granularity tensor: per sequence), to stay what transformers + bitsandbytes compute.
        handles.append(apply_quantization(model, QuantConfig(LLMInt8Method(8, fmt.threshold, PerTensor()), inputs)))
    if isinstance(fmt, CompressedTensorsExport) and _w8a8_modules(section, fmt):
        handles.append(compressed_tensors_inputs(model, _w8a8_modules(section, fmt)))
    if section.get("attention") is not None:
        handles.append(apply_quantization(model, QuantConfig.from_dict(section["attention"])))
    model.quantdiff_handles = handles
    model.quantdiff_recorded = recorded_quantization(section)  # what its cells must say ran
    return model


def compressed_tensors_inputs(model: nn.Module, modules: list[str]) -> QuantizationHandle:
    """W8A8's run-time activations, as transformers computes them from a compressed-tensors `int-quantized`
    checkpoint: each listed module's input through the package's dynamic per-token rule (absmax/127.5, clamp to
    [−128, 127], `numerics.compressed_tensors_token_fake_quantize`), in the model's dtype, before its float
    matmul with the decoded weight (the package's `set_forward_quantized`)."""
    found = dict(model.named_modules())
    quantize = lambda module, args: (compressed_tensors_token_fake_quantize(args[0]), *args[1:])  # noqa: E731
    hooks = [found[fqn].register_forward_pre_hook(quantize) for fqn in modules]
    return QuantizationHandle([hook.remove for hook in hooks])


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
    tile_size: int | None = DEFAULT_TILE_SIZE,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Any checkpoint quantdiff reads, on the quantdiff backend in eval mode: a plain model directory, or a
    quantdiff quantized export (weights decoded, recorded quantizations re-applied)."""
    if is_quantdiff_checkpoint(loading.check_model_dir(path)):
        if device_map is not None:
            raise LoadError("quantized quantdiff checkpoints load on one device (no device_map)")
        return load_quantized(path, device=device, dtype=dtype, tile_size=tile_size)
    return loading.load(path, device=device, dtype=dtype, device_map=device_map, tile_size=tile_size, trust_remote_code=trust_remote_code)
