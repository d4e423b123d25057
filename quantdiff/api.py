"""The public Python API behind `quantdiff.<name>`: the same model names as the CLI, errors naming parameters.

Every argument is checked at this boundary (`api_checks`) with the CLI's own checks, so every failure is a
`QuantdiffError` with a one-line message."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence, get_args

import torch
from torch import nn

from quantdiff import api_checks as check
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int
from quantdiff.core.memory import check_fits
from quantdiff.data.sources import Batch, make_batches
from quantdiff.models import loading
from quantdiff.models.names import check_one_model, resolve
from quantdiff.quant import checkpoint, export, formats, gguf_export, kv_cache as kv_caches, kv_layout as kv_layouts, sites, transforms
from quantdiff.quant.formats import ExportFormat
from quantdiff.quant.gguf_format import GGUFExport
from quantdiff.quant.precision_plan import PlannedConfig, PrecisionPlan, planned_config
from quantdiff.stats.collect import DEFAULT_K
from quantdiff.stats.collect import collect_stats as collect_batches
from quantdiff.stats.model_stats import ModelStats

LOAD_KEYWORDS = ("device_map", "tile_size", "trust_remote_code")
EXPORT_KEYWORDS = ("include_lm_head", "force", "attention", "allow_partial", "trust_remote_code", "layer_bits")
GGUF_EXPORT_KEYWORDS = ("include_lm_head", "force", "allow_partial", "layer_bits")


def _one_model(model: str | Path) -> Path:
    return check_one_model(model, resolve(check.model_name(model)), "model")


@check.arguments
def load(model: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None, **kwargs: Any) -> nn.Module:
    """A built-in name ('tiny/diff', 'smollm2', 'gemma3'), a local model directory, a GGUF file (its dequantized copy), a
    hub id or a quantdiff export, on the quantdiff backend.

    device: default CUDA when present, else CPU; dtype: a floating torch.dtype or its name ('bfloat16'); other
    keywords (`device_map`, `tile_size` (None or 0: one tile), `trust_remote_code`) as `checkpoint.load`.
    """
    check.known_keywords(kwargs, LOAD_KEYWORDS, "load")
    if "tile_size" in kwargs:
        kwargs["tile_size"] = check.tile_size(kwargs["tile_size"])
    if "trust_remote_code" in kwargs:
        check.flag(kwargs["trust_remote_code"], "trust_remote_code")
    check.device_map(kwargs.get("device_map"))
    check.model_name(model)
    wanted = check.dtype(dtype)
    if kwargs.get("device_map") is None:
        resolve_device(device, "device")  # before anything is resolved or loaded
    return checkpoint.load(_one_model(model), device=device, dtype=wanted, **kwargs)


@check.arguments
def load_tokenizer(model: str | Path):
    """The tokenizer stored with a model (any name `load` takes)."""
    return loading.load_tokenizer(_one_model(model))


@check.arguments
def collect_stats(
    model: nn.Module,
    data: torch.Tensor | Sequence[Batch],
    k: int = DEFAULT_K,
    batch_size: int = 4,
    compile: bool | None = None,
) -> ModelStats:
    """Attention-logit and hidden-state statistics of `model` over `data`: token ids (B, T) (or (T,)) cut into
    batches of `batch_size` rows, or ready `Batch`es. The result is what `quantdiff stats --json` writes
    (`ModelStats.summary()`), and merges exactly with statistics of other data. Empty data, ids outside the
    vocabulary and sequences longer than the model's positions are refused."""
    check.quantdiff_model(model)
    check.positive_int(k, "k")
    check.positive_int(batch_size, "batch_size")
    if compile is not None:
        check.flag(compile, "compile")
    config = model.config
    layers, heads = getattr(config, "num_hidden_layers", 1), getattr(config, "num_attention_heads", 1)
    check_fits(ModelStats.topk_bytes(layers, heads, k), f"k={k:,}")  # as `quantdiff stats --top-k`
    if isinstance(data, torch.Tensor):
        data = make_batches(check.token_ids(data, model).tolist(), batch_size)
    else:
        data = check.batches(data, model)
    return collect_batches(model, data, k, compile=compile)


def _config(config: Any, plans: bool = True) -> sites.QuantConfig | PlannedConfig | None:
    """A config as given; with `plans`, a mixed-precision plan (`quantdiff.load_plan`) as its per-width configs."""
    if plans and isinstance(config, PrecisionPlan):
        return planned_config(config)
    if config is not None and not isinstance(config, sites.QuantConfig):
        plan = " or a PrecisionPlan (quantdiff.load_plan(path))" if plans else ""
        raise ConfigError(f"config must be a QuantConfig (quantdiff.parse_config(method, bits, site)){plan} or None, got {check.kind_of(config)}")
    return config


@check.arguments
@contextmanager
def quantized(model: nn.Module, config: sites.QuantConfig | PrecisionPlan | None, allow_partial: bool = False) -> Iterator[nn.Module]:
    """`model` quantized as `config` says inside the block (see `quant.sites.quantized`)."""
    check.quantdiff_model(model)
    check.flag(allow_partial, "allow_partial")
    with sites.quantized(model, _config(config), allow_partial) as inside:
        yield inside


@check.arguments
def apply_quantization(model: nn.Module, config: sites.QuantConfig | PrecisionPlan | None) -> sites.QuantizationHandle:
    """Fake-quantize `model` in place as `config` says until the handle's `remove()` (see `quant.sites`)."""
    check.quantdiff_model(model)
    return sites.apply_quantization(model, _config(config))


