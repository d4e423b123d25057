"""Where a quantization acts on a model: config types, a registry of site handlers, apply/remove.

A `QuantConfig` pairs a method (how to quantize a tensor) with a site (which tensors). Handlers are looked up
by site type; nothing past the CLI boundary (`parse_config`) reads a mode string. Every handler records undo
callables, so removing a configuration leaves the model exactly as it was (same Parameter objects, same taps).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, get_args

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.attention.coverage import tracking
from quantdiff.core.typed import checked_class
from quantdiff.core.errors import ConfigError
from quantdiff.models import structure
from quantdiff.quant.numerics import (
    LLM_INT8_THRESHOLD,
    Granularity,
    PerColumn,
    PerRow,
    PerTensor,
    absmax_quantize,
    absmax_weight_quantize,
    check_bits,
    absmax,
    check_group_size,
    fake_quantize_with_absmax,
    outlier_features,
    rowwise_absmax_quantize,
    tokenwise_vectorwise_quantize,
    vectorwise_quantize,
)
from quantdiff.quant import kv_layout
from quantdiff.quant.kv_layout import KVLayout
from quantdiff.quant.kv_plan import KVPlan, plan_quantizers
from quantdiff.quant.registry import DEFAULT_GRANULARITY, granularity_name, is_causal, method_name, parse_bit_width, site_name
from quantdiff.quant.registry import granularity as _granularity
from quantdiff.quant.transforms import Transform, apply_transform, transform_from_dict

ModuleFilter = Callable[[nn.Module, str], bool]


# ---- methods: how one tensor is quantized -------------------------------------------------------------------


@checked_class
@dataclass(frozen=True)
class AbsmaxMethod:
    """Symmetric absmax. `granularity` applies to activations (logits, Q/K, linear inputs) and the KV cache.
    PerRow, the default, is causal: one scale per token (linear inputs; Q and K per token and head), per query row
    over its causal entries (logits), per token and KV head (kv). PerTensor is the former default, one scale per
    sequence, and PerColumn one per channel over the sequence's tokens: both let later tokens change earlier
    tokens' scales (not causal). Linear weights are quantized per output channel, or with `weight_group_size` G
    in groups of G inputs of each output channel (the linear site only)."""

    bits: int
    granularity: Granularity = PerRow()
    weight_group_size: int | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not isinstance(self.granularity, (PerTensor, PerRow, PerColumn)):
            raise ConfigError(f"unknown granularity {self.granularity!r}")
        if self.weight_group_size is not None:
            check_group_size(self.weight_group_size)


@checked_class
@dataclass(frozen=True)
class LLMInt8Method:
    """LLM.int8 (vector-wise absmax + exact outlier feature columns), generalised to `bits`.

    `granularity` says where the outlier features are chosen: PerRow (the default, causal) per token, each token's
    own entries at or above the threshold, as bitsandbytes finds them decoding one token at a time; PerTensor (not
    causal) the columns where any token of the sequence holds one, as bitsandbytes finds them over a whole prompt.
    The row scales are per token either way."""

    bits: int = 8
    threshold: float = LLM_INT8_THRESHOLD
    granularity: Granularity = PerRow()

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not self.threshold > 0:
            raise ConfigError(f"LLM.int8 threshold must be positive, got {self.threshold}")
        if not isinstance(self.granularity, (PerRow, PerTensor)):
            raise ConfigError(f"LLM.int8 chooses its outlier features per token (granularity row) or per sequence (tensor), not {self.granularity!r}")


Method = AbsmaxMethod | LLMInt8Method


# ---- sites: which tensors ----------------------------------------------------------------------------------


@checked_class
@dataclass(frozen=True)
class LogitsSite:
    """Pre-softmax attention scores (QKᵀ·scaling), causal entries only; for Diff both maps."""


@checked_class
@dataclass(frozen=True)
class QKSite:
    """Q and K as operands of the logits matmul."""


@checked_class
@dataclass(frozen=True)
class LinearSite:
    """Weights and inputs of nn.Linear layers. Default: floating-point nn.Linear inside decoder layers,
    plus lm_head if `include_lm_head`; `filter (module, fqn) -> bool` replaces that choice (not serialisable).
    `weights=True, inputs=False` is weight-only quantization, what an exported absmax checkpoint holds.
    `transform`: a Hadamard rotation or SmoothQuant smoothing applied first (`quant.transforms`)."""

    include_lm_head: bool = False
    filter: ModuleFilter | None = field(default=None, compare=False)
    weights: bool = True
    inputs: bool = True
    transform: Transform | None = None

    def __post_init__(self) -> None:
        if not (self.weights or self.inputs):
            raise ConfigError("a linear site must quantize weights, inputs or both")


@checked_class
@dataclass(frozen=True)
class KVSite:
    """The keys and values attention reads, after RoPE, as a KV cache holds them. Absmax only, at any 2–16 bits.
    At the default granularity (row, causal) each token is quantized as it is written: keys and values one scale
    per token and KV head over the head's channels, or per `group_size` channels of it (vLLM's per-token-head
    INT8 KV and llama.cpp's q8_0/q4_0 blocks of 32 approximately: their exact codes are the `vllm-int8-head`,
    `q8_0` and `q4_0` layouts); `quantdiff.kv_cache(..., layout="token")` stores exactly these codes.
    At granularity tensor (the former default, not causal) KIVI's scheme over the whole sequence (Liu et al.
    2024, §3): keys per channel (one scale per sequence, KV head and channel, over the sequence's tokens), values
    per token; KIVI's token groups and full-precision window of recent tokens are left out.
    `plan`: per-layer, per-KV-head bits and positions kept at 16 bits (`quant.kv_plan`); the method's bits are
    then the plan's budget.
    `layout`: a cache layout (`quant.kv_layout`, e.g. KIVI's, `quantdiff.kv_cache`'s default) quantized with the
    cache's own functions: every complete block as the cache holds it once the sequence is written, the trailing
    incomplete block in float. Not causal within a block unless the layout is (per token, no residual)."""

    plan: KVPlan | None = None
    group_size: int | None = None
    layout: KVLayout | None = None

    def __post_init__(self) -> None:
        if self.group_size is not None:
            check_group_size(self.group_size)
        if self.layout is not None and not isinstance(self.layout, KVLayout):
            raise ConfigError(f"a kv site's layout must be a KVLayout (quantdiff.quant.kv_layout), got {type(self.layout).__name__}")
        if self.layout is not None and self.group_size is not None:
            raise ConfigError("a kv layout carries its own group size: give it there, not as the site's group_size")


Site = LogitsSite | QKSite | LinearSite | KVSite
SITE_TYPES: dict[str, type] = {"logits": LogitsSite, "qk": QKSite, "linear": LinearSite, "kv": KVSite}  # keys: registry.SITE_NAMES


@checked_class
@dataclass(frozen=True)
class QuantConfig:
    """`layers`: the decoder layers (0-based) quantized at the site; None: every layer (and, at site linear, the
    lm_head when the site includes it; a layer subset leaves the lm_head alone)."""

    method: Method
    site: Site
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            if any(layer < 0 for layer in self.layers):
                raise ConfigError(f"layers must be decoder-layer indices of at least 0, got {list(self.layers)}")
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))

    def to_dict(self) -> dict:
        chosen = {} if self.layers is None else {"layers": list(self.layers)}
        return {"method": _method_to_dict(self.method), "site": _site_to_dict(self.site), **chosen}

    @classmethod
    def from_dict(cls, data: dict) -> QuantConfig:
        if not isinstance(data, dict) or not {"method", "site"} <= set(data) <= {"method", "site", "layers"}:
            raise ConfigError("a quantization config needs the keys 'method' and 'site' (and optionally 'layers'), no others")
        layers = data.get("layers")
        if layers is not None and (not isinstance(layers, list) or not all(type(l) is int for l in layers)):
            raise ConfigError(f"a quantization config's layers must be a list of integers, got {layers!r:.60}")
        return cls(_method_from_dict(data["method"]), _site_from_dict(data["site"]), None if layers is None else tuple(layers))

    def parts_for(self, model: nn.Module) -> list[QuantConfig]:
        """The configs `apply_quantization` applies to `model`: this one (a mixed-precision plan's
        `precision_plan.PlannedConfig` gives one per width, after checking the plan fits the model)."""
        return [self]


# ---- the JSON form of configs (names from `registry`) -------------------------------------------------------


def _method_to_dict(method: Method) -> dict:
    if isinstance(method, AbsmaxMethod):
        grouped = {} if method.weight_group_size is None else {"weight_group_size": method.weight_group_size}
        return {"name": "absmax", "bits": method.bits, "granularity": granularity_name(method.granularity), **grouped}
    return {"name": "llm-int8", "bits": method.bits, "threshold": method.threshold, "granularity": granularity_name(method.granularity)}


def _site_to_dict(site: Site) -> dict:
    if isinstance(site, LinearSite):
        if site.filter is not None:
            raise ConfigError("a linear site with a custom module filter cannot be serialised")
        transform = {} if site.transform is None else {"transform": site.transform.to_dict()}
        return {"name": "linear", "include_lm_head": site.include_lm_head, "weights": site.weights, "inputs": site.inputs, **transform}
    if isinstance(site, KVSite) and (site.plan is not None or site.group_size is not None or site.layout is not None):
        grouped = {} if site.group_size is None else {"group_size": site.group_size}
        laid = {} if site.layout is None else {"layout": site.layout.to_dict()}
        return {"name": "kv", **({} if site.plan is None else {"plan": site.plan.to_dict()}), **grouped, **laid}
    return {"name": site_name_of(site)}


def _method_from_dict(data: object) -> Method:
    if not isinstance(data, dict):
        raise ConfigError("quantization method must be an object")
    fields = dict(data)
    name = method_name(fields.pop("name", None))
    # A config written before causal scales became the default names no granularity: it ran per sequence.
    granularity = _granularity(fields.pop("granularity", "tensor"))
    try:
        if name == "absmax":
            return AbsmaxMethod(granularity=granularity, **fields)
        return LLMInt8Method(granularity=granularity, **fields)
    except TypeError as exc:  # unknown or missing keys
        raise ConfigError(f"bad {name} method settings: {exc}") from None


def _site_from_dict(data: object) -> Site:
    if not isinstance(data, dict):
        raise ConfigError("quantization site must be an object")
    fields = dict(data)
    name = site_name(fields.pop("name", None))
    if name == "linear" and fields.get("transform") is not None:
        fields["transform"] = transform_from_dict(fields["transform"])
    if name == "kv" and fields.get("plan") is not None:
        fields["plan"] = KVPlan.from_dict(fields["plan"])
    if name == "kv" and fields.get("layout") is not None:
        fields["layout"] = KVLayout.from_dict(fields["layout"])
    try:
        return SITE_TYPES[name](**fields)
    except TypeError as exc:
        raise ConfigError(f"bad {name} site settings: {exc}") from None


def parse_config(
    method: str,
    bits: int | str,
    site: str,
    granularity: str = DEFAULT_GRANULARITY,
    threshold: float = LLM_INT8_THRESHOLD,
    include_lm_head: bool = False,
    group_size: int | None = None,
    transform: Transform | None = None,
    kv_layout: str | None = None,
    layers: Sequence[int] | None = None,
) -> QuantConfig:
    """Names to config types (the CLI's and the API's way in). Raises ConfigError with a one-line message.

    granularity: "row" (default, causal: per token / query row / token and KV head), "tensor" (one scale per
    sequence, not causal: the former default) or "column" (per channel over the sequence, not causal).
    group_size: absmax weights in groups of that many inputs per output channel (site linear), or the KV cache's
    rows in groups of that many channels (site kv, granularity row).
    transform: a Hadamard rotation or SmoothQuant smoothing before quantizing (site linear only).
    kv_layout: a KV-cache layout by name (`quant.kv_layout.LAYOUTS`: "kivi", "token", "q8_0", "q4_0", "vllm-int8-head",
    "vllm-int4-head", "vllm-fp8-head", "vllm-fp8-tensor"; site kv only), quantized with `quantdiff.kv_cache`'s own functions;
    group_size then sets the layout's groups.
    layers: quantize only these decoder layers (0-based) at the site; checked against the model when applied."""
    bits = parse_bit_width(bits)
    _refuse_ignored(method_name(method), site_name(site), threshold, include_lm_head)
    if transform is not None and not isinstance(transform, get_args(Transform)):  # a name is not a transform
        raise ConfigError(f"transform must be None, a HadamardRotation or a Smoothing (quantdiff.HadamardRotation()), got {transform!r}")
    if group_size is not None and site_name(site) not in ("linear", "kv"):
        raise ConfigError(f"a group size sets how the linear site's weights or the kv site's rows are quantized, not site {site!r}")
    if kv_layout is not None and site_name(site) != "kv":
        raise ConfigError(f"a kv layout sets how the kv site quantizes the cache, not site {site!r}")
    kv_groups = group_size if site_name(site) == "kv" else None
    if kv_groups is not None:
        group_size = None  # the cache's rows are grouped, not any weight
    if transform is not None and site_name(site) != "linear":
        raise ConfigError(f"a {transform.name} transform acts on the linear site's inputs and weights, not site {site!r}")
    if method_name(method) == "absmax":
        method_cfg: Method = AbsmaxMethod(bits, _granularity(granularity), group_size)
    elif group_size is not None:
        raise ConfigError("group-wise weights are an absmax option: LLM.int8 quantizes weights per output channel")
    else:
        method_cfg = LLMInt8Method(bits, threshold, _granularity(granularity))
    site_type = SITE_TYPES[site_name(site)]
    if site_type is LinearSite:
        site_cfg: Site = site_type(include_lm_head=include_lm_head, transform=transform)
    else:
        site_cfg = _kv_site(kv_groups, kv_layout) if site_type is KVSite else site_type()
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence)
                               or not all(type(l) is int for l in layers)):
        raise ConfigError(f"layers must be a list of decoder-layer indices or None, got {layers!r:.60}")
    config = QuantConfig(method_cfg, site_cfg, None if layers is None else tuple(layers))
    check_supported(config)
    return config


def _kv_site(group_size: int | None, layout: str | None) -> KVSite:
    if layout is None:
        return KVSite(group_size=group_size)
    return KVSite(layout=kv_layout.layout_named(layout, group_size=group_size))


def _refuse_ignored(method: str, site: str, threshold: object, include_lm_head: object) -> None:
    """A setting the chosen method or site would not read is an error, as the CLI's options are (a value equal
    to its default changes nothing, and is accepted)."""
    if method != "llm-int8" and threshold != LLM_INT8_THRESHOLD:
        raise ConfigError(f"threshold is an LLM.int8 setting: method {method} would ignore threshold={threshold!r}")
    if not isinstance(include_lm_head, bool):
        raise ConfigError(f"include_lm_head must be True or False, got {include_lm_head!r}")
    if include_lm_head and site != "linear":
        raise ConfigError(f"include_lm_head chooses the linear site's layers: site {site} would ignore it")


# ---- the quantizers the handlers install ------------------------------------------------------------------


@dataclass(frozen=True)
class LogitsQuantizer:
    """A tap's logits quantizer: absmax over the valid logits of every key tile (the backend's pre-pass)."""

    bits: int
    per_row: bool
    needs_absmax = True  # asks the attention backend for the absmax pre-pass

    def __call__(self, logits: torch.Tensor, ctx: attention.TileContext) -> torch.Tensor:
        amax = ctx.row_absmax if self.per_row else ctx.tensor_absmax  # (B,H,rows,1) or (B,1,1,1)
        return fake_quantize_with_absmax(logits, amax, self.bits, mask=ctx.valid)


@dataclass(frozen=True)
class AbsmaxQKQuantizer:
    method: AbsmaxMethod

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q (B, H, T, D), k (B, Hkv, S, D); batch_dims=1 keeps one scale per sequence, never per batch.
        bits, granularity = self.method.bits, self.method.granularity
        return (
            absmax_quantize(q, bits, granularity, batch_dims=1).dequant,
            absmax_quantize(k, bits, granularity, batch_dims=1).dequant,
        )


@dataclass(frozen=True)
class LLMInt8QKQuantizer:
    """Q and K row-wise (per token and head); head-dim features where Q or K holds an outlier stay exact.

    The outlier features are the union of Q's and K's within each sequence and KV-head group, so that
    every product q·k uses the same exact features on both sides.
    """

    method: LLMInt8Method

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if is_causal(self.method.granularity):  # each token and head its own outlier features, on each side
            bits, threshold = self.method.bits, self.method.threshold
            return tokenwise_vectorwise_quantize(q, bits, threshold), tokenwise_vectorwise_quantize(k, bits, threshold)
        b, h, _, d = q.shape
        hkv = k.shape[1]
        q_out = outlier_features(q, self.method.threshold)  # (B, H, 1, D)
        q_out = q_out.view(b, hkv, h // hkv, 1, d).any(dim=2)  # (B, Hkv, 1, D): query heads sharing a KV head
        kv_out = q_out | outlier_features(k, self.method.threshold)  # (B, Hkv, 1, D)
        q_mask = attention.repeat_kv(kv_out, h // hkv)  # (B, H, 1, D)
        bits, threshold = self.method.bits, self.method.threshold
        return (
            vectorwise_quantize(q, bits, threshold, outliers=q_mask).dequant,
            vectorwise_quantize(k, bits, threshold, outliers=kv_out).dequant,
        )


@dataclass(frozen=True)
class KVQuantizer:
    """A tap's K/V quantizer (`KVSite`); K (B, Hkv, S, D) and V (B, Hkv, S, Dv) in the layout the KV cache holds.
    Causal (the default): every row, one token of one KV head, on its own scale(s), as `kv_cache`'s `token` layout
    writes it;
    otherwise KIVI over the sequence (keys per channel, values per token)."""

    bits: int
    causal: bool = True
    group_size: int | None = None
    layout: KVLayout | None = None  # a cache layout: its own quantizers (`kv_layout.fake_quantize`), as the cache stores

    def keys(self, key: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """valid (B, 1, S, 1) bool: the key positions some query may attend to (padding is not in a sequence's cache;
        a layout's blocks, as the cache's, do not know it)."""
        if self.layout is not None:
            return kv_layout.fake_quantize(key, self.bits, self.layout, keys=True)
        if self.causal:
            return rowwise_absmax_quantize(key, self.bits, self.group_size).dequant
        return fake_quantize_with_absmax(key, absmax(key, PerColumn(), mask=valid, batch_dims=2), self.bits)

    def values(self, value: torch.Tensor) -> torch.Tensor:
        if self.layout is not None:
            return kv_layout.fake_quantize(value, self.bits, self.layout, keys=False)
        if self.causal:
            return rowwise_absmax_quantize(value, self.bits, self.group_size).dequant
        return fake_quantize_with_absmax(value, absmax(value, PerRow()), self.bits)


def causal(config: QuantConfig | None) -> bool:
    """True when the configuration never lets a later token change an earlier token's quantization."""
    if config is not None and isinstance(config.site, KVSite) and config.site.layout is not None:
        return config.site.layout.causal
    return config is None or is_causal(config.method.granularity)


