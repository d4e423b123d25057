"""The quantdiff backend against transformers' own eager/sdpa attention and the paper's equations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import quantdiff.attention.backend as attention
from quantdiff.models.loading import prepare
from quantdiff.models.pairs import build_pair, lambda_parameter_count, pair_configs, parameter_count
from quantdiff.quant.numerics import PerRow, PerTensor

T = 13


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second sequence
    return ids, mask


def _qwen2():
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=97, max_position_embeddings=128)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()


def _models(tiny_pair):
    return {**tiny_pair, "qwen2": _qwen2()}


@pytest.mark.parametrize("tile_size", [4, 13, None], ids=["tile=4", "tile=13", "tile=all"])
@pytest.mark.parametrize("kind", ["standard", "diff", "qwen2"])
def test_backend_matches_eager_and_sdpa(tiny_pair, kind, tile_size):
    model = _models(tiny_pair)[kind]
    ids, mask = _batch(model.config.vocab_size)
    real = mask.bool()  # padded query positions carry no meaning in any backend
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=mask).logits
        prepare(model, tile_size=tile_size)
        fast = model(ids, attention_mask=mask).logits  # no hooks: SDPA fast path
        handles = [t.register_forward_hook(lambda *a: None) for t in attention.taps(model)]
        tiled = model(ids, attention_mask=mask).logits  # a hook forces the explicit tiled path
        for h in handles:
            h.remove()
    assert model.config._attn_implementation == "quantdiff"
    for name, out in {"sdpa": sdpa, "fast": fast, "tiled": tiled}.items():
        diff = (out - eager)[real].abs().max().item()
        assert diff <= 1e-5, f"{kind} {name} tile={tile_size}: max abs diff {diff:.2e}"


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rmsnorm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _paper_diff_attention(attn, x, cos, sin, layer_number):
    """Differential attention written from the paper's equations (arXiv 2410.05258, §2.1), not from DiffLlama.

    [Q1;Q2] = X Wq, [K1;K2] = X Wk, V = X Wv; the i-th differential head pairs query/key head i (map 1) with head
    i + H/2 (map 2); V of head i is the concatenation of KV heads i and i + Hkv/2 (value width 2d).
    """
    b, t, _ = x.shape
    h, d = attn.config.num_attention_heads, attn.head_dim
    hkv = attn.config.num_key_value_heads
    q = attn.q_proj(x).view(b, t, h, d).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, hkv, d).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, hkv, d).transpose(1, 2)
    q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
    k = k.repeat_interleave(h // hkv, dim=1)
    v_wide = torch.cat(v.chunk(2, dim=1), dim=-1)  # (B, Hkv/2, T, 2d)
    v_wide = v_wide.repeat_interleave(h // hkv, dim=1)  # (B, H/2, T, 2d)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer_number - 1))  # l counted from 1 in the paper
    lam = torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum()) + lambda_init
    heads = []
    for i in range(h // 2):
        a1 = ((q[:, i] @ k[:, i].transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, -math.inf).softmax(-1)
        a2 = ((q[:, i + h // 2] @ k[:, i + h // 2].transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, -math.inf).softmax(-1)
        head = (a1 - lam * a2) @ v_wide[:, i]  # (B, T, 2d)
        heads.append((1 - lambda_init) * _rmsnorm(head, attn.config.rms_norm_eps))
    return attn.o_proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("tile_size", [5, None], ids=["tile=5", "tile=all"])
def test_diff_backend_matches_paper_equations(tiny_pair, tile_size):
    model = prepare(tiny_pair["diff"], tile_size=tile_size)
    ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(2))
    captured = {}

    def grab(module, args, kwargs, output):
        captured[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"], output[0])

    handles = [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in model.model.layers]
    handles += [t.register_forward_hook(lambda *a: None) for t in attention.taps(model)]
    with torch.no_grad():
        model(ids)
        for idx, (x, (cos, sin), out) in captured.items():
            ref = _paper_diff_attention(model.model.layers[idx].self_attn, x, cos, sin, layer_number=idx + 1)
            diff = (out - ref).abs().max().item()
            assert diff <= 1e-5, f"layer {idx}: max abs diff {diff:.2e}"
    for h in handles:
        h.remove()
    assert len(captured) == model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["standard", "diff"])
@pytest.mark.parametrize("tile_size", [3, None], ids=["tile=3", "tile=all"])
def test_tap_sees_exactly_the_causal_logits(tiny_pair, kind, tile_size):
    model = prepare(tiny_pair[kind], tile_size=tile_size)
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(3))
    seen: dict[int, torch.Tensor] = {}
    inputs = {}

    def observe(tap, args, output):
        logits, ctx = args
        full = seen.setdefault(tap.layer_idx, torch.full((1, logits.shape[1], T, T), math.nan))
        block = full[:, :, ctx.q_start:, ctx.k_start:ctx.k_start + logits.shape[-1]]
        valid = ctx.valid.expand_as(logits)
        assert torch.isnan(block[valid]).all(), "a logit was delivered twice"
        block[valid] = logits[valid]

    def grab(module, args, kwargs, output):
        inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [t.register_forward_hook(observe) for t in attention.taps(model)]
    handles += [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    heads = model.config.num_attention_heads
    total = sum(int((~torch.isnan(v)).sum()) for v in seen.values())
    assert total == model.config.num_hidden_layers * heads * T * (T + 1) // 2  # Diff logits not doubled
    for idx, logits in seen.items():
        attn = model.model.layers[idx].self_attn
        x, (cos, sin) = inputs[idx]
        q = _rope(attn.q_proj(x).view(1, T, heads, -1).transpose(1, 2), cos[:, None], sin[:, None])
        k = _rope(attn.k_proj(x).view(1, T, attn.config.num_key_value_heads, -1).transpose(1, 2), cos[:, None], sin[:, None])
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        direct = (q @ k.transpose(-1, -2)) * attn.head_dim**-0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand_as(direct)
        assert torch.isnan(logits[~causal]).all(), "a masked (future) logit reached the tap"
        diff = (logits[causal] - direct[causal].detach()).abs().max().item()
        assert diff <= 1e-5, f"layer {idx}: tap logits differ from QK^T*scaling by {diff:.2e}"


def test_padding_never_reaches_the_tap(tiny_pair):
    model = prepare(tiny_pair["standard"], tile_size=4)
    ids, mask = _batch(97)
    count = []
    handles = [t.register_forward_hook(lambda tap, a, o: count.append(int(a[1].valid.expand_as(a[0]).sum()))) for t in attention.taps(model)]
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for h in handles:
        h.remove()
    real = mask.sum(dim=1).tolist()  # 13 and 9 real tokens
    expected = model.config.num_hidden_layers * model.config.num_attention_heads * sum(n * (n + 1) // 2 for n in real)
    assert sum(count) == expected


def test_matched_pair_differs_only_by_lambda(tiny_preset):
    pair = build_pair(tiny_preset)
    standard, diff = pair["standard"], pair["diff"]
    assert lambda_parameter_count(standard) == 0
    lam = lambda_parameter_count(diff)
    head_dim = tiny_preset.hidden_size // tiny_preset.num_heads
    assert lam == 4 * head_dim * tiny_preset.num_layers
    assert parameter_count(diff) - parameter_count(standard) == lam
    shapes = {n: p.shape for n, p in standard.named_parameters()}
    assert {n: p.shape for n, p in diff.named_parameters() if "lambda_" not in n} == shapes


def test_pair_configs_are_not_shared(tiny_preset):
    configs = pair_configs(tiny_preset)
    before = copy.deepcopy(configs["diff"].to_dict())
    build_pair(tiny_preset)
    assert configs["diff"].to_dict() == before


def _naive_quantized_attention(bits, per_row=False):
    """Eager attention with the whole (B, H, T, T) logits absmax-quantized per sequence (or per query row) over
    causal entries."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(n_rep, dim=1)
        v = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        logits = (query @ k.transpose(-1, -2)) * scaling
        t = logits.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scale = logits.abs().masked_fill(~causal, 0).amax(dim=-1 if per_row else (1, 2, 3), keepdim=True) / (2 ** (bits - 1) - 1)
        logits = (torch.round(logits / scale) * scale).masked_fill(~causal, -math.inf)
        return (logits.softmax(-1) @ v).transpose(1, 2), None

    return forward


@pytest.mark.parametrize("kind", ["standard", "diff"])
@pytest.mark.parametrize("tile_size", [4, None], ids=["tile=4", "tile=all"])
@pytest.mark.parametrize("granularity", [PerTensor(), PerRow()], ids=["tensor", "row"])
def test_quantized_logits_match_naive_full_matrix(tiny_pair, kind, tile_size, granularity):
    from transformers import AttentionInterface

    from quantdiff.quant.sites import AbsmaxMethod, LogitsSite, QuantConfig, quantized

    model = tiny_pair[kind]
    ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(4))
    AttentionInterface.register("naive_quant3", _naive_quantized_attention(3, per_row=granularity == PerRow()))
    with torch.no_grad():
        model.set_attn_implementation("naive_quant3")
        reference = model(ids).logits
        prepare(model, tile_size=tile_size)
        with quantized(model, QuantConfig(AbsmaxMethod(3, granularity), LogitsSite())):
            ours = model(ids).logits
        plain = model(ids).logits
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-4, f"{kind}: max abs diff {diff:.2e}"
    assert (plain - reference).abs().max().item() > 1e-3  # 3 bits really changes the output
