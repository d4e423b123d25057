"""SmoothQuant smoothing: scales by the paper's formula, maxima from the statistics engine, the folded model against
an unfolded reference, and structures it cannot fold or cannot smooth."""

import json

import pytest
import torch
from torch import nn

from quantdiff.core.errors import ConfigError
from quantdiff.eval.sweep import cells_from_json, cells_to_json, run_cell
from quantdiff.models import loading
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, QuantConfig, parse_config, quantized
from quantdiff.quant.smoothing import Calibration, apply_smoothing, calibrate, divide_inputs, smoothing_scales
from quantdiff.quant.transforms import Smoothing, calibrated_configs

PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """Pre-tokenized calibration sequences (JSONL input_ids): no tokenizer needed."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.jsonl"
    rows = torch.randint(0, PRESET.vocab_size, (6, 16), generator=torch.Generator().manual_seed(5)).tolist()
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
    return path


def _model(kind: str) -> nn.Module:
    model = build_pair(PRESET, seed=0, kinds=(kind,))[kind].eval()
    return loading.prepare(model, tile_size=8)


def _ids() -> torch.Tensor:
    return torch.randint(0, PRESET.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))


def test_scales_follow_the_paper_formula():
    act = torch.tensor([4.0, 0.5, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -2.0, 0.3, 0.0], [0.5, 0.1, -0.2, 0.0]])
    w2 = torch.tensor([[-3.0, 0.2, 0.1, 0.0]])
    for alpha in (0.0, 0.5, 0.8, 1.0):
        s = smoothing_scales(act, [w1, w2], alpha)
        for j in range(4):
            a = max(float(act[j]), 1e-5)
            w = max(max(abs(float(w[i, j])) for i in range(w.shape[0])) for w in (w1, w2))
            expected = max(a**alpha / max(w, 1e-5) ** (1 - alpha), 1e-5)
            assert float(s[j]) == pytest.approx(expected, rel=1e-5), (alpha, j)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_calibration_reads_the_linear_inputs_maxima_and_groups(kind, calibration_file):
    model = _model(kind)
    captured: dict[str, torch.Tensor] = {}
    layer = model.model.layers[1]
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, a, out: captured.setdefault("attention", out.detach())),
             layer.post_attention_layernorm.register_forward_hook(lambda m, a, out: captured.setdefault("ffn", out.detach()))]
    rows = torch.tensor([json.loads(line)["input_ids"] for line in calibration_file.read_text().splitlines()])
    with torch.no_grad():
        model(rows)  # the naive maxima: one pass over all calibration rows
    for hook in hooks:
        hook.remove()
    calibrated = calibrate(model, None, Calibration(str(calibration_file), tokens=96, seq_len=16))
    for which, name in enumerate(("attention", "ffn")):
        expected = captured[name].abs().amax(dim=(0, 1))
        assert torch.allclose(calibrated.stats.input_absmax[1, which], expected, rtol=1e-6)
    groups = {(g.layer, g.input): g for g in calibrated.groups}
    assert groups[(0, "attention")].norm == "model.layers.0.input_layernorm"
    # every linear reading the normed layer input shares its smoothing scales: DIFF V2's λ and the G1 gate too
    extra = {"diffv2": {"lambda_proj"}, "gated": {"output_gate_proj"}}.get(kind, set())
    expected_attention = {"q_proj", "k_proj", "v_proj"} | extra
    assert {name.rsplit(".", 1)[1] for name in groups[(0, "attention")].linears} == expected_attention
    assert {name.rsplit(".", 1)[1] for name in groups[(1, "ffn")].linears} == {"gate_proj", "up_proj"}
    assert calibrated.folded and calibrated.record["tokens"] == 96 and calibrated.record["sequences"] == 6


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_folded_smoothing_equals_the_unfolded_reference_and_the_model(kind, calibration_file):
    model = _model(kind)
    calibrated = calibrate(model, None, Calibration(str(calibration_file), tokens=96, seq_len=16))
    ids = _ids()
    inputs: dict[str, list[torch.Tensor]] = {"folded": [], "unfolded": []}
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        reference = model(ids).logits
        outputs = {}
        for fold in (True, False):
            undo = []
            divide_inputs(apply_smoothing(model, calibrated, 0.5, undo, fold=fold), undo)  # folded: nothing to divide
            key = "folded" if fold else "unfolded"
            hook = q_proj.register_forward_hook(lambda m, args, out, key=key: inputs[key].append(args[0].detach()))
            outputs[key] = model(ids).logits
            weights = q_proj.weight.detach().clone()
            hook.remove()
            while undo:
                undo.pop()()
            outputs[key + " weight"] = weights
    scale = reference.abs().max()
    for key in ("folded", "unfolded"):
        assert (outputs[key] - reference).abs().max() < 1e-5 * scale, (key, (outputs[key] - reference).abs().max())
    assert torch.allclose(inputs["folded"][0], inputs["unfolded"][0], rtol=1e-5, atol=1e-6)  # the linear sees X / s either way
    assert torch.equal(outputs["folded weight"], outputs["unfolded weight"])  # W · s either way
    assert torch.equal(model(ids).logits, reference)  # undone


def test_smoothing_flattens_the_linear_inputs_and_sweeps_record_it(calibration_file):
    model = _model("standard")
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight[3] = 40.0  # an outlier channel in the attention input
    transform = Smoothing(Calibration(str(calibration_file), tokens=96, seq_len=16), alpha=0.5)
    config = calibrated_configs([parse_config("absmax", 8, "linear", transform=transform)], model, None)[0]
    seen = []
    hook = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().abs().amax(dim=(0, 1))))
    with torch.no_grad(), quantized(model, config):  # the hook above runs before the quantizer's: it sees X / s
        model(_ids())
    with torch.no_grad():
        model(_ids())
    hook.remove()
    smoothed, plain = seen
    ratio = lambda m: float(m.max() / m.median())  # noqa: E731
    assert ratio(smoothed) < ratio(plain) / 3, (ratio(smoothed), ratio(plain))

    class OneBatch:
        name, metrics, headline = "fake", ("x",), "x"

        def evaluate(self, model, prepared, progress=None):
            with torch.no_grad():
                return {"x": float(model(_ids()).logits.abs().mean())}

    cell = run_cell(model, "m", OneBatch(), [0], config)
    back = cells_from_json(json.loads(json.dumps(cells_to_json([cell]))))[0]
    record = back.transform
    assert record["name"] == "smooth" and record["alpha"] == 0.5
    assert record["calibrated"]["source"] == str(calibration_file) and record["calibrated"]["tokens"] == 96 and record["calibrated"]["folded"]
    assert QuantConfig.from_dict(config.to_dict()) == config


class OffsetNorm(nn.Module):
    """One weight like RMSNorm, but an offset too: 1/s cannot fold into it."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + 0.1


