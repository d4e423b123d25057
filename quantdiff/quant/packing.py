"""Dense bit packing of signed integer codes: n-bit codes take n bits on disk, not a whole int8.

Layout: code c ∈ [−qmax, qmax] is stored as the unsigned value c + qmax (< 2^bits), codes in row-major order,
each value's bits least-significant first, in one little-endian bit stream; the last byte is zero-padded.
At 4 bits this is two codes per byte, the first in the low nibble.
"""

from __future__ import annotations

import math

import torch

from quantdiff.quant.numerics import code_dtype, qmax

_BYTE_WEIGHTS = 1 << torch.arange(8, dtype=torch.int32)  # bit i of a byte has value 2^i


def packed_size(numel: int, bits: int) -> int:
    """Bytes that `numel` codes of `bits` bits take."""
    return -(-numel * bits // 8)


_CHUNK = 1 << 20  # codes per chunk: a multiple of 8, so every chunk ends on a byte boundary; bounds temporaries


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes of any shape → flat uint8 bit stream of packed_size(numel, bits) bytes."""
    flat = codes.reshape(-1)
    chunks = [_pack_chunk(flat[i : i + _CHUNK], bits) for i in range(0, flat.numel(), _CHUNK)]
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=codes.device)


def _pack_chunk(codes: torch.Tensor, bits: int) -> torch.Tensor:
    unsigned = codes.to(torch.int32) + qmax(bits)  # (N,) in [0, 2^bits − 2]
    stream = ((unsigned[:, None] >> torch.arange(bits, dtype=torch.int32, device=codes.device)) & 1).reshape(-1)  # (N·bits,) LSB first
    stream = torch.nn.functional.pad(stream, (0, packed_size(codes.numel(), bits) * 8 - stream.numel()))
    return (stream.view(-1, 8) * _BYTE_WEIGHTS.to(codes.device)).sum(dim=1).to(torch.uint8)  # (bytes,)


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of pack_codes: the signed codes, int8 (≤ 8 bits) or int16, in `shape`."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != packed_size(numel, bits):
        raise ValueError(f"{packed.numel()} packed bytes do not hold {numel} codes of {bits} bits")
    flat = packed.reshape(-1)
    step = _CHUNK * bits // 8  # bytes per chunk of _CHUNK codes
    chunks = [_unpack_chunk(flat[i : i + step], bits) for i in range(0, flat.numel(), step)]
    codes = torch.cat(chunks)[:numel] if chunks else torch.zeros(0, dtype=torch.int32, device=packed.device)
    return (codes - qmax(bits)).to(code_dtype(bits)).reshape(shape)


def _unpack_chunk(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if 8 % bits == 0:  # whole codes in every byte (2 or 4 bits): shift and mask, no bit stream (a KV cache's every read)
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
        return ((packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    stream = ((packed.to(torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32, device=packed.device)) & 1).reshape(-1)
    whole = stream.numel() // bits
    values = stream[: whole * bits].view(whole, bits)  # (N, bits) LSB first; the tail is padding
    return (values << torch.arange(bits, dtype=torch.int32, device=packed.device)).sum(dim=1)  # unsigned codes
