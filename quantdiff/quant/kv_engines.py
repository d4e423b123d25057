"""Engines' own KV-cache quantizers, reproduced code for code.

llama.cpp's q8_0 and q4_0 blocks (`--cache-type-k q8_0`), as ggml writes them (ggml/src/ggml-quants.c,
`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, and `dequantize_row_q8_0`, `dequantize_row_q4_0`), over blocks
of 32 consecutive channels of a row (one token of one KV head), each with an fp16 scale d:

- q8_0: d = amax / 127, code = roundf(x · (1 / d)) (half away from zero), value = code · d;
- q4_0: d = (the block's signed extreme) / −8, code = min(15, (int8)(x · (1 / d) + 8.5)) (truncated),
  value = (code − 8) · d. The grid is −8 … 7, not the symmetric ±7 of quantdiff's `token` layout.

The codes are computed with the fp32 d, the value with d rounded to fp16, as ggml does. Codes are stored unsigned,
offset by `OFFSETS` (what dequantization subtracts). These transcriptions were written from ggml's reference
functions as the files above state them (the project's tests check them against loop-by-loop transcriptions).

vLLM's per-token-head caches (`--kv-cache-dtype int8_per_token_head` / `fp8_per_token_head`), as its Triton kernel
writes them (github.com/vllm-project/vllm at 60e0ba0b, vllm/v1/attention/ops/triton_reshape_and_cache_flash.py,
`_reshape_cache_per_token_head`, launched by `triton_reshape_and_cache_flash_per_token_head_quant`): one float32
scale per token and KV head over the head's channels,

- scale = max(amax / QUANT_MAX, 1e-6), q = clamp(x · (1 / scale), QUANT_MIN, QUANT_MAX), value = q · scale;
- int8 (QUANT_MAX 127, QUANT_MIN −128): `tl.store` into the int8 cache converts float to int by truncation toward
  zero (vLLM's own test, tests/quantization/test_per_token_kv_cache.py, says so: "INT8 Triton stores truncate"),
  so codes are truncated, not rounded, on a −128 … 127 grid;
- fp8 (torch.float8_e4m3fn, QUANT_MAX 448 = its largest finite value): the store casts to e4m3, round to nearest
  even.

vLLM's `int4_per_token_head` at the same commit (`_reshape_cache_int4_packed`, the same file) is asymmetric, per
token and KV head: mn, mx over the row; s₀ = max((mx − mn) / 15, 1e-6); zp = clamp(round(−mn / s₀), 0, 15);
q = clamp(round(x · (1 / s₀) + zp), 0, 15); then one least-squares step, s = max(Σx·(q − zp) / max(Σ(q − zp)², 1e-6),
1e-6), and zp, q again with s (zp = clamp(round(−mn · (1 / s)), 0, 15)); "round" is (v ± 0.5) truncated, half away
from zero. The zero-point is stored in the scale's 4 lowest mantissa bits, so the scale read back is s with those
bits cleared, and value = (q − zp) · that scale (here code · scale + zero, zero = −zp · scale, equal bit for bit:
the scale keeps at most 20 significant bits and codes 4, so every product and the sum are exact).
(A later version of vLLM's tests, seen in the index without its kernel, describes a codebook int4 instead: this is
the asymmetric mode as 60e0ba0b has it.)

vLLM's per-tensor fp8 (`--kv-cache-dtype fp8`, e4m3, with `--calculate-kv-scales`): one float32 scale per layer
for keys and one for values, set once by the first forward (`Attention.calc_kv_scales`, vllm/attention/layer.py)
as amax(|K|) / K_SCALE_CONSTANT and amax(|V|) / V_SCALE_CONSTANT (vllm/envs.py: 200 and 100, not 448), then
x / scale converted to e4m3 with saturation, round to nearest even (csrc/quantization/fp8/nvidia/quant_utils.cuh,
`scaled_vec_conversion`: `__nv_cvt_float_to_fp8(a / scale, __NV_SATFINITE, __NV_E4M3)`), value = e4m3 · scale.
Without calculated or checkpoint scales vLLM uses 1.0: not reproduced. Here the first forward's amax is per
sequence (vLLM's first forward may hold several requests).

Where these can differ from the GPU: Triton lowers fp32 `/` to an approximate division (PTX div.full.f32) and may
fuse x · (1 / s) + zp into one FMA, and sums in float32 in tree order; these use IEEE division, two roundings, and
the int4 sum Σx·(q − zp) in float64 rounded once. A scale can then differ in its last bits, and a code only where a
value sits within an ulp of a rounding boundary.
"""

