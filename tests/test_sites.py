"""Quantization sites on tiny standard and differential models, checked against naive references."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantdiff.models import loading
from quantdiff.attention.backend import taps
from quantdiff.core.errors import ConfigError
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.quant.numerics import PerColumn, PerRow, PerTensor
from quantdiff.quant.sites import (
    AbsmaxMethod,
    LinearSite,
    LLMInt8Method,
    LogitsSite,
    QKSite,
    QuantConfig,
    apply_quantization,
    linear_targets,
    parse_config,
    quantized,
)

PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)
KINDS = ["standard", "diff"]


@pytest.fixture(scope="module")
def models():
    pair = build_pair(PRESET, seed=0)
    for model in pair.values():
        loading.prepare(model, tile_size=5)  # several key tiles per call
    return pair


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, PRESET.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))


def naive_fake_quant(x: torch.Tensor, bits: int, dims) -> torch.Tensor:
    """round(x / scale) · scale with scale = max|x| / (2^(b−1) − 1) over `dims`; zero groups stay zero."""
    scale = x.abs().amax(dim=dims, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.where(scale > 0, torch.round(x / scale) * scale, torch.zeros_like(x))


ALL_CONFIGS = [
    QuantConfig(AbsmaxMethod(4), LogitsSite()),
    QuantConfig(AbsmaxMethod(3, PerRow()), LogitsSite()),
    QuantConfig(AbsmaxMethod(4, PerColumn()), QKSite()),
    QuantConfig(LLMInt8Method(3, threshold=0.5), QKSite()),
    QuantConfig(AbsmaxMethod(4, PerRow()), LinearSite()),
    QuantConfig(LLMInt8Method(4, threshold=1.0), LinearSite(include_lm_head=True)),
    QuantConfig(AbsmaxMethod(3), LinearSite(inputs=False)),
    QuantConfig(LLMInt8Method(8, threshold=0.5), LinearSite(weights=False)),
]
CONFIG_IDS = [
    "logits-tensor", "logits-row", "qk-absmax-column", "qk-llm-int8", "linear-absmax", "linear-llm-int8-lm_head",
    "linear-weight-only", "linear-inputs-only",
]


# ---- configs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=CONFIG_IDS)
def test_config_json_round_trip(config):
    assert QuantConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_parse_config_builds_types():
    assert parse_config("absmax", "6", "logits", granularity="row") == QuantConfig(AbsmaxMethod(6, PerRow()), LogitsSite())
    assert parse_config("llm-int8", 8, "linear", include_lm_head=True) == QuantConfig(LLMInt8Method(8), LinearSite(True))


@pytest.mark.parametrize(
    "method, bits, site, granularity, message",
    [
        ("absmax", 1, "logits", "tensor", "bits"),
        ("absmax", 17, "logits", "tensor", "bits"),
        ("absmax", "x", "logits", "tensor", "bits"),
        ("gptq", 8, "logits", "tensor", "unknown quantization method"),
        ("absmax", 8, "values", "tensor", "unknown quantization site"),
        ("absmax", 8, "logits", "block", "unknown granularity"),
        ("absmax", 8, "logits", "column", "per tensor or per row"),
        ("llm-int8", 8, "logits", "tensor", "use site 'qk' or 'linear'"),
    ],
)
def test_parse_config_errors_are_one_line(method, bits, site, granularity, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(method, bits, site, granularity=granularity)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data",
    [{"method": {"name": "absmax", "bits": 8}}, {"method": {"name": "absmax", "bits": 8, "nope": 1}, "site": {"name": "qk"}}],
    ids=["missing-site", "unknown-key"],
)
def test_from_dict_rejects_malformed(data):
    with pytest.raises(ConfigError):
        QuantConfig.from_dict(data)


def test_linear_site_must_quantize_something():
    with pytest.raises(ConfigError, match="weights, inputs or both"):
        LinearSite(weights=False, inputs=False)


def test_custom_filter_is_not_serialisable():
    with pytest.raises(ConfigError, match="custom module filter"):
        QuantConfig(AbsmaxMethod(8), LinearSite(filter=lambda m, fqn: True)).to_dict()


# ---- apply / remove ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=CONFIG_IDS)
def test_apply_then_remove_restores_model_and_quantizer_acts(models, ids, kind, config):
    model = models[kind]
    with torch.no_grad():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        params = dict(model.named_parameters())
        reference = model(ids).logits
        with quantized(model, config):
            changed = model(ids).logits
        after = model(ids).logits
    assert not torch.equal(changed, reference), "the quantizer did not act"
    assert torch.equal(after, reference)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(t.logits_quantizer is None and t.operand_quantizer is None for t in taps(model))
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_none_config_is_a_no_op(models, ids):
    model = models["standard"]
    with torch.no_grad():
        reference = model(ids).logits
        with quantized(model, None):
            assert torch.equal(model(ids).logits, reference)


def test_applying_twice_is_refused_and_leaves_first_intact(models):
    model = models["standard"]
    config = QuantConfig(AbsmaxMethod(8), LogitsSite())
    handle = apply_quantization(model, config)
    try:
        with pytest.raises(ConfigError, match="already has"):
            apply_quantization(model, config)
        assert all(t.logits_quantizer is not None for t in taps(model))
    finally:
        handle.remove()
    assert all(t.logits_quantizer is None for t in taps(model))


def test_attention_sites_need_the_quantdiff_backend():
    model = build_pair(PRESET)["standard"]  # sdpa, no taps
    with pytest.raises(ConfigError, match="quantdiff attention backend"):
        apply_quantization(model, QuantConfig(AbsmaxMethod(8), QKSite()))


# ---- logits site vs a naive reference ----------------------------------------------------------------------


def _capture_tiles(model, ids):
    """Per layer: list of (logits in, logits out, ctx) as the tap saw them."""
    seen: dict[int, list] = {}
    hooks = [
        t.register_forward_hook(lambda tap, args, out: seen.setdefault(tap.layer_idx, []).append((args[0], out, args[1])))
        for t in taps(model)
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row"])
def test_logits_site_matches_naive_per_sequence_grid(models, ids, kind, per_row):
    model = models[kind]
    bits = 3
    granularity = PerRow() if per_row else PerTensor()
    with quantized(model, QuantConfig(AbsmaxMethod(bits, granularity), LogitsSite())):
        seen = _capture_tiles(model, ids)
    b, t = ids.shape
    assert len(seen) == PRESET.num_layers
    for tiles in seen.values():
        # Reassemble the (B, H, T, T) logits from the tiles, NaN where not valid (non-causal).
        full = torch.full((b, tiles[0][0].shape[1], t, t), float("nan"))
        for logits, _, ctx in tiles:
            rows, cols = logits.shape[-2:]
            block = full[:, :, ctx.q_start : ctx.q_start + rows, ctx.k_start : ctx.k_start + cols]
            block.copy_(torch.where(ctx.valid, logits, torch.tensor(float("nan"))))
        assert torch.equal(~full.isnan(), torch.ones(t, t, dtype=torch.bool).tril().expand_as(full))
        mag = full.nan_to_num(0.0).abs()  # causal entries only set the scale
        amax = mag.amax(dim=-1, keepdim=True) if per_row else mag.amax(dim=(1, 2, 3), keepdim=True)  # all heads, both Diff maps
        scale = amax / (2 ** (bits - 1) - 1)  # (B, H, T, 1) or (B, 1, 1, 1): one per sequence, never per batch
        for logits, out, ctx in tiles:
            s = scale[:, :, ctx.q_start : ctx.q_start + logits.shape[-2]] if per_row else scale
            expect = torch.round(logits / s) * s
            valid = ctx.valid.expand_as(logits)
            torch.testing.assert_close(out[valid], expect[valid], rtol=1e-6, atol=1e-7)
            assert torch.equal(out[~valid], logits[~valid])  # masked entries pass through (they become −inf next)


@pytest.mark.parametrize("config", ALL_CONFIGS[:4], ids=CONFIG_IDS[:4])
def test_attention_quantization_does_not_depend_on_batch(models, ids, config):
    model = models["diff"]
    loud = ids.clone()
    loud[1] = ids[0].flip(0)
    with torch.no_grad(), quantized(model, config):
        together = model(loud).logits[0]
        alone = model(loud[:1]).logits[0]
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


# ---- QK site vs a naive reference --------------------------------------------------------------------------


def _qk(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 6, 8, generator=g)  # (B, H, T, D)
    k = torch.randn(2, 2, 6, 8, generator=g)  # (B, Hkv, S, D): two query heads per KV head
    q[0, 1, 2, 5] = 9.0  # Q outlier: feature 5 in KV group 0 of sequence 0
    k[1, 1, 4, 3] = -7.0  # K outlier: feature 3 in KV group 1 of sequence 1
    return q, k


def _operand_quantizer(models, config):
    model = models["standard"]
    handle = apply_quantization(model, config)
    try:
        return taps(model)[0].operand_quantizer
    finally:
        handle.remove()


@pytest.mark.parametrize("g, dims", [(PerTensor(), (1, 2, 3)), (PerRow(), (3,)), (PerColumn(), (1, 2))], ids=["tensor", "row", "column"])
def test_qk_absmax_matches_naive(models, g, dims):
    quantizer = _operand_quantizer(models, QuantConfig(AbsmaxMethod(5, g), QKSite()))
    q, k = _qk()
    q_fq, k_fq = quantizer(q, k)
    torch.testing.assert_close(q_fq, naive_fake_quant(q, 5, dims), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(k_fq, naive_fake_quant(k, 5, dims), rtol=1e-6, atol=1e-7)


def test_qk_llm_int8_keeps_union_of_outlier_features_exact(models):
    quantizer = _operand_quantizer(models, QuantConfig(LLMInt8Method(4, threshold=6.0, granularity=PerTensor()), QKSite()))
    q, k = _qk()
    q_fq, k_fq = quantizer(q, k)
    exact = {(0, 0): [5], (1, 1): [3]}  # (sequence, KV head) -> features kept exact on both sides
    for b in range(2):
        for kv in range(2):
            feats = exact.get((b, kv), [])
            rest = [d for d in range(8) if d not in feats]
            for x, x_fq in [(k[b, kv], k_fq[b, kv]), *[(q[b, h], q_fq[b, h]) for h in (2 * kv, 2 * kv + 1)]]:
                assert torch.equal(x_fq[:, feats], x[:, feats])
                small = x.abs().masked_fill(x.abs() >= 6.0, 0)  # bnb: outlier entries do not set the row absmax
                scale = small.amax(dim=1, keepdim=True) / 7
                torch.testing.assert_close(x_fq[:, rest], torch.round(x[:, rest] / scale) * scale, rtol=1e-6, atol=1e-7)


def test_causal_qk_llm_int8_keeps_each_tokens_own_outliers_exact(models):
    """Granularity row: a token's outlier features are its own entries ≥ threshold; no other token's count."""
    quantizer = _operand_quantizer(models, QuantConfig(LLMInt8Method(4, threshold=6.0), QKSite()))
    q, k = _qk()
    for x, x_fq in zip((q, k), quantizer(q, k)):
        for row, row_fq in zip(x.reshape(-1, x.shape[-1]), x_fq.reshape(-1, x.shape[-1])):
            big = row.abs() >= 6.0
            assert torch.equal(row_fq[big], row[big])
            scale = row.abs().masked_fill(big, 0).amax() / 7
            expected = torch.round(row[~big] / scale) * scale if scale > 0 else torch.zeros_like(row[~big])
            torch.testing.assert_close(row_fq[~big], expected, rtol=1e-6, atol=1e-7)


# ---- linear site vs a naive reference ----------------------------------------------------------------------


def test_linear_targets_default_and_lm_head(models):
    model = models["diff"]
    names = [fqn for fqn, _ in linear_targets(model, LinearSite())]
    assert len(names) == 7 * PRESET.num_layers and all(n.startswith("model.layers.") for n in names)
    assert [fqn for fqn, _ in linear_targets(model, LinearSite(include_lm_head=True))][-1] == "lm_head"
    only_q = LinearSite(filter=lambda m, fqn: fqn.endswith("q_proj"))
    assert [fqn for fqn, _ in linear_targets(model, only_q)] == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]


@pytest.mark.parametrize("g, dims", [(PerTensor(), (1, 2)), (PerRow(), (2,)), (PerColumn(), (1,))], ids=["tensor", "row", "column"])
def test_linear_absmax_matches_naive(g, dims):
    layer = nn.Linear(6, 3)
    wrapper = nn.Sequential(layer)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(5))
    x[1] *= 50
    weight = layer.weight.detach().clone()
    with torch.no_grad(), quantized(wrapper, QuantConfig(AbsmaxMethod(4, g), LinearSite(filter=lambda m, fqn: True))):
        y = wrapper(x)
    expect = F.linear(naive_fake_quant(x, 4, dims), naive_fake_quant(weight, 4, (1,)), layer.bias)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights, inputs", [(True, False), (False, True)], ids=["weight-only", "inputs-only"])
def test_linear_site_halves(weights, inputs):
    layer = nn.Linear(6, 3)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(6))
    weight = layer.weight.detach().clone()
    site = LinearSite(filter=lambda m, fqn: True, weights=weights, inputs=inputs)
    with torch.no_grad(), quantized(nn.Sequential(layer), QuantConfig(AbsmaxMethod(3, PerRow()), site)):
        y = layer(x)
    expect_x = naive_fake_quant(x, 3, (2,)) if inputs else x
    expect_w = naive_fake_quant(weight, 3, (1,)) if weights else weight
    torch.testing.assert_close(y, F.linear(expect_x, expect_w, layer.bias), rtol=1e-5, atol=1e-6)


def test_group_size_is_an_absmax_linear_weight_option():
    from quantdiff.eval.sweep import Cell, cell_label, cells_from_json, cells_to_json, plan_sweep

    config = parse_config("absmax", 4, "linear", group_size=128)
    assert config.method.weight_group_size == 128 and QuantConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert "weight_group_size" not in parse_config("absmax", 4, "linear").to_dict()["method"]  # per channel: as before
    with pytest.raises(ConfigError, match="not site 'qk'"):
        parse_config("absmax", 4, "qk", group_size=128)
    with pytest.raises(ConfigError, match="group size must be a positive integer"):
        parse_config("absmax", 4, "linear", group_size=0)
    plan = plan_sweep(["absmax", "llm-int8"], [8, 4], ["linear"], group_size=64)
    assert [c.method.weight_group_size for c in plan.configs] == [64, 64] and "llm-int8 at site linear" in plan.skipped[0]
    cell = Cell("m", "lm", "absmax", 4, "linear", {"accuracy": 0.5}, group_size=64)
    assert cell_label(cell) == "absmax 4b g64 @linear" and cells_from_json(cells_to_json([cell])) == [cell]
