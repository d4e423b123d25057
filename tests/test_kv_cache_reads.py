"""The quantized KV cache's reads (`quant.kv_cache`, the decode-speed path): what every update hands attention equals,
bit for bit, a naive reference that quantizes every complete block of everything written so far with the layout's
quantizers and dequantizes all of it at once as KIVI does (`code · scale + zero`, a multiply then an add, or
`(code − offset) · scale` without a zero-point), the float residual, 16-bit heads and kept rows as written; at every
layout, width (packed or not), per-head plan, sliding window and dtype."""

import pytest
import torch

from quantdiff.quant.kv_cache import QuantizedKVLayer
from quantdiff.quant.kv_layout import TOKEN, KVLayout, layout_named, quantize
from quantdiff.quant.kv_plan import FULL_BITS, LayerPlan

BATCH, HEADS, WIDTH = 2, 3, 64
CHUNKS = (9, 1, 1, 1, 3, 1, 6, 1, 1, 1)  # a prompt, then single tokens and a few short chunks: 25 tokens


def naive(x: torch.Tensor, bits: int, layout: KVLayout, keys: bool, kept: torch.Tensor | None) -> torch.Tensor:
    """x (B, h, n, D), whole blocks → every element dequantized at once, as the cache's reads used to."""
    stored = quantize(x, bits, layout, keys, kept)
    codes = stored.codes.float()
    if keys and layout.keys == "channel":
        view = codes.unflatten(-2, (stored.scale.shape[-3], -1))
    else:
        view = codes.unflatten(-1, (stored.scale.shape[-2], -1))
    if stored.zero is None:
        out = (view - stored.offset) * stored.scale
    else:
        out = view * stored.scale + stored.zero
    return out.reshape(x.shape)


def reference(written: torch.Tensor, plan: LayerPlan, layout: KVLayout, keys: bool, done: int, last: int) -> torch.Tensor:
    """What attention should read: the first `done` tokens quantized per head width (kept positions as written), the
    rest as written; the last `last` tokens."""
    out = written.clone()
    kept = torch.zeros(done, dtype=torch.bool)
    kept[[p for p in plan.keep_positions if p < done]] = True
    for bits in set(plan.kv_bits) - {FULL_BITS} if done else ():
        heads = [h for h, b in enumerate(plan.kv_bits) if b == bits]
        out[:, heads, :done] = naive(written[:, heads, :done].float(), bits, layout, keys, kept if kept.any() else None).to(written.dtype)
    out[:, :, :done][:, :, kept] = written[:, :, :done][:, :, kept]
    return out[:, :, -last:]


def drive(plan: LayerPlan, layout: KVLayout, window: int | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Feed CHUNKS of random keys and values through one layer; every update's reads against the reference.
    Returns how many updates read quantized blocks (so a test can check it exercised them)."""
    layer = QuantizedKVLayer(plan, layout, window)
    generator = torch.Generator().manual_seed(len(plan.kv_bits) + layout.residual)
    keys = values = torch.zeros(BATCH, HEADS, 0, WIDTH, dtype=dtype)
    block = layout.residual or 1
    quantized_reads = 0
    for size in CHUNKS:
        new_keys, new_values = (torch.randn(BATCH, HEADS, size, WIDTH, generator=generator).to(dtype) for _ in range(2))
        new_keys[..., 5] *= 30  # an outlier channel, as keys carry
        done = keys.shape[2] // block * block if layout.residual else keys.shape[2] + size
        keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
        last = keys.shape[2] if window is None else min(keys.shape[2], window - 1 + size)
        got_keys, got_values = layer.update(new_keys, new_values)
        assert got_keys.dtype == dtype and got_keys.shape == (BATCH, HEADS, last, WIDTH)
        rows = got_keys.untyped_storage().nbytes() // (BATCH * HEADS * WIDTH * got_keys.element_size())
        assert rows - last < block  # a sliding layer dequantizes no block that no query reads
        assert torch.equal(got_keys, reference(keys, plan, layout, True, done, last))
        assert torch.equal(got_values, reference(values, plan, layout, False, done, last))
        quantized_reads += done > keys.shape[2] - last
    return quantized_reads


@pytest.mark.parametrize("layout", [KVLayout(residual=4), KVLayout(residual=4, group_size=16), KVLayout(residual=4, zero_point=False),
                                    KVLayout("token", True, None, 4), TOKEN, layout_named("token", group_size=16)],
                         ids=["kivi", "kivi-groups", "kivi-symmetric", "token-keys-zero-point", "token", "token-groups"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8, 12])
def test_reads_equal_a_naive_dequantization_of_everything(layout, bits):
    assert drive(LayerPlan((bits,) * HEADS), layout) >= len(CHUNKS) - 1


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_engine_layouts_read_as_dequantized_everything(name):
    bits = {"q8_0": 8, "q4_0": 4}[name]
    assert drive(LayerPlan((bits,) * HEADS), layout_named(name)) == len(CHUNKS)


@pytest.mark.parametrize("layout", [KVLayout(residual=4), TOKEN], ids=["kivi", "token"])
def test_per_head_widths_and_kept_positions_read_as_the_reference(layout):
    """A plan's mixed widths (a 16-bit head among them) and kept positions, one of them inside a later block."""
    assert drive(LayerPlan((4, 16, 2), (0, 6)), layout) >= len(CHUNKS) - 1


@pytest.mark.parametrize("window", [7, 3])
@pytest.mark.parametrize("layout", [KVLayout(residual=4), TOKEN], ids=["kivi", "token"])
def test_a_sliding_window_reads_only_its_last_tokens(layout, window):
    """A window over 25 tokens (one narrower than a block, too): each read is the reference's last window − 1 + new
    tokens, and no block wholly before them is dequantized."""
    assert drive(LayerPlan((4,) * HEADS, (0,)), layout, window=window) >= 1


def test_a_bfloat16_model_reads_the_reference_in_its_dtype():
    assert drive(LayerPlan((4, 8, 4)), KVLayout(residual=4), dtype=torch.bfloat16) >= len(CHUNKS) - 1
