"""The Hadamard rotation of the linear site: scipy's Walsh–Hadamard matrices as the reference, the unquantized model
unchanged by it, and a planted outlier channel spread over its block."""

import pytest
import scipy.linalg
import torch
from torch import nn

from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.hadamard import hadamard_block, rotate, sylvester_matrix
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, QuantConfig, apply_quantization, linear_targets, parse_config
from quantdiff.quant.transforms import HadamardRotation, apply_transform

PRESET = SizePreset(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)


def dense_reference(width: int, block: int) -> torch.Tensor:
    """diag(H_b, …, H_b) / √b from scipy's Sylvester matrix: an implementation independent of ours."""
    h = torch.from_numpy(scipy.linalg.hadamard(block)).double() / block**0.5
    return torch.block_diag(*[h] * (width // block))


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_sylvester_matrix_is_scipys(n):
    assert torch.equal(sylvester_matrix(n) * n**0.5, torch.from_numpy(scipy.linalg.hadamard(n)).double())


@pytest.mark.parametrize(("width", "block"), [(576, 64), (640, 128), (1536, 512), (2048, 2048), (192, 64), (6, 2)])
def test_block_is_the_largest_power_of_two_dividing_the_width(width, block):
    assert hadamard_block(width) == block


@pytest.mark.parametrize("width", [1, 575])
def test_odd_widths_are_refused(width):
    with pytest.raises(ConfigError, match="even input width"):
        hadamard_block(width)


@pytest.mark.parametrize("width", [576, 640, 64, 192, 2])
def test_rotate_matches_the_dense_block_diagonal_matrix(width):
    block = hadamard_block(width)
    x = torch.randn(3, 5, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64)
    expected = x @ dense_reference(width, block)
    got = rotate(x.float(), block).double()
    assert (got - expected).abs().max() < 1e-5 * expected.abs().max(), (got - expected).abs().max()
    assert torch.allclose(rotate(rotate(x.float(), block), block).double(), x, atol=1e-5)  # H·H = I
    assert rotate(x.bfloat16(), block).dtype == torch.bfloat16


def test_a_planted_outlier_channel_is_spread_over_its_block():
    width, channel, peak = 192, 70, 60.0
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1))
    x[:, channel] = peak
    rotated = rotate(x, hadamard_block(width))  # blocks of 64: the outlier falls by about √64 = 8
    assert rotated.abs().max() < peak / 8 + 4.0  # 4: the other 63 channels' N(0, 1) contributions, with room
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # orthogonal: norms unchanged
    # Other blocks are untouched by the outlier: their peak stays that of N(0, 1) values.
    assert rotated[:, 128:].abs().max() < 6.0
    # So 4-bit per-tensor inputs lose far less in the rotated basis (the outlier channel's weights are small, so the
    # output is carried by the ordinary channels, which the outlier's scale rounds to 0 unrotated). Weights stay
    # exact here: rotating also moves the outlier's norm onto every weight's rounding error, a cost of its own.
    layer = nn.Linear(width, 32, bias=False).requires_grad_(False)
    torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(2))
    layer.weight[:, channel] *= 0.02
    exact = layer(x)
    errors = {}
    for transform in (None, HadamardRotation()):
        site = LinearSite(filter=lambda m, fqn: True, weights=False, transform=transform)
        wrapper = nn.Sequential(layer)
        handle = apply_quantization(wrapper, QuantConfig(AbsmaxMethod(4), site))
        errors[transform] = float((wrapper(x.unsqueeze(0))[0] - exact).norm() / exact.norm())
        handle.remove()
    assert errors[None] > 0.9 and errors[HadamardRotation()] < errors[None] / 2, errors


def _models():
    models = build_pair(PRESET, seed=0, kinds=ALL_KINDS)
    for model in models.values():
        loading.prepare(model.eval(), tile_size=8)
    return models


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_rotation_without_quantization_leaves_the_model_unchanged(kind):
    model = _models()[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids).logits
        params = {name: p for name, p in model.named_parameters()}
        targets = [m for _, m in linear_targets(model, LinearSite(include_lm_head=True))]
        undo = []
        apply_transform(model, HadamardRotation(), targets, undo)
        rotated = model(ids).logits
        assert all(not torch.equal(m.weight, params[f"{n}.weight"]) for n, m in linear_targets(model, LinearSite()))  # stored rotated
        while undo:
            undo.pop()()
        restored = model(ids).logits
    assert (rotated - reference).abs().max() < 1e-5 * reference.abs().max(), (rotated - reference).abs().max()
    assert torch.equal(restored, reference)
    assert all(p is params[name] for name, p in model.named_parameters())  # the same Parameters came back


def test_rotation_config_round_trips_and_is_a_linear_option():
    config = parse_config("absmax", 4, "linear", transform=HadamardRotation())
    assert QuantConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["site"]["transform"] == {"name": "hadamard"}
    with pytest.raises(ConfigError, match="not site 'qk'"):
        parse_config("absmax", 4, "qk", transform=HadamardRotation())