def test_a_norm_that_cannot_fold_is_smoothed_unfolded(calibration_file):
    model = _model("standard")
    model.model.layers[1].post_attention_layernorm = OffsetNorm(model.model.layers[1].post_attention_layernorm)
    calibrated = calibrate(model, None, Calibration(str(calibration_file), tokens=96, seq_len=16))
    assert not calibrated.folded
    ids = _ids()
    with torch.no_grad():
        reference = model(ids).logits
        undo = []
        divide_inputs(apply_smoothing(model, calibrated, 0.5, undo), undo)
        smoothed = model(ids).logits
        while undo:
            undo.pop()()
    assert (smoothed - reference).abs().max() < 1e-5 * reference.abs().max()


class NoFFN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def test_a_layer_whose_input_no_linear_reads_is_refused_by_name(calibration_file):
    model = _model("standard")
    model.model.layers[1].mlp = NoFFN()
    with pytest.raises(ConfigError, match="decoder layer 1 has no ffn input"):
        calibrate(model, None, Calibration(str(calibration_file), tokens=96, seq_len=16))


def test_smoothing_settings_are_checked():
    with pytest.raises(ConfigError, match="from 0 to 1"):
        Smoothing(Calibration("builtin:corpus-train"), alpha=1.5)
    with pytest.raises(ConfigError, match="tokens"):
        Calibration("builtin:corpus-train", tokens=0)
    config = QuantConfig(AbsmaxMethod(4), LinearSite(transform=Smoothing(Calibration("builtin:corpus-train"))))
    with pytest.raises(ConfigError, match="calibration pass first"):
        with quantized(_model("standard"), config):
            pass
