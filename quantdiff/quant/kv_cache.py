"""A real quantized KV cache on transformers' `Cache` API: keys and values stored as integer codes with scales,
written once per token, read back dequantized; `model.generate(..., past_key_values=kv_cache(model, plan))`.

Each row of the cache (one token of one KV head, after RoPE) is quantized when it is written, on its own absmax
scale, or one scale per `group_size` channels of the row: what vLLM's per-token-head INT8 KV cache and llama.cpp's
q8_0/q4_0 blocks do, and exactly the `kv` site's causal quantizer (`sites.KVQuantizer`), so a full forward under
the `kv` site and a generation through this cache see the same keys and values. A token is never re-quantized and
no later token changes its scale.

Storage per layer (`_QuantizedRows`, once for keys, once for values): the KV heads grouped by their width; heads at
16 bits as the model computed them; heads at 9–15 bits as int16 codes, 5–8 bits int8, ≤ 4 bits packed densely
(`quant.packing`: two 4-bit codes a byte) when a row fills whole bytes, else int8; float32 scales per row or group.
A kv plan (`quant.kv_plan`) sets each (layer, KV head)'s width and the positions kept at 16 bits (the sinks):
their rows are stored as computed, beside the codes (whose few entries at those positions are never read).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from quantdiff.core.errors import ConfigError
from quantdiff.models import structure
from quantdiff.quant.kv_plan import FULL_BITS, KVPlan, LayerPlan, check_plan_fits
from quantdiff.quant.numerics import check_bits, check_group_size, expand_group_scales, rowwise_absmax_quantize
from quantdiff.quant.packing import pack_codes, unpack_codes

PACKED_MAX_BITS = 4  # at most this many bits a code, rows are bit-packed (int8 codes would waste half or more)


class _QuantizedRows:
    """One tensor kind (keys or values) of one layer: (B, H, S, D) rows appended along S, stored quantized."""

    def __init__(self, head_bits: tuple[int, ...], group_size: int | None) -> None:
        self.head_bits = head_bits
        self.group_size = group_size
        self.codes: dict[int, torch.Tensor] = {}  # width -> (B, h, S, D) int codes, or (B, h, S, D·w/8) packed uint8
        self.scales: dict[int, torch.Tensor] = {}  # width -> (B, h, S, 1 or groups) float32
        self.full: torch.Tensor | None = None  # (B, h16, S, D): the heads at 16 bits
        self.kept: torch.Tensor | None = None  # (B, H, kept, D): the kept positions' rows, as computed
        self.length = 0
        self.shape: tuple[int, int, int] | None = None  # (B, H, D), fixed at the first write
        self.dtype: torch.dtype | None = None

    def _heads(self, width: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([h for h, b in enumerate(self.head_bits) if b == width], device=device)

    def _packed(self, width: int, row: int) -> bool:
        return width <= PACKED_MAX_BITS and (row * width) % 8 == 0

    def append(self, x: torch.Tensor, keep: torch.Tensor) -> None:
        """x (B, H, T, D), the rows of positions length … length + T − 1; `keep` (T,) bool: rows kept at 16 bits."""
        batch, heads, new, row = x.shape
        if self.shape is None:
            if heads != len(self.head_bits):
                raise ConfigError(f"kv cache: the model writes {heads} KV heads, the plan gives bits for {len(self.head_bits)}")
            self.shape, self.dtype = (batch, heads, row), x.dtype
        for width in sorted(set(self.head_bits)):
            part = x.index_select(1, self._heads(width, x.device))
            if width == FULL_BITS:
                self.full = _cat(self.full, part)
                continue
            result = rowwise_absmax_quantize(part, width, self.group_size)
            codes = pack_codes(result.codes, width).view(*part.shape[:3], -1) if self._packed(width, row) else result.codes
            self.codes[width] = _cat(self.codes.get(width), codes)
            self.scales[width] = _cat(self.scales.get(width), result.scale)
        if bool(keep.any()):
            self.kept = _cat(self.kept, x[:, :, keep])
        self.length += new

    def read(self) -> torch.Tensor:
        """Every row written so far, dequantized: (B, H, S, D) in the model's dtype."""
        batch, heads, row = self.shape
        out = torch.empty(batch, heads, self.length, row, dtype=self.dtype, device=self._device())
        for width in set(self.head_bits):
            index = self._heads(width, out.device)
            out[:, index] = self.full if width == FULL_BITS else self._dequantize(width)
        return out

    def _dequantize(self, width: int) -> torch.Tensor:
        batch, _, row = self.shape
        codes, scale = self.codes[width], self.scales[width]
        if self._packed(width, row):
            codes = unpack_codes(codes.reshape(-1), width, (*codes.shape[:3], row))
        if self.group_size is not None:
            scale = expand_group_scales(scale, self.group_size, row)
        return (codes.float() * scale).to(self.dtype)  # the float32 product `numerics` dequantizes with

    def _device(self) -> torch.device:
        stored = self.full if self.full is not None else next(iter(self.codes.values()))
        return stored.device

    def nbytes(self) -> int:
        tensors = [*self.codes.values(), *self.scales.values(), self.full, self.kept]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def map(self, fn) -> None:
        """Apply fn to every stored tensor (their batch axis: beam search's reordering, repeats)."""
        self.codes = {w: fn(t) for w, t in self.codes.items()}
        self.scales = {w: fn(t) for w, t in self.scales.items()}
        self.full = None if self.full is None else fn(self.full)
        self.kept = None if self.kept is None else fn(self.kept)
        stored = self.full if self.full is not None else next(iter(self.codes.values()), None)
        if stored is not None and self.shape is not None:
            self.shape = (stored.shape[0], *self.shape[1:])


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)