def fake_quant_weight(weight: torch.Tensor, method: Method) -> torch.Tensor:
    """A linear weight (out, in) quantized per output channel (or in groups of `weight_group_size` inputs of
    each output channel) and dequantized, in its dtype.

    Both methods give the same per-channel weights (LLM.int8 keeps no weight outliers); export writes exactly
    these codes.
    """
    return absmax_weight_quantize(weight, method.bits, getattr(method, "weight_group_size", None)).dequant


def fake_quant_input(x: torch.Tensor, method: Method) -> torch.Tensor:
    """A linear layer's input (B, T, k) or (N, k): per token (causal granularity row), or per sequence, never
    across the batch."""
    if isinstance(method, LLMInt8Method):
        if is_causal(method.granularity):
            return tokenwise_vectorwise_quantize(x, method.bits, method.threshold)
        # Outlier columns per sequence: rows of one (T, k) slice; a 2-d input is one sequence.
        return vectorwise_quantize(x, method.bits, method.threshold).dequant
    return absmax_quantize(x, method.bits, method.granularity, batch_dims=1 if x.dim() > 2 else 0).dequant


# ---- handlers -----------------------------------------------------------------------------------------------

Undo = Callable[[], None]
Handler = Callable[[nn.Module, QuantConfig, list[Undo]], None]  # appends its undo steps as it goes
_HANDLERS: dict[type, Handler] = {}


