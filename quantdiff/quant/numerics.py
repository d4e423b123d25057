"""Quantizers as pure functions: each returns the integer codes and scales as well as the fake-quantized tensor.

Symmetric absmax at any width 2–16 bits, and LLM.int8 (Dettmers et al. 2022) generalised to n bits. The
conventions follow bitsandbytes' reference kernels (`int8_vectorwise_quant`, `int8_mixed_scaled_mm`):
codes = round(x · (qmax / absmax)) with round-half-to-even, so at 8 bits our codes and row statistics equal
bitsandbytes' bit for bit on float16 inputs. Everything is computed in float32; `dequant` comes back in the
input's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int

MIN_BITS, MAX_BITS = 2, 16
# LLM.int8's outlier magnitude (Dettmers et al. 2022, bitsandbytes' default): |x| ≥ 6 marks an outlier feature.
LLM_INT8_THRESHOLD = 6.0


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor (or for each index of its leading `batch_dims` axes)."""


@dataclass(frozen=True)
class PerRow:
    """One scale per row: reduce over the last axis only (a token's features, a weight's output channel)."""


@dataclass(frozen=True)
class PerColumn:
    """One scale per index of the last axis (a feature channel): reduce over every other non-batch axis."""


Granularity = PerTensor | PerRow | PerColumn


def check_bits(bits: object) -> int:
    """`bits` as a Python int (any integer: `core.integers`), from MIN_BITS to MAX_BITS."""
    value = as_int(bits)
    if value is None:
        raise ConfigError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= value <= MAX_BITS:
        raise ConfigError(f"bits must be from {MIN_BITS} to {MAX_BITS}, got {value}")
    return value


def qmax(bits: int) -> int:
    """Largest code of a symmetric signed grid: 127 at 8 bits (−128 is never used, as in bitsandbytes)."""
    return 2 ** (check_bits(bits) - 1) - 1


def code_dtype(bits: int) -> torch.dtype:
    return torch.int8 if check_bits(bits) <= 8 else torch.int16


@dataclass(frozen=True)
class QuantResult:
    codes: torch.Tensor  # int8 (≤ 8 bits) or int16, x's shape; 0 where masked out
    scale: torch.Tensor  # float32, broadcastable to x: dequant = codes · scale (group-wise: (..., groups), see there)
    dequant: torch.Tensor  # x's dtype: codes · scale where valid, x itself where masked out


def absmax(x: torch.Tensor, granularity: Granularity, mask: torch.Tensor | None = None, batch_dims: int = 0) -> torch.Tensor:
    """max |x| over the axes the granularity reduces, keepdim, float32. Only `mask`-True entries count."""
    if not 0 <= batch_dims < max(x.dim(), 1):
        raise ConfigError(f"batch_dims={batch_dims} does not fit a {x.dim()}-d tensor")
    if isinstance(granularity, PerTensor):
        dims = tuple(range(batch_dims, x.dim()))
    elif isinstance(granularity, PerRow):
        dims = (x.dim() - 1,)
    elif isinstance(granularity, PerColumn):
        dims = tuple(range(batch_dims, x.dim() - 1))
    else:
        raise ConfigError(f"unknown granularity {granularity!r}")
    mag = x.detach().abs().float()
    if mask is not None:
        mag = mag.masked_fill(~mask, 0.0)
    if not dims or x.numel() == 0:  # e.g. PerColumn of a 1-d tensor: every entry is its own column
        return mag
    return mag.amax(dim=dims, keepdim=True)


def _inverse_and_scale(amax: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qmax / amax, amax / qmax), float32. bitsandbytes multiplies by 127 / absmax, so do we.

    A zero amax, or one so small (< ~1e-36) that qmax / amax overflows, gives inverse 0: codes 0, no NaN.
    """
    inv = q / amax.float()
    return torch.where(torch.isfinite(inv), inv, torch.zeros_like(inv)), amax.float() / q


def _scaled_grid(x: torch.Tensor, amax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as a fresh float32 tensor, scale)."""
    q = qmax(bits)
    inv, scale = _inverse_and_scale(amax, q)
    # One float buffer, updated in place from here on: fresh tensors of logits size cost more than the arithmetic.
    return (x.float() * inv).round_().clamp_(-q, q), scale


