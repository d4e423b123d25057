"""Dense bit packing of signed integer codes: n-bit codes take n bits on disk, not a whole int8.

Layout: code c ∈ [−qmax, qmax] is stored as the unsigned value c + qmax (< 2^bits), codes in row-major order,
each value's bits least-significant first, in one little-endian bit stream; the last byte is zero-padded.
At 4 bits this is two codes per byte, the first in the low nibble.
"""

from __future__ import annotations

import math

import torch

from quantdiff.quant.numerics import code_dtype, qmax


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
    unsigned = codes.to(torch.int64) + qmax(bits)  # (N,) in [0, 2^bits − 2]
    groups = torch.nn.functional.pad(unsigned, (0, -unsigned.numel() % 8)).view(-1, 8)  # zero codes pad: zero bits
    words = torch.zeros(groups.shape[0], 2, dtype=torch.int64, device=codes.device)  # 8 codes: 8·bits ≤ 128 bits
    for i in range(8):
        for word, shift in _placements(i * bits, bits):  # bits shifted past bit 63 fall off, as they should
            words[:, word] |= groups[:, i] << shift if shift >= 0 else groups[:, i] >> -shift
    stream = words.view(torch.uint8).view(-1, 16)[:, :bits].reshape(-1)  # each group's `bits` bytes, little-endian
    return stream[: packed_size(codes.numel(), bits)]


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of pack_codes: the signed codes, int8 (≤ 8 bits) or int16, in `shape`."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != packed_size(numel, bits):
        raise ValueError(f"{packed.numel()} packed bytes do not hold {numel} codes of {bits} bits")
    flat = packed.reshape(-1)
    step = _CHUNK * bits // 8  # bytes per chunk of _CHUNK codes
    chunks = [_unpack_chunk(flat[i : i + step], bits) for i in range(0, flat.numel(), step)]
    codes = torch.cat(chunks)[:numel] if chunks else torch.zeros(0, dtype=torch.int64, device=packed.device)
    return (codes - qmax(bits)).to(code_dtype(bits)).reshape(shape)


def _unpack_chunk(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if 8 % bits == 0:  # whole codes in every byte (2, 4, 8 bits): shift and mask (a KV cache's every read)
        shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=packed.device)
        return ((packed.to(torch.int64)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    count = packed.numel() * 8 // bits  # whole codes; the tail is padding
    groups = -(-count // 8)
    stream = torch.nn.functional.pad(packed, (0, groups * bits - packed.numel())).view(groups, bits)
    words = torch.nn.functional.pad(stream, (0, 16 - bits)).contiguous().view(torch.int64)  # (groups, 2)
    codes = torch.zeros(groups, 8, dtype=torch.int64, device=packed.device)
    for i in range(8):
        for word, shift in _placements(i * bits, bits):
            if shift < 0:
                codes[:, i] |= words[:, word] << -shift
            elif shift == 0:
                codes[:, i] |= words[:, word]
            else:  # >> is arithmetic on int64: keep only the 64 − shift bits that came from the word
                codes[:, i] |= (words[:, word] >> shift) & ((1 << (64 - shift)) - 1)
    return (codes & ((1 << bits) - 1)).reshape(-1)[:count]


def _placements(offset: int, bits: int) -> list[tuple[int, int]]:
    """Where a code starting at bit `offset` of a two-word group lies: (word, left shift into it; negative for a
    right shift), one entry per word it touches. Eight codes of ≤ 16 bits fill at most the two 64-bit words;
    shifting whole words is one tensor operation per code slot instead of one per bit, on any device."""
    word, start = divmod(offset, 64)
    placements = [(word, start)]
    if start + bits > 64:  # the code straddles the words: its high bits open the next one
        placements.append((word + 1, start - 64))
    return placements
