"""Causal quantization and the quantized KV cache (`quant.kv_cache`): on every model kind, changing only later
tokens leaves earlier logits unchanged at every site; greedy generate() through `quantdiff.kv_cache` equals a
full forward under the `kv` site, step by step, with and without a plan; generate() inside the kv context equals
a full forward; the stored codes are the naive per-row absmax codes, packed at ≤ 4 bits, and their bytes add up."""

import pytest
import torch
from transformers import DynamicCache

import quantdiff
from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.kv_plan import KVPlan, LayerPlan, model_shape
from quantdiff.quant.packing import unpack_codes
from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, parse_config, quantized

PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)
PROMPT, NEW = 6, 8


@pytest.fixture(scope="module")
def models():
    return {kind: loading.prepare(model.eval(), tile_size=4) for kind, model in build_pair(PRESET, seed=0, kinds=ALL_KINDS).items()}


def prompt(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, PRESET.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(seed))


def sink_plan(model) -> KVPlan:
    """Per-head widths (a 16-bit head among them) and the first position kept, as the `heads`/`first` policies make."""
    return KVPlan("heads", 7, model_shape(model.config), (LayerPlan((3, 16), (0,)), LayerPlan((5, 4), (0, 7))))  # heads average 7 bits


def greedy(model, ids: torch.Tensor, cache=None):
    """(sequences, per-step logits (B, NEW, V)) of greedy decoding; every prompt token real (no pad id inside)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **({} if cache is None else {"cache": cache}))
    return out.sequences, torch.stack(out.logits, dim=1)


def step_logits_of_a_full_forward(model, sequences: torch.Tensor) -> torch.Tensor:
    return model(sequences).logits[:, PROMPT - 1 : -1]


# ---- causality: later tokens never change earlier logits ----------------------------------------------------

CONFIGS = [("absmax", "logits"), ("absmax", "qk"), ("absmax", "linear"), ("absmax", "kv"), ("llm-int8", "qk"), ("llm-int8", "linear")]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_changing_later_tokens_leaves_earlier_logits_unchanged_at_every_site(models, kind):
    model = models[kind]
    ids = torch.randint(1, PRESET.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    later = ids.clone()
    later[:, 10:] = (ids[:, 10:] * 7 + 3) % (PRESET.vocab_size - 1) + 1  # other tokens from position 10 on
    later[0, 10:] = 0  # and a token of its own far larger activations could not hurt: row scales see only their token
    with torch.no_grad():
        for method, site in CONFIGS:
            with quantized(model, parse_config(method, 3, site, threshold=1.0) if method == "llm-int8" else parse_config(method, 3, site)):
                a, b = model(ids).logits[:, :10], model(later).logits[:, :10]
            assert (a - b).abs().max() <= 1e-5, (method, site, (a - b).abs().max())


def test_granularity_tensor_is_not_causal(models):
    """The former default lets later tokens change earlier logits: the check above can fail."""
    model = models["standard"]
    ids = torch.randint(1, PRESET.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    later = ids.clone()
    later[:, 10:] = (ids[:, 10:] + 5) % PRESET.vocab_size
    with torch.no_grad():
        for site in ("logits", "qk", "linear", "kv"):
            with quantized(model, parse_config("absmax", 3, site, granularity="tensor")):
                a, b = model(ids).logits[:, :10], model(later).logits[:, :10]
            assert (a - b).abs().max() > 1e-4, site


# ---- the real cache against the kv site -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("setting", ["uniform", "grouped", "plan"])
def test_generate_through_the_quantized_cache_equals_the_kv_site_in_a_full_forward(models, kind, setting):
    model = models[kind]
    plan = sink_plan(model) if setting == "plan" else None
    group = 4 if setting == "grouped" else None
    config = QuantConfig(AbsmaxMethod(plan.budget_bits if plan else 4), KVSite(plan, group_size=group))
    with torch.no_grad():
        sequences, steps = greedy(model, prompt(), quantdiff.kv_cache(model, plan, bits=None if plan else 4, group_size=group))
        with quantized(model, config):
            full = step_logits_of_a_full_forward(model, sequences)
        unquantized = step_logits_of_a_full_forward(model, sequences)
    assert (steps - full).abs().max() <= 1e-5
    assert (steps - unquantized).abs().max() > 1e-3  # the cache quantized something


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_generate_inside_the_kv_context_equals_a_full_forward(models, kind):
    model = models[kind]
    with torch.no_grad(), quantized(model, parse_config("absmax", 3, "kv")):
        sequences, steps = greedy(model, prompt(3))
        full = step_logits_of_a_full_forward(model, sequences)
    assert (steps - full).abs().max() <= 1e-4


def naive_codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """round(x / (max|row| / qmax)) per row of the last axis."""
    scale = x.abs().amax(dim=-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.round(x / scale).to(torch.int8)


def test_the_cache_stores_codes_not_floats_and_counts_its_bytes(models):
    model = models["standard"]
    plan = KVPlan("heads", 8, model_shape(model.config), (LayerPlan((4, 16), (0,)), LayerPlan((9, 3), ())))  # heads average 8 bits
    ids = prompt(4)
    with torch.no_grad():
        plain = DynamicCache()
        model(ids, cache=plain, use_cache=True)  # the first layer's keys as the model writes them
        cache = quantdiff.kv_cache(model, plan)
        model(ids, cache=cache, use_cache=True)
    batch, heads, length, width = 2, 2, PROMPT, 8
    keys0, written = cache.layers[0]._keys, plain.layers[0].keys
    assert keys0.codes[4].dtype == torch.uint8 and keys0.codes[4].shape == (batch, 1, length, width // 2)  # two codes a byte
    assert torch.equal(unpack_codes(keys0.codes[4].reshape(-1), 4, (batch, 1, length, width)), naive_codes(written[:, :1], 4))
    assert torch.equal(keys0.full, written[:, 1:])  # the 16-bit head, as computed
    assert torch.equal(keys0.kept, written[:, :, :1])  # the kept position, as computed
    values1 = cache.layers[1]._values
    assert values1.codes[9].dtype == torch.int16 and values1.codes[9].shape == (batch, 1, length, width)
    assert values1.codes[3].dtype == torch.uint8 and values1.codes[3].shape == (batch, 1, length, 3)  # 8 codes of 3 bits: 3 bytes
    # bytes: per layer and tensor, codes (packed) + one float32 scale per quantized row + 16-bit heads and kept rows
    rows = batch * length
    layer0 = rows * width // 2 + rows * 4 + rows * width * 4 + batch * heads * width * 4
    layer1 = rows * width * 2 + rows * 3 + 2 * rows * 4
    assert cache.nbytes() == 2 * (layer0 + layer1)


def test_kv_cache_refuses_what_it_cannot_honour(models):
    model = models["standard"]
    with pytest.raises(ConfigError, match="needs bits"):
        quantdiff.kv_cache(model)
    with pytest.raises(ConfigError, match="budget of 7 bits"):
        quantdiff.kv_cache(model, sink_plan(model), bits=3)
    with pytest.raises(ConfigError, match="kv plan is for"):
        quantdiff.kv_cache(models["diff"], sink_plan(model))
    with pytest.raises(ConfigError, match="bits must be from 2 to 16"):
        quantdiff.kv_cache(model, bits=1)
    with pytest.raises(ConfigError, match="cannot be cropped"):
        quantdiff.kv_cache(model, bits=4).layers[0].crop(-1)


def test_beam_search_and_repeated_sequences_reorder_the_stored_rows(models):
    """At 16 bits the cache stores the rows as computed: beam search through it (reordered every step) and
    several returned sequences per prompt (rows repeated) give exactly the unquantized cache's sequences."""
    model = models["diff"]
    ids = prompt(5)
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        got = model.generate(ids, **settings, cache=quantdiff.kv_cache(model, bits=16))
    assert got.shape == (4, PROMPT + 5) and torch.equal(got, expected)
