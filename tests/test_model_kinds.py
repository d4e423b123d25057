"""quantdiff's own model kinds. Gated ("quantdiff_gated") and sink ("quantdiff_sink"): each against a naive
implementation of its equations, with mutations that must fail, and the whole tool on it — statistics (logits
without the sink, first-position mass with it), the parameter budget beside the standard model's, `info`, `pair`
and `stats`, and SDPA refused by name for the sink kind. All three (DIFF V2 too; its own equations are in
tests/test_diffv2.py): quantizers at every site (the gate and λ projections at `linear`), export and exact reload.

The equations (tests/naive_llama.py plus the combinations below) are written from Qiu et al. 2025's G1 gate,
sigmoid(x W_gᵀ) per token and head times each head's attention output, and from GPT-OSS's sinks,
p = exp(ℓ) / (exp(s_h) + Σ exp(ℓ)); they share nothing with `quantdiff.models.gated` / `quantdiff.models.sink`.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import naive_llama
from own_kinds import B, PRESET, T, on_backend, perturbed_models, token_ids

import quantdiff
from quantdiff.data.sources import Batch
from quantdiff.models import structure
from quantdiff.models.pairs import added_parameter_count, build_pair, parameter_count
from quantdiff.models.sink import EAGER_WITH_SINKS
from quantdiff.stats.collect import collect_stats

KINDS = ("gated", "sink")
OWN_KINDS = ("diffv2", *KINDS)  # quantdiff's own model types: the tool tests below run on each


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return perturbed_models(("standard", *OWN_KINDS))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return token_ids()


# ---- the naive implementations ------------------------------------------------------------------------------------


def naive(model: torch.nn.Module, ids: torch.Tensor, gate=torch.sigmoid, heads_of_gate=None, sink_logits=lambda s: s) -> dict:
    """float64 from the equations. Gated: out = concat_i(sigmoid(a·w_i) O_i) W_Oᵀ, w_i row i of the gate projection;
    sink: p_tj = exp(ℓ_tj) / (exp(s_h) + Σ_j' exp(ℓ_tj')). The keyword arguments mutate the equations."""
    weights = {name: t.detach().double() for name, t in model.state_dict().items()}
    kind = structure.attention_kind(model)

    def gated(prefix: str, a: torch.Tensor, heads: list[torch.Tensor]) -> torch.Tensor:
        g = gate(a @ weights[prefix + "self_attn.output_gate_proj.weight"].T)  # (T, h)
        order = heads_of_gate or range(len(heads))
        return torch.cat([g[:, i : i + 1] * heads[h] for i, h in enumerate(order)], dim=-1)

    if kind == "gated":
        return naive_llama.forward(model, ids, gated)
    return naive_llama.forward(model, ids, sinks=lambda prefix: sink_logits(weights[prefix + "self_attn.sinks"]))


def _gap(model, ids, **mutation) -> float:
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    return (got - naive(model, ids, **mutation)["logits"]).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_model_equals_the_equations_and_mutations_do_not(models, ids, kind):
    model = models[kind]
    as_trained = build_pair(PRESET, kinds=(kind,))[kind].eval()  # on what training uses: SDPA, eager for the sinks
    as_trained.load_state_dict(model.state_dict())
    assert as_trained.config._attn_implementation == {"gated": "sdpa", "sink": EAGER_WITH_SINKS}[kind]
    for runner in (model, on_backend(model), as_trained):
        assert _gap(runner, ids) <= 1e-5
    mutations = {
        "gated": [dict(gate=torch.ones_like), dict(gate=lambda z: torch.sigmoid(-z)), dict(heads_of_gate=[1, 0, 3, 2])],
        "sink": [dict(sink_logits=lambda s: torch.full_like(s, -torch.inf)), dict(sink_logits=torch.zeros_like), dict(sink_logits=lambda s: -s)],
    }[kind]  # gate removed, inverted, given to the wrong heads; sink ignored, fixed at 0 (off-by-one), negated
    for mutation in mutations:
        assert _gap(model, ids, **mutation) > 1e-2, mutation


def test_each_attention_row_falls_short_of_one_by_the_sinks_share(models, ids):
    """The model's own (eager) attention probabilities are the naive ones, and each row sums to 1 − exp(s)/(exp(s) +
    Σ exp(ℓ)): the share the sink takes, computed from the logits."""
    model = models["sink"]
    want = naive(model, ids)
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer, (got, probs, scores) in enumerate(zip(attentions, want["probs"], want["scores"])):
        assert (got.double() - probs).abs().max() <= 1e-5
        sinks = model.model.layers[layer].self_attn.sinks.detach().double()[None, :, None]
        share = torch.exp(sinks) / (torch.exp(sinks) + torch.exp(scores.masked_fill(~causal, -torch.inf)).sum(-1))
        assert (1 - got.double().sum(-1) - share).abs().max() <= 1e-5 and share.max() > 0.1


# ---- the tool on them ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stats_see_only_qk_logits_and_sink_mass_is_the_true_probability(models, ids, kind):
    model = models[kind]
    want = naive(model, ids)
    stats = collect_stats(on_backend(model, 3), [Batch(ids, None, 0)], k=8)
    logits = stats.summary()["attention_logits"]
    heads = model.config.num_attention_heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert logits["count"] == B * PRESET.num_layers * heads * T * (T + 1) // 2  # the sink is no key position
    top = torch.cat([s[..., causal].abs().flatten() for s in want["scores"]]).max().item()
    assert logits["max"] == pytest.approx(top, rel=1e-5)
    per_head = stats.sinks.per_head()
    for layer, probs in enumerate(want["probs"]):
        assert per_head[layer].tolist() == pytest.approx(probs[..., 0].mean(dim=(0, 2)).tolist(), abs=1e-6)
    if kind == "sink":  # the mass without the sink term (the mutation "sink ignored") is far from it
        without = naive(model, ids, sink_logits=lambda s: torch.full_like(s, -torch.inf))["probs"][0][..., 0].mean(dim=(0, 2))
        assert (per_head[0] - without).abs().max() > 1e-2
    assert structure.attention_kind(model) == kind and structure.model_head_maps(model) is None


# every method at every site it supports (llm-int8 quantizes matmul operands: not the logits)
@pytest.mark.parametrize("kind", OWN_KINDS)
@pytest.mark.parametrize(("method", "site"), [("absmax", "logits"), ("absmax", "qk"), ("absmax", "linear"), ("llm-int8", "qk"), ("llm-int8", "linear")])
def test_quantizers_run_at_every_site(models, ids, kind, method, site):
    from quantdiff.quant.sites import parse_config, quantized

    model = on_backend(models[kind])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        with quantized(model, parse_config(method, 16, site)):  # also checks every attention module was reached
            at16 = model(input_ids=ids).logits
        with quantized(model, parse_config(method, 3, site)):
            at3 = model(input_ids=ids).logits
    assert torch.isfinite(at3).all() and (at16 - reference).abs().max() < (at3 - reference).abs().max()
    assert (at3 - reference).abs().max() > 1e-3  # 3 bits really changed the model


def test_the_gate_projection_is_quantized_at_the_linear_site(models):
    from quantdiff.quant.sites import LinearSite, linear_targets

    names = [name for name, _ in linear_targets(models["gated"], LinearSite())]
    assert [n for n in names if n.endswith("output_gate_proj")] == [f"model.layers.{i}.self_attn.output_gate_proj" for i in range(PRESET.num_layers)]


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_save_reload_and_quantized_export_are_exact(models, ids, kind, tmp_path):
    from quantdiff.quant.checkpoint import load_quantized
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.formats import AbsmaxExport, LLMInt8Export
    from quantdiff.quant.numerics import PerTensor
    from quantdiff.quant.sites import AbsmaxMethod, LinearSite, LLMInt8Method, LogitsSite, QuantConfig, quantized

    models[kind].save_pretrained(tmp_path / "src")
    source = quantdiff.load(tmp_path / "src", device="cpu")  # the strict tensor check passes: the plain state_dict
    assert source.config.model_type == f"quantdiff_{kind}"
    assert all(torch.equal(source.state_dict()[n], t) for n, t in models[kind].state_dict().items())
    attention_cfg = QuantConfig(AbsmaxMethod(6), LogitsSite())
    # An llm-int8 export reloads onto bitsandbytes, which picks a forward's outlier columns over all its tokens:
    # granularity tensor, by name.
    for fmt, method in ((AbsmaxExport(4), AbsmaxMethod(4)), (LLMInt8Export(), LLMInt8Method(8, granularity=PerTensor()))):
        out = tmp_path / type(fmt).__name__
        export_quantized(tmp_path / "src", out, fmt, attention=attention_cfg)
        reloaded = load_quantized(out, device="cpu")
        with torch.no_grad(), quantized(source, QuantConfig(method, LinearSite(inputs=isinstance(fmt, LLMInt8Export)))):
            with quantized(source, attention_cfg):
                expect = source(input_ids=ids).logits
            got = reloaded(input_ids=ids).logits
        assert torch.equal(got, expect), type(fmt).__name__
        added = {"diffv2": "lambda_proj", "gated": "output_gate_proj", "sink": "sinks"}[kind]
        assert added in " ".join(n for n, _ in reloaded.named_parameters())
        if kind == "sink":  # stored unquantized, as norms: bit for bit
            assert all(torch.equal(reloaded.state_dict()[n], t) for n, t in source.state_dict().items() if n.endswith("sinks"))


def test_parameters_beside_the_standard_models(models):
    d_model, heads, layers = PRESET.hidden_size, PRESET.num_heads, PRESET.num_layers
    standard = parameter_count(models["standard"])
    assert parameter_count(models["gated"]) - standard == added_parameter_count(models["gated"]) == layers * d_model * heads
    assert parameter_count(models["sink"]) - standard == added_parameter_count(models["sink"]) == layers * heads
    assert added_parameter_count(models["standard"]) == 0


def test_sdpa_is_refused_by_name_for_the_sink_kind(models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = copy.deepcopy(models["sink"])
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        model.set_attn_implementation("sdpa")  # it would drop the sinks without a word
    model.save_pretrained(tmp_path / "sink")
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "sink", attn_implementation="sdpa")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "sink").config._attn_implementation == EAGER_WITH_SINKS  # the default: eager, with sinks


def _main(argv: list[str], capsys) -> str:
    from quantdiff.cli.app import main

    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    captured = capsys.readouterr()
    assert info.value.code == 0, captured.err
    return captured.out


def test_pair_writes_both_kinds_with_their_counts_and_info_names_them(tmp_path, capsys):
    sizes = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "259", "--context", "16"]
    out = _main(["pair", str(tmp_path / "p"), "--gated", "--sink", *sizes], capsys)
    # 2 layers: D·h = 64 gate weights each, h = 2 sink logits each
    assert "gated: " in out and "(+128 vs standard, 128 λ/gate/sink)" in out and "(+4 vs standard, 4 λ/gate/sink)" in out
    assert sorted(p.name for p in (tmp_path / "p").iterdir() if p.is_dir()) == ["diff", "gated", "sink", "standard"]
    table = _main(["info", str(tmp_path / "p" / "gated"), str(tmp_path / "p" / "sink"), "--device", "cpu"], capsys)
    assert "gated (head-wise)" in table and "sink logit per" in table


@pytest.mark.parametrize("kind", KINDS)
def test_stats_json_names_the_kind(models, kind, tmp_path, capsys):
    models[kind].save_pretrained(tmp_path / kind)
    rows = tmp_path / "ids.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": list(range(3, 3 + T))}) + "\n" for _ in range(2)))
    _main(["stats", str(tmp_path / kind), "--data", str(rows), "--json", str(tmp_path / "s.json"), "--quiet", "--device", "cpu"], capsys)
    assert json.loads((tmp_path / "s.json").read_text())["models"][0]["kind"] == kind
