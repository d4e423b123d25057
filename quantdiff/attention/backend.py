"""The quantdiff attention backend: explicit pre-softmax logits, key tile by key tile, through a Tap.

Registered in transformers' attention registry as "quantdiff" (together with a mask function — without
it the mask silently arrives as None). Every attention module gets a `Tap` submodule
(`module.quantdiff_tap`): forward hooks on it observe each logits tile, and its quantizers fake-quantize
the keys and values as a KV cache holds them, the logits matmul's operands, and the logits. Memory grows with T·tile, never T², because softmax is computed online
(flash-attention style running max and sum) across key tiles.

When a tap has no hooks and no quantizer the backend takes transformers' SDPA path: same outputs, faster —
except for models that soft-cap logits or add attention sinks, which SDPA cannot express: they always run tiled.
Every keyword argument a model passes is either implemented (scaling, dropout in eval, sliding_window,
softcap, s_aux sinks), known to carry no semantics for the attention math (`NEUTRAL_KWARGS`), or refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from quantdiff.core.errors import ConfigError
from quantdiff.models import structure

BACKEND_NAME = "quantdiff"
DEFAULT_TILE_SIZE = 512
# Arguments transformers passes along to attention functions that do not change what attention computes.
NEUTRAL_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "past_key_values", "past_key_value", "token_type_ids",
})
IMPLEMENTED_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "is_causal"})


@dataclass
class TileContext:
    """What a tap needs to know about one logits tile of shape (B, H, rows, cols).

    Rows are queries `q_start : q_start + rows` of this call, columns keys `k_start : k_start + cols`
    (indices into the key axis, which includes any cached prefix).
    """

    layer_idx: int
    q_start: int
    k_start: int
    valid: torch.Tensor  # bool, broadcastable to the tile: causal & padding
    q_positions: torch.Tensor  # (rows,) absolute position of each query row within its sequence
    head_map: torch.Tensor | None  # (H,) 1 or 2 for differential maps, None for standard attention
    tensor_absmax: torch.Tensor | None = None  # (B,1,1,1) max |valid logit| over all heads and tiles
    row_absmax: torch.Tensor | None = None  # (B,H,rows,1) max |valid logit| of each query row over all tiles
    # The softmax input is softcap·tanh(logits/softcap) when softcap is set, and the denominator also holds
    # exp(sinks[h]) per head when sinks are set: what an observer needs to reconstruct the probabilities.
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H,) float32
    bias: torch.Tensor | None = None  # additive float mask values of the tile (Doge's dynamic mask), added last
    rows: SoftmaxRows | None = None  # the call's online-softmax state: final once the call returns


@dataclass
class SoftmaxRows:
    """Per query row of one attention call, (B, H, T, 1) float32, as the model's softmax computes them (after any
    logits quantizer): the max and the sum of exp(x − max) over the valid keys (and a sink logit, if any), and the
    softmax input at key 0 (−∞ where a row cannot see it). Written in place tile by tile, so an observer that
    keeps it from a tile hook reads the final values once the call returns, instead of recomputing softmax."""

    max: torch.Tensor
    sum: torch.Tensor
    first_key: torch.Tensor


@dataclass(frozen=True)
class AttentionArgs:
    """The semantic keyword arguments of one attention call, checked against what the backend implements."""

    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H,)

    @property
    def sdpa_exact(self) -> bool:
        """SDPA ignores soft-capping and sinks: only without them is it the same attention."""
        return self.softcap is None and self.sinks is None


class KVQuantizer(Protocol):
    """Quantizes keys (B, Hkv, S, D), given which key positions are valid ((B, 1, S, 1) bool or None), and values."""

    def keys(self, key: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor: ...

    def values(self, value: torch.Tensor) -> torch.Tensor: ...


class Tap(nn.Module):
    """Identity on a logits tile unless a quantizer is set; forward hooks see `(logits, ctx)`.

    `pairing`: how a differential layer's heads pair into maps ("halves", "adjacent"; see models.structure),
    None for standard attention."""

    def __init__(self, layer_idx: int, pairing: str | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.pairing = pairing
        self.tile_size: int | None = DEFAULT_TILE_SIZE  # None: one tile spanning all keys
        self.logits_quantizer: Callable[[torch.Tensor, TileContext], torch.Tensor] | None = None
        self.operand_quantizer: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self.kv_quantizer: KVQuantizer | None = None  # K and V as attention receives them: after RoPE, before GQA repeat
        self.calls = 0  # attention calls that reached the backend: coverage checks read it

    def forward(self, logits: torch.Tensor, ctx: TileContext) -> torch.Tensor:
        if self.logits_quantizer is None:
            return logits
        return self.logits_quantizer(logits, ctx)

    @property
    def differential(self) -> bool:
        return self.pairing is not None

    @property
    def needs_logits(self) -> bool:
        """True when someone must see the explicit logits (a hook or a logits quantizer)."""
        return bool(self._forward_hooks or self._forward_pre_hooks or self.logits_quantizer is not None)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, pairing={self.pairing}, tile_size={self.tile_size}"


def attach_taps(model: nn.Module) -> list[Tap]:
    """Give every attention module the model declares a Tap (idempotent); LoadError if it declares none."""
    pairing = structure.head_pairing(model)
    out = []
    for _, module in structure.attention_modules(model):
        if not isinstance(getattr(module, "quantdiff_tap", None), Tap):
            module.quantdiff_tap = Tap(module.layer_idx, pairing)
        out.append(module.quantdiff_tap)
    return out


def taps(model: nn.Module) -> list[Tap]:
    """The taps of a model in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, Tap)), key=lambda t: t.layer_idx)


