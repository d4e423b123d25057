"""Exports with a remedy: a rotated or smoothed absmax export reloads to the outputs of the same fake-quantized
weights, formats that cannot hold a rotation refuse it, and the CLI's remedy options are checked up front."""

import json

import pytest
import torch

from quantdiff.cli.transform_options import make_transform
from quantdiff.core.errors import ConfigError
from quantdiff.models.loading import load_tokenizer
from quantdiff.models.names import resolve
from quantdiff.quant.checkpoint import load, load_quantized
from quantdiff.quant.export import export_quantized
from quantdiff.quant.formats import AbsmaxExport, Bnb4bitExport, LLMInt8Export
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, LLMInt8Method, QuantConfig, quantized
from quantdiff.quant.smoothing import Calibration
from quantdiff.quant.transforms import HadamardRotation, Smoothing, calibrated_configs

SOURCE = resolve("bb/standard")[0]  # shipped, tiny, with a tokenizer (smoothing calibrates through it)
CALIBRATION = Calibration("builtin:bigram-backcopy", tokens=512, seq_len=64)


def _ids() -> torch.Tensor:
    return torch.randint(3, 80, (2, 20), generator=torch.Generator().manual_seed(0))


def _fake_quantized_logits(transform, method) -> torch.Tensor:
    """The source model with weight-only fake quantization and the same transform: what the export must reload to."""
    model = load(SOURCE, device="cpu")
    config = calibrated_configs([QuantConfig(method, LinearSite(inputs=False, transform=transform))], model, load_tokenizer(SOURCE))[0]
    with torch.no_grad(), quantized(model, config):
        return model(_ids()).logits


def test_a_rotated_absmax_export_reloads_to_the_rotated_fake_quantized_model(tmp_path):
    summary = export_quantized(SOURCE, tmp_path / "rot", AbsmaxExport(4), transform=HadamardRotation())
    recorded = summary.description["transform"]
    assert recorded["name"] == "hadamard" and recorded["modules"]["model.layers.0.mlp.down_proj"] == 64  # 192 = 3 · 64
    section = json.loads((tmp_path / "rot" / "config.json").read_text())["quantization_config"]
    assert section["transform"] == recorded
    with torch.no_grad():
        reloaded = load_quantized(tmp_path / "rot", device="cpu")(_ids()).logits
        plain = load(SOURCE, device="cpu")(_ids()).logits
    expected = _fake_quantized_logits(HadamardRotation(), AbsmaxMethod(4))
    assert torch.allclose(reloaded, expected, atol=1e-5), (reloaded - expected).abs().max()
    assert (reloaded - plain).abs().max() > 1e-3  # 4-bit weights do change the outputs


@pytest.mark.parametrize("fmt", [AbsmaxExport(8), LLMInt8Export()], ids=["absmax", "llm-int8"])
def test_a_smoothed_export_reloads_to_the_smoothed_fake_quantized_model(tmp_path, fmt):
    transform = Smoothing(CALIBRATION, alpha=0.5)
    summary = export_quantized(SOURCE, tmp_path / "smooth", fmt, transform=transform)
    recorded = summary.description["transform"]
    assert recorded["alpha"] == 0.5 and recorded["calibrated"]["folded"] and recorded["calibrated"]["tokens"] == 512
    reloaded_model = load_quantized(tmp_path / "smooth", device="cpu")
    for handle in reloaded_model.quantdiff_handles:  # llm-int8 quantizes its inputs at run time; compare weights alone
        handle.remove()
    with torch.no_grad():
        reloaded = reloaded_model(_ids()).logits
    expected = _fake_quantized_logits(transform, AbsmaxMethod(8) if isinstance(fmt, AbsmaxExport) else LLMInt8Method(8))
    assert torch.allclose(reloaded, expected, atol=1e-4), (reloaded - expected).abs().max()


def test_formats_that_cannot_hold_a_rotation_refuse_it_before_loading(tmp_path):
    for fmt in (LLMInt8Export(), Bnb4bitExport("nf4")):
        with pytest.raises(ConfigError, match="--rotate needs --method absmax"):
            export_quantized(tmp_path / "no-such-model", tmp_path / "out", fmt, transform=HadamardRotation())


def test_remedy_options_are_checked():
    with pytest.raises(ConfigError, match="choose one"):
        make_transform("hadamard", 0.5, None, None)
    with pytest.raises(ConfigError, match="unknown rotation"):
        make_transform("givens", None, None, None)
    with pytest.raises(ConfigError, match="--calibration does nothing without --smooth"):
        make_transform(None, None, "builtin:corpus-train", None)
    with pytest.raises(ConfigError, match="builtin:corpus is evaluation data"):
        make_transform(None, 0.5, "builtin:corpus", None, task="lm")
    assert make_transform(None, 0.5, None, None, task="bb").calibration.source == "builtin:bigram-backcopy"
    assert make_transform(None, 0.5, None, 100, task="lm").calibration == Calibration("builtin:corpus-train", 100)
