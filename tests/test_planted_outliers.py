"""The whole chain where outliers are real: a tiny model with a planted massive activation and a planted head.

Planted by editing weights, so value and place are known:
- a massive activation: residual channel CHANNEL is 0 in every embedding row except token MASSIVE_TOKEN's,
  where it is 1000; the token fills ~1/8 of the positions, so every layer's output carries |x| ≈ 10³ there,
  and the norms before the projections amplify that channel (as trained models' norm weights do);
- a head with huge logits: the query projection of head HEAD in layer LOGIT_LAYER scaled by QUERY_SCALE.
`stats` must find both values and locations exactly as a naive capture (forward hooks on the decoder layers,
and QKᵀ·scaling from the query/key states an independent attention function records), report the channel as
an LLM.int8 outlier feature, and absmax on the site holding the outlier must wreck the output while LLM.int8
at the same bits (outlier features kept exact) keeps it, in float32 and bfloat16: Q/K (the planted head) at
4 bits, linear layers (the planted channel) at 8 bits, LLM.int8's own setting — at 4 bits the projections'
inputs lose too much even with the outlier kept (relative error ≈ 0.4 vs ≈ 1 for absmax).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from quantdiff.attention.backend import repeat_kv
from quantdiff.data.sources import make_batches
from quantdiff.models.loading import prepare
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.quant.sites import parse_config, quantized
from quantdiff.stats.collect import collect_stats

CHANNEL, MASSIVE_TOKEN, MASSIVE = 7, 5, 1000.0
NORM_GAIN = 50.0  # the norms' weight on CHANNEL: the projections' inputs see ≈ 8·50 = 400 at planted tokens
LOGIT_LAYER, HEAD, QUERY_SCALE = 1, 1, 400.0
CAPTURE = "planted_capture"
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def planted_model(kind: str, plant: bool = True) -> torch.nn.Module:
    preset = SizePreset(hidden_size=64, num_layers=2, num_heads=4, vocab_size=97, max_position_embeddings=128)
    model = build_pair(preset, seed=0, attn_implementation="sdpa")[kind].eval()
    if not plant:
        return model
    head_dim = preset.hidden_size // preset.num_heads
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, CHANNEL] = 0.0
        embedding[MASSIVE_TOKEN, CHANNEL] = MASSIVE
        for layer in model.model.layers:
            layer.input_layernorm.weight[CHANNEL] = NORM_GAIN
            layer.post_attention_layernorm.weight[CHANNEL] = NORM_GAIN
        model.model.layers[LOGIT_LAYER].self_attn.q_proj.weight[HEAD * head_dim : (HEAD + 1) * head_dim] *= QUERY_SCALE
    return model


def batches(vocab: int = 97):
    g = torch.Generator().manual_seed(7)
    sequences = []
    for length in (48, 40, 33, 48):
        ids = torch.randint(10, vocab, (length,), generator=g)
        ids[torch.rand(length, generator=g) < 0.125] = MASSIVE_TOKEN
        sequences.append(ids.tolist())
    return make_batches(sequences, 2)  # right-padded pairs


def naive_hidden_top1(model, data) -> tuple[float, tuple[int, int, int, int]]:
    """(max |x|, (layer, sequence, position, channel)) over decoder-layer outputs at real tokens, via forward hooks."""
    outputs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        layer.register_forward_hook(lambda _m, _a, out, i=i: outputs[i].append((out[0] if isinstance(out, tuple) else out).detach().float()))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            for batch in data:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for hook in hooks:
            hook.remove()
    best = (-1.0, None)
    for layer, per_batch in enumerate(outputs):
        sequence = 0
        for batch, hidden in zip(data, per_batch):
            mask = batch.attention_mask.bool() if batch.attention_mask is not None else torch.ones(hidden.shape[:2], dtype=torch.bool)
            a = hidden.abs().masked_fill(~mask[..., None], -1.0)
            value = float(a.max())
            if value > best[0]:
                b, t, c = (int(i) for i in torch.nonzero(a == a.max())[0])
                best = (value, (layer, sequence + b, t, c))
            sequence += hidden.shape[0]
    return best


def naive_logits_top1(model, data) -> tuple[float, tuple[int, int, int, int, int]]:
    """(max |QKᵀ·scaling|, (layer, head, sequence, query, key)) over causal real-token entries, from recorded Q/K."""
    records: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if not records or records[-1][0] is not query:  # DiffLlama calls twice with the same Q, K
            records.append((query, key, scaling, module.layer_idx))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(CAPTURE, capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    model.set_attn_implementation(CAPTURE)
    best, sequence = (-1.0, None), 0
    try:
        with torch.no_grad():
            for batch in data:
                records.clear()
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                mask = batch.attention_mask.bool()
                t = mask.shape[1]
                allowed = torch.tril(torch.ones(t, t, dtype=torch.bool, device=mask.device))[None, None] & mask[:, None, :, None] & mask[:, None, None, :]
                for query, key, scaling, layer in records:
                    key = repeat_kv(key, query.shape[1] // key.shape[1])
                    logits = (query.float() @ key.float().transpose(2, 3) * scaling).abs().masked_fill(~allowed, -1.0)
                    if float(logits.max()) > best[0]:
                        b, h, q, k = (int(i) for i in torch.nonzero(logits == logits.max())[0])
                        best = (float(logits.max()), (layer, h, sequence + b, q, k))
                sequence += batch.input_ids.shape[0]
    finally:
        model.set_attn_implementation("sdpa")
    return best


def logits_error(model, data, config) -> float:
    """Relative L2 error of the output logits at real tokens, quantized vs unquantized (0 = unchanged)."""
    with torch.no_grad():
        reference = [model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float() for b in data]
        with quantized(model, config):
            got = [model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float() for b in data]
    num = sum(float(((g - r)[b.attention_mask.bool()] ** 2).sum()) for g, r, b in zip(got, reference, data))
    den = sum(float(((r - r.mean(-1, keepdim=True))[b.attention_mask.bool()] ** 2).sum()) for r, b in zip(reference, data))
    return (num / den) ** 0.5


def _on(device: str, dtype: torch.dtype, model: torch.nn.Module, data):
    return model.to(device=device, dtype=dtype), [b.to(device) for b in data]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_stats_find_the_planted_massive_activation_and_head(kind, dtype, device):
    model, data = _on(device, DTYPES[dtype], planted_model(kind), batches())
    hidden_value, hidden_at = naive_hidden_top1(model, data)
    logit_value, logit_at = naive_logits_top1(model, data)
    assert 0.9 * MASSIVE < hidden_value < 1.1 * MASSIVE and hidden_at[3] == CHANNEL  # the plant took
    assert logit_at[:2] == (LOGIT_LAYER, HEAD) and logit_value > 50  # huge beside the other heads' logits

    stats = collect_stats(prepare(model, 16), data, k=5)
    summary = stats.summary()
    top_hidden = summary["hidden_states"]["topk"][0]
    top_logit = summary["attention_logits"]["topk"][0]
    assert top_hidden["value"] == hidden_value, f"hidden top-1 {top_hidden['value']} vs naive {hidden_value}"
    assert (top_hidden["layer"], top_hidden["sequence"], top_hidden["position"], top_hidden["channel"]) == hidden_at
    tolerance = 1e-6 if dtype == "float32" else 1e-2  # bf16 Q/K: the tiled and the full matmul may round apart
    assert top_logit["value"] == pytest.approx(logit_value, rel=tolerance), f"logit top-1 {top_logit['value']} vs naive {logit_value}"
    assert (top_logit["layer"], top_logit["head"], top_logit["sequence"], top_logit["query"], top_logit["key"]) == logit_at
    assert summary["linear_inputs"]["outlier_features"]["channels"] == [CHANNEL]
    others = [h for layer in summary["attention_logits"]["per_head"] for h in layer]
    assert sorted(h["max"] for h in others)[-2] < logit_value / 10  # only the planted head is huge


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("kind", ["standard", "diff"])
@pytest.mark.parametrize("site,bits", [("qk", 4), ("linear", 8)])
def test_absmax_collapses_where_llm_int8_keeps_the_output(kind, dtype, device, site, bits):
    data = batches()
    errors = {}
    for planted in (True, False):
        model, on_device = _on(device, DTYPES[dtype], planted_model(kind, planted), data)
        prepare(model)
        for method in ("absmax", "llm-int8"):  # per sequence (granularity tensor): the outlier sets every token's scale
            errors[planted, method] = logits_error(model, on_device, parse_config(method, bits, site, granularity="tensor"))
        if planted:  # the causal default
            errors["per token", "absmax"] = logits_error(model, on_device, parse_config("absmax", bits, site))
    message = f"relative logits error {errors}"
    assert errors[True, "absmax"] > 0.5, message  # the planted outlier sets the scale: everything else rounds away
    assert errors["per token", "absmax"] < errors[True, "absmax"] / 1.5, message  # per token it wrecks its own tokens only
    assert errors[True, "llm-int8"] < 0.2, message  # its feature kept exact, the rest quantized row by row
    assert errors[False, "absmax"] < 0.1, message  # without the plant the same bits are harmless: the outlier did it