def set_tile_size(model: nn.Module, tile_size: int | None) -> None:
    if tile_size is not None and tile_size < 1:
        raise ValueError("tile size must be positive")
    for tap in taps(model):
        tap.tile_size = tile_size


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv·n_rep, S, D), each KV head serving n_rep consecutive query heads."""
    if n_rep == 1:
        return x
    b, hkv, s, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def _repeat_state(module: nn.Module, tap: Tap, query: torch.Tensor, key: torch.Tensor) -> dict | None:
    """DiffLlama calls attention twice per layer with the *same* Q and K tensors (once per half of V).

    Returns the state the first call left (quantized operands, logits absmax) on the repeat call, else None and
    starts a new state. Taps must see each logit once, so the repeat call runs quantizers without hooks.
    """
    if tap.pairing != "halves":  # DiffLlama's pairing; DIFF V2 calls attention once with all 2H query heads
        return None
    last = getattr(module, "_quantdiff_last_call", None)
    if last is not None and last["query"] is query and last["key"] is key:
        module._quantdiff_last_call = None
        return last
    module._quantdiff_last_call = {"query": query, "key": key}
    return None


def _quantized_kv(module: nn.Module, tap: Tap, key: torch.Tensor, value: torch.Tensor, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V through the tap's KV quantizer. Keys the whole sequence holds: those some query may attend to.

    DiffLlama's two calls read the same K (its quantized copy is reused, so `_repeat_state` still recognises the
    repeat by identity) and each a half of V's KV heads, repeated twice: V is quantized per head and token, so
    quantizing each half gives exactly the quantized cache's halves.
    """
    cached = getattr(module, "_quantdiff_kv_key", None)
    if cached is not None and cached[0] is key:
        module._quantdiff_kv_key = None
        return cached[1], tap.kv_quantizer.values(value)
    valid, _ = _split_mask(mask)
    if valid is not None:
        valid = valid.any(dim=2).any(dim=1).view(valid.shape[0], 1, -1, 1)  # (B, 1, S, 1): attended by some query
    quantized = tap.kv_quantizer.keys(key, valid)
    if tap.pairing == "halves":
        module._quantdiff_kv_key = (key, quantized)
    return quantized, tap.kv_quantizer.values(value)