def register_site(site_type: type) -> Callable[[Handler], Handler]:
    def decorator(fn: Handler) -> Handler:
        _HANDLERS[site_type] = fn
        return fn

    return decorator


def check_supported(config: QuantConfig) -> None:
    if type(config.site) not in _HANDLERS:
        raise ConfigError(f"no handler for quantization site {type(config.site).__name__}")
    if isinstance(config.site, LogitsSite):
        if isinstance(config.method, LLMInt8Method):
            raise ConfigError("llm-int8 quantizes matmul operands: use site 'qk' or 'linear', not 'logits'")
        if isinstance(config.method.granularity, PerColumn):
            raise ConfigError("logits quantization is per tensor or per row, not per column")
    if isinstance(config.site, KVSite):
        if isinstance(config.method, LLMInt8Method):
            raise ConfigError("site kv is absmax (per token and KV head, or KIVI's per sequence); llm-int8 is not defined there")
        if isinstance(config.method.granularity, PerColumn):
            raise ConfigError("site kv is quantized per token and KV head (granularity row) or as KIVI over the sequence (tensor), not per column")
        if config.site.layout is not None and not is_causal(config.method.granularity):
            raise ConfigError("a kv layout sets its own scales: it needs granularity row, not tensor")
        if config.site.layout is not None:
            config.site.layout.check_bits(config.method.bits)
        if config.site.group_size is not None and not is_causal(config.method.granularity):
            raise ConfigError("a kv group size splits each token's row into groups: it needs granularity row, not tensor")
        if config.site.plan is not None and config.method.bits != config.site.plan.budget_bits:
            raise ConfigError(f"a kv plan at a budget of {config.site.plan.budget_bits} bits needs a method at {config.site.plan.budget_bits} bits, not {config.method.bits}")