def quantize_with_absmax(x: torch.Tensor, amax: torch.Tensor, bits: int, mask: torch.Tensor | None = None) -> QuantResult:
    """Quantize x on the symmetric grid that maps ±amax to ±qmax; amax broadcastable to x.

    Entries where `mask` is False are not quantized: code 0, dequant = x (masked logits must pass through;
    they are set to −inf after the tap anyway).
    """
    grid, scale = _scaled_grid(x, amax, bits)
    codes = grid.to(code_dtype(bits))
    if mask is not None:
        codes.masked_fill_(~mask, 0)
    return QuantResult(codes, scale, _dequantize_into(grid, scale, x, mask))


def fake_quantize_with_absmax(x: torch.Tensor, amax: torch.Tensor, bits: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`quantize_with_absmax(...).dequant` without materialising the integer codes: the logits tiles' hot path."""
    if x.is_cuda:  # one fused kernel instead of five passes over a logits-sized tensor
        q = qmax(bits)
        return _fused_fake_quant()(x, *_inverse_and_scale(amax, q), q, mask)
    grid, scale = _scaled_grid(x, amax, bits)
    return _dequantize_into(grid, scale, x, mask)


def _dequantize_into(grid: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    dequant = grid.mul_(scale)
    if mask is not None:
        other = x.float()
        if dequant.requires_grad or other.requires_grad:  # out= has no autograd: a forward with grad allocates
            dequant = torch.where(mask, dequant, other)
        else:
            dequant = torch.where(mask, dequant, other, out=dequant)
    return dequant.to(x.dtype)


def _fake_quant_math(x: torch.Tensor, inv: torch.Tensor, scale: torch.Tensor, q: int, mask: torch.Tensor | None) -> torch.Tensor:
    """The same float32 operations as _scaled_grid + _dequantize_into, out of place, for torch.compile to fuse."""
    dequant = (x.float() * inv).round().clamp(-q, q) * scale
    if mask is not None:
        dequant = torch.where(mask, dequant, x.float())
    return dequant.to(x.dtype)


@functools.cache
def _fused_fake_quant() -> Callable:
    return torch.compile(_fake_quant_math, dynamic=True)


def absmax_quantize(
    x: torch.Tensor,
    bits: int,
    granularity: Granularity = PerTensor(),
    mask: torch.Tensor | None = None,
    batch_dims: int = 0,
) -> QuantResult:
    """Symmetric absmax: scale = max|x| / (2^(bits−1) − 1) per granularity group; only valid entries set it."""
    return quantize_with_absmax(x, absmax(x, granularity, mask, batch_dims), bits, mask)


def check_group_size(group_size: object) -> int:
    value = as_int(group_size)
    if value is None or value < 1:
        raise ConfigError(f"group size must be a positive integer, got {group_size!r}")
    return value


def groupwise_absmax_quantize(x: torch.Tensor, bits: int, group_size: int) -> QuantResult:
    """Symmetric absmax over groups of `group_size` consecutive entries of the last axis (a weight (out, in):
    groups along each output channel's inputs, as GPTQ/AWQ/llama.cpp group their weights), one scale per group.

    A last axis that is not a multiple of `group_size` ends in a shorter group (zero-padded, and zeros never
    raise a group's absmax), so a width like 576 takes groups of 128. `scale` is (..., groups):
    dequant[..., j] = codes[..., j] · scale[..., j // group_size].
    """
    k = x.shape[-1]
    groups = -(-k // check_group_size(group_size))
    group_size = min(group_size, max(k, 1))  # a group as wide as the row or wider is the row: never pad past it
    padded = torch.nn.functional.pad(x, (0, groups * group_size - k)).reshape(*x.shape[:-1], groups, group_size)
    result = absmax_quantize(padded, bits, PerRow())  # one group per row of the padded view
    unpad = lambda t: t.reshape(*x.shape[:-1], groups * group_size)[..., :k]  # noqa: E731
    return QuantResult(unpad(result.codes), result.scale.squeeze(-1), unpad(result.dequant))


def rowwise_absmax_quantize(x: torch.Tensor, bits: int, group_size: int | None = None) -> QuantResult:
    """One scale per row of the last axis (scale (..., 1)), or per group of `group_size` consecutive entries of
    each row (scale (..., groups)). Rows never share a scale: a weight's output channels, or a KV cache's rows
    (one token of one KV head), each quantized on its own, whatever else the tensor holds."""
    if group_size is None:
        return absmax_quantize(x, bits, PerRow())
    return groupwise_absmax_quantize(x, bits, group_size)


def absmax_weight_quantize(weight: torch.Tensor, bits: int, group_size: int | None = None) -> QuantResult:
    """A linear weight (out, in) per output channel (scale (out, 1)), or per group of `group_size` inputs of
    each output channel (scale (out, groups)): the `linear` site's weight quantizer, which exports store."""
    return rowwise_absmax_quantize(weight, bits, group_size)


def expand_group_scales(scale: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """(..., groups) group scales -> (..., k), one per entry: the inverse of the grouping above."""
    return scale.repeat_interleave(min(group_size, max(k, 1)), dim=-1)[..., :k]


def compressed_tensors_token_fake_quantize(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Dynamic per-token symmetric int quantization exactly as the compressed-tensors package runs it (0.20.0,
    what transformers executes for a W8A8 `int-quantized` checkpoint), in x's own dtype throughout:

    - `utils/helpers.py` `compute_dynamic_scales_and_zp` (strategy `token`): min/max over every axis but the
      first two (a (B, T, k) input: per token; a 2-d input: the whole tensor), widened to include 0;
    - `calculate_qparams`: scale = max(|min|, |max|) / (bit range / 2) = absmax / 127.5 at 8 bits (not / 127),
      a zero scale replaced by the dtype's eps; zero point 0;
    - `lifecycle/forward_helpers.py` `_quantize_dequantize`: x / scale (a division, not a product with the
      inverse), clamped to [−2^(bits−1), 2^(bits−1) − 1] = [−128, 127] *before* `torch.round` (half to even),
      times scale.

    So the token's largest positive value lands on 127 (127.5 clamped) and its most negative on −128.
    """
    q_min, q_max = -(2 ** (check_bits(bits) - 1)), 2 ** (bits - 1) - 1
    dims = tuple(range(2, x.dim()))
    low = (x.amin(dim=dims, keepdim=True) if dims else x.amin()).clamp(max=0)
    high = (x.amax(dim=dims, keepdim=True) if dims else x.amax()).clamp(min=0)
    scale = torch.maximum(low.abs(), high) / ((q_max - q_min) / 2)
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    return torch.round(torch.clamp(x / scale, q_min, q_max)) * scale


@dataclass(frozen=True)
class VectorwiseResult:
    codes: torch.Tensor  # (..., rows, k) int; 0 in outlier feature columns
    row_absmax: torch.Tensor  # (..., rows) float32: bitsandbytes' row_stats (SCA, or SCB for a weight)
    outliers: torch.Tensor  # (..., 1, k) bool: feature columns kept in full precision
    dequant: torch.Tensor  # x's dtype: codes · row_absmax / qmax, outlier columns exactly x

    @property
    def outlier_cols(self) -> torch.Tensor:
        """Indices of the outlier columns of a 2-d input, as bitsandbytes returns them (int64)."""
        if self.outliers.dim() != 2:
            raise ValueError("outlier_cols is defined for 2-d inputs; use `outliers` for batched ones")
        return torch.argwhere(self.outliers[0]).view(-1)


def tokenwise_vectorwise_quantize(x: torch.Tensor, bits: int, threshold: float) -> torch.Tensor:
    """LLM.int8 with every row (token) of x (..., rows, k) its own matmul input: its outlier features are its own
    entries with |x| ≥ threshold, never another token's. This is what bitsandbytes computes when it decodes one
    token at a time, and it keeps a token's result independent of the tokens after it. Returns the dequant."""
    return vectorwise_quantize(x.unsqueeze(-2), bits, threshold).dequant.squeeze(-2)


def outlier_features(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """(..., 1, k) bool: columns of x (..., rows, k) holding any |x| ≥ threshold; none when threshold ≤ 0."""
    if threshold <= 0:
        return torch.zeros(*x.shape[:-2], 1, x.shape[-1], dtype=torch.bool, device=x.device)
    return (x.detach().abs() >= threshold).any(dim=-2, keepdim=True)


def vectorwise_quantize(
    x: torch.Tensor, bits: int, threshold: float = 0.0, outliers: torch.Tensor | None = None
) -> VectorwiseResult:
    """LLM.int8's vector-wise quantization of x (..., rows, k), generalised to n bits.

    Row-wise absmax; feature columns holding any |x| ≥ threshold (or the given `outliers` mask, (..., 1, k))
    are left out of the codes and kept exact. As in bitsandbytes' `int8_vectorwise_quant`, only the outlier
    *entries* are zeroed before the row absmax: other entries of an outlier column still count.
    """
    if x.dim() < 2:
        raise ConfigError("vector-wise quantization needs a tensor of at least 2 dimensions (rows, features)")
    if outliers is None:
        outliers = outlier_features(x, threshold)
    big = x.detach().abs() >= threshold if threshold > 0 else torch.zeros_like(x, dtype=torch.bool)
    amax = absmax(x, PerRow(), mask=~big)  # (..., rows, 1)
    result = quantize_with_absmax(x, amax, bits, mask=~outliers)
    return VectorwiseResult(result.codes, amax.squeeze(-1), outliers, result.dequant)


@dataclass(frozen=True)
class LLMInt8Result:
    a: VectorwiseResult  # activations flattened to (N, k), float32
    weight: VectorwiseResult  # (m, k): row-wise = per output channel, float32
    product: torch.Tensor  # (..., n, m) in a's dtype: a.dequant @ weight.dequantᵀ

    @property
    def outlier_cols(self) -> torch.Tensor:
        return self.a.outlier_cols


def llm_int8_matmul(a: torch.Tensor, weight: torch.Tensor, bits: int = 8, threshold: float = LLM_INT8_THRESHOLD) -> LLMInt8Result:
    """y = a @ weightᵀ as LLM.int8 computes it; a (..., n, k), weight (m, k) (nn.Linear's and bitsandbytes' layout).

    Outlier columns are found over all rows of a, leading axes flattened, as bitsandbytes does; their products
    use the exact activations with the *dequantized* weight columns (bitsandbytes' `int8_mixed_scaled_mm` with
    has_fp16_weights=False), so the product is simply a_fake @ w_fakeᵀ. The weight itself has no outlier split.
    """
    k = a.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ConfigError(f"weight of shape {tuple(weight.shape)} does not fit activations with {k} features")
    a_q = vectorwise_quantize(a.float().reshape(-1, k), bits, threshold)  # (N, k)
    w_q = vectorwise_quantize(weight.float(), bits)  # (m, k)
    product = (a_q.dequant @ w_q.dequant.T).reshape(*a.shape[:-1], weight.shape[0])  # (..., n, m)
    return LLMInt8Result(a_q, w_q, product.to(a.dtype))
