"""Statistics collected through the hooks against logits and hidden states materialised independently."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import quantdiff.attention.backend as attention
from quantdiff.data.sources import Batch
from quantdiff.models.loading import prepare
from quantdiff.attention.observe import decoder_layers, observe
from quantdiff.models.pairs import SizePreset, build_model, pair_configs
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR
from quantdiff.stats.collect import collect_stats

K = 25
PAD = 0
FIRST_SEQUENCE = 7  # the batch is not the first of the data set: locations must carry the offset
LENGTHS = (16, 11, 14)  # right padding in rows 1 and 2


def _reference(model, ids, mask):
    """Full (B, H, T, T) logits per layer (masked entries included), each decoder layer's output, and the inputs of
    its q_proj and gate_proj (the normed hidden states that enter attention and the FFN)."""
    ref = copy.deepcopy(model)
    logits, hidden, inputs = {}, {}, {}

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # (B, H, T, D)
        logits[module.layer_idx] = (query @ k.transpose(2, 3)).float() * scaling  # DiffLlama's 2nd call: same Q, K
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    AttentionInterface.register("test_capture", capture)
    AttentionMaskInterface.register("test_capture", eager_mask)
    ref.set_attn_implementation("test_capture")
    handles = [
        layer.register_forward_hook(lambda _m, _a, out, i=i: hidden.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(ref.model.layers)
    ]
    for i, layer in enumerate(ref.model.layers):
        for which, linear in enumerate((layer.self_attn.q_proj, layer.mlp.gate_proj)):
            handles.append(linear.register_forward_pre_hook(lambda _m, args, key=(i, which): inputs.__setitem__(key, args[0])))
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    t = ids.shape[1]
    real = mask.bool()
    causal = torch.ones(t, t).tril().bool()
    valid = causal[None] & real[:, :, None] & real[:, None, :]  # (B, T, T): query rows, key columns
    return [logits[i] for i in range(len(logits))], [hidden[i] for i in range(len(hidden))], valid, real, inputs


def _model_and_batch(kind: str, preset: SizePreset):
    model = build_model(pair_configs(preset)[kind], seed=0, attn_implementation="eager").eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD] *= 300.0  # padding would dominate every statistic if it leaked in
    for seed in range(50):  # inputs whose largest logit in every layer lies above the causal diagonal
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, preset.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=g)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(LENGTHS):
            mask[row, :n] = 1
        ids[mask == 0] = PAD
        logits, hidden, valid, real, inputs = _reference(model, ids, mask)
        both_real = real[:, :, None] & real[:, None, :]
        above = both_real & ~valid
        if all(l.abs().masked_fill(~above[:, None], 0).amax() > l.abs().masked_fill(~valid[:, None], 0).amax() for l in logits):
            return model, ids, mask, (logits, hidden, valid, real, inputs)
    raise AssertionError("no input with a masked causal entry as the largest logit")


@pytest.mark.parametrize("tile_size", [5, None], ids=["tile=5", "tile=all"])
@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_stats_equal_topk_of_independently_materialised_activations(tiny_preset, kind, tile_size):
    model, ids, mask, (logits, hidden, valid, real, inputs) = _model_and_batch(kind, tiny_preset)
    # Padding and non-causal entries are the largest of all: they must never show up.
    assert max(l.abs().amax() for l in logits) > max(l.abs().masked_fill(~valid[:, None], 0).amax() for l in logits)
    assert max(h.abs().amax() for h in hidden) > max(h.abs().masked_fill(~real[..., None], 0).amax() for h in hidden)
    prepare(model, tile_size)
    stats = collect_stats(model, [Batch(ids, mask, FIRST_SEQUENCE)], k=K).summary()
    heads = model.config.num_attention_heads

    def valid_logits(layers, head_filter=lambda h: True):
        chosen = [l[:, h][valid] for i, l in enumerate(logits) if i in layers for h in range(heads) if head_filter(h)]
        return torch.cat(chosen).abs()

    def check(block, reference, k):
        got = torch.tensor([e["value"] for e in block["topk"]])
        want = reference.topk(min(k, reference.numel())).values
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), f"max diff {(got - want).abs().max():.2e}"
        assert block["count"] == reference.numel()
        exact = reference.double().median().item()
        assert abs(block["median"] - exact) <= QUANTILE_RELATIVE_ERROR * exact + 1e-6 * exact

    layers = range(len(logits))
    logit_block = stats["attention_logits"]
    check(logit_block, valid_logits(layers), K)
    for layer in layers:
        check(logit_block["per_layer"][layer], valid_logits([layer]), K)
        for head in range(heads):
            check(logit_block["per_head"][layer][head], valid_logits([layer], lambda h: h == head), 10)
    if kind == "diff":
        for m, heads_of_map in (("1", range(heads // 2)), ("2", range(heads // 2, heads))):
            check(logit_block["per_map"][m], valid_logits(layers, lambda h: h in heads_of_map), K)
    else:
        assert "per_map" not in logit_block
    for entry in logit_block["topk"]:  # every location points at a valid entry holding that value
        seq = entry["sequence"] - FIRST_SEQUENCE
        assert valid[seq, entry["query"], entry["key"]]
        ref_value = logits[entry["layer"]][seq, entry["head"], entry["query"], entry["key"]].abs().item()
        assert ref_value == pytest.approx(entry["value"], rel=1e-5, abs=1e-7)
        if kind == "diff":
            assert entry["map"] == (1 if entry["head"] < heads // 2 else 2)

    hidden_block = stats["hidden_states"]
    real_hidden = [h[real].abs().reshape(-1) for h in hidden]  # (positions·D,)
    check(hidden_block, torch.cat(real_hidden), K)
    for layer, ref in enumerate(real_hidden):
        check(hidden_block["per_layer"][layer], ref, K)
        both = torch.cat([inputs[layer, 0][real], inputs[layer, 1][real]])  # (positions of both inputs, D)
        assert stats["linear_inputs"]["channel_absmax"][layer] == pytest.approx(both.abs().amax(0).tolist(), rel=1e-5)
    for entry in hidden_block["topk"]:
        seq = entry["sequence"] - FIRST_SEQUENCE
        assert real[seq, entry["position"]]
        ref_value = hidden[entry["layer"]][seq, entry["position"], entry["channel"]].abs().item()
        assert ref_value == pytest.approx(entry["value"], rel=1e-5)


def test_tiles_never_hold_all_keys_and_long_contexts_run():
    """At T = 2048 with tile 128 every observed tile is at most T × 128: no T × T logits tensor exists."""
    preset = SizePreset(hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_position_embeddings=2048)
    model = prepare(build_model(pair_configs(preset)["diff"], seed=0), tile_size=128)
    t = 2048
    shapes = []
    with observe(model, lambda logits, ctx: shapes.append(tuple(logits.shape))):
        stats = collect_stats(model, [Batch(torch.randint(0, 64, (1, t)), None, 0)], k=5)
    assert shapes and max(cols for *_, cols in shapes) == 128
    assert max(rows * cols for *_, rows, cols in shapes) <= t * 128
    heads = model.config.num_attention_heads
    assert stats.logits.pooled().summary()["count"] == heads * t * (t + 1) // 2  # each causal logit once


def test_hooks_are_removed_even_on_error(tiny_pair):
    model = prepare(tiny_pair["diff"], tile_size=4)
    with pytest.raises(RuntimeError, match="boom"):
        with observe(model, lambda *a: None, lambda *a: None):
            assert all(tap._forward_hooks for tap in attention.taps(model))
            raise RuntimeError("boom")
    assert not any(tap._forward_hooks for tap in attention.taps(model))
    assert not any(layer._forward_hooks for layer in decoder_layers(model))
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
