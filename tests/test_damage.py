"""quantdiff.damage (llama.cpp's KL-divergence measures), layer subsets of a config, and `quantdiff sensitivity`."""

from __future__ import annotations

import json

import pytest
import torch

import quantdiff
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError
from quantdiff.eval.sensitivity import spearman
from quantdiff.models import structure
from quantdiff.quant.sites import QuantConfig, parse_config


def _naive(model, ids, config) -> dict:
    """KL, Δp, same top-1 and Δ loss written out from the model's own logits, with and without quantized()."""
    with torch.inference_mode():
        full = model(input_ids=ids).logits.float().double()[:, :-1].log_softmax(-1)
        with quantdiff.quantized(model, config):
            quant = model(input_ids=ids).logits.float().double()[:, :-1].log_softmax(-1)
    target = ids[:, 1:].unsqueeze(-1)
    kl = (full.exp() * (full - quant)).sum(-1).flatten()
    p_full, p_quant = full.gather(-1, target).exp().flatten(), quant.gather(-1, target).exp().flatten()
    return {"kld_mean": kl.mean().item(), "kld_max": kl.max().item(), "kld_median": kl.median().item() if kl.numel() % 2 else None,
            "delta_p_rms": (p_quant - p_full).pow(2).mean().sqrt().item(),
            "same_top1": (full.argmax(-1) == quant.argmax(-1)).double().mean().item(),
            "delta_loss": (-(p_quant.log()).mean() + p_full.log().mean()).item()}


def _layer_outputs(model, ids, config) -> list[torch.Tensor]:
    outputs, handles = [], []
    for _, layer in structure.decoder_layers(model):
        handles.append(layer.register_forward_hook(lambda m, a, out: outputs.append((out[0] if isinstance(out, tuple) else out).clone())))
    try:
        with torch.inference_mode(), quantdiff.quantized(model, config, allow_partial=True):
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _check_damage(model, ids, config, layers: int) -> None:
    got = quantdiff.damage(model, ids, config)
    naive = _naive(model, ids, config)
    for key, value in naive.items():
        if value is not None:
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert got["kld_mean"] > 0 and got["kld_p99"] <= got["kld_max"]
    none = quantdiff.damage(model, ids, config, layers=[])
    assert none["kld_max"] == 0 and none["delta_loss"] == 0 and none["same_top1"] == 1
    assert quantdiff.damage(model, ids, config, layers=list(range(layers))) == got


def test_damage_matches_naive_kl_on_a_tiny_model():
    model = quantdiff.load("tiny/diff", device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    _check_damage(model, ids, parse_config("absmax", 4, "linear"), model.config.num_hidden_layers)


@pytest.mark.slow(seconds=35)
def test_damage_on_smollm2_and_layer_k_alone_leaves_earlier_layers_bit_identical():
    model = quantdiff.load("smollm2", device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    config = parse_config("absmax", 4, "linear")
    _check_damage(model, ids, config, model.config.num_hidden_layers)
    k = 5
    full, alone = _layer_outputs(model, ids, None), _layer_outputs(model, ids, parse_config("absmax", 4, "linear", layers=[k]))
    assert all(torch.equal(a, b) for a, b in zip(full[:k], alone[:k]))
    assert not torch.equal(full[k], alone[k])


@pytest.mark.parametrize("site", ["linear", "logits", "kv"])
def test_layer_k_alone_leaves_earlier_layers_bit_identical(site):
    model = quantdiff.load("tiny/diff", device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(2))
    last = model.config.num_hidden_layers - 1
    full, alone = _layer_outputs(model, ids, None), _layer_outputs(model, ids, parse_config("absmax", 2, site, layers=[last]))
    assert all(torch.equal(a, b) for a, b in zip(full[:last], alone[:last]))
    assert not torch.equal(full[last], alone[last])


def test_layers_are_refused_by_name_and_round_trip():
    model = quantdiff.load("tiny/diff", device="cpu")
    with pytest.raises(ConfigError, match="layer 9 is out of range: .* 4 decoder layers"):
        with quantdiff.quantized(model, parse_config("absmax", 4, "kv", layers=[1, 9])):
            pass
    with pytest.raises(ConfigError, match="layers must be"):
        parse_config("absmax", 4, "linear", layers="1")
    config = parse_config("absmax", 4, "qk", layers=[3, 1])
    assert config.layers == (1, 3) and QuantConfig.from_dict(config.to_dict()) == config
    assert "layers" not in parse_config("absmax", 4, "qk").to_dict()


def test_spearman_matches_scipy():
    from scipy.stats import spearmanr

    x, y = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0], [2.0, 7.0, 1.0, 8.0, 2.0, 8.0]
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, rel=1e-12)
    assert spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_sensitivity_cli_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "s.json"
    main(["sensitivity", "tiny/diff", "--bits", "4", "--site", "linear,kv", "--tokens", "64", "--seq-len", "32", "--json", str(out), "--quiet"])
    result = json.loads(out.read_text())
    assert [s["site"] for s in result["sites"]] == ["linear", "kv"]
    for site in result["sites"]:
        assert [e["layer"] for e in site["layers"]] == [0, 1, 2, 3]
        assert all(e["damage"]["kld_mean"] > 0 and "massive" in e["outliers"] for e in site["layers"])
        assert site["additivity"]["measured_whole"]["kld_mean"] > 0
    with pytest.raises(SystemExit):
        main(["sensitivity", "tiny/diff", "--site", "nope", "--quiet"])
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error:")


@pytest.mark.slow(seconds=35)
def test_sensitivity_cli_on_smollm2(tmp_path):
    out = tmp_path / "s.json"
    main(["sensitivity", "smollm2", "--bits", "4", "--site", "linear", "--tokens", "32", "--seq-len", "32", "--json", str(out), "--quiet"])
    [site] = json.loads(out.read_text())["sites"]
    assert [e["layer"] for e in site["layers"]] == list(range(30))
    assert all(e["damage"]["kld_mean"] > 0 and e["outliers"]["input_top1"] > 0 for e in site["layers"])
    assert any(e["outliers"]["massive"] for e in site["layers"])


def test_eval_layers_option_records_the_layers_and_refuses_out_of_range(tmp_path, capsys):
    out = tmp_path / "e.json"
    main(["eval", "tiny/diff", "--task", "lm", "--bits", "4", "--site", "linear", "--layers", "3,1", "--limit", "2", "--json", str(out), "--quiet"])
    [cell] = json.loads(out.read_text())["cells"]
    assert cell["layers"] == [1, 3]
    from quantdiff.eval.sweep import cells_from_json

    assert cells_from_json({"cells": [cell]})[0].layers == [1, 3]
    with pytest.raises(SystemExit):
        main(["sweep", "tiny/diff", "--task", "lm", "--bits", "4", "--site", "linear", "--layers", "1,9", "--limit", "2", "--quiet"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --layers: layer 9 is out of range: tiny/diff has 4 decoder layers (0–3)"
