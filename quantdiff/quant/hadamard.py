"""Walsh–Hadamard rotations of a linear layer's input axis, as pure functions (QuaRot, Ashkboos et al. 2024;
SpinQuant, Liu et al. 2024).

A rotation by an orthogonal H leaves a linear layer unchanged, y = x Wᵀ = (xH)(WH)ᵀ, while the rotated input xH
spreads a channel holding an outlier over all channels H mixes: |xH|'s peak falls by up to √(block). Width k is
rotated by the block-diagonal matrix diag(H_b, …, H_b) with H_b the normalised Sylvester Walsh–Hadamard matrix
(H_1 = [1], H_2n = [[H_n, H_n], [H_n, −H_n]], divided by √b) and b the largest power of two dividing k: the
whole width when k is a power of two, 64 for SmolLM2's 576 = 9·64, 128 for Gemma's 640 = 5·128.

Why that block: Sylvester matrices exist for powers of two only. QuaRot reaches a full rotation of other widths
with a Kronecker product H_m ⊗ H_(k/m) where m is one of a dozen hard-coded Hadamard orders (12, 20, 36, …);
the largest power-of-two block needs no table and stays exact, at the price of mixing only within each block
(an outlier's peak falls by √b, not √k). Blocks are contiguous, so each block is a slice of the input axis.

H_b is symmetric, so xH = xHᵀ, and applying it twice gives x back. It is applied without forming H_b: with
b = b1·b2 (b1, b2 powers of two), H_b = H_b1 ⊗ H_b2, so each block reshaped to (b1, b2) is multiplied on both
sides by the small matrices — O(k·(b1 + b2)) per row instead of O(k·b), and no b × b matrix for wide layers.
"""

from __future__ import annotations

import functools

import torch

from quantdiff.core.errors import ConfigError


def hadamard_block(width: int) -> int:
    """The block size b used for input width `width`: its largest power-of-two divisor (see the module docstring).

    ConfigError for an odd width, whose only such block is 1 (no rotation at all)."""
    if width < 2 or width % 2:
        raise ConfigError(f"a Hadamard rotation needs an even input width, got {width} (its only power-of-two block is 1)")
    return width & -width


@functools.lru_cache(maxsize=32)
def _sylvester(n: int) -> torch.Tensor:
    """The unnormalised ±1 Sylvester matrix of order n (a power of two), float64 on the CPU."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sylvester_matrix(n: int) -> torch.Tensor:
    """H_n / √n: the normalised Walsh–Hadamard matrix of order n (a power of two), float64, orthogonal and symmetric."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"Sylvester Hadamard matrices have power-of-two orders, got {n}")
    return _sylvester(n) / n**0.5


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x · diag(H_block, …) along the last axis (whose length `block` must divide), in float32, back in x's dtype."""
    k = x.shape[-1]
    if block < 1 or block & (block - 1) or k % block:
        raise ConfigError(f"a Hadamard block of {block} does not tile an axis of {k}")
    b1 = 1 << ((block.bit_length() - 1) // 2)  # b1 ≤ b2, b1·b2 = block
    b2 = block // b1
    h1 = sylvester_matrix(b1).to(device=x.device, dtype=torch.float32)
    h2 = sylvester_matrix(b2).to(device=x.device, dtype=torch.float32)
    blocks = x.float().reshape(*x.shape[:-1], k // block, b1, b2)  # (..., blocks, b1, b2): row-major = H_b1 ⊗ H_b2
    rotated = h1 @ blocks @ h2  # both symmetric: (H_b1 ⊗ H_b2) vec(X) = vec(H_b1 X H_b2) in row-major order
    return rotated.reshape(x.shape).to(x.dtype)