TAP_SITES = {"logits_quantizer": "logits", "operand_quantizer": "qk", "kv_quantizer": "kv"}  # a tap's slot -> its site


def _occupied(model: nn.Module, tap: attention.Tap, name: str) -> ConfigError:
    """The refusal for a tap slot already holding a quantizer, naming the export's record when it holds it."""
    held = [r for r in getattr(model, "quantdiff_recorded", []) if r["site"] == TAP_SITES[name]]
    where = (f"the model's export records {held[0]['method']} {held[0]['bits']}-bit at site {held[0]['site']}, re-applied on load: "
             "quantize the model it was exported from") if held else "remove it first"
    return ConfigError(f"layer {tap.layer_idx} already has a {name.replace('_', ' ')}: {where}")


def chosen_layers(model: nn.Module, config: QuantConfig) -> list[int] | None:
    """`config.layers` checked against `model`: an index past its last decoder layer is refused by name."""
    if config.layers is None:
        return None
    count = len(structure.decoder_layers(model))
    wrong = [layer for layer in config.layers if layer >= count]
    if wrong:
        raise ConfigError(f"layer {wrong[0]} is out of range: {structure.model_label(model)} has {count} decoder layers (0–{count - 1})")
    return list(config.layers)


def _site_taps(model: nn.Module, config: QuantConfig) -> list[attention.Tap]:
    """The attention taps of the layers `config` quantizes; a chosen layer without attention is refused by name."""
    taps = _model_taps(model)
    layers = chosen_layers(model, config)
    if layers is None:
        return taps
    by_layer = {tap.layer_idx: tap for tap in taps}
    missing = [layer for layer in layers if layer not in by_layer]
    if missing:
        raise ConfigError(f"layer {missing[0]} has no attention for site {site_name_of(config.site)} to quantize")
    return [by_layer[layer] for layer in layers]


