"""Every model kind decodes with a KV cache exactly as its full forward computes, on every attention
implementation it allows, and `generate()` equals greedy decoding by full forwards.

The reference is the model's own full forward over the whole sequence (no cache): a kind whose attention ignored
or mishandled the cache argument (transformers 5.24 renamed it `cache`) gives other logits for the decoded tokens.
The cache keyword is taken from the installed transformers' forward signature, so the test runs on the lowest and
the newest allowed release alike (scripts/tested_ranges.sh).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from own_kinds import perturbed_models, token_ids
from transformers import AutoModelForCausalLM

import quantdiff.attention.backend as attention
from quantdiff.models.llama_variant import VariantAttention
from quantdiff.models.names import resolve
from quantdiff.models.pairs import ALL_KINDS

PROMPT = 4  # tokens given before decoding starts
SHIPPED_ARMS = ("standard", "diff", "diffv2", "gated", "sink", "standard-sgd")


def _implementations(model: torch.nn.Module) -> list[str]:
    """eager, SDPA where the kind allows it, and quantdiff's backend."""
    return ["eager", *(["sdpa"] if model._supports_sdpa else []), attention.BACKEND_NAME]


def _cache_keyword(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _decoded_token_by_token(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position: the prompt in one call, then one token per call over the growing cache."""
    keyword = _cache_keyword(model)
    out = model(ids[:, :PROMPT], use_cache=True)
    logits = [out.logits]
    for t in range(PROMPT, ids.shape[1]):
        out = model(ids[:, t : t + 1], use_cache=True, **{keyword: out.past_key_values})
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def _greedy_by_full_forwards(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    sequence = prompt
    for _ in range(new_tokens):
        next_token = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    return sequence


def _check(model: torch.nn.Module, ids: torch.Tensor) -> None:
    with torch.no_grad():
        full = model(ids).logits
        cached = _decoded_token_by_token(model, ids)
        # float32 matmuls of other shapes (one query against the cache, all queries at once) round differently,
        # and MKL's path follows the CPU vendor: up to 1.25e-5 measured on an AMD EPYC (bb/diffv2), under 1e-5 on
        # Intel; a wrong cache moves logits by O(1), and a mutated cache must differ (below)
        torch.testing.assert_close(cached, full, rtol=0, atol=5e-5)
        new_tokens = ids.shape[1] - PROMPT
        model.generation_config.eos_token_id = None  # decode every step: greedy by full forwards knows no end token
        generated = model.generate(ids[:, :PROMPT], max_new_tokens=new_tokens, do_sample=False,
                                   attention_mask=torch.ones_like(ids[:, :PROMPT]), pad_token_id=0)  # fmt: skip
        assert torch.equal(generated, _greedy_by_full_forwards(model, ids[:, :PROMPT], new_tokens))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_cached_decoding_equals_the_full_forward_for_every_kind_and_implementation(kind):
    model = perturbed_models((kind,))[kind]  # GQA, weights under which every mechanism (λ, gates, sinks) matters
    attention.register()
    for implementation in _implementations(model):
        model.set_attn_implementation(implementation)
        _check(model, token_ids())


@pytest.mark.parametrize("arm", SHIPPED_ARMS)
def test_the_shipped_bb_arms_decode_with_a_cache_as_transformers_loads_them(arm):
    attention.register()
    directory = resolve(f"bb/{arm}")[0]
    ids = torch.randint(3, 80, (2, 12), generator=torch.Generator().manual_seed(0))
    for implementation in _implementations(AutoModelForCausalLM.from_pretrained(directory)):
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=implementation, dtype=torch.float32).eval()
        _check(model, ids)


def test_a_mutated_cache_is_seen_so_the_comparison_can_fail():
    """Decoding over a cache whose keys were altered must differ from the full forward: the check above is not
    comparing a model with itself by another name."""
    model = perturbed_models(("gated",))["gated"]
    ids = token_ids()
    keyword = _cache_keyword(model)
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True)
        for layer in out.past_key_values.layers:
            layer.keys.mul_(1.5)
        step = model(ids[:, PROMPT : PROMPT + 1], use_cache=True, **{keyword: out.past_key_values}).logits
        assert (step - model(ids[:, : PROMPT + 1]).logits[:, -1:]).abs().max() > 1e-3


def test_an_argument_transformers_starts_passing_that_the_kind_sets_fails_loudly():
    model = perturbed_models(("sink",))["sink"]
    attention_module = next(m for m in model.modules() if isinstance(m, VariantAttention))
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(3)[None])
    with pytest.raises(TypeError, match="s_aux"):
        attention_module(hidden, position_embeddings, None, s_aux=torch.zeros(model.config.num_attention_heads))
