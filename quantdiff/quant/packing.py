"""Dense bit packing of signed integer codes: n-bit codes take n bits on disk, not a whole int8.

Layout: code c ∈ [−qmax, qmax] is stored as the unsigned value c + qmax (< 2^bits), codes in row-major order,
each value's bits least-significant first, in one little-endian bit stream; the last byte is zero-padded.
At 4 bits this is two codes per byte, the first in the low nibble.
"""

from __future__ import annotations

import math

import numpy as np
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
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)


def _pack_chunk(codes: torch.Tensor, bits: int) -> torch.Tensor:
    unsigned = (codes.to(torch.int64) + qmax(bits)).cpu().numpy().astype(np.uint64)  # (N,) in [0, 2^bits − 2]
    groups = np.zeros(-(-unsigned.size // 8) * 8, dtype=np.uint64)
    groups[: unsigned.size] = unsigned  # zero codes pad the last group: zero bits, as the layout pads
    words = np.zeros((groups.size // 8, 2), dtype="<u8")  # eight codes fill 8·bits ≤ 128 bits: two words
    for i, code in enumerate(groups.reshape(-1, 8).T):
        for word, shift in _placements(i * bits, bits):
            words[:, word] |= code << np.uint64(shift) if shift >= 0 else code >> np.uint64(-shift)
    stream = words.view(np.uint8)[:, :bits].reshape(-1)  # each group's bits bytes, little-endian
    return torch.from_numpy(stream[: packed_size(unsigned.size, bits)].copy()).to(codes.device)


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of pack_codes: the signed codes, int8 (≤ 8 bits) or int16, in `shape`."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != packed_size(numel, bits):
        raise ValueError(f"{packed.numel()} packed bytes do not hold {numel} codes of {bits} bits")
    flat = packed.reshape(-1)
    step = _CHUNK * bits // 8  # bytes per chunk of _CHUNK codes
    chunks = [_unpack_chunk(flat[i : i + step], bits) for i in range(0, flat.numel(), step)]
    codes = torch.cat(chunks)[:numel] if chunks else torch.zeros(0, dtype=torch.int32)
    return (codes - qmax(bits)).to(code_dtype(bits)).reshape(shape)


def _unpack_chunk(packed: torch.Tensor, bits: int) -> torch.Tensor:
    stream = packed.cpu().numpy()
    count = stream.size * 8 // bits  # whole codes; the tail is padding
    groups = -(-count // 8)
    words = np.zeros((groups, 16), dtype=np.uint8)
    padded = np.zeros(groups * bits, dtype=np.uint8)
    padded[: stream.size] = stream
    words[:, :bits] = padded.reshape(groups, bits)
    words = words.view("<u8")  # (groups, 2)
    codes = np.zeros((groups, 8), dtype=np.uint64)
    for i in range(8):
        for word, shift in _placements(i * bits, bits):
            codes[:, i] |= words[:, word] >> np.uint64(shift) if shift >= 0 else words[:, word] << np.uint64(-shift)
    codes &= np.uint64((1 << bits) - 1)
    return torch.from_numpy(codes.reshape(-1)[:count].astype(np.int32)).to(packed.device)


def _placements(offset: int, bits: int) -> list[tuple[int, int]]:
    """Where a code starting at bit `offset` of a two-word group lies: (word, left shift into it; negative for a
    right shift), one entry per word it touches. Eight codes of ≤ 16 bits fill at most the two 64-bit words,
    and shifting word-wise is what keeps packing vectorised: one operation per code slot, not per bit."""
    word, start = divmod(offset, 64)
    placements = [(word, start)]
    if start + bits > 64:  # the code straddles the words: its high bits open the next one
        placements.append((word + 1, start - 64))
    return placements