def site_name_of(site: Site) -> str:
    return next(name for name, site_type in SITE_TYPES.items() if isinstance(site, site_type))


def _set_on_taps(model: nn.Module, config: QuantConfig, name: str, value: object, undo: list[Undo]) -> None:
    for tap in _site_taps(model, config):
        if getattr(tap, name) is not None:
            raise _occupied(model, tap, name)
        setattr(tap, name, value)
        undo.append(lambda tap=tap: setattr(tap, name, None))


def _model_taps(model: nn.Module) -> list[attention.Tap]:
    found = attention.taps(model)
    backend = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not found or backend != attention.BACKEND_NAME:
        raise ConfigError("attention quantization needs the quantdiff attention backend: load the model with quantdiff")
    return found


@register_site(LogitsSite)
def _apply_logits(model: nn.Module, config: QuantConfig, undo: list[Undo]) -> None:
    quantizer = LogitsQuantizer(config.method.bits, per_row=isinstance(config.method.granularity, PerRow))
    _set_on_taps(model, config, "logits_quantizer", quantizer, undo)


@register_site(QKSite)
def _apply_qk(model: nn.Module, config: QuantConfig, undo: list[Undo]) -> None:
    if isinstance(config.method, LLMInt8Method):
        quantizer = LLMInt8QKQuantizer(config.method)
    else:
        quantizer = AbsmaxQKQuantizer(config.method)
    _set_on_taps(model, config, "operand_quantizer", quantizer, undo)