from __future__ import annotations

import torch

BLOCK = 32  # QK8_0 = QK4_0: channels per block
ENGINE_BITS = {"q8_0": 8, "q4_0": 4, "vllm-int8-head": 8, "vllm-int4-head": 4, "vllm-fp8-head": 8, "vllm-fp8-tensor": 8}
OFFSETS = {"q8_0": 127, "q4_0": 8, "vllm-int8-head": 128, "vllm-int4-head": 0, "vllm-fp8-head": 0, "vllm-fp8-tensor": 0}  # fp8 codes are float8_e4m3fn
GROUPS = {"q8_0": BLOCK, "q4_0": BLOCK, "vllm-int8-head": None, "vllm-int4-head": None, "vllm-fp8-head": None, "vllm-fp8-tensor": None}  # channels per scale (None: the row)
PER_TENSOR = {"vllm-fp8-tensor": (200.0, 100.0)}  # engine -> (K_SCALE_CONSTANT, V_SCALE_CONSTANT): one scale a tensor, set by the first forward
ZERO_POINTS = {name: name == "vllm-int4-head" for name in ENGINE_BITS}
DESCRIPTIONS = {
    "q8_0": f"llama.cpp q8_0: per token, blocks of {BLOCK} channels, fp16 scales, ggml's rounding",
    "q4_0": f"llama.cpp q4_0: per token, blocks of {BLOCK} channels, fp16 scales, ggml's rounding",
    "vllm-int8-head": "vLLM int8_per_token_head: per token and KV head, float32 scales, codes truncated",
    "vllm-int4-head": "vLLM int4_per_token_head: per token and KV head, asymmetric, least-squares scale, zero-point in the scale's low bits",
    "vllm-fp8-head": "vLLM fp8_per_token_head: per token and KV head, float32 scales, e4m3 round to nearest even",
    "vllm-fp8-tensor": "vLLM fp8 with calculated kv scales: one scale per layer for keys (amax / 200) and values (amax / 100), set by the first forward",
}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: vLLM's FP8_MAX for float8_e4m3fn


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, BLOCK))  # (..., D / 32, 32)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # codes, scale, zero (None: symmetric)


def q8_0(x: torch.Tensor) -> Quantized:
    """x (..., D) → (codes + 127 as uint8 (..., D), d as float16 (..., D / 32, 1), None)."""
    blocks = _blocks(x)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    whole = torch.trunc(scaled)
    codes = whole + torch.sign(scaled) * ((scaled - whole).abs() >= 0.5)  # roundf: half away from zero, exactly
    return (codes + OFFSETS["q8_0"]).to(torch.uint8).flatten(-2), d.to(torch.float16), None


def q4_0(x: torch.Tensor) -> Quantized:
    """x (..., D) → (codes 0…15 as uint8 (..., D), d as float16 (..., D / 32, 1), None)."""
    blocks = _blocks(x)
    first = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as `if (amax < fabsf(v))`
    d = blocks.gather(-1, first) / -8
    shifted = blocks * _inverse(d) + 8.5
    codes = torch.clamp(torch.trunc(shifted), max=15)  # (int8_t) truncates toward zero; MIN(15, ·)
    return codes.to(torch.uint8).flatten(-2), d.to(torch.float16), None