class QuantizedKVLayer(DynamicLayer):
    """One decoder layer's quantized cache (transformers' `CacheLayerMixin` protocol, grown like `DynamicLayer`).

    `update` quantizes the new keys and values (rows of the kept positions also stored as computed) and returns
    the whole cache dequantized, the new tokens included, as attention reads it."""

    is_croppable = False  # crop would have to cut packed rows and the kept rows apart; generate never needs it here

    def __init__(self, layer: LayerPlan, group_size: int | None = None) -> None:
        super().__init__()
        self.plan = layer
        self.group_size = group_size
        self.cumulative_length = 0
        self._keys = self._values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = _QuantizedRows(self.plan.kv_bits, self.group_size)
        self._values = _QuantizedRows(self.plan.kv_bits, self.group_size)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.cumulative_length, key_states.shape[-2]
        positions = torch.arange(start, start + new)
        keep = torch.isin(positions, torch.tensor(self.plan.keep_positions, dtype=torch.long)).to(key_states.device)
        self._keys.append(key_states, keep)
        self._values.append(value_states, keep)
        self.cumulative_length += new
        keys, values = self._keys.read(), self._values.read()
        kept = [p for p in sorted(set(self.plan.keep_positions)) if p < self.cumulative_length]
        if kept:
            keys[:, :, kept], values[:, :, kept] = self._keys.kept, self._values.kept
        return keys, values  # not kept: a float copy held between steps would undo the savings

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes the cache holds: codes, scales and full-precision rows (the dequantized copy `update` returns is
        attention's, freed with the layer's forward, not the cache's)."""
        return 0 if not self.is_initialized else self._keys.nbytes() + self._values.nbytes()

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self._keys = self._values = None

    def _map(self, fn) -> None:
        if self.is_initialized:
            self._keys.map(fn)
            self._values.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError("the quantized KV cache cannot be cropped (assisted or speculative decoding): use an unquantized cache there")


class QuantizedKVCache(Cache):
    """A model's quantized KV cache: one `QuantizedKVLayer` per decoder layer. `nbytes()` counts what it stores."""

    def __init__(self, layers: list[QuantizedKVLayer]) -> None:
        super().__init__(layers=layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def kv_cache(model: nn.Module, plan: KVPlan | None = None, bits: int | None = None, group_size: int | None = None) -> QuantizedKVCache:
    """A quantized KV cache for `model`: every KV head at `bits`, or as `plan` says (per-head bits, positions kept at
    16 bits; `bits`, if given, must be its budget). `group_size`: one scale per that many channels of a row."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ConfigError("kv_cache needs a transformers model (one with config.num_hidden_layers)")
    if group_size is not None:
        check_group_size(group_size)
    if plan is not None:
        if not isinstance(plan, KVPlan):
            raise ConfigError(f"plan must be a KVPlan (quantdiff.quant.kv_plan.KVPlan.load(path)) or None, got {type(plan).__name__}")
        if bits is not None and bits != plan.budget_bits:
            raise ConfigError(f"a kv plan at a budget of {plan.budget_bits} bits cannot run at bits={bits}: leave bits out")
        check_plan_fits(plan, config, structure.model_label(model))
        layer_plans = list(plan.layers)
    else:
        if bits is None:
            raise ConfigError("kv_cache needs bits (2–16) or a plan")
        check_bits(bits)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        layer_plans = [LayerPlan((bits,) * heads) for _ in range(layers)]
    return QuantizedKVCache([QuantizedKVLayer(layer, group_size) for layer in layer_plans])