@register_site(KVSite)
def _apply_kv(model: nn.Module, config: QuantConfig, undo: list[Undo]) -> None:
    causal = is_causal(config.method.granularity)
    if config.site.plan is None:
        _set_on_taps(model, config, "kv_quantizer", KVQuantizer(config.method.bits, causal, config.site.group_size, config.site.layout), undo)
        return
    chosen = {tap.layer_idx for tap in _site_taps(model, config)}
    planned = zip(_model_taps(model), plan_quantizers(model, config.site.plan, causal, config.site.group_size, config.site.layout))
    for tap, quantizer in ((tap, q) for tap, q in planned if tap.layer_idx in chosen):
        if tap.kv_quantizer is not None:
            raise _occupied(model, tap, "kv_quantizer")
        tap.kv_quantizer = quantizer
        undo.append(lambda tap=tap: setattr(tap, "kv_quantizer", None))


def decoder_layer_prefixes(model: nn.Module) -> list[str]:
    """Fully qualified names of the decoder layers, as the model declares them."""
    return [name for name, _ in structure.decoder_layers(model)]


def linear_targets(model: nn.Module, site: LinearSite, allow_partial: bool = False) -> list[tuple[str, nn.Linear]]:
    """(fqn, module) of the nn.Linear layers the site quantizes, in module order.

    With the default filter every decoder layer must hold one (GPT-2's Conv1D projections, say, hold none):
    ConfigError naming the layers that would stay unquantized, unless allow_partial.
    """
    if site.filter is not None:
        chosen = site.filter
    else:
        prefixes = tuple(p + "." for p in decoder_layer_prefixes(model))
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = lambda module, fqn: fqn.startswith(prefixes) or (site.include_lm_head and module is output)  # noqa: E731
    targets = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.weight.is_floating_point() and chosen(m, fqn)
    ]
    if site.filter is None and not allow_partial:
        empty = [p[:-1] for p in prefixes if not any(fqn.startswith(p) for fqn, _ in targets)]
        if empty:
            raise ConfigError(
                f"{structure.model_label(model)}: decoder layers without a floating-point nn.Linear to quantize: "
                f"{', '.join(empty[:4])}{' …' if len(empty) > 4 else ''} (allow_partial accepts a partial run)"
            )
    return targets


