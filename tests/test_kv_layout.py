"""KV-cache layouts (`quant.kv_layout`): the asymmetric quantizer and its dequantization are KIVI's, bit for bit
(on random rows with an outlier channel and on SmolLM2's real keys and values); the `token` layout is
the symmetric per-row absmax of `numerics`; a layout's name and JSON round-trip; bad layouts are refused."""

import pytest
import torch

from quantdiff.core.errors import ConfigError
from quantdiff.quant.kv_layout import KIVI, TOKEN, KVLayout, dequantize, fake_quantize, layout_named, quantize_key_blocks, quantize_rows
from quantdiff.quant.numerics import rowwise_absmax_quantize


def kivi_quant_and_pack_kcache(k: torch.Tensor, group_size: int, bits: int):
    """Transcribed from KIVI (github.com/jy-yuan/KIVI), quant/new_pack.py, `quant_and_pack_kcache`, without the
    packing: keys grouped along the tokens, min/max per (group, channel)."""
    B, nh, T, D = k.shape
    num_groups = T // group_size
    max_int = 2**bits - 1
    data = k.view(B, nh, num_groups, group_size, D)
    mn = torch.min(data, dim=-2, keepdim=True)[0]
    mx = torch.max(data, dim=-2, keepdim=True)[0]
    scale = (mx - mn) / max_int
    data = data - mn
    data.div_(scale)
    data = data.clamp_(0, max_int).round_().to(torch.int32)
    return data.view(k.shape), scale, mn


def kivi_quant_and_pack_vcache(v: torch.Tensor, group_size: int, bits: int):
    """Transcribed from KIVI, quant/new_pack.py, `quant_and_pack_vcache`, without the packing: values grouped
    along the channels of each token."""
    B, nh, T, D = v.shape
    num_groups = D // group_size
    max_int = 2**bits - 1
    data = v.view(B, nh, T, num_groups, group_size)
    mn = torch.min(data, dim=-1, keepdim=True)[0]
    mx = torch.max(data, dim=-1, keepdim=True)[0]
    scale = (mx - mn) / max_int
    data = data - mn
    data.div_(scale)
    data = data.clamp_(0, max_int).round_().to(torch.int32)
    return data.view(v.shape), scale, mn


def sample(shape=(2, 3, 32, 16), seed=0) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20  # an outlier channel, as keys carry
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_keys_per_channel_are_kivis_codes(bits):
    x = sample()
    codes, scale, mn = kivi_quant_and_pack_kcache(x.clone(), 8, bits)
    got = quantize_key_blocks(x, bits, KVLayout(residual=8))
    assert torch.equal(got.codes.int(), codes)
    assert torch.equal(got.scale, scale) and torch.equal(got.zero, mn)
    kivi = (codes.view(2, 3, 4, 8, 16) * scale + mn).view(x.shape)  # KIVI's dequantization: a multiply, then an add
    ours = dequantize(got, x.dtype, per_channel=True)
    assert torch.equal(ours, kivi)
    assert (ours - x).abs().max() <= (scale / 2).max() * (1 + 1e-5)  # half a level at most


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_per_token_are_kivis_codes(bits):
    x = sample(seed=1)
    codes, scale, mn = kivi_quant_and_pack_vcache(x.clone(), 8, bits)
    got = quantize_rows(x, bits, KVLayout(group_size=8))
    assert torch.equal(got.codes.int(), codes)
    assert torch.equal(got.scale, scale) and torch.equal(got.zero, mn)
    kivi = (codes.view(2, 3, 32, 2, 8) * scale + mn).view(x.shape)  # a multiply, then an add, as KIVI
    assert torch.equal(dequantize(got, x.dtype, per_channel=False), kivi)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivis_codes_and_dequantization_on_smollm2s_keys_and_values(smollm2_dir, bits):
    """On a real model's cache (SmolLM2's first and last layers, 24 tokens: three key blocks of 8, KIVI's layout
    with 8-token blocks), the codes, scales, zero-points and dequantized values are KIVI's, bit for bit."""
    from tests.test_kv_engines import smollm2_keys_and_values

    layout = KVLayout(residual=8)
    for x, keys in smollm2_keys_and_values(smollm2_dir):
        if keys:
            codes, scale, mn = kivi_quant_and_pack_kcache(x.clone(), 8, bits)
            got = quantize_key_blocks(x, bits, layout)
            kivi = (codes.view(*x.shape[:2], 3, 8, x.shape[-1]) * scale + mn).view(x.shape)
        else:
            codes, scale, mn = kivi_quant_and_pack_vcache(x.clone(), x.shape[-1], bits)  # one group: a token's row
            got = quantize_rows(x, bits, layout)
            kivi = (codes.unsqueeze(-2) * scale + mn).view(x.shape)
        assert torch.equal(got.codes.int(), codes) and torch.equal(got.scale, scale) and torch.equal(got.zero, mn)
        assert torch.equal(dequantize(got, x.dtype, per_channel=keys), kivi)


