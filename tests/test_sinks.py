"""Attention-sink score against eager attention: softmax of the full QKᵀ·scaling, mass on column 0."""

from __future__ import annotations

import pytest
import torch

from quantdiff.data.sources import make_batches
from quantdiff.models.loading import prepare
from quantdiff.report.stats_report import sink_line
from quantdiff.stats.schema import model_entry
from quantdiff.stats.collect import collect_stats
from quantdiff.stats.sinks import SinkStats


def _sharpen(model: torch.nn.Module, factor: float = 6.0) -> None:
    """Scale the query projections so attention maps are far from uniform (sinks differ from head to head)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("q_proj.weight"):
                param.mul_(factor)


def _batches(vocab: int):
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 23, 9, 31)]
    return make_batches(sequences, 3)  # right-padded batches of 3 and 1 sequences


def _eager_first_position_mass(model, batches) -> torch.Tensor:
    """(layers, heads) mean over valid query rows of the eager attention probability on key 0."""
    total, rows = None, 0
    with torch.no_grad():
        for batch in batches:
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
            mask = torch.ones_like(batch.input_ids) if batch.attention_mask is None else batch.attention_mask
            mass = torch.stack([(a[..., 0] * mask[:, None]).sum(dim=(0, 2)) for a in out.attentions]).double()
            total = mass if total is None else total + mass
            rows += int(mask.sum())
    return total / rows


def _paper_lambda(attn) -> float:
    """λ = exp(λq1·λk1) − exp(λq2·λk2) + λinit, written out from the paper's equation."""
    q1, k1, q2, k2 = (p.detach().double() for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2))
    return float(torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + attn.lambda_init)


@pytest.mark.parametrize("kind", ["standard", "diff"])
@pytest.mark.parametrize("tile", [7, None], ids=["tiled", "one-tile"])
def test_sink_mass_equals_eager_attention(tiny_pair, kind, tile):
    model = tiny_pair[kind]
    _sharpen(model)
    batches = _batches(model.config.vocab_size)
    reference = _eager_first_position_mass(model, batches)
    stats = collect_stats(prepare(model, tile), batches, k=5)
    got = stats.sinks.per_head()
    assert got.shape == reference.shape
    assert torch.allclose(got, reference, atol=2e-6), f"max diff {(got - reference).abs().max():.3g}"
    assert reference.max() - reference.min() > 1000 * 2e-6  # heads differ far beyond the tolerance: a wrong head order fails

    summary = stats.sinks.summary()
    if kind == "standard":
        scored = reference
        assert "combined" not in summary
    else:
        half = reference.shape[1] // 2
        lambdas = torch.tensor([_paper_lambda(layer.self_attn) for layer in model.model.layers], dtype=torch.float64)[:, None]
        scored = (reference[:, :half] - lambdas * reference[:, half:]) / (1 - lambdas)
        assert torch.allclose(torch.tensor(summary["combined"], dtype=torch.float64), scored, atol=1e-5)
        assert torch.allclose(torch.tensor(summary["per_map"]["2"], dtype=torch.float64), reference[:, half:], atol=2e-6)
    assert summary["score"] == pytest.approx(float((scored > 0.3).double().mean()))
    assert summary["mean"] == pytest.approx(float(scored.mean()), abs=1e-5)
    assert summary["heads_scored"] == scored.numel()


def test_sink_stats_merge_exactly_and_round_trip(tiny_pair):
    model = prepare(tiny_pair["diff"], 5)
    batches = _batches(model.config.vocab_size)
    whole = collect_stats(model, batches, k=5).sinks
    parts = [collect_stats(model, [b], k=5).sinks for b in batches]
    merged = SinkStats.from_dict(parts[0].to_dict()).merge(parts[1])
    assert torch.equal(merged.rows, whole.rows) and torch.equal(merged.mass, whole.mass)  # integer sums: exact
    other_order = SinkStats.from_dict(parts[1].to_dict()).merge(parts[0])
    assert torch.equal(other_order.mass, whole.mass)
    assert merged.lambdas == whole.lambdas


def test_stats_entry_carries_the_sink_block_and_its_line(tiny_pair):
    model = prepare(tiny_pair["standard"], 5)
    entry = model_entry("std", "path", collect_stats(model, _batches(model.config.vocab_size), k=5))
    sinks = entry["sinks"]
    assert len(sinks["per_head"]) == model.config.num_hidden_layers and sinks["epsilon"] == 0.3
    line = sink_line("std", sinks)
    assert line.startswith("std: attention sinks:") and f"of {sinks['heads_scored']} heads" in line


