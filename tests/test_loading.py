"""quantdiff.load: real directories written by save_pretrained, and every way a directory can be wrong."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from quantdiff.cli.app import main
from quantdiff.core.errors import LoadError
from quantdiff.attention.backend import taps
from quantdiff.quant.checkpoint import load


@pytest.fixture
def saved_pair(tiny_pair, tmp_path):
    for kind, model in tiny_pair.items():
        model.save_pretrained(tmp_path / kind)
    return tmp_path


@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_load_roundtrip_on_quantdiff_backend(tiny_pair, saved_pair, kind):
    model = load(saved_pair / kind, device="cpu")
    assert model.config._attn_implementation == "quantdiff"
    assert not model.training
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).logits - tiny_pair[kind](ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_load_third_architecture(tmp_path):
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=50)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    model = load(tmp_path, device="cpu")
    assert len(taps(model)) == 1


def _truncate(path):
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _only_pickle(path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _no_config(path):
    (path / "config.json").unlink()


def _unsupported(path):
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "vit"
    config["architectures"] = ["ViTModel"]
    (path / "config.json").write_text(json.dumps(config))


BROKEN = {
    "missing": (lambda p: shutil.rmtree(p), "does not exist|neither an existing path"),
    "no-config": (_no_config, "no config.json"),
    "truncated": (_truncate, "truncated"),
    "pickle-only": (_only_pickle, "pickled"),
    "unsupported": (_unsupported, "unsupported architecture"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_directories_raise_one_clear_error(saved_pair, case, capsys):
    path = saved_pair / "standard"
    breaker, words = BROKEN[case]
    breaker(path)
    with pytest.raises(LoadError, match=words):
        load(path, device="cpu")
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and re.search(words, err) and "\n" not in err and "Traceback" not in err


def test_pickle_next_to_safetensors_is_never_read(saved_pair, monkeypatch):
    path = saved_pair / "diff"
    (path / "pytorch_model.bin").write_bytes(b"garbage that would crash torch.load")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    load(path, device="cpu")


@pytest.mark.parametrize("method,bits", [("absmax", 4), ("nf4", 4)])
def test_load_reads_quantized_exports(saved_pair, tmp_path, method, bits):
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.formats import parse_export

    source = saved_pair / "diff"
    out = tmp_path / f"q-{method}"
    export_quantized(source, out, parse_export(method, bits))
    model = load(out, device="cpu")
    original = load(source, device="cpu")
    assert model.config._attn_implementation == "quantdiff"
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(weight, original.model.layers[0].self_attn.q_proj.weight)  # really quantized
    assert (weight - original.model.layers[0].self_attn.q_proj.weight).abs().max() < 0.5 * weight.abs().max()
