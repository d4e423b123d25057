"""DIFF Transformer V2 ("quantdiff_diffv2"): the model against a naive implementation of its equations, and the
whole tool on it — taps, statistics per map and combined, sinks with a per-token λ, retrieval maps, `quantdiff info`
(quantizers at every site and export with exact reload: tests/test_model_kinds.py, for every kind of quantdiff's own).

The naive implementation below is written from the authors' equations (README and reference module of
microsoft/unilm Diff-Transformer-V2), loops over heads and shares nothing with `quantdiff.models.diffv2`.
"""

from __future__ import annotations

import pytest
import torch

import naive_llama
from own_kinds import B, PRESET, T, on_backend, perturbed_models, token_ids

import quantdiff
import quantdiff.attention.backend as attention
from quantdiff.data.sources import Batch
from quantdiff.models import structure
from quantdiff.models.pairs import lambda_parameter_count, parameter_count
from quantdiff.stats.collect import collect_stats

@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return perturbed_models(("standard", "diffv2"))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return token_ids()


# ---- the naive implementation ---------------------------------------------------------------------------------


def naive(model: torch.nn.Module, ids: torch.Tensor, pairing: str = "adjacent", gate=torch.sigmoid) -> dict:
    """Logits (B, T, V), and per layer the probabilities (B, 2h, T, T), pre-softmax logits and λ (B, T, h), in
    float64, from the equations: O_j = softmax(RoPE(Q_j)·RoPE(K_g(j))ᵀ/√d) V_g(j), λ = sigmoid(x W_λᵀ),
    A_i = O_2i − λ_i O_2i+1, out = concat(A) W_Oᵀ inside LLaMA's pre-norm decoder layer (tests/naive_llama.py)."""
    n_q = model.config.num_attention_heads
    first, second = (range(0, n_q, 2), range(1, n_q, 2)) if pairing == "adjacent" else (range(n_q // 2), range(n_q // 2, n_q))
    weights = {name: t.detach().double() for name, t in model.state_dict().items()}
    lambdas: dict[str, list[torch.Tensor]] = {}

    def combine(prefix: str, a: torch.Tensor, heads: list[torch.Tensor]) -> torch.Tensor:
        lam = gate(a @ weights[prefix + "self_attn.lambda_proj.weight"].T)  # (T, h)
        lambdas.setdefault(prefix, []).append(lam)
        return torch.cat([heads[f] - lam[:, i : i + 1] * heads[s] for i, (f, s) in enumerate(zip(first, second))], dim=-1)

    out = naive_llama.forward(model, ids, combine)
    return out | {"lambda": [torch.stack(lambdas[f"model.layers.{layer}."]) for layer in range(model.config.num_hidden_layers)]}


def _gap(model, ids, **mutation) -> float:
    with torch.no_grad():
        got = model(input_ids=ids).logits.double()
    return (got - naive(model, ids, **mutation)["logits"]).abs().max().item()


def test_model_equals_the_equations_and_mutations_do_not(models, ids):
    model = models["diffv2"]
    for runner in (model, on_backend(model)):
        assert _gap(runner, ids) <= 1e-5
    # The check sees the λ formula and the pairing: each mutation of the equations is far off.
    assert _gap(model, ids, gate=lambda z: torch.sigmoid(-z)) > 1e-2
    assert _gap(model, ids, gate=lambda z: torch.full_like(z, 0.5)) > 1e-2
    assert _gap(model, ids, pairing="halves") > 1e-2


def test_backend_equals_eager_with_tiles_and_left_padding(models, ids):
    model = models["diffv2"]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for padded in (False, True):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask if padded else None).logits
        for tile in (3, T):
            tiled = on_backend(model, tile)
            for tap in attention.taps(tiled):
                tap.register_forward_hook(lambda *_: None)  # a listener forces the tiled path
            with torch.no_grad():
                got = tiled(input_ids=ids, attention_mask=mask if padded else None).logits
            real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
            assert (got - want)[real].abs().max().item() <= 1e-5, (padded, tile)


# ---- the tool on it -------------------------------------------------------------------------------------------


def test_structure_pairs_adjacent_heads_within_a_group(models):
    model = models["diffv2"]
    assert structure.head_pairing(model) == "adjacent" and structure.attention_kind(model) == "diffv2"
    assert structure.model_head_maps(model) == [1, 2] * PRESET.num_heads
    assert structure.layer_lambdas(model) is None and len(structure.lambda_projections(model)) == PRESET.num_layers
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    first, second = structure.map_heads(model.config.num_attention_heads, "adjacent")
    assert all(f // group == s // group for f, s in zip(first, second))


def test_stats_per_map_and_sinks_combined_with_each_rows_lambda(models, ids):
    model = models["diffv2"]
    want = naive(model, ids)
    stats = collect_stats(on_backend(model, 3), [Batch(ids, None, 0)], k=8)
    logits = stats.summary()["attention_logits"]
    n_q = model.config.num_attention_heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert logits["count"] == B * PRESET.num_layers * n_q * T * (T + 1) // 2  # taps see exactly the causal logits
    for name, heads in (("1", slice(0, n_q, 2)), ("2", slice(1, n_q, 2))):
        values = torch.cat([s[:, heads][..., causal].abs().flatten() for s in want["scores"]])
        assert logits["per_map"][name]["count"] == values.numel()
        assert logits["per_map"][name]["max"] == pytest.approx(values.max().item(), rel=1e-5)

    sinks = stats.sinks.summary()
    assert sinks["lambda_per_token"] and sinks["lambdas"] is None
    for layer, (probs, lam) in enumerate(zip(want["probs"], want["lambda"])):
        at_first = probs[..., 0]  # (B, 2h, T): each query row's mass on position 0
        a1, a2, lam = at_first[:, 0::2], at_first[:, 1::2], lam.transpose(1, 2)  # λ (B, h, T)
        combined = ((a1 - lam * a2) / (1 - lam)).mean(dim=(0, 2))
        assert sinks["per_map"]["1"][layer] == pytest.approx(a1.mean(dim=(0, 2)).tolist(), abs=1e-6)
        assert sinks["combined"][layer] == pytest.approx(combined.tolist(), abs=1e-6)
        assert not torch.allclose(combined, (a1.mean((0, 2)) - lam.mean((0, 2)) * a2.mean((0, 2))) / (1 - lam.mean((0, 2))), atol=1e-6)


def test_retrieval_maps_are_the_combined_maps_with_each_rows_lambda(models, ids):
    from quantdiff.eval.tasks.retrieval import last_rows_attention

    model = models["diffv2"]
    want = naive(model, ids)
    maps = last_rows_attention(on_backend(model, 3), ids.tolist(), rows=2)
    for layer, got in enumerate(maps):
        probs, lam = want["probs"][layer][:, :, -2:], want["lambda"][layer][:, -2:].transpose(1, 2)[..., None]
        combined = (probs[:, 0::2] - lam * probs[:, 1::2]) / (1 - lam)
        assert (got.double() - combined).abs().max().item() <= 1e-5


def test_matched_to_the_baseline_as_the_authors_match_it(models):
    standard, v2 = models["standard"], models["diffv2"]
    d_model, heads, layers = PRESET.hidden_size, PRESET.num_heads, PRESET.num_layers
    # Same D, heads, KV heads, head width, W_O and MLP; plus Q2 (D·h·d = D²) and W_λ (D·h) per layer.
    assert parameter_count(v2) - parameter_count(standard) == layers * (d_model * d_model + d_model * heads)
    assert lambda_parameter_count(v2) == layers * d_model * heads
    assert v2.config.head_dim == d_model // heads and v2.config.num_key_value_heads == PRESET.num_kv_heads


def test_info_names_the_attention_kind(models, tmp_path, capsys):
    from quantdiff.cli.app import main

    models["diffv2"].save_pretrained(tmp_path / "v2")
    with pytest.raises(SystemExit) as info:
        main(["info", str(tmp_path / "v2"), "--device", "cpu"])
        raise SystemExit(0)
    assert info.value.code == 0
    assert "differential V2" in capsys.readouterr().out


def test_a_pairing_across_groups_is_refused_in_one_line(models, tmp_path, capsys):
    import json

    from quantdiff.cli.app import main

    models["diffv2"].save_pretrained(tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 6, "num_key_value_heads": 2}))
    capsys.readouterr()  # what saving printed (progress bars) is not the command's output
    with pytest.raises(SystemExit) as info:
        main(["info", str(tmp_path / "bad"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert info.value.code != 0 and err.startswith("error:") and "\n" not in err and "GQA group" in err


def test_pair_command_writes_a_diffv2_of_the_same_sizes(tmp_path, capsys):
    from quantdiff.cli.app import main

    argv = ["pair", str(tmp_path / "p"), "--diffv2", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "259", "--context", "16"]
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    assert info.value.code == 0, capsys.readouterr().err
    v2 = quantdiff.load(tmp_path / "p" / "diffv2", device="cpu")
    assert v2.config.num_attention_heads == 4 and v2.config.head_dim == 16 and (tmp_path / "p" / "diff").is_dir()
