"""The architecture matrix: every decoder family either runs exactly on the quantdiff backend or is refused by name.

For each family a tiny random float32 model is built twice with the same weights: once under transformers'
own eager attention (the reference), once on the quantdiff backend with a no-op hook on every tap (which
forces the tiled path). Outputs must agree within 1e-5 (relative to logits above 1) for two tile sizes, with and without left padding,
and quantdiff's logit statistics (count, Top-k, median) must equal an independent capture of the causal
(and windowed) `QKᵀ·scaling`, taken from the model's own eager attention function with an eager mask.
Families the backend cannot run must fail with one line naming the reason — never a silent mismatch.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention

import quantdiff.attention.backend as attention
from quantdiff.core.errors import QuantdiffError
from quantdiff.data.sources import Batch
from quantdiff.models.llama_variant import VariantAttention
from quantdiff.models.loading import prepare
from quantdiff.models.sink import EAGER_WITH_SINKS, SinkAttention
from quantdiff.stats.collect import collect_stats
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR

VOCAB, T, PAD_LEFT = 64, 12, 3
TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2,  # logits of order one: soft-capping and sinks change the outputs measurably
)
WINDOW = 4  # shorter than the sequence, so windows really cut keys off
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
MLA = dict(
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4,  # V wider than Q·K (12)
    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16,
)
# model_type -> config overrides. Sliding windows, soft-capping, sinks, MLA, fused QKV and differential
# attention are all exercised; docs/architectures.md lists these families.
SUPPORTED = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(head_dim=8),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=8),
    "gemma3_text": dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "olmo": {},
    "olmo2": {},
    "cohere": {},
    "granite": {},
    "phi": {},
    "phi3": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "smollm3": {},
    "deepseek_v3": MLA,
    "diffllama": {},
    "doge": dict(keep_window_size=6),  # a learned additive mask, and keys beyond the window dynamically masked
    "gpt2": {},
    "gpt_neox": {},
    "gpt_oss": dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], **MOE),
    "stablelm": {},
    "quantdiff_diffv2": {},  # quantdiff's own DIFF Transformer V2: 4 query heads paired (0,1), (2,3) over 2 KV heads
    "quantdiff_gated": {},  # quantdiff's own gated attention: a sigmoid gate per token and head before o_proj
    "quantdiff_sink": {},  # quantdiff's own learned sink logit per head (`s_aux`), eager = GPT-OSS's eager attention
}
# Every other decoder of the installed transformers that builds from the same tiny config, checked the same way
# (slow: about a second each).
EXTENDED = (
    "afmoe apertus arcee aria_text beam biogpt bitnet cohere2 cohere2_moe ctrl cwm ernie4_5 ernie4_5_moe "
    "exaone4 exaone_moe falcon_h1 flex_olmo flint glm glm4 glm4_moe gpt-sw3 gpt_bigcode granite_swa granitemoe "
    "granitemoe_swa granitemoeshared hy_v3 hyperclovax internlm3 iquestcoder jais2 jetmoe kolibri1 laguna lfm2 "
    "mellum mimo_v2_flash minimax_m2 ministral3 mixtral modernbert-decoder moshi nanochat nemotron "
    "olmo3 olmoe opt persimmon phimoe qwen2_moe qwen3_moe seed_oss solar_open vaultgemma zaya"
).split()
REFUSED = {"falcon": "does not use transformers' registry"}
# Run, but their statistics are refused: hybrids (layers without softmax attention), decoder layers that return
# more than (batch, tokens, hidden). (hrm_text is left out: it runs each attention module several times per
# forward, which quantdiff counts every time and the one-call capture here cannot.)
STATS_REFUSED = {
    "deepseek_v4": "returns hidden states of shape",
    "minimax": "never reached the quantdiff attention backend",
    "nemotron_h": "statistics need softmax attention in every decoder layer",
    "olmo_hybrid": "statistics need softmax attention in every decoder layer",
}
# Refused with one line, each for the reason given (slow: the same check over every such family).
EXTENDED_REFUSED = {
    **{t: "does not use transformers' registry" for t in (
        "bloom cpmant falcon_mamba git gpt_neox_japanese mamba megatron-bert mpt openai-gpt rembert roformer rwkv "
        "trocr xglm xlm"
    ).split()},
    **{t: "'encoder_hidden_states'" for t in (
        "bert bert-generation camembert data2vec-text electra ernie roberta roberta-prelayernorm roc_bert xlm-roberta xlm-roberta-xl"
    ).split()},
    "big_bird": "declares no attention modules",
    "fuyu": "declares no attention modules",
    "llama4_text": "declares no attention modules",
    "hy_v4": "'indices'",
    "inkling_text": "'position_bias'",
    "inkling2_text": "'position_bias'",
    "minimax_m3_vl_text": "'block_indices'",
}


def _tiny(model_type: str, overrides: dict) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():  # some initialisers leave parameters at exact zeros or ones: make every one count
        for name, param in model.named_parameters():
            if "sinks" in name or "lambda" in name or param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :PAD_LEFT] = 0  # row 1 is left-padded
    ids[mask == 0] = TINY["pad_token_id"]
    return ids, mask


class _Capture:
    """Pre-softmax QKᵀ·scaling of each layer, from inside the model's own eager attention function."""

    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}
        self.valid: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        heads = query.shape[1]
        key_all = key.repeat_interleave(heads // key.shape[1], dim=1)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        self.logits[module.layer_idx] = torch.matmul(query, key_all.transpose(2, 3)).float() * scaling
        self.valid[module.layer_idx] = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # eager: always a full mask
        return _own_eager(module)(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _own_eager(module):
    """The family's own semantics: its modeling module's eager attention. quantdiff's kinds run LLaMA's forward, so
    LLaMA's, except the sink kind's registered eager with sinks."""
    if isinstance(module, SinkAttention):
        return ALL_ATTENTION_FUNCTIONS[EAGER_WITH_SINKS]
    return sys.modules[(LlamaAttention if isinstance(module, VariantAttention) else type(module)).__module__].eager_attention_forward


def _captured_abs_logits(model, ids, mask) -> torch.Tensor:
    capture = _Capture()
    AttentionInterface.register("capture", capture)
    AttentionMaskInterface.register("capture", eager_mask)  # eager_mask always materialises causal + window + padding
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("capture")
    with torch.no_grad():
        reference(input_ids=ids, attention_mask=mask)
    real_query = mask.bool()[:, None, :, None]  # padded query rows are not observed
    return torch.cat([capture.logits[i].abs()[(capture.valid[i] & real_query).expand_as(capture.logits[i])] for i in sorted(capture.logits)])


def _forced_tiled(model, tile_size: int):
    quantdiff_model = prepare(copy.deepcopy(model), tile_size)
    for tap in attention.taps(quantdiff_model):
        tap.register_forward_hook(lambda *_: None)  # a listener: the backend must materialise every tile
    return quantdiff_model


@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_forced_tiled_equals_eager_and_stats_equal_capture(model_type):
    _check_family(model_type, SUPPORTED[model_type])


@pytest.mark.slow(seconds=0.5)  # each family; the set is the minute
@pytest.mark.parametrize("model_type", EXTENDED)
def test_every_other_family_equals_eager_and_capture(model_type):
    _check_family(model_type, {})


def _check_family(model_type: str, overrides: dict) -> None:
    model = _tiny(model_type, overrides)
    ids, mask = _inputs()
    with torch.no_grad():
        eager = {padded: model(input_ids=ids, attention_mask=mask if padded else None).logits for padded in (False, True)}
    for tile_size in (5, T):
        tiled = _forced_tiled(model, tile_size)
        for padded, reference in eager.items():
            with torch.no_grad():
                got = tiled(input_ids=ids, attention_mask=mask if padded else None).logits
            real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
            diff = (got - reference)[real].abs().max().item()
            # float32 rounding of the tiled online softmax grows with the logits' size (zaya's reach ~4)
            bound = 1e-5 * max(1.0, reference[real].abs().max().item())
            assert diff <= bound, f"{model_type} tile={tile_size} padded={padded}: max |Δ output| {diff:.2e} > {bound:.2e}"

    want = _captured_abs_logits(model, ids, mask)
    stats = collect_stats(_forced_tiled(model, 5), [Batch(ids, mask, 0)], k=8).summary()["attention_logits"]
    got_top = torch.tensor([e["value"] for e in stats["topk"]])
    want_top = want.topk(8).values
    assert stats["count"] == want.numel(), f"{model_type}: {stats['count']} logits observed, {want.numel()} valid"
    assert torch.allclose(got_top, want_top, rtol=1e-5, atol=1e-7), f"{model_type}: max Top-k diff {(got_top - want_top).abs().max():.2e}"
    exact = want.double().median().item()
    assert abs(stats["median"] - exact) <= QUANTILE_RELATIVE_ERROR * exact + 1e-6 * exact, f"{model_type}: median {stats['median']} vs {exact}"


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_unsupported_families_are_refused_by_name(model_type):
    _check_refused(model_type, REFUSED[model_type])


@pytest.mark.slow(seconds=0.2)
@pytest.mark.parametrize("model_type", sorted(EXTENDED_REFUSED))
def test_every_other_unsupported_family_is_refused_by_name(model_type):
    _check_refused(model_type, EXTENDED_REFUSED[model_type])


@pytest.mark.slow(seconds=0.2)
@pytest.mark.parametrize("model_type", sorted(STATS_REFUSED))
def test_statistics_of_hybrid_families_are_refused_by_name(model_type):
    with pytest.raises(QuantdiffError) as info:
        collect_stats(_forced_tiled(_tiny(model_type, {}), 5), [Batch(*_inputs(), 0)])
    message = str(info.value)
    assert "\n" not in message and model_type in message and STATS_REFUSED[model_type] in message, message


def _check_refused(model_type: str, reason: str) -> None:
    """Refused when prepared or at its first attention call: one line naming the model and the reason."""
    model = _tiny(model_type, {})
    with pytest.raises(QuantdiffError) as info, torch.no_grad():
        _forced_tiled(model, 5)(input_ids=_inputs()[0])
    message = str(info.value)
    assert "\n" not in message and model_type in message.lower() and reason in message, message


def test_unknown_attention_argument_is_refused_by_name():
    model = prepare(_tiny("llama", {}))
    module = next(m for m in model.modules() if isinstance(getattr(m, "quantdiff_tap", None), attention.Tap))
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(Exception, match="'chunk_size'") as info:
        attention.quantdiff_attention_forward(module, q, q[:, :2], q[:, :2], None, scaling=1.0, chunk_size=2)
    assert "llama" in str(info.value)


def test_dropout_in_training_is_refused_on_the_tiled_path():
    model = _forced_tiled(_tiny("llama", {"attention_dropout": 0.5}), 4).train()
    with pytest.raises(Exception, match="dropout"):
        model(input_ids=_inputs()[0])


# ---- end to end: one soft-capping, one sinks, one fused-QKV family and quantdiff's own kinds through the CLI -------------

END_TO_END = {
    "gemma2": "softcap", "gpt_oss": "sinks", "phi3": "fused qkv_proj", "quantdiff_diffv2": "per-token λ",
    "quantdiff_gated": "output gate (an nn.Linear in attention)", "quantdiff_sink": "learned sink logits",
}


def _saved_with_tokenizer(model_type: str, directory) -> int:
    """The tiny model saved with the shipped standard model's tokenizer (vocabulary sized to match)."""
    from quantdiff.models.names import ASSETS

    tokenizer_dir = ASSETS / "tiny" / "standard"
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    model = _tiny(model_type, {**SUPPORTED[model_type], "vocab_size": vocab})
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return vocab


@pytest.mark.parametrize("model_type", sorted(END_TO_END))
def test_stats_sweep_and_quantize_end_to_end(model_type, tmp_path, capsys):
    from quantdiff.cli.app import main
    from quantdiff.quant.checkpoint import load_quantized

    model_dir = tmp_path / model_type
    _saved_with_tokenizer(model_type, model_dir)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n" * 40)

    def run(*argv) -> None:
        with pytest.raises(SystemExit) as info:
            main([str(a) for a in argv])
            raise SystemExit(0)
        assert info.value.code == 0, capsys.readouterr().err

    run("stats", model_dir, "--data", text, "--tokens", "200", "--seq-len", "16", "--tile-size", "5", "--json", tmp_path / "s.json", "--quiet", "--device", "cpu")
    entry = json.loads((tmp_path / "s.json").read_text())["models"][0]
    assert entry["kind"] == (model_type.removeprefix("quantdiff_") if model_type.startswith("quantdiff_") else "standard")
    assert entry["coverage"]["complete"] and entry["coverage"]["attention_reached"] == TINY["num_hidden_layers"]
    assert entry["trust_remote_code"] is False and entry["coverage"]["allow_partial"] is False
    assert entry["attention_logits"]["count"] > 0
    capped = entry.get("attention_logits_capped")
    if model_type == "gemma2":  # the capped values that enter softmax: never above the cap, never above the raw logits
        assert capped["count"] == entry["attention_logits"]["count"] and capped["max"] <= min(2.0, entry["attention_logits"]["max"])
    else:
        assert capped is None

    run("sweep", model_dir, "--task", "lm", "--data", text, "--context", "16", "--limit", "2", "--bits", "8,4", "--site", "logits,qk",
        "--json", tmp_path / "w.json", "--quiet", "--device", "cpu")  # fmt: skip
    cells = json.loads((tmp_path / "w.json").read_text())["cells"]
    assert len(cells) == 1 + 2 * 2 and all(c["loss"] is not None for c in cells)
    assert len({round(c["loss"], 6) for c in cells}) > 1  # 4-bit quantization inside attention changes something

    run("quantize", model_dir, "--out", tmp_path / "q", "--bits", "4", "--attention-bits", "8")
    reloaded, source = load_quantized(tmp_path / "q", device="cpu"), prepare(AutoModelForCausalLM.from_pretrained(model_dir))
    biases = {name: t for name, t in source.state_dict().items() if name.endswith(".bias")}
    assert all(torch.equal(reloaded.state_dict()[name], t) for name, t in biases.items())  # quantized layers keep their biases
    with torch.no_grad():
        assert torch.isfinite(reloaded(input_ids=torch.arange(3, 15)[None]).logits).all()


# ---- definitions and coverage ------------------------------------------------------------------------------


def test_capped_block_is_the_softcap_of_the_raw_logits():
    from quantdiff.stats.collect import collect

    cap = SUPPORTED["gemma2"]["attn_logit_softcapping"]
    ids, mask = _inputs()
    collected = collect(_forced_tiled(_tiny("gemma2", SUPPORTED["gemma2"]), 5), [Batch(ids, mask, 0)], k=8)
    raw = collected.stats.summary()["attention_logits"]
    capped = collected.capped_logits.pooled().summary()
    assert raw["max"] > cap / 2  # capping really bends these logits
    # |cap·tanh(x/cap)| is monotone in |x|: the capped Top-k are the capped raw Top-k, at the same locations.
    want = [cap * math.tanh(e["value"] / cap) for e in raw["topk"]]
    assert [e["value"] for e in capped["topk"]] == pytest.approx(want, rel=1e-6)
    assert [e["key"] for e in capped["topk"]] == [e["key"] for e in raw["topk"]] and capped["count"] == raw["count"]


def _bypass_attention(model, layer: int) -> str:
    """Make one attention module skip the backend (as custom or remote code might); returns its name."""
    name, module = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "quantdiff_tap", None), attention.Tap)][layer]
    module.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(hidden_states), None)
    return name