def _per_token_head_scale(data: torch.Tensor, quant_max: float) -> torch.Tensor:
    """tl.maximum(tl.max(tl.abs(x)) / QUANT_MAX, 1e-6), per row: (..., 1)."""
    return torch.clamp(data.abs().amax(dim=-1, keepdim=True) / quant_max, min=1e-6)


def vllm_int8_head(x: torch.Tensor) -> Quantized:
    """x (..., D) → (codes + 128 as uint8 (..., D), scale float32 (..., 1, 1), None); codes truncated toward zero."""
    data = x.float()
    scale = _per_token_head_scale(data, 127.0)
    codes = torch.trunc(torch.clamp(data * (1.0 / scale), -128.0, 127.0))  # the int8 store truncates
    return (codes + OFFSETS["vllm-int8-head"]).to(torch.uint8), scale.unsqueeze(-1), None


def vllm_fp8_head(x: torch.Tensor) -> Quantized:
    """x (..., D) → (codes as float8_e4m3fn (..., D), scale float32 (..., 1, 1), None)."""
    data = x.float()
    scale = _per_token_head_scale(data, FP8_MAX)
    return torch.clamp(data * (1.0 / scale), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.unsqueeze(-1), None


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """tl.where(v >= 0, (v + 0.5).to(tl.int32), (v - 0.5).to(tl.int32)): the cast truncates."""
    return torch.trunc(torch.where(v >= 0, v + 0.5, v - 0.5))


def _int4_grid(data: torch.Tensor, inverse: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(x · (1 / s) + zp), 0, 15)."""
    return torch.clamp(_round_half_away(data * inverse + zp), 0.0, 15.0)


def vllm_int4_head(x: torch.Tensor) -> Quantized:
    """x (..., D) → (codes 0…15 as uint8 (..., D), scale float32 (..., 1, 1) with its 4 low bits cleared,
    zero = −zp · scale (..., 1, 1)); the module docstring gives the steps."""
    data = x.float()
    mn, mx = data.amin(dim=-1, keepdim=True), data.amax(dim=-1, keepdim=True)
    initial = torch.clamp((mx - mn) / 15.0, min=1e-6)
    zp = torch.clamp(_round_half_away(-mn / initial), 0.0, 15.0)
    centred = _int4_grid(data, 1.0 / initial, zp) - zp
    xr = (data.double() * centred.double()).sum(dim=-1, keepdim=True).float()
    rr = (centred * centred).sum(dim=-1, keepdim=True)  # whole numbers below 2^24: exact in float32
    scale = torch.clamp(xr / torch.clamp(rr, min=1e-6), min=1e-6)
    inverse = 1.0 / scale
    zp = torch.clamp(_round_half_away(-mn * inverse), 0.0, 15.0)
    codes = _int4_grid(data, inverse, zp)
    stored = (scale.view(torch.int32) & -16).view(torch.float32)  # (bits & -16) | zp, read back as bits & -16
    return codes.to(torch.uint8), stored.unsqueeze(-1), (-zp * stored).unsqueeze(-1)


def vllm_fp8_tensor_scale(x: torch.Tensor, engine: str, keys: bool) -> torch.Tensor:
    """calc_kv_scales per sequence: x (B, H, S, D) → amax over the sequence's heads, tokens and channels divided by
    the K or V constant, float32 (B, 1, 1, 1, 1) (the shape of a per-token scale with one group)."""
    constant = PER_TENSOR[engine][0 if keys else 1]
    return (x.float().abs().amax(dim=(1, 2, 3), keepdim=True) / constant).unsqueeze(-1)


def vllm_fp8_tensor(x: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """x (B, H, S, D), scale (B, 1, 1, 1, 1) → (codes as float8_e4m3fn, scale, None): e4m3(saturate(x / scale))."""
    return torch.clamp(x.float() / scale.squeeze(-1), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale, None


QUANTIZERS = {"q8_0": q8_0, "q4_0": q4_0, "vllm-int8-head": vllm_int8_head, "vllm-int4-head": vllm_int4_head, "vllm-fp8-head": vllm_fp8_head}