@pytest.mark.parametrize("tile", [5, None], ids=["tiled", "one-tile"])
def test_rows_that_cannot_see_position_zero_put_no_mass_there(tile):
    """A sliding window hides key 0 from later rows: their mass on it is 0, as in eager attention (the logit at
    key 0 was once read whether or not the row could see it, giving such rows a mass that does not exist)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=61, max_position_embeddings=64, sliding_window=8, attn_implementation="eager")
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    _sharpen(model)
    batches = _batches(config.vocab_size)
    reference = _eager_first_position_mass(model, batches)
    got = collect_stats(prepare(model, tile), batches, k=5).sinks.per_head()
    assert torch.allclose(got, reference, atol=2e-6), f"max diff {(got - reference).abs().max():.3g}"


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2", "doge", "quantdiff_sink"])
@pytest.mark.parametrize("tile", [5, None], ids=["tiled", "one-tile"])
def test_sink_mass_is_the_probability_softmax_gives(model_type, tile):
    """The mass on position 0 is the probability the model's softmax gives it: with the model's sink logits in every
    row's denominator (GPT-OSS, the sink kind: rows then sum to less than 1), of the soft-capped logits (Gemma 2),
    with the learned additive mask (Doge). Ignoring them was off by 0.059, 0.018 and 0.0019."""
    from test_architectures import SUPPORTED, _tiny

    model = _tiny(model_type, SUPPORTED[model_type])
    _sharpen(model, 3.0)
    batches = _batches(model.config.vocab_size)
    reference = _eager_first_position_mass(model, batches)
    got = collect_stats(prepare(model, tile), batches, k=5).sinks.per_head()
    assert torch.allclose(got, reference, atol=2e-6), f"max diff {(got - reference).abs().max():.3g}"


def test_the_mass_a_sink_logit_absorbs_is_the_naive_share_on_the_shipped_sink_model():
    """Per head, the mean over valid query rows (padding excluded) of exp(s)/(exp(s) + Σ_j exp(ℓ_j)), the share of
    each row's softmax denominator that goes to no key, is 1 − the row's naive probabilities summed (float64,
    tests/naive_llama.py); kinds without a sink logit report none."""
    import naive_llama

    from quantdiff.across_seeds.metrics import model_values
    from quantdiff.models.loading import load
    from quantdiff.models.names import ASSETS

    model = load(ASSETS / "bb" / "sink", device="cpu", tile_size=16)
    g = torch.Generator().manual_seed(4)
    sequences = [[0] + torch.randint(1, model.config.vocab_size, (n - 1,), generator=g).tolist() for n in (40, 23, 9, 31)]
    stats = collect_stats(model, make_batches(sequences, 3), k=5)  # right-padded batches of 3 and 1
    weights = {name: t.detach().double() for name, t in model.state_dict().items()}
    share, first = (torch.zeros(model.config.num_hidden_layers, model.config.num_attention_heads, dtype=torch.float64) for _ in range(2))
    rows = 0
    with torch.no_grad():
        for sequence in sequences:
            probs = naive_llama.forward(model, torch.tensor([sequence]), sinks=lambda prefix: weights[prefix + "self_attn.sinks"])["probs"]
            share = share + torch.stack([(1 - p.sum(-1)).sum(dim=(0, 2)) for p in probs])
            first = first + torch.stack([p[..., 0].sum(dim=(0, 2)) for p in probs])
            rows += len(sequence)
    summary = stats.sinks.summary()
    absorbed = torch.tensor(summary["sink_logit"]["per_head"], dtype=torch.float64)
    assert torch.allclose(absorbed, share / rows, atol=2e-6), f"max diff {(absorbed - share / rows).abs().max():.3g}"
    assert torch.allclose(stats.sinks.per_head(), first / rows, atol=2e-6)
    assert absorbed.max() - absorbed.min() > 0.05  # heads differ far beyond the tolerance: a wrong head order fails
    assert (summary["sink_logit"]["max"], summary["sink_logit"]["mean"]) == pytest.approx((absorbed.max().item(), absorbed.mean().item()))
    assert SinkStats.from_dict(stats.sinks.to_dict()).summary() == summary  # what a dump carries
    parts = [collect_stats(model, [batch], k=5).sinks for batch in make_batches(sequences, 3)]
    assert torch.equal(SinkStats.from_dict(parts[1].to_dict()).merge(parts[0]).sink_logit_mass, stats.sinks.sink_logit_mass)  # exact, any order
    entry = model_entry("sink", "shipped", stats, "sink")
    assert model_values({"models": [entry]})["sinks/sink_logit_max"]["sink"] == summary["sink_logit"]["max"]
    assert "the sink logits absorb" in sink_line("sink", entry["sinks"])
    standard = collect_stats(load(ASSETS / "bb" / "standard", device="cpu"), make_batches(sequences[:1], 1), k=5).sinks.summary()
    assert "sink_logit" not in standard


def test_the_smallest_sink_mass_is_of_the_maps_the_model_outputs():
    """sinks/min: Diff V1's combined map (which may be negative) where the model has one, else each head's map."""
    from quantdiff.across_seeds.metrics import model_values

    per_head = [[0.2, 0.5], [0.1, 0.05]]
    plain = {"name": "s", "sinks": {"per_head": per_head, "max": 0.5, "score": 0.25}}
    diff = {"name": "d", "sinks": {"per_head": per_head, "combined": [[-0.89], [0.04]], "max": 0.04, "score": 0.0}}
    for model in (plain, diff):
        model |= {"attention_logits": {"topk": [{"value": 1.0}], "median": 1.0, "per_head": []}, "hidden_states": {"topk": [{"value": 1.0}], "median": 1.0}}
    values = model_values({"models": [plain, diff]})
    assert values["sinks/min"] == {"s": 0.05, "d": -0.89} and values["sinks/max"] == {"s": 0.5, "d": 0.04}
    assert values["sinks/sink_logit_max"] == {"s": None, "d": None}