def attention_args(module: nn.Module, query: torch.Tensor, attention_mask, scaling: float | None, kwargs: dict) -> AttentionArgs:
    """The call's semantics; ConfigError naming the model and the argument for anything not implemented."""
    label = structure.model_label(module)
    for name in kwargs:
        if name not in NEUTRAL_KWARGS and name not in IMPLEMENTED_KWARGS:
            raise ConfigError(f"{label}: the quantdiff attention backend does not implement the attention argument {name!r}")
    if attention_mask is None and not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ConfigError(f"{label}: the quantdiff attention backend does not implement non-causal attention without a mask")
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.detach().float().reshape(-1)
        if sinks.numel() != query.shape[1]:
            raise ConfigError(f"{label}: attention sinks (s_aux) must hold one logit per head, got {sinks.numel()} for {query.shape[1]} heads")
    softcap = kwargs.get("softcap")
    return AttentionArgs(
        scaling=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        sliding_window=kwargs.get("sliding_window") or None,
        softcap=float(softcap) if softcap else None,
        sinks=sinks,
    )


def quantdiff_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature; returns ((B, T, H, Dv), None)."""
    tap: Tap | None = getattr(module, "quantdiff_tap", None)
    args = attention_args(module, query, attention_mask, scaling, kwargs)
    sdpa_kwargs = {k: v for k, v in kwargs.items() if k in NEUTRAL_KWARGS or k in ("sliding_window", "is_causal")}
    if tap is not None:
        tap.calls += 1
        if tap.kv_quantizer is not None:
            key, value = _quantized_kv(module, tap, key, value, attention_mask)
    plain = tap is None or (tap.operand_quantizer is None and not tap.needs_logits)
    if plain and args.sdpa_exact:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=args.scaling, **sdpa_kwargs)
    if dropout > 0.0:
        raise ConfigError(f"{structure.model_label(module)}: the tiled attention path does not implement attention dropout (training mode)")
    tap = tap or Tap(getattr(module, "layer_idx", 0))  # a module without a tap: no hooks, one tile

    repeat = _repeat_state(module, tap, query, key)
    state = repeat if repeat is not None else getattr(module, "_quantdiff_last_call", None) or {}
    if tap.operand_quantizer is not None:
        if "operands" not in state:
            state["operands"] = tap.operand_quantizer(query, key)
        query, key = state["operands"]
    # A Diff repeat call shows its hooks nothing, so without a logits quantizer SDPA gives the same output faster.
    if args.sdpa_exact and (not tap.needs_logits or (repeat is not None and tap.logits_quantizer is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=args.scaling, **sdpa_kwargs)
    attention_mask, bias = _split_mask(attention_mask)
    return _tiled_attention(tap, query, key, value, attention_mask, bias, args, state, observe=repeat is None)


def _split_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An additive float mask -> (bool mask, additive bias or None): most models' finite entries are all 0,
    but some (Doge) add learned values to the logits through the mask, which softmax must still see."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    valid = mask > torch.finfo(mask.dtype).min / 2
    bias = mask.masked_fill(~valid, 0.0)
    return valid, (bias.float() if bool(bias.any()) else None)


def _tiled_attention(
    tap: Tap,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    args: AttentionArgs,
    state: dict,
    observe: bool,
) -> tuple[torch.Tensor, None]:
    """Online-softmax attention over key tiles; `state` carries the logits absmax to a Diff repeat call."""
    b, h, t, _ = query.shape
    s = key.shape[2]
    key = repeat_kv(key, h // key.shape[1])  # (B, H, S, D)
    value = repeat_kv(value, h // value.shape[1])  # (B, H, S, Dv)
    tile = tap.tile_size or s
    offset = s - t  # queries are the last t positions (a KV cache holds the first s - t)
    device = query.device
    q_pos_all = torch.arange(offset, s, device=device)
    head_map = torch.tensor(structure.head_maps(h, tap.pairing), device=device) if tap.differential else None
    sinks = None if args.sinks is None else args.sinks.to(device)
    call_tap = tap if observe else tap.forward  # a bound forward skips hooks: the repeat call must not be counted twice

    tiles = []
    for k_start in range(0, s, tile):
        k_stop = min(k_start + tile, s)
        # Causal: query rows before the tile's first key see none of it (unless an explicit mask says otherwise).
        q_first = 0 if mask is not None else max(0, k_start - offset)
        if q_first < t:
            tiles.append((k_start, k_stop, q_first))

    def logits_of(k_start: int, k_stop: int, q_first: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = query[:, :, q_first:]
        # (B, H, rows, cols); scaled in place: the matmul's (or .float()'s) fresh tensor, nobody else holds it yet
        logits = torch.matmul(q, key[:, :, k_start:k_stop].transpose(2, 3)).float().mul_(args.scaling)
        valid = _valid_mask(mask, q_pos_all[q_first:], q_first, k_start, k_stop, args.sliding_window)
        return logits, valid

    tensor_absmax = row_absmax = reuse = None
    if getattr(tap.logits_quantizer, "needs_absmax", False):
        if "absmax" not in state:
            state["absmax"], reuse = _absmax_prepass(tiles, logits_of, (b, h, t, 1), device)
        tensor_absmax, row_absmax = state["absmax"]

    # Online softmax state, float32: running max m, normaliser l, unnormalised output acc. A sink is one more
    # logit per head in every row's denominator, with no value: it starts the running max and sum.
    if sinks is None:
        m = torch.full((b, h, t, 1), -math.inf, device=device)
        l = torch.zeros(b, h, t, 1, device=device)
    else:
        m = sinks.view(1, h, 1, 1).expand(b, h, t, 1).clone()
        l = torch.ones(b, h, t, 1, device=device)
    rows = SoftmaxRows(m, l, torch.empty(b, h, t, 1, device=device))
    acc = torch.zeros(b, h, t, value.shape[-1], device=device)
    # The masked softmax input, then its exponentials, live in one buffer per call: the hooks' tile stays as they
    # saw it, and no tile-sized tensor is allocated per tile (on CPU fresh pages cost more than the arithmetic).
    scratch = torch.empty(b * h * t * min(tile, s), device=device)
    negative_infinity = torch.tensor(-math.inf, device=device)  # where's out= form takes no Python scalar
    for k_start, k_stop, q_first in tiles:
        logits, valid = reuse if reuse is not None else logits_of(k_start, k_stop, q_first)
        ctx = TileContext(
            layer_idx=tap.layer_idx,
            q_start=q_first,
            k_start=k_start,
            valid=valid,
            q_positions=q_pos_all[q_first:],
            head_map=head_map,
            tensor_absmax=tensor_absmax,
            row_absmax=None if row_absmax is None else row_absmax[:, :, q_first:],
            softcap=args.softcap,
            sinks=sinks,
            bias=None if bias is None else bias[:, :, q_first:, k_start:k_stop],
            rows=rows,
        )
        x = softmax_input(call_tap(logits, ctx), ctx)  # taps see QKᵀ·scaling before capping
        # Autograd refuses out= and in-place writes on tensors it tracks (training through this backend, gradients
        # of a quantized model): those take fresh tensors, with the same values.
        tracked = x.requires_grad
        p = torch.where(valid, x, negative_infinity, out=None if tracked else scratch[: x.numel()].view(x.shape))  # (B, H, rows, cols)
        if k_start == 0:  # covers every row
            rows.first_key.copy_(p[..., :1])
        m_old = m[:, :, q_first:]
        m_new = torch.maximum(m_old, p.amax(dim=-1, keepdim=True))
        safe_m = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing valid yet
        p = torch.exp(p - safe_m) if tracked else torch.sub(p, safe_m, out=p).exp_()
        correction = torch.exp(m_old - safe_m)
        l[:, :, q_first:] = l[:, :, q_first:] * correction + p.sum(dim=-1, keepdim=True)
        acc[:, :, q_first:] = acc[:, :, q_first:] * correction + torch.matmul(p, value[:, :, k_start:k_stop].float())
        m[:, :, q_first:] = m_new
    out = acc / l.clamp_min(torch.finfo(torch.float32).tiny)  # fully masked rows (padding) give 0, not NaN
    return out.to(query.dtype).transpose(1, 2).contiguous(), None  # (B, T, H, Dv)


def _absmax_prepass(tiles: list, logits_of: Callable, shape: tuple, device: torch.device) -> tuple[tuple, tuple | None]:
    """((tensor absmax (B,1,1,1), row absmax (B,H,T,1)) of the valid logits, the single tile's (logits, valid)
    to reuse in the main pass when there is only one tile, else None)."""
    row_absmax = torch.zeros(shape, device=device)
    reuse = None
    for k_start, k_stop, q_first in tiles:
        logits, valid = logits_of(k_start, k_stop, q_first)
        if len(tiles) == 1:
            reuse = (logits, valid)
            logits = logits.abs()
        else:
            logits.abs_()  # a throwaway tile: in place saves an allocation per tile
        tile_max = logits.masked_fill_(~valid, 0.0).amax(dim=-1, keepdim=True)
        row_absmax[:, :, q_first:] = torch.maximum(row_absmax[:, :, q_first:], tile_max)
    return (row_absmax.amax(dim=(1, 2, 3), keepdim=True), row_absmax), reuse


def softmax_input(logits: torch.Tensor, ctx: TileContext) -> torch.Tensor:
    """A tile as it enters softmax: soft-capped, cap·tanh(logits/cap), when the model caps; plus any additive mask."""
    if ctx.softcap is not None:
        logits = torch.tanh(logits / ctx.softcap) * ctx.softcap
    return logits if ctx.bias is None else logits + ctx.bias


def attention_probs(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over whole rows (B, H, rows, S) of softmax input; sinks (H,) add one logit per head to each denominator."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    b, h, rows, _ = logits.shape
    sink_column = sinks.to(logits).view(1, h, 1, 1).expand(b, h, rows, 1)
    return torch.softmax(torch.cat([logits, sink_column], dim=-1), dim=-1)[..., :-1]


def _valid_mask(
    mask: torch.Tensor | None, q_pos: torch.Tensor, q_first: int, k_start: int, k_stop: int, window: int | None
) -> torch.Tensor:
    """Causal (and, with a window, only the last `window` keys up to the query), or the model's own mask."""
    k_pos = torch.arange(k_start, k_stop, device=q_pos.device)
    if mask is not None:
        valid = mask[:, :, q_first:, k_start:k_stop]  # (B|1, 1|H, rows, cols)
    else:
        valid = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, rows, cols)
    if window is None:
        return valid
    # transformers' sliding window: key kv is visible to query q when kv > q - window (on the key axis)
    return valid & (k_pos[None, :] > q_pos[:, None] - window)[None, None]


def register() -> None:
    """Make attn_implementation="quantdiff" available to every transformers model (idempotent)."""
    AttentionInterface.register(BACKEND_NAME, quantdiff_attention_forward)
    # sdpa_mask: a boolean mask (True = attend), or None for a plain causal pattern the backend builds per tile.
    AttentionMaskInterface.register(BACKEND_NAME, sdpa_mask)


def iter_attention_modules(model: nn.Module) -> Iterator[nn.Module]:
    """Attention modules carrying a Tap, in model order."""
    return (m for m in model.modules() if isinstance(getattr(m, "quantdiff_tap", None), Tap))