def _swap_weight(module: nn.Linear, method: Method) -> Undo:
    original = module.weight
    module.weight = nn.Parameter(fake_quant_weight(original.detach(), method), requires_grad=False)
    return lambda: setattr(module, "weight", original)  # the very same Parameter: ties and optimizers intact


@register_site(LinearSite)
def _apply_linear(model: nn.Module, config: QuantConfig, undo: list[Undo]) -> None:
    targets = linear_targets(model, config.site)
    layers = chosen_layers(model, config)
    if layers is not None:
        prefixes = decoder_layer_prefixes(model)
        for layer in layers:
            if not any(fqn.startswith(prefixes[layer] + ".") for fqn, _ in targets):
                raise ConfigError(f"layer {layer} ({prefixes[layer]}) has no nn.Linear for site linear to quantize")
        kept = tuple(prefixes[layer] + "." for layer in layers)
        targets = [(fqn, module) for fqn, module in targets if fqn.startswith(kept)]
    if not targets and layers != []:
        raise ConfigError("the linear site matched no nn.Linear layer")
    if config.site.transform is not None and targets:
        apply_transform(model, config.site.transform, [module for _, module in targets], undo)
    for _, module in targets:
        if config.site.weights:
            undo.append(_swap_weight(module, config.method))
        if config.site.inputs:
            hook = module.register_forward_pre_hook(lambda m, args, method=config.method: (fake_quant_input(args[0], method), *args[1:]))
            undo.append(hook.remove)


