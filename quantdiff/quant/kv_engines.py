"""Engines' own KV-cache quantizers, reproduced code for code.

llama.cpp's q8_0 and q4_0 blocks (`--cache-type-k q8_0`), as ggml writes them (ggml/src/ggml-quants.c, `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, and
`dequantize_row_q8_0`, `dequantize_row_q4_0`), over blocks of 32 consecutive channels of a row (one token of one
KV head), each with an fp16 scale d:

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

Where these can differ from the GPU: Triton lowers fp32 `/` to an approximate division (PTX div.full.f32), while
these use IEEE division, so a scale (and, rarely, a code sitting within an ulp of a boundary) can differ in its
last bit. vLLM's int4 per-token-head mode (asymmetric, a least-squares scale, its zero-point hidden in the scale's
low mantissa bits) is not reproduced here.
"""

from __future__ import annotations

import torch

BLOCK = 32  # QK8_0 = QK4_0: channels per block
ENGINE_BITS = {"q8_0": 8, "q4_0": 4, "vllm-int8-head": 8, "vllm-fp8-head": 8}
OFFSETS = {"q8_0": 127, "q4_0": 8, "vllm-int8-head": 128, "vllm-fp8-head": 0}  # fp8 codes are float8_e4m3fn, read as floats
GROUPS = {"q8_0": BLOCK, "q4_0": BLOCK, "vllm-int8-head": None, "vllm-fp8-head": None}  # channels per scale (None: the row)
DESCRIPTIONS = {
    "q8_0": f"llama.cpp q8_0: per token, blocks of {BLOCK} channels, fp16 scales, ggml's rounding",
    "q4_0": f"llama.cpp q4_0: per token, blocks of {BLOCK} channels, fp16 scales, ggml's rounding",
    "vllm-int8-head": "vLLM int8_per_token_head: per token and KV head, float32 scales, codes truncated",
    "vllm-fp8-head": "vLLM fp8_per_token_head: per token and KV head, float32 scales, e4m3 round to nearest even",
}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: vLLM's FP8_MAX for float8_e4m3fn


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, BLOCK))  # (..., D / 32, 32)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) → (codes + 127 as uint8 (..., D), d as float16 (..., D / 32, 1))."""
    blocks = _blocks(x)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    whole = torch.trunc(scaled)
    codes = whole + torch.sign(scaled) * ((scaled - whole).abs() >= 0.5)  # roundf: half away from zero, exactly
    return (codes + OFFSETS["q8_0"]).to(torch.uint8).flatten(-2), d.to(torch.float16)


def q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) → (codes 0…15 as uint8 (..., D), d as float16 (..., D / 32, 1))."""
    blocks = _blocks(x)
    first = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as `if (amax < fabsf(v))`
    d = blocks.gather(-1, first) / -8
    shifted = blocks * _inverse(d) + 8.5
    codes = torch.clamp(torch.trunc(shifted), max=15)  # (int8_t) truncates toward zero; MIN(15, ·)
    return codes.to(torch.uint8).flatten(-2), d.to(torch.float16)


def _per_token_head_scale(data: torch.Tensor, quant_max: float) -> torch.Tensor:
    """tl.maximum(tl.max(tl.abs(x)) / QUANT_MAX, 1e-6), per row: (..., 1)."""
    return torch.clamp(data.abs().amax(dim=-1, keepdim=True) / quant_max, min=1e-6)


def vllm_int8_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) → (codes + 128 as uint8 (..., D), scale float32 (..., 1, 1)); codes truncated toward zero."""
    data = x.float()
    scale = _per_token_head_scale(data, 127.0)
    codes = torch.trunc(torch.clamp(data * (1.0 / scale), -128.0, 127.0))  # the int8 store truncates
    return (codes + OFFSETS["vllm-int8-head"]).to(torch.uint8), scale.unsqueeze(-1)


def vllm_fp8_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) → (codes as float8_e4m3fn (..., D), scale float32 (..., 1, 1))."""
    data = x.float()
    scale = _per_token_head_scale(data, FP8_MAX)
    return torch.clamp(data * (1.0 / scale), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.unsqueeze(-1)


QUANTIZERS = {"q8_0": q8_0, "q4_0": q4_0, "vllm-int8-head": vllm_int8_head, "vllm-fp8-head": vllm_fp8_head}
