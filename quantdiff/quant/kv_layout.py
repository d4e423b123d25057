"""How a KV cache lays its codes out: which axis a scale spans, whether it has a zero-point, and how many recent
tokens stay in float. Pure quantizers (codes, scales, zero-points) shared by `quant.kv_cache` and the `kv` site,
so a sweep measures what the cache stores.

Layouts:

- `kivi` (the cache's default; Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
  keys per channel, one scale and zero-point per (KV head, channel) over a block of `residual` tokens; values per
  token, one scale and zero-point per token and KV head (or per `group_size` channels of it); the most recent
  tokens in float until `residual` of them complete a block, which is then quantized once and never again.
- `token` (the former default, `residual` 0): keys and values per token and KV head, symmetric absmax, each token
  quantized as it is written (vLLM's per-token-head INT8 scales, rounded rather than truncated).

Causality. A per-token row's scale sees only its own token. A per-channel key scale sees every token of its block,
so the cache quantizes a block only once complete, after the forward that completes it has read it in float: a
query never reads a block quantized over a token later than itself. The `kv` site's full forward cannot do that
for the queries inside a block (one key tensor serves every query), so at the `kivi` layout the site quantizes
every complete block as the cache holds it once the whole sequence is written: not causal within a block, and
named so (`KVLayout.causal`).

The asymmetric quantizer is KIVI's (github.com/jy-yuan/KIVI, quant/new_pack.py, `quant_and_pack_kcache` and
`quant_and_pack_vcache`): mn, mx over the group, scale = (mx − mn) / (2^b − 1), code = round(clamp((x − mn) / scale,
0, 2^b − 1)), dequant = code · scale + mn. A group whose entries are all equal (scale 0) takes code 0, dequant mn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int
from quantdiff.quant.kv_engines import DESCRIPTIONS, ENGINE_BITS, GROUPS, OFFSETS, PER_TENSOR, QUANTIZERS, ZERO_POINTS, vllm_fp8_tensor, vllm_fp8_tensor_scale
from quantdiff.quant.numerics import check_bits, check_group_size, qmax

KEY_AXES = ("channel", "token")
DEFAULT_RESIDUAL = 128  # transformers' QuantizedCache default, and KIVI's R


@dataclass(frozen=True)
class KVLayout:
    """keys: "channel" (a scale per channel over a block of `residual` tokens) or "token" (per token and KV head);
    values are always per token. zero_point: asymmetric min/max grid (KIVI) or symmetric absmax. group_size:
    channels per scale of a per-token row (None: the whole row). residual: tokens kept in float until they complete
    a block of that many (0: every token quantized as written; needs keys per token). engine: an engine's own
    quantizer instead of quantdiff's (`quant.kv_engines`: llama.cpp's "q8_0", "q4_0", per token in blocks of 32
    channels; vLLM's "vllm-int8-head", "vllm-int4-head", "vllm-fp8-head", per token and KV head, and
    "vllm-fp8-tensor", one scale per tensor set by the first forward)."""

    keys: str = "channel"
    zero_point: bool = True
    group_size: int | None = None
    residual: int = DEFAULT_RESIDUAL
    engine: str | None = None

    def __post_init__(self) -> None:
        if self.keys not in KEY_AXES:
            raise ConfigError(f"kv layout: keys are quantized per {' or per '.join(KEY_AXES)}, not {self.keys!r}")
        if not isinstance(self.zero_point, bool):
            raise ConfigError(f"kv layout: zero_point must be True or False, got {self.zero_point!r}")
        if self.group_size is not None:
            check_group_size(self.group_size)
        residual = as_int(self.residual)
        if residual is None or residual < 0:
            raise ConfigError(f"kv layout: residual must be a whole number of tokens ≥ 0, got {self.residual!r}")
        if self.keys == "channel" and residual == 0:
            raise ConfigError("kv layout: keys per channel need a block of tokens: residual must be at least 1")
        if self.engine is not None:
            if self.engine not in ENGINE_BITS:
                raise ConfigError(f"kv layout: unknown engine mode {self.engine!r} (choose from {', '.join(ENGINE_BITS)})")
            if (self.keys, self.zero_point, self.group_size, residual) != ("token", ZERO_POINTS[self.engine], GROUPS[self.engine], 0):
                grid = "asymmetric" if ZERO_POINTS[self.engine] else "symmetric"
                raise ConfigError(f"kv layout: {DESCRIPTIONS[self.engine].split(':')[0]} is {_engine_shape(self.engine)}, {grid}, with no residual")

    def check_bits(self, bits: int) -> None:
        """ConfigError when an engine mode is asked for a width its engine does not have."""
        if self.engine is not None and bits != ENGINE_BITS[self.engine]:
            raise ConfigError(f"kv layout {self.engine} stores {ENGINE_BITS[self.engine]}-bit codes, not {bits}")

    @property
    def causal(self) -> bool:
        """Whether a full forward under the `kv` site is causal at this layout (the cache always is; a per-tensor
        engine's scale comes from the whole first forward, in the cache as at the site)."""
        return self.keys == "token" and self.residual == 0 and self.engine not in PER_TENSOR

    @property
    def name(self) -> str:
        if self.engine is not None:
            return DESCRIPTIONS[self.engine]
        keys = f"keys per channel over {self.residual}-token blocks" if self.keys == "channel" else "keys per token"
        groups = "" if self.group_size is None else f" in groups of {self.group_size} channels"
        grid = "asymmetric (zero-point)" if self.zero_point else "symmetric absmax"
        window = f", float residual of < {self.residual} tokens" if self.residual else ""
        return f"{keys}, values per token{groups}, {grid}{window}"

    def to_dict(self) -> dict:
        return {"keys": self.keys, "values": "token", "zero_point": self.zero_point, "group_size": self.group_size,
                "residual": self.residual, "engine": self.engine, "name": self.name}

    @classmethod
    def from_dict(cls, data: object) -> KVLayout:
        if not isinstance(data, dict):
            raise ConfigError("kv layout must be an object")
        fields = {k: v for k, v in data.items() if k not in ("values", "name")}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ConfigError(f"bad kv layout: {exc}") from None


KIVI = KVLayout()
TOKEN = KVLayout(keys="token", zero_point=False, residual=0)
def _engine_shape(engine: str) -> str:
    group = GROUPS[engine]
    return "per token and KV head" if group is None else f"per token in blocks of {group} channels"


ENGINE_LAYOUTS = {name: KVLayout("token", ZERO_POINTS[name], GROUPS[name], 0, name) for name in ENGINE_BITS}
LAYOUTS = {"kivi": KIVI, "token": TOKEN, **ENGINE_LAYOUTS}


def layout_named(name: str, group_size: int | None = None, residual: int | None = None) -> KVLayout:
    """A named layout (`LAYOUTS`), with its group size and residual overridden where given (not an engine's)."""
    if not isinstance(name, str) or name not in LAYOUTS:
        raise ConfigError(f"unknown kv layout {name!r} (choose from {', '.join(LAYOUTS)})")
    base = LAYOUTS[name]
    if base.engine is not None:
        if group_size is not None or residual is not None:
            group = GROUPS[name]
            shape = "one scale per token and KV head" if group is None else f"blocks of {group} channels"
            raise ConfigError(f"kv layout {name} is {DESCRIPTIONS[name].split(':')[0]}'s own: its {shape} and its lack of a residual are fixed")
        return base
    return KVLayout(base.keys, base.zero_point, group_size, base.residual if residual is None else residual)


# ---- the quantizers: codes, scales, zero-points ----------------------------------------------------------------


@dataclass(frozen=True)
class KVCodes:
    """codes: uint8 (≤ 8 bits) or int16, unsigned grid indices (symmetric codes c stored as c + offset), or an fp8
    engine's float8_e4m3fn values (offset 0);
    scale (float32, or an engine's float16), zero (float32; None: symmetric), shaped as the quantizers say;
    value = code · scale + zero, or (code − offset) · scale."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    offset: int


def _code_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits <= 8 else torch.int16


def minmax_quantize(x: torch.Tensor, bits: int, dim: int, ignore: torch.Tensor | None = None) -> KVCodes:
    """KIVI's asymmetric quantizer over axis `dim` (module docstring); scale and zero keep that axis as 1.
    `ignore` (bool, broadcastable to x): entries that do not set the scale (kept positions; their codes are
    never read)."""
    levels = 2 ** check_bits(bits) - 1
    data = x.float()
    low = data if ignore is None else data.masked_fill(ignore, float("inf"))
    high = data if ignore is None else data.masked_fill(ignore, float("-inf"))
    mn = low.amin(dim=dim, keepdim=True)
    mx = high.amax(dim=dim, keepdim=True)
    mn, mx = torch.where(torch.isfinite(mn), mn, 0.0), torch.where(torch.isfinite(mx), mx, 0.0)  # all ignored
    scale = (mx - mn) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # flat groups: code 0, dequant mn
    codes = ((data - mn) / safe).clamp_(0, levels).round_()
    return KVCodes(codes.to(_code_dtype(bits)), scale, mn, 0)


def absmax_codes(x: torch.Tensor, bits: int, dim: int, ignore: torch.Tensor | None = None) -> KVCodes:
    """Symmetric absmax over axis `dim` (`numerics.quantize_with_absmax`'s grid: x · (qmax / amax), rounded),
    codes offset by qmax so that every layout stores unsigned codes. `ignore`: as for `minmax_quantize`."""
    q = qmax(check_bits(bits))
    magnitude = x.detach().abs().float()
    amax = (magnitude if ignore is None else magnitude.masked_fill(ignore, 0.0)).amax(dim=dim, keepdim=True)
    inv = q / amax
    inv = torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv))
    codes = (x.float() * inv).round_().clamp_(-q, q).add_(q)
    return KVCodes(codes.to(_code_dtype(bits)), amax / q, None, q)


def _quantize(x: torch.Tensor, bits: int, zero_point: bool, dim: int, ignore: torch.Tensor | None = None) -> KVCodes:
    return (minmax_quantize if zero_point else absmax_codes)(x, bits, dim, ignore)


def quantize_rows(x: torch.Tensor, bits: int, layout: KVLayout) -> KVCodes:
    """Per token: x (B, H, S, D) → codes (B, H, S, D); scale, zero (B, H, S, groups, 1)."""
    groups = _groups(x.shape[-1], layout.group_size)
    if layout.engine is not None:
        layout.check_bits(bits)
        return KVCodes(*QUANTIZERS[layout.engine](x), OFFSETS[layout.engine])
    result = _quantize(x.unflatten(-1, (groups, -1)), bits, layout.zero_point, dim=-1)
    return KVCodes(result.codes.flatten(-2), result.scale, result.zero, result.offset)


def quantize_key_blocks(x: torch.Tensor, bits: int, layout: KVLayout, kept: torch.Tensor | None = None) -> KVCodes:
    """Per channel over blocks: x (B, H, n·R, D) → codes (B, H, n·R, D); scale, zero (B, H, n, 1, D).
    kept (n·R,) bool: positions kept in float, left out of their block's scales (IntactKV, `quant.kv_plan`)."""
    block = layout.residual
    if x.shape[-2] % block:
        raise ValueError(f"{x.shape[-2]} tokens are not whole blocks of {block}")
    ignore = None if kept is None else kept.view(-1, block, 1)
    result = _quantize(x.unflatten(-2, (-1, block)), bits, layout.zero_point, dim=-2, ignore=ignore)
    return KVCodes(result.codes.flatten(-3, -2), result.scale, result.zero, result.offset)


def quantize(x: torch.Tensor, bits: int, layout: KVLayout, keys: bool, kept: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> KVCodes:
    """Complete blocks (or, with no residual, tokens) of keys or values, as the cache stores them; `kept`: see
    `quantize_key_blocks` (a per-token row's scale never sees another token). scale: a per-tensor engine's scale,
    set by the first forward (None: from x)."""
    if layout.engine in PER_TENSOR:
        layout.check_bits(bits)
        chosen = vllm_fp8_tensor_scale(x, layout.engine, keys) if scale is None else scale
        return KVCodes(*vllm_fp8_tensor(x, chosen), OFFSETS[layout.engine])
    if keys and layout.keys == "channel":
        return quantize_key_blocks(x, bits, layout, kept)
    return quantize_rows(x, bits, layout)


def _groups(width: int, group_size: int | None) -> int:
    if group_size is None:
        return 1
    if width % group_size:
        raise ConfigError(f"kv layout: a group size of {group_size} does not divide the head width {width}")
    return width // group_size


def dequantize(stored: KVCodes, dtype: torch.dtype, per_channel: bool) -> torch.Tensor:
    """codes (B, H, S, D) unsigned → (B, H, S, D) in `dtype`: code · scale + zero, or (code − offset) · scale.
    per_channel: scale and zero are (B, H, n, 1, D) over blocks of S / n tokens; else (B, H, S, groups, 1)."""
    codes, scale = stored.codes, stored.scale
    view = codes.unflatten(-2, (scale.shape[-3], -1)) if per_channel else codes.unflatten(-1, (scale.shape[-2], -1))
    out = torch.empty(view.shape, dtype=torch.float32, device=codes.device)
    dequantize_into(view, scale, stored.zero, stored.offset, out)
    return out.reshape(codes.shape).to(dtype)


def dequantize_into(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, offset: int, out: torch.Tensor) -> None:
    """out (float32, codes' shape, any strides) ← the codes, dequantized (`dequantize_in_place`)."""
    out.copy_(codes)
    dequantize_in_place(out, scale, zero, offset)


def dequantize_in_place(out: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, offset: int) -> None:
    """out (float32 codes, any strides) ← code · scale + zero as KIVI computes it (a multiply, then an add: two
    roundings, as `data * scale + mn` in its quant/new_pack.py), or (code − offset) · scale; scale and zero broadcast
    to out. The cache's reads and `dequantize` share it, so what the cache hands attention is bit for bit what the
    `kv` site computes. (Two in-place passes with one broadcast operand each: torch's CPU kernels vectorize those,
    where a fused addcmul of a per-row scale and zero-point, both broadcast along the row, loops element by element.)"""
    if zero is None:
        out.sub_(offset).mul_(scale)
    else:
        out.mul_(scale).add_(zero)


def fake_quantize(x: torch.Tensor, bits: int, layout: KVLayout, keys: bool, kept: torch.Tensor | None = None) -> torch.Tensor:
    """What attention reads from a cache holding x (B, H, S, D) in full: complete blocks quantized and
    dequantized, the trailing incomplete block (the float residual) as is. With no residual, every token.
    kept (S,) bool: see `quantize_key_blocks` (the caller restores those rows)."""
    block = layout.residual or 1
    done = x.shape[-2] // block * block
    if done == 0:
        return x
    stored = quantize(x[:, :, :done], bits, layout, keys, None if kept is None else kept[:done])
    out = dequantize(stored, x.dtype, keys and layout.keys == "channel")
    return out if done == x.shape[-2] else torch.cat([out, x[:, :, done:]], dim=2)