@check.arguments
def export_quantized(model: str | Path, out: str | Path, fmt: ExportFormat, **kwargs: Any) -> export.ExportSummary:
    """Quantize a model's linear weights and write a model directory at `out` (see `quant.export`), or with a
    GGUF format (`parse_export(..., format="gguf")`) the GGUF file `out` (see `quant.gguf_export`).
    `layer_bits={layer: bits}`: a mixed-precision plan, each decoder layer's linears at its own width (`quant.layer_bits`)."""
    from quantdiff.core.savedir import check_target
    from quantdiff.models.inputs import model_inputs

    check.known_keywords(kwargs, EXPORT_KEYWORDS, "export_quantized")
    for name in ("include_lm_head", "force", "allow_partial", "trust_remote_code"):
        if name in kwargs:
            check.flag(kwargs[name], name)
    if "attention" in kwargs:
        _config(kwargs["attention"], plans=False)
    if not isinstance(fmt, get_args(ExportFormat)):
        raise ConfigError(f"fmt must be an export format (quantdiff.parse_export(method, bits)), got {check.kind_of(fmt)}")
    if isinstance(fmt, GGUFExport):  # one file, written by its own writer (which checks its target)
        check.known_keywords(kwargs, GGUF_EXPORT_KEYWORDS, "export_quantized with a GGUF format")
        check.model_name(out, "out", "a file path")
        return gguf_export.export_gguf(model, out, fmt, **kwargs)
    check.model_name(out, "out", "a directory path")
    source = _one_model(model)
    check_target(out, kwargs.get("force", False), model_inputs([model], [source]), flag="out", kind="export")
    return export.export_quantized(source, out, fmt, **kwargs)


@check.arguments
def kv_cache(model: nn.Module, plan: Any = None, bits: int | None = None, group_size: int | None = None,
             layout: str | kv_layouts.KVLayout = "kivi") -> kv_caches.QuantizedKVCache:
    """A KV cache storing keys and values quantized, for
    `model.generate(..., past_key_values=quantdiff.kv_cache(model, plan))` (see `quant.kv_cache`). layout: "kivi"
    (keys per channel over 128-token blocks, values per token, zero-points, recent tokens in float) or "token"
    (per token and KV head, symmetric, every token quantized as written), an engine's own codes ("q8_0", "q4_0",
    "vllm-int8-head", "vllm-int4-head", "vllm-fp8-head", "vllm-fp8-tensor": `quant.kv_engines`), or a `quant.kv_layout.KVLayout`."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a loaded model (quantdiff.load(...)), got {check.kind_of(model)}")
    chosen = layout if isinstance(layout, kv_layouts.KVLayout) else kv_layouts.layout_named(layout)
    return kv_caches.kv_cache(model, plan, bits, group_size, chosen)


# The config builders, with their calls checked as every function here (their own checks cover the values).
parse_config = check.arguments(sites.parse_config)
parse_export = check.arguments(formats.parse_export)


@check.arguments
def calibrated_configs(configs: Sequence[sites.QuantConfig], model: nn.Module, tokenizer: Any, bos_id: int | None = None) -> list[sites.QuantConfig]:
    """`configs` with every smoothing calibrated on `model` (see `quant.transforms.calibrated_configs`)."""
    if isinstance(configs, (str, bytes)) or not isinstance(configs, Sequence):
        raise ConfigError(f"configs must be a list of QuantConfig (quantdiff.parse_config(...)), got {check.kind_of(configs)}")
    wrong = next((c for c in configs if not isinstance(c, sites.QuantConfig)), False)
    if wrong is not False:
        raise ConfigError(f"configs must be a list of QuantConfig (quantdiff.parse_config(...)), got a list holding {check.kind_of(wrong)}")
    check.quantdiff_model(model)
    if bos_id is not None and (as_int(bos_id) is None or bos_id < 0):
        raise ConfigError(f"bos_id must be a token id (an integer of at least 0) or None, got {bos_id!r}")
    return transforms.calibrated_configs(configs, model, tokenizer, None if bos_id is None else as_int(bos_id))


@check.arguments
def damage(model: nn.Module, ids: torch.Tensor, config: sites.QuantConfig | PrecisionPlan, *, layers: Sequence[int] | None = None, batch_size: int = 4) -> dict:
    """How far `model` quantized as `config` moves from itself in full precision on token ids (B, T) (or (T,)):
    per-token KL divergence (mean, median, p99, max), Δp of the correct token (mean, RMS), same top-1 rate and
    Δ loss, llama.cpp's `--kl-divergence` measures (see `eval.damage`). `layers`: quantize only those decoder
    layers (replaces `config.layers`; not with a plan, which sets every layer's width)."""
    from dataclasses import replace

    from quantdiff.eval.damage import damages

    check.quantdiff_model(model)
    check.positive_int(batch_size, "batch_size")
    if isinstance(config, PrecisionPlan) and layers is not None:
        raise ConfigError("layers does not apply to a PrecisionPlan: the plan sets every decoder layer's width")
    if config is None:
        raise ConfigError("config must be a QuantConfig (quantdiff.parse_config(method, bits, site)) or a PrecisionPlan, got None")
    config = _config(config)
    if isinstance(config, PlannedConfig):
        config.plan.check_model(model)
    elif layers is not None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not all(as_int(l) is not None for l in layers):
            raise ConfigError(f"layers must be a list of decoder-layer indices or None, got {layers!r:.60}")
        config = replace(config, layers=tuple(as_int(l) for l in layers))
    for part in config.parts if isinstance(config, PlannedConfig) else [config]:
        sites.chosen_layers(model, part)
    batches = make_batches(check.token_ids(ids, model).tolist(), batch_size)
    return damages(model, batches, [config])[0][0]