def test_an_attention_module_that_bypasses_the_backend_is_an_error_unless_partial():
    from quantdiff.core.errors import ConfigError
    from quantdiff.quant.sites import parse_config, quantized
    from quantdiff.stats.collect import collect

    model = prepare(_tiny("llama", {}))
    skipped = _bypass_attention(model, 1)
    batch = Batch(*_inputs(), 0)
    with pytest.raises(ConfigError, match=skipped) as info:
        collect(model, [batch])
    assert "\n" not in str(info.value) and "partial" in str(info.value)
    coverage = collect(model, [batch], allow_partial=True).coverage.to_dict()
    assert coverage["missing"] == [skipped] and coverage["attention_reached"] == 1 and not coverage["complete"]
    with pytest.raises(ConfigError, match=skipped), torch.no_grad(), quantized(model, parse_config("absmax", 4, "logits")):
        model(input_ids=batch.input_ids)


def test_linear_quantization_refuses_decoder_layers_without_nn_linear():
    from quantdiff.core.errors import ConfigError
    from quantdiff.quant.sites import LinearSite, linear_targets

    model = _tiny("gpt2", {})  # GPT-2 projects with transformers' Conv1D, not nn.Linear
    with pytest.raises(ConfigError, match=r"transformer\.h\.0"):
        linear_targets(model, LinearSite())
    assert linear_targets(model, LinearSite(), allow_partial=True) == []