# ---- entry points -------------------------------------------------------------------------------------------


class QuantizationHandle:
    """What `apply_quantization` returns: `remove()` undoes it, in reverse order, once."""

    def __init__(self, undo: list[Undo]) -> None:
        self._undo = undo

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def apply_quantization(model: nn.Module, config: QuantConfig | None) -> QuantizationHandle:
    """Fake-quantize `model` in place as `config` says; None is the unquantized reference (a no-op). A
    mixed-precision plan's `precision_plan.PlannedConfig` applies its configs (disjoint layers) together."""
    if config is None:
        return QuantizationHandle([])
    parts = config.parts_for(model)
    for part in parts:
        check_supported(part)
    undo: list[Undo] = []
    try:
        for part in parts:
            _HANDLERS[type(part.site)](model, part, undo)
    except BaseException:
        QuantizationHandle(undo).remove()
        raise
    return QuantizationHandle(undo)


@contextmanager
def quantized(model: nn.Module, config: QuantConfig | None, allow_partial: bool = False) -> Iterator[nn.Module]:
    """`model` quantized as `config` says inside the block. When the block ran forward passes, every attention
    module and decoder layer must have been reached (ConfigError naming the others unless allow_partial)."""
    handle = apply_quantization(model, config)
    track = tracking(model) if config is not None and attention.taps(model) else nullcontext(None)
    try:
        with track as coverage:
            yield model
    finally:
        handle.remove()
    if coverage is not None and coverage.ran:
        coverage.check(allow_partial)
