"""Engines' own KV-cache quantizers, reproduced code for code: llama.cpp's q8_0 and q4_0 blocks (`--cache-type-k
q8_0`), as ggml writes them (ggml/src/ggml-quants.c, `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, and
`dequantize_row_q8_0`, `dequantize_row_q4_0`), over blocks of 32 consecutive channels of a row (one token of one
KV head), each with an fp16 scale d:

- q8_0: d = amax / 127, code = roundf(x · (1 / d)) (half away from zero), value = code · d;
- q4_0: d = (the block's signed extreme) / −8, code = min(15, (int8)(x · (1 / d) + 8.5)) (truncated),
  value = (code − 8) · d. The grid is −8 … 7, not the symmetric ±7 of quantdiff's `token` layout.

The codes are computed with the fp32 d, the value with d rounded to fp16, as ggml does. Codes are stored unsigned,
offset by `OFFSETS` (what dequantization subtracts). These transcriptions were written from ggml's reference
functions as the files above state them (the project's tests check them against loop-by-loop transcriptions).
"""

from __future__ import annotations

import torch

BLOCK = 32  # QK8_0 = QK4_0: channels per block
ENGINE_BITS = {"q8_0": 8, "q4_0": 4}
OFFSETS = {"q8_0": 127, "q4_0": 8}


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


QUANTIZERS = {"q8_0": q8_0, "q4_0": q4_0}
