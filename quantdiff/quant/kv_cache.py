"""A real quantized KV cache on transformers' `Cache` API: keys and values stored as integer codes with scales
(and zero-points), read back dequantized; `model.generate(..., past_key_values=kv_cache(model, plan))`.

How the codes are laid out is a `quant.kv_layout.KVLayout`, named in the cache's repr and `describe()`:
by default KIVI's (keys per channel over blocks of 128 tokens, values per token, both with a zero-point; the
most recent tokens in float until they complete a block). A block is quantized once, after the forward that
completes it has read it in float, and never again: no query reads a scale set by a later token (causal). The
`kv` site quantizes with the same functions (`kv_layout.fake_quantize`), so a sweep measures these codes.

Storage per layer (`_Store`, once for keys, once for values): the float residual (every head, the model's
dtype); then per width of the plan's KV heads the quantized blocks: codes as uint8 (two 4-bit or four 2-bit codes
a byte, packed along the channels; other widths one code a byte, int16 above 8 bits), float32 scales and
zero-points; heads at 16 bits as computed. A kv plan (`quant.kv_plan`) sets each (layer, KV head)'s width and the
positions kept at 16 bits (the sinks): their rows are stored as computed and left out of their block's key scales.

Sliding-window layers (Gemma 3's local layers) keep at most the window, as transformers' `DynamicSlidingWindowLayer`
does: whole quantized blocks that no later query can see are dropped, and attention reads the last
`window − 1` tokens plus the new ones.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from quantdiff.core.errors import ConfigError
from quantdiff.models import structure
from quantdiff.quant.kv_engines import PER_TENSOR
from quantdiff.quant.kv_layout import KIVI, KVLayout, dequantize_in_place, quantize
from quantdiff.quant.kv_plan import FULL_BITS, KVPlan, LayerPlan, check_plan_fits
from quantdiff.quant.numerics import check_bits

PACKED = (2, 4)  # widths whose codes fill whole bytes: packed (shift and mask in uint8, no int64)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) uint8 codes → (..., D·bits/8): byte j holds channel j + i·D·bits/8 in bits i·bits … (i+1)·bits − 1
    (the channels cut into 8/bits contiguous parts: each part dequantizes into a contiguous run of the output,
    twice as fast as interleaved nibbles)."""
    parts = codes.unflatten(-1, (8 // bits, -1))
    out = parts[..., 0, :].clone()
    for i in range(1, 8 // bits):
        out |= parts[..., i, :] << (i * bits)
    return out


def _unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Inverse of `_pack`, converting: out (..., D) float ← the codes of (..., D·bits/8), each channel part unpacked
    in uint8 (shifts and masks, no wider temporaries; the top part needs no mask) and converted as it is copied into
    its run of out (one copy a part: torch.cat into a float `out` from uint8 parts takes twice as long)."""
    per, mask, width = 8 // bits, (1 << bits) - 1, packed.shape[-1]
    for i in range(per):
        part = packed if i == 0 else packed >> (i * bits)
        out.narrow(-1, i * width, width).copy_(part if i == per - 1 else part & mask)


def _packable(bits: int, row: int, groups: int, per_channel: bool) -> bool:
    """Whether codes of this width pack: they fill whole bytes and each channel part holds whole scale groups."""
    per = 8 // bits
    return bits in PACKED and row % per == 0 and (per_channel or groups == 1 or groups % per == 0)


class _Store:
    """One tensor kind (keys or values) of one layer: (B, H, S, D) rows appended along S."""

    def __init__(self, head_bits: tuple[int, ...], layout: KVLayout, keys: bool, keep: tuple[int, ...]) -> None:
        self.head_bits = head_bits
        self.layout = layout
        self.per_channel = keys and layout.keys == "channel"
        self.keys = keys
        self.keep = frozenset(keep)
        self.block = layout.residual or 1  # tokens quantized together; 1: each token as written
        self.residual: torch.Tensor | None = None  # (B, H, r, D) float, r < block after a flush
        self.codes: dict[int, torch.Tensor] = {}  # width -> (B, h, Sq, D) uint8/int16, or packed (B, h, Sq, D·w/8)
        self.scales: dict[int, torch.Tensor] = {}
        self.zeros: dict[int, torch.Tensor] = {}
        self.full: torch.Tensor | None = None  # (B, h16, Sq, D): heads at 16 bits
        self.kept: torch.Tensor | None = None  # (B, H, k, D): kept positions' rows, as computed
        self.kept_positions: list[int] = []
        self.offset = 0  # position of the first stored token (a sliding window drops whole blocks)
        self.quantized = 0  # tokens in the quantized part
        self.indices = {w: [h for h, b in enumerate(head_bits) if b == w] for w in sorted(set(head_bits))}
        self.packed: set[int] = set()  # widths stored packed
        self.offsets: dict[int, int] = {}  # width -> what dequantization subtracts from a symmetric code
        self.frozen = layout.engine in PER_TENSOR  # one scale per width, set by the first flush (vLLM's calculated kv scales)

    @property
    def end(self) -> int:
        return self.offset + self.quantized + (0 if self.residual is None else self.residual.shape[2])

    def append(self, x: torch.Tensor) -> None:
        if x.shape[1] != len(self.head_bits):
            raise ConfigError(f"kv cache: the model writes {x.shape[1]} KV heads, the plan gives bits for {len(self.head_bits)}")
        self.residual = x if self.residual is None else torch.cat([self.residual, x], dim=2)

    def flush(self) -> None:
        """Quantize the residual's complete blocks (all of them at once: a prompt's)."""
        done = self.residual.shape[2] // self.block * self.block
        if done == 0:
            return
        chunk, self.residual = self.residual[:, :, :done], self.residual[:, :, done:]
        start = self.offset + self.quantized
        positions = [p for p in range(start, start + done) if p in self.keep]
        kept = None
        if positions:
            kept = torch.zeros(done, dtype=torch.bool, device=chunk.device)
            kept[[p - start for p in positions]] = True
            self.kept = _cat(self.kept, chunk[:, :, kept])
            self.kept_positions += positions
        for width, heads in self.indices.items():
            part = chunk if len(self.indices) == 1 else chunk[:, heads]
            if width == FULL_BITS:
                self.full = _cat(self.full, part)
                continue
            stored = quantize(part, width, self.layout, self.keys, kept, self.scales.get(width) if self.frozen else None)
            self.offsets[width] = stored.offset
            if _packable(width, part.shape[-1], stored.scale.shape[-2], self.per_channel):
                self.packed.add(width)
            codes = _pack(stored.codes, width) if width in self.packed else stored.codes
            self.codes[width] = _cat(self.codes.get(width), codes)
            self.scales[width] = stored.scale if self.frozen else _cat(self.scales.get(width), stored.scale)  # axis 2: blocks, or tokens
            if stored.zero is not None:
                self.zeros[width] = _cat(self.zeros.get(width), stored.zero)
        self.quantized += done

    def read(self, last: int) -> torch.Tensor:
        """The last `last` stored tokens, dequantized: (B, H, last, D) in the residual's dtype. (A sliding layer's
        `drop_before` has already dropped every block before them. narrow, not indexing: each step runs this per
        layer, and Python's indexing costs microseconds a call.)"""
        batch, heads, recent, row = self.residual.shape
        out = torch.empty(batch, heads, self.quantized + recent, row, dtype=self.residual.dtype, device=self.residual.device)
        if self.quantized:
            quantized = out.narrow(2, 0, self.quantized)
            for width, index in self.indices.items():
                every = len(index) == heads
                if width == FULL_BITS:
                    if every:
                        quantized.copy_(self.full)
                    else:
                        quantized[:, index] = self.full
                elif every and out.dtype == torch.float32:
                    self._dequantize_into(width, quantized)  # straight into attention's tensor
                else:
                    part = torch.empty(batch, len(index), self.quantized, row, device=out.device)
                    self._dequantize_into(width, part)
                    if every:
                        quantized.copy_(part)
                    else:
                        quantized[:, index] = part.to(out.dtype)
            for i, position in enumerate(self.kept_positions):
                out[:, :, position - self.offset] = self.kept[:, :, i]
        out.narrow(2, self.quantized, recent).copy_(self.residual)
        return out.narrow(2, out.shape[2] - last, last) if last < out.shape[2] else out

    def _dequantize_into(self, width: int, out: torch.Tensor) -> None:
        """out (B, h, Sq, D) float32 ← the width's codes, dequantized: converted into out (packed ones channel part
        by part), then scaled there (`kv_layout.dequantize_in_place`)."""
        codes, scale = self.codes[width], self.scales[width]
        if width in self.packed:
            _unpack_into(codes, width, out)
        else:
            out.copy_(codes)
        # per channel: scale (B, h, n, 1, D), blocks along the tokens; per token: (B, h, S, G, 1), groups along the row
        view = out.unflatten(-2, (scale.shape[-3], -1)) if self.per_channel else out.unflatten(-1, (scale.shape[-2], -1))
        dequantize_in_place(view, scale, self.zeros.get(width), self.offsets[width])

    def drop_before(self, position: int) -> None:
        """Drop the whole quantized blocks that end before `position` (a sliding window's oldest)."""
        blocks = (min(position, self.offset + self.quantized) - self.offset) // self.block
        if blocks <= 0:
            return
        tokens = blocks * self.block
        for width in self.codes:
            self.codes[width] = self.codes[width][:, :, tokens:]
            if not self.frozen:
                self.scales[width] = self.scales[width][:, :, blocks if self.per_channel else tokens :]
            if width in self.zeros:
                self.zeros[width] = self.zeros[width][:, :, blocks if self.per_channel else tokens :]
        if self.full is not None:
            self.full = self.full[:, :, tokens:]
        self.offset += tokens
        self.quantized -= tokens
        if self.kept_positions:
            stay = [i for i, p in enumerate(self.kept_positions) if p >= self.offset]
            self.kept = self.kept[:, :, stay] if stay else None
            self.kept_positions = [self.kept_positions[i] for i in stay]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.codes.values(), *self.scales.values(), *self.zeros.values(), self.full, self.kept, self.residual) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def map(self, fn) -> None:
        """Apply fn to every stored tensor (their batch axis: beam search's reordering, repeats)."""
        for table in (self.codes, self.scales, self.zeros):
            for width in table:
                table[width] = fn(table[width])
        self.full, self.kept, self.residual = (None if t is None else fn(t) for t in (self.full, self.kept, self.residual))


def _cat(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=2)


class QuantizedKVLayer(DynamicLayer):
    """One decoder layer's quantized cache (transformers' `CacheLayerMixin` protocol, grown like `DynamicLayer`).

    `update` appends the new keys and values in float, returns what attention reads (the quantized blocks
    dequantized, the residual and the new tokens as computed), then quantizes the blocks now complete. With no
    residual (layout `token`) every token is quantized before it is read: its scale sees only itself."""

    is_croppable = False  # crop would have to cut packed blocks and the kept rows apart; generate never needs it here

    def __init__(self, layer: LayerPlan, layout: KVLayout = KIVI, sliding_window: int | None = None) -> None:
        super().__init__()
        self.plan = layer
        self.layout = layout
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self._keys = self._values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._keys = _Store(self.plan.kv_bits, self.layout, True, self.plan.keep_positions)
        self._values = _Store(self.plan.kv_bits, self.layout, False, self.plan.keep_positions)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        self.cumulative_length += new
        stores = (self._keys, self._values)
        for store, x in zip(stores, (key_states, value_states)):
            store.append(x)
            if self.layout.residual == 0:
                store.flush()
        visible = self.cumulative_length if self.sliding_window is None else min(self.cumulative_length, self.sliding_window - 1 + new)
        keys, values = (store.read(visible) for store in stores)
        for store in stores:
            if self.layout.residual:
                store.flush()
            if self.sliding_window is not None:
                store.drop_before(self.cumulative_length - self.sliding_window + 1)
        return keys, values  # not kept: a float copy held between steps would undo the savings

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.sliding_window is None:
            return self.cumulative_length + query_length, 0
        # as transformers' DynamicSlidingWindowLayer: the last window − 1 tokens and the new ones
        offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, offset
        return self.cumulative_length + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def nbytes(self) -> int:
        """Bytes the cache holds: codes, scales, zero-points, float residual and full-precision rows (the
        dequantized copy `update` returns is attention's, freed with the layer's forward, not the cache's)."""
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

    def __init__(self, layers: list[QuantizedKVLayer], layout: KVLayout) -> None:
        super().__init__(layers=layers)
        self.layout = layout

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def describe(self) -> dict:
        """The cache's settings, for a JSON record: its layout (named) and per layer the bits and window."""
        return {"layout": self.layout.to_dict(),
                "layers": [{"kv_bits": list(l.plan.kv_bits), "keep_positions": list(l.plan.keep_positions), "sliding_window": l.sliding_window}
                           for l in self.layers]}

    def __repr__(self) -> str:
        bits = sorted({b for l in self.layers for b in l.plan.kv_bits})
        sliding = sum(l.is_sliding for l in self.layers)
        return f"QuantizedKVCache({len(self.layers)} layers, {sliding} sliding, bits {bits}, layout: {self.layout.name})"


def _windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for full attention; other kinds refused by name."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = get_layer_types_and_kwargs(text)
    windows = []
    for kind, extra in zip(types, kwargs):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(int(extra["sliding_window"]))
        else:
            raise ConfigError(f"kv_cache: layers of type {kind!r} are not implemented (full and sliding-window attention are)")
    return windows


def kv_cache(model: nn.Module, plan: KVPlan | None = None, bits: int | None = None, group_size: int | None = None,
             layout: KVLayout = KIVI) -> QuantizedKVCache:
    """A quantized KV cache for `model`: every KV head at `bits`, or as `plan` says (per-head bits, positions kept at
    16 bits; `bits`, if given, must be its budget). `layout`: how codes are laid out (`quant.kv_layout`; KIVI's
    by default); `group_size`, if given, sets the layout's channels per scale of a per-token row."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ConfigError("kv_cache needs a transformers model (one with config.num_hidden_layers)")
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout (quantdiff.quant.kv_layout), got {type(layout).__name__}")
    if group_size is not None:
        layout = KVLayout(layout.keys, layout.zero_point, group_size, layout.residual, layout.engine)
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
    width = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if layout.group_size is not None and width % layout.group_size:
        raise ConfigError(f"kv_cache: a group size of {layout.group_size} does not divide the head width {width}")
    for layer in layer_plans:
        for width in set(layer.kv_bits) - {FULL_BITS}:
            layout.check_bits(width)
    windows = _windows(config)
    return QuantizedKVCache([QuantizedKVLayer(p, layout, w) for p, w in zip(layer_plans, windows)], layout)
