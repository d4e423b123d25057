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
from quantdiff.quant.kv_cache import QuantizedKVLayer
from quantdiff.quant.kv_layout import KIVI, KVLayout
from quantdiff.quant.kv_plan import KVPlan, LayerPlan, PlanKVQuantizer, model_shape
from quantdiff.quant.numerics import PerTensor
from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, check_supported, parse_config, quantized

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
        cache = quantdiff.kv_cache(model, plan, bits=None if plan else 4, group_size=group, layout="token")
        sequences, steps = greedy(model, prompt(), cache)
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
    """round(x / (max|row| / qmax)) per row of the last axis, stored offset by qmax (unsigned)."""
    q = 2 ** (bits - 1) - 1
    return (torch.round(x / (x.abs().amax(dim=-1, keepdim=True) / q)) + q).to(torch.uint8)


def unpack_halves(packed: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte: channel j in the low nibble, channel j + D/2 in the high one."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def test_the_cache_stores_codes_not_floats_and_counts_its_bytes(models):
    model = models["standard"]
    plan = KVPlan("heads", 8, model_shape(model.config), (LayerPlan((4, 16), (0,)), LayerPlan((9, 3), ())))  # heads average 8 bits
    ids = prompt(4)
    with torch.no_grad():
        plain = DynamicCache()
        model(ids, cache=plain, use_cache=True)  # the first layer's keys as the model writes them
        cache = quantdiff.kv_cache(model, plan, layout="token")
        model(ids, cache=cache, use_cache=True)
    batch, heads, length, width = 2, 2, PROMPT, 8
    keys0, written = cache.layers[0]._keys, plain.layers[0].keys
    assert keys0.codes[4].dtype == torch.uint8 and keys0.codes[4].shape == (batch, 1, length, width // 2)  # two codes a byte
    assert torch.equal(unpack_halves(keys0.codes[4]), naive_codes(written[:, :1], 4))
    assert torch.equal(keys0.full, written[:, 1:])  # the 16-bit head, as computed
    assert torch.equal(keys0.kept, written[:, :, :1])  # the kept position, as computed
    values1 = cache.layers[1]._values
    assert values1.codes[9].dtype == torch.int16 and values1.codes[9].shape == (batch, 1, length, width)
    assert values1.codes[3].dtype == torch.uint8 and values1.codes[3].shape == (batch, 1, length, width)  # a byte a 3-bit code
    # bytes: per layer and tensor, codes (4 bits packed) + one float32 scale per quantized row + 16-bit heads and
    # kept rows (the float residual is empty: no residual at the token layout)
    rows = batch * length
    layer0 = rows * width // 2 + rows * 4 + rows * width * 4 + batch * heads * width * 4
    layer1 = rows * width * 2 + rows * width + 2 * rows * 4
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


# ---- the KIVI layout (the default): blocks quantized once complete, after they are read -------------------------


def test_each_update_reads_the_complete_blocks_quantized_and_the_rest_as_computed():
    """Fed chunk by chunk (a prompt, then tokens), a layer returns the blocks completed by earlier updates as the
    `kv` site's plan quantizer quantizes them (per-head widths, a kept position out of the key scales and restored)
    and every newer token as written; its store then holds exactly what the site gives for all tokens."""
    layout = KVLayout(residual=4)
    plan = LayerPlan((4, 16), (1,))
    layer = QuantizedKVLayer(plan, layout)
    site = PlanKVQuantizer(plan, halves=False, layout=layout)
    generator = torch.Generator().manual_seed(6)
    keys = values = torch.zeros(2, 2, 0, 8)
    for size in (6, 1, 1, 1, 3, 1):
        new_keys, new_values = torch.randn(2, 2, size, 8, generator=generator), torch.randn(2, 2, size, 8, generator=generator)
        got_keys, got_values = layer.update(new_keys, new_values)
        seen_keys, seen_values = site.keys(keys, None), site.values(values)
        assert torch.equal(got_keys, torch.cat([seen_keys, new_keys], dim=2))
        assert torch.equal(got_values, torch.cat([seen_values, new_values], dim=2))
        keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
    assert keys.shape[2] == 13 and layer._keys.quantized == 12  # three blocks of 4 quantized, one token in float
    assert torch.equal(layer._keys.read(13), site.keys(keys, None)) and torch.equal(layer._values.read(13), site.values(values))
    assert not torch.equal(site.keys(keys, None)[:, :1], keys[:, :1])  # the 4-bit head was quantized


def test_the_prompt_attends_in_float_and_later_steps_read_quantized_blocks(models):
    """Causal: a block is quantized after the forward completing it has read it, so a prompt's logits through
    the cache are the unquantized forward's, and only the steps after it read quantized blocks."""
    model = models["standard"]
    ids = torch.randint(1, PRESET.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        cache = quantdiff.kv_cache(model, bits=2, layout=KVLayout(residual=4))
        prompt_logits = model(ids[:, :10], cache=cache, use_cache=True).logits
        step = model(ids[:, 10:11], cache=cache, use_cache=True).logits
        plain = model(ids[:, :11]).logits
    assert torch.equal(prompt_logits, model(ids[:, :10]).logits)
    assert (step[:, 0] - plain[:, 10]).abs().max() > 1e-3


def tiny_gemma3(window: int):
    """Gemma 3's layer pattern at toy size: two sliding-window layers, then a full-attention one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, sliding_window=window, max_position_embeddings=128,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def test_sliding_window_layers_keep_their_window():
    """At 16 bits the cache hands attention exactly what DynamicCache does (the masks' sizes agree); at 8 bits a
    sliding layer holds at most the window's last tokens and a block, the full layer everything."""
    model = tiny_gemma3(window=6)
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(8))
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(ids, **settings, cache=DynamicCache(config=model.config))
        exact = model.generate(ids, **settings, cache=quantdiff.kv_cache(model, bits=16, layout=KVLayout(residual=4)))
        cache = quantdiff.kv_cache(model, bits=8, layout=KVLayout(residual=4))
        model.generate(ids, **settings, cache=cache)
    assert torch.equal(torch.stack(exact.logits), torch.stack(expected.logits))
    held = [layer._keys.end - layer._keys.offset for layer in cache.layers]
    assert held[2] == 29 and all(6 - 1 <= h < 6 - 1 + 4 for h in held[:2])  # 29 tokens written (the last never is)
    assert "2 sliding" in repr(cache)


def test_the_cache_names_its_layout(models):
    cache = quantdiff.kv_cache(models["standard"], bits=4)
    assert repr(cache) == ("QuantizedKVCache(2 layers, 0 sliding, bits [4], layout: keys per channel over 128-token blocks, "
                           "values per token, asymmetric (zero-point), float residual of < 128 tokens)")
    record = cache.describe()
    assert record["layout"] == KIVI.to_dict() and record["layers"][0] == {"kv_bits": [4, 4], "keep_positions": [], "sliding_window": None}
    assert QuantConfig.from_dict(QuantConfig(AbsmaxMethod(4), KVSite(layout=KIVI)).to_dict()).site.layout == KIVI


def test_layouts_the_cache_cannot_honour_are_refused(models):
    model = models["standard"]
    with pytest.raises(ConfigError, match="does not divide the head width 8"):
        quantdiff.kv_cache(model, bits=4, group_size=3)
    with pytest.raises(ConfigError, match="unknown kv layout"):
        quantdiff.kv_cache(model, bits=4, layout="kivi2")
    chunked = tiny_gemma3(window=6)
    chunked.config.layer_types = ["chunked_attention", "sliding_attention", "full_attention"]
    chunked.config.attention_chunk_size = 4
    with pytest.raises(ConfigError, match="layers of type 'chunked_attention' are not implemented"):
        quantdiff.kv_cache(chunked, bits=4)
    with pytest.raises(ConfigError, match="needs granularity row"):
        check_supported(QuantConfig(AbsmaxMethod(4, PerTensor()), KVSite(layout=KIVI)))


@pytest.mark.parametrize("layout", ["kivi", "token"])
def test_a_left_padded_batch_decodes_as_each_sequence_alone_at_16_bits(models, layout):
    """The cache hands attention every row as the model wrote it at 16 bits, whatever the layout's bookkeeping
    (blocks, residual): a left-padded batch then decodes as through an unquantized cache, and at 4 bits the
    cache still quantizes something."""
    model = models["diff"]
    ids = prompt(9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second sequence is three tokens shorter, padded on the left
    ids[1, :3] = 0
    settings = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    small = KVLayout(residual=4) if layout == "kivi" else layout
    with torch.no_grad():
        expected = model.generate(ids, **settings, cache=DynamicCache())
        exact = model.generate(ids, **settings, cache=quantdiff.kv_cache(model, bits=16, layout=small))
        coarse = model.generate(ids, **settings, cache=quantdiff.kv_cache(model, bits=4, layout=small))
    assert torch.equal(torch.stack(exact.logits), torch.stack(expected.logits))
    assert (torch.stack(coarse.logits) - torch.stack(expected.logits)).abs().max() > 1e-4