def test_the_token_layout_is_numerics_symmetric_row_absmax():
    x = sample(seed=2)
    for group in (None, 4):
        expected = rowwise_absmax_quantize(x, 4, group).dequant
        assert torch.equal(fake_quantize(x, 4, layout_named("token", group_size=group), keys=True), expected)


def test_only_complete_blocks_are_quantized_and_kept_positions_stay_out_of_key_scales():
    x = sample((1, 2, 21, 16), seed=3)
    layout = KVLayout(residual=8)
    out = fake_quantize(x, 4, layout, keys=True)
    assert torch.equal(out[:, :, 16:], x[:, :, 16:])  # the trailing 5 tokens: the float residual
    assert not torch.equal(out[:, :, :16], x[:, :, :16])
    x[:, :, 0] = 1e4  # a sink token's massive key
    kept = torch.zeros(21, dtype=torch.bool)
    kept[0] = True
    with_kept = fake_quantize(x, 4, layout, keys=True, kept=kept)
    assert (with_kept[:, :, 1:8] - x[:, :, 1:8]).abs().max() < 20 * 2 / 15  # scales set by the block's other tokens
    assert (fake_quantize(x, 4, layout, keys=True)[:, :, 1:8] - x[:, :, 1:8]).abs().max() > 10  # without: a level is 1e4 / 15 wide


def test_a_flat_group_dequantizes_to_its_value():
    x = torch.full((1, 1, 4, 8), 0.5)
    got = quantize_key_blocks(x, 4, KVLayout(residual=4))
    assert torch.equal(got.codes, torch.zeros_like(got.codes))
    assert torch.equal(dequantize(got, x.dtype, per_channel=True), x)


def test_layouts_are_named_and_round_trip_through_json():
    assert KIVI.name == "keys per channel over 128-token blocks, values per token, asymmetric (zero-point), float residual of < 128 tokens"
    assert TOKEN.name == "keys per token, values per token, symmetric absmax"
    for layout in (KIVI, TOKEN, KVLayout(keys="token", group_size=32, residual=64)):
        assert KVLayout.from_dict(layout.to_dict()) == layout
    assert TOKEN.causal and not KIVI.causal


@pytest.mark.parametrize("fields, message", [
    ({"keys": "head"}, "keys are quantized per channel or per token"),
    ({"keys": "channel", "residual": 0}, "residual must be at least 1"),
    ({"residual": -1}, "residual must be a whole number"),
    ({"group_size": 0}, "group size must be a positive integer"),
    ({"zero_point": "yes"}, "zero_point must be True or False"),
])
def test_bad_layouts_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        KVLayout(**fields)
    with pytest.raises(ConfigError, match="unknown kv layout"):
        layout_named("kivi2")


def test_parse_config_names_a_layout_for_the_kv_site_only():
    from quantdiff.quant.sites import parse_config

    config = parse_config("absmax", 4, "kv", kv_layout="kivi", group_size=16)
    assert config.site.layout == KVLayout(group_size=16) and config.site.group_size is None
    assert parse_config("absmax", 8, "kv", kv_layout="q8_0").site.layout == layout_named("q8_0")
    with pytest.raises(ConfigError, match="not site 'linear'"):
        parse_config("absmax", 4, "linear", kv_layout="kivi")
    with pytest.raises(ConfigError, match="stores 8-bit codes, not 4"):
        parse_config("absmax", 4, "kv", kv_layout="q8_0")
    with pytest.raises(ConfigError, match="needs granularity row"):
        parse_config("absmax", 4, "kv", granularity="tensor", kv_layout="kivi")
