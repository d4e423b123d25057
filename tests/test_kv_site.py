"""Site kv: keys per channel and values per token, checked against a naive loop and against a KV cache that
quantizes what it stores (the reference: eager attention reading that cache), for standard (GQA), DiffLlama's two
maps and DIFF V2's doubled query heads."""

import pytest
import torch
from transformers import DynamicCache

from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.sites import KVQuantizer, parse_config, quantized

PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)


def naive_keys(key: torch.Tensor, bits: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """One scale per (sequence, head, channel): max |k| over the valid tokens / (2^(b−1) − 1), loop by loop."""
    out = key.clone()
    b, h, s, d = key.shape
    q = 2 ** (bits - 1) - 1
    for i in range(b):
        rows = [t for t in range(s) if valid is None or bool(valid[i, 0, t, 0])]
        for j in range(h):
            for c in range(d):
                scale = max(abs(float(key[i, j, t, c])) for t in rows) / q
                for t in rows:
                    out[i, j, t, c] = round(float(key[i, j, t, c]) / scale) * scale if scale > 0 else 0.0
    return out


def naive_values(value: torch.Tensor, bits: int) -> torch.Tensor:
    """One scale per (sequence, head, token): max |v| over the head's channels."""
    scale = value.abs().amax(dim=-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.where(scale > 0, torch.round(value / scale) * scale, torch.zeros_like(value))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kv_quantizer_matches_the_naive_loops(bits):
    g = torch.Generator().manual_seed(bits)
    key = torch.randn(2, 3, 7, 5, generator=g) * torch.linspace(0.1, 20, 5)  # channels of very different ranges
    value = torch.randn(2, 3, 7, 5, generator=g)
    valid = torch.ones(2, 1, 7, 1, dtype=torch.bool)
    valid[1, :, 5:] = False  # the second sequence is padded: its last two keys are not in its cache
    key[1, :, 5:] = 1e3  # and would dominate every channel's scale if they counted
    quantizer = KVQuantizer(bits)
    got = quantizer.keys(key, valid)
    assert torch.allclose(got[:, :, :5], naive_keys(key, bits, valid)[:, :, :5], atol=1e-5)
    assert torch.allclose(got[0], naive_keys(key, bits, valid)[0], atol=1e-5)
    assert torch.allclose(quantizer.values(value), naive_values(value, bits), atol=1e-6)


class QuantizingCache(DynamicCache):
    """A KV cache that stores its keys and values quantized (the naive reference) and hands those to attention."""

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.bits = bits

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(naive_keys(key_states, self.bits), naive_values(value_states, self.bits), layer_idx, *args, **kwargs)


@pytest.fixture(scope="module")
def models():
    return {kind: model.eval() for kind, model in build_pair(PRESET, seed=0, kinds=ALL_KINDS).items()}


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("bits", [3, 6])
def test_kv_site_equals_eager_attention_over_a_quantized_cache(models, kind, bits):
    model = models[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 9), generator=torch.Generator().manual_seed(bits))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, past_key_values=QuantizingCache(bits), use_cache=True).logits
        unquantized = model(ids).logits
        loading.prepare(model, tile_size=4)
        with quantized(model, parse_config("absmax", bits, "kv")):
            got = model(ids).logits
    assert (got - reference).abs().max() < 1e-4 * reference.abs().max(), (got - reference).abs().max()
    assert (got - unquantized).abs().max() > 1e-3 * unquantized.abs().max()  # the quantization did something


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_sixteen_bits_equal_the_unquantized_model(models, kind):
    model = loading.prepare(models[kind], tile_size=4)
    ids = torch.randint(0, PRESET.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
        with quantized(model, parse_config("absmax", 16, "kv")):
            got = model(ids).logits
    assert (got - reference).abs().max() < 1e-3 * reference.abs().max()


def test_padding_keys_do_not_set_a_sequences_scales(models):
    model = loading.prepare(models["standard"], tile_size=4)
    ids = torch.randint(0, PRESET.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 8), torch.zeros(1, 3)], dim=1).long()
    with torch.no_grad(), quantized(model, parse_config("absmax", 4, "kv")):
        alone = model(ids).logits
        with_padding = model(padded, attention_mask=mask).logits[:, :8]
    assert torch.allclose(alone, with_padding, atol=1e-5)


def test_kv_takes_absmax_only():
    with pytest.raises(ConfigError, match="llm-int8 is not defined"):
        parse_config("llm-int8", 8, "kv")
    with pytest.raises(ConfigError, match="granularity"):
        parse_config("absmax", 8, "kv", granularity="row")