def test_docs_list_exactly_the_matrix():
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text(encoding="utf-8")
    rows = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert rows == set(SUPPORTED)
    also = section.split("Also checked the same way", 1)[1].split("\n\n", 1)[0]
    assert set(also.split("`")[1::2]) == set(EXTENDED)
    refused = section.split("Refused:", 1)[1].split("Not covered", 1)[0]
    assert set(refused.split("`")[1::2]) >= {*REFUSED, *EXTENDED_REFUSED, *STATS_REFUSED}


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_retrieval_attention_maps_equal_eager_probabilities(model_type):
    """Maps rebuilt from tap tiles include soft-capping and sinks exactly as the model's softmax does."""
    from quantdiff.eval.scoring import left_pad
    from quantdiff.eval.tasks.retrieval import last_rows_attention

    model = _tiny(model_type, SUPPORTED[model_type])
    seqs = [list(range(3, 3 + T)), list(range(10, 10 + T - PAD_LEFT))]
    ids, mask, positions = left_pad(seqs, torch.device("cpu"))
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_attentions=True).attentions
    maps = last_rows_attention(prepare(copy.deepcopy(model), 5), seqs, rows=3)
    for layer, (got, want) in enumerate(zip(maps, eager)):
        diff = (got - want[:, :, -3:]).abs().max().item()
        assert diff <= 1e-5, f"{model_type} layer {layer}: max |Δ probability| {diff:.2e}"


