"""Site kv: per token and KV head (causal, the default), or keys per channel and values per token (granularity
tensor), checked against naive loops and against a KV cache that
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
    quantizer = KVQuantizer(bits, causal=False)
    got = quantizer.keys(key, valid)
    assert torch.allclose(got[:, :, :5], naive_keys(key, bits, valid)[:, :, :5], atol=1e-5)
    assert torch.allclose(got[0], naive_keys(key, bits, valid)[0], atol=1e-5)
    assert torch.allclose(quantizer.values(value), naive_values(value, bits), atol=1e-6)


def naive_rows(x: torch.Tensor, bits: int, group: int | None = None) -> torch.Tensor:
    """One scale per (sequence, head, token) over the head's channels, or per `group` consecutive channels of it."""
    out = x.clone()
    q = 2 ** (bits - 1) - 1
    width = group or x.shape[-1]
    for start in range(0, x.shape[-1], width):
        part = x[..., start : start + width]
        scale = part.abs().amax(dim=-1, keepdim=True) / q
        out[..., start : start + width] = torch.where(scale > 0, torch.round(part / scale) * scale, torch.zeros_like(part))
    return out


@pytest.mark.parametrize("bits, group", [(2, None), (4, None), (8, None), (4, 2), (3, 3)])
def test_causal_kv_quantizer_matches_the_naive_rows(bits, group):
    g = torch.Generator().manual_seed(bits)
    key = torch.randn(2, 3, 7, 6, generator=g) * torch.linspace(0.1, 20, 6)
    value = torch.randn(2, 3, 7, 6, generator=g)
    quantizer = KVQuantizer(bits, group_size=group)
    later = key.clone()
    later[:, :, 5:] *= 1e3  # later tokens never reach an earlier token's scale
    assert torch.allclose(quantizer.keys(key, None), naive_rows(key, bits, group), atol=1e-5)
    assert torch.equal(quantizer.keys(later, None)[:, :, :5], quantizer.keys(key, None)[:, :, :5])
    assert torch.allclose(quantizer.values(value), naive_rows(value, bits, group), atol=1e-6)


class QuantizingCache(DynamicCache):
    """A KV cache that stores its keys and values quantized (the naive reference) and hands those to attention."""

    def __init__(self, bits: int, causal: bool) -> None:
        super().__init__()
        self.bits, self.causal = bits, causal

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.causal:
            return super().update(naive_rows(key_states, self.bits), naive_rows(value_states, self.bits), layer_idx, *args, **kwargs)
        return super().update(naive_keys(key_states, self.bits), naive_values(value_states, self.bits), layer_idx, *args, **kwargs)


@pytest.fixture(scope="module")
def models():
    return {kind: model.eval() for kind, model in build_pair(PRESET, seed=0, kinds=ALL_KINDS).items()}


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("bits, granularity", [(3, "row"), (6, "tensor")])
def test_kv_site_equals_eager_attention_over_a_quantized_cache(models, kind, bits, granularity):
    model = models[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 9), generator=torch.Generator().manual_seed(bits))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, past_key_values=QuantizingCache(bits, granularity == "row"), use_cache=True).logits
        unquantized = model(ids).logits
        loading.prepare(model, tile_size=4)
        with quantized(model, parse_config("absmax", bits, "kv", granularity=granularity)):
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
    with torch.no_grad(), quantized(model, parse_config("absmax", 4, "kv", granularity="tensor")):
        alone = model(ids).logits
        with_padding = model(padded, attention_mask=mask).logits[:, :8]
    assert torch.allclose(alone, with_padding, atol=1e-5)


def test_kv_takes_absmax_only():
    with pytest.raises(ConfigError, match="llm-int8 is not defined"):
        parse_config("llm-int8", 8, "kv")
    with pytest.raises(ConfigError, match="not per column"):
        parse_config("absmax", 8, "kv", granularity="column")
    with pytest.raises(ConfigError, match="needs granularity row"):
        parse_config("absmax", 8, "kv", granularity="tensor", group_size=32)