def test_structure_comes_from_the_models_declarations():
    from quantdiff.models import structure

    gpt2 = _tiny("gpt2", {"add_cross_attention": True})  # cross-attention modules are of the same class: not self-attention
    assert [name for name, _ in structure.attention_modules(gpt2)] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert [name for name, _ in structure.decoder_layers(gpt2)] == ["transformer.h.0", "transformer.h.1"]
    neox = _tiny("gpt_neox", {})
    assert [name for name, _ in structure.attention_modules(neox)] == ["gpt_neox.layers.0.attention", "gpt_neox.layers.1.attention"]
    diff, llama = _tiny("diffllama", {}), _tiny("llama", {})
    assert structure.model_head_maps(diff) == [1, 1, 2, 2] and structure.model_head_maps(llama) is None
    module = structure.attention_modules(diff)[1][1]
    dot = lambda q, k: float((q * k).sum().detach())  # noqa: E731
    want = math.exp(dot(module.lambda_q1, module.lambda_k1)) - math.exp(dot(module.lambda_q2, module.lambda_k2)) + 0.8 - 0.6 * math.exp(-0.3)
    assert structure.differential_lambda(module) == pytest.approx(want, rel=1e-6)  # the paper's λ_init for layer index 1


def test_non_causal_attention_without_a_mask_is_refused():
    model = prepare(_tiny("llama", {}))
    module = next(m for m in model.modules() if isinstance(getattr(m, "quantdiff_tap", None), attention.Tap))
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(QuantdiffError, match="non-causal"):
        attention.quantdiff_attention_forward(module, q, q[:, :2], q[:, :2], None, scaling=1.0, is_causal=False)
