"""KV-cache precision plans (`quant.kv_plan`): kept positions bit-identical, 16 bits everywhere equal to the
unquantized model, every kind against eager attention over a cache that stores what the plan says (a naive
reference), the effective bits worked by hand, the policies' budgets, the file format and its one-line refusals."""

import json

import pytest
import torch
from transformers import DynamicCache

from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError
from quantdiff.models import loading
from quantdiff.models.pairs import ALL_KINDS, SizePreset, build_pair
from quantdiff.quant.kv_plan import KVCalibration, KVPlan, LayerPlan, PlanKVQuantizer, derive_plan, measured_bits, model_shape
from quantdiff.quant.registry import GRANULARITY_NAMES
from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, parse_config, quantized

PRESET = SizePreset(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, max_position_embeddings=64)


def naive_keys(key: torch.Tensor, bits: list[int], keep: set[int]) -> torch.Tensor:
    """Per (sequence, head, channel): scale = max |k| over the positions not kept / (2^(b−1) − 1); kept positions
    and 16-bit heads copied. Loop by loop."""
    out = key.clone()
    b, h, s, d = key.shape
    for i in range(b):
        for j in range(h):
            if bits[j] == 16:
                continue
            q = 2 ** (bits[j] - 1) - 1
            rows = [t for t in range(s) if t not in keep]
            for c in range(d):
                scale = max(abs(float(key[i, j, t, c])) for t in rows) / q
                for t in rows:
                    out[i, j, t, c] = round(float(key[i, j, t, c]) / scale) * scale if scale > 0 else 0.0
    return out


def naive_values(value: torch.Tensor, bits: list[int], keep: set[int]) -> torch.Tensor:
    """Per (sequence, head, token): scale = max |v| over the head's channels; kept tokens and 16-bit heads copied."""
    out = value.clone()
    for j, width in enumerate(bits):
        if width == 16:
            continue
        v = value[:, j]
        scale = v.abs().amax(dim=-1, keepdim=True) / (2 ** (width - 1) - 1)
        quant = torch.where(scale > 0, torch.round(v / scale) * scale, torch.zeros_like(v))
        rows = [t for t in range(v.shape[1]) if t not in keep]
        out[:, j, rows] = quant[:, rows]
    return out


class PlanCache(DynamicCache):
    """A KV cache that stores keys and values as the plan says (the naive loops above) and hands those to attention."""

    def __init__(self, plan: KVPlan, causal: bool) -> None:
        super().__init__()
        self.plan, self.causal = plan, causal

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.plan.layers[layer_idx]
        keep = set(layer.keep_positions)
        keys = naive_values if self.causal else naive_keys  # causal: keys, like values, one scale per token and head
        return super().update(keys(key_states, list(layer.kv_bits), keep), naive_values(value_states, list(layer.kv_bits), keep), layer_idx, *args, **kwargs)


@pytest.fixture
def models():
    """Fresh models for each test, each on quantdiff's attention backend: a test that switches one to eager
    attention (or quantizes it) must not decide what the next test sees, whichever worker runs it (issue 53)."""
    built = {kind: model.eval() for kind, model in build_pair(PRESET, seed=0, kinds=ALL_KINDS).items()}
    for model in built.values():
        loading.prepare(model, tile_size=4)
    return built


def plan_for(model, bits: list[list[int]], keep: tuple[int, ...] = (), budget: int = 4) -> KVPlan:
    return KVPlan("heads", budget, model_shape(model.config), tuple(LayerPlan(tuple(row), keep) for row in bits))


def plan_config(plan: KVPlan, granularity: str = "row") -> QuantConfig:
    return QuantConfig(AbsmaxMethod(plan.budget_bits, GRANULARITY_NAMES[granularity]), KVSite(plan))


def test_kept_positions_leave_keys_and_values_bit_identical():
    g = torch.Generator().manual_seed(0)
    key = torch.randn(2, 3, 9, 5, generator=g)
    key[:, :, 0] *= 300.0  # a sink token whose keys would dominate every channel's scale
    value = torch.randn(2, 3, 9, 5, generator=g)
    quantizer = PlanKVQuantizer(LayerPlan((4, 2, 16), (0, 3)), halves=False, causal=False)
    got_k, got_v = quantizer.keys(key, None), quantizer.values(value)
    for t in (0, 3):
        assert torch.equal(got_k[:, :, t], key[:, :, t]) and torch.equal(got_v[:, :, t], value[:, :, t])
    assert torch.equal(got_k[:, 2], key[:, 2]) and torch.equal(got_v[:, 2], value[:, 2])  # the 16-bit head
    assert torch.allclose(got_k, naive_keys(key, [4, 2, 16], {0, 3}), atol=1e-5)  # scales over the other positions
    assert torch.allclose(got_v, naive_values(value, [4, 2, 16], {0, 3}), atol=1e-6)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_plan_at_16_bits_everywhere_equals_the_unquantized_model(models, kind):
    model = models[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
        with quantized(model, plan_config(plan_for(model, [[16, 16], [16, 16]], keep=(0,), budget=16))):
            assert torch.equal(model(ids).logits, reference)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_plans_equal_eager_attention_over_a_cache_holding_what_the_plan_says(models, kind, granularity):
    model = models[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    plan = plan_for(model, [[3, 6], [5, 2]], keep=(0, 4))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, cache=PlanCache(plan, granularity == "row"), use_cache=True).logits
        unquantized = model(ids).logits
        loading.prepare(model, tile_size=4)
        with quantized(model, plan_config(plan, granularity)):
            got = model(ids).logits
    assert not torch.allclose(reference, unquantized, atol=1e-3)  # the plan changes something
    assert torch.allclose(got, reference, atol=1e-4)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_uniform_plan_is_the_plain_kv_site(models, kind):
    model = models[kind]
    ids = torch.randint(0, PRESET.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with quantized(model, parse_config("absmax", 3, "kv")):
            plain = model(ids).logits
        with quantized(model, plan_config(plan_for(model, [[3, 3], [3, 3]], budget=3))):
            assert torch.equal(model(ids).logits, plain)


def test_effective_bits_by_hand(models):
    """Heads [[4, 2], [3, 3]], position 0 kept, 8 tokens: per head (16 + 7·b) / 8 = 5.5, 3.75, 4.625, 4.625,
    mean 4.625. With the second sequence padded to 5 tokens: (16 + 7b) + (16 + 4b) over 13 positions per head:
    (32 + 11·(4+2+3+3)) / 4 / 13 = (128 + 132) / 52 = 5.0."""
    model = models["standard"]
    plan = plan_for(model, [[4, 2], [3, 3]], keep=(0,), budget=3)
    assert plan.expected_bits(8) == pytest.approx(4.625)
    ids = torch.randint(0, PRESET.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad(), quantized(model, plan_config(plan)):
        model(ids)
        assert measured_bits(model) == pytest.approx(4.625)
    mask[1, 5:] = 0
    with torch.no_grad(), quantized(model, plan_config(plan)):
        model(ids, attention_mask=mask)
        assert measured_bits(model) == pytest.approx(5.0)


def calibration(masses: list[list[float]], kv_heads: int, share: dict[int, float] | None = None) -> KVCalibration:
    shape = {"kind": "standard", "layers": len(masses), "kv_heads": [kv_heads] * len(masses), "query_heads": len(masses[0]), "head_dim": 8}
    return KVCalibration(shape, masses, share or {}, {"source": "builtin:corpus-train"})


def test_per_head_policy_moves_bits_from_the_least_sinky_heads_to_the_sink_heads():
    # 4 query heads on 2 KV heads: KV head scores = max of pairs: layer 0 [0.9, 0.1], layer 1 [0.5, 0.05]
    plan = derive_plan(calibration([[0.9, 0.2, 0.1, 0.0], [0.5, 0.4, 0.05, 0.01]], kv_heads=2), "heads", 3)
    assert [l.kv_bits for l in plan.layers] == [(4, 2), (4, 2)]
    bits = [b for l in plan.layers for b in l.kv_bits]
    assert sum(bits) / len(bits) == 3 and plan.expected_bits(100) == 3
    three_sinks = derive_plan(calibration([[0.9, 0.2, 0.8, 0.0], [0.5, 0.4, 0.05, 0.01]], kv_heads=2), "heads", 4)
    assert [l.kv_bits for l in three_sinks.layers] == [(5, 4), (4, 3)]  # 3 sinks, 1 other head: one pair moves
    with pytest.raises(ConfigError, match="outside 2–16"):
        derive_plan(calibration([[0.9, 0.0, 0.0, 0.0]], kv_heads=2), "heads", 2)


def test_position_policies():
    cal = calibration([[0.9, 0.0]], kv_heads=1, share={0: 1.0, 7: 0.6, 9: 0.2})
    assert derive_plan(cal, "massive", 4).layers[0].keep_positions == (0, 7)  # at least half of the sequences
    assert derive_plan(cal, "first", 4, keep_first=3).layers[0].keep_positions == (0, 1, 2)
    assert derive_plan(cal, "uniform", 2).layers[0] == LayerPlan((2,), ())
    assert derive_plan(cal, "first", 4, keep_first=1).expected_bits(64) == pytest.approx((16 + 63 * 4) / 64)


def test_plan_json_round_trip_and_refusals(models, tmp_path):
    model = models["diff"]
    plan = plan_for(model, [[3, 6], [5, 2]], keep=(0,))
    assert KVPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert QuantConfig.from_dict(json.loads(json.dumps(plan_config(plan).to_dict()))) == plan_config(plan)
    with pytest.raises(ConfigError, match="kind differs"):
        with quantized(models["standard"], plan_config(plan)):
            pass
    wrong = dict(plan.to_dict(), layers=plan.to_dict()["layers"][:1])
    with pytest.raises(ConfigError, match="1 layer entries for a model of 2 layers"):
        KVPlan.from_dict(wrong)
    with pytest.raises(ConfigError, match="gives bits for 3 KV heads"):
        KVPlan.from_dict(dict(plan.to_dict(), layers=[{"kv_bits": [4, 4, 4]}, {"kv_bits": [4, 4]}]))
    with pytest.raises(ConfigError, match="version"):
        KVPlan.from_dict(dict(plan.to_dict(), version=99))


def test_cli_kv_plan_then_eval_applies_it_and_refuses_another_shape(tmp_path, capsys):
    out = tmp_path / "plan.json"
    main(["kv-plan", "bb/standard", "--policy", "first", "--bits", "3", "--calibration", "builtin:bigram-backcopy",
          "--calibration-tokens", "256", "--seq-len", "64", "--out", str(out), "--quiet"])
    data = json.loads(out.read_text())
    assert data["schema"] == "quantdiff.kv-plan" and data["version"] == 1 and data["layers"][0]["keep_positions"] == [0]
    result = tmp_path / "eval.json"
    main(["eval", "bb/standard", "--task", "bb", "--kv-plan", str(out), "--limit", "8", "--json", str(result), "--quiet"])
    [cell] = json.loads(result.read_text())["cells"]
    assert cell["site"] == "kv" and cell["bits"] == 3 and cell["kv_plan"]["policy"] == "first"
    assert 3 < cell["kv_plan"]["effective_bits"] <= 3 + 13 / 2  # position 0 of each ≥2-token sequence at 16 bits
    swept = tmp_path / "sweep.json"
    main(["sweep", "bb/standard", "--task", "bb", "--site", "kv", "--bits", "3", "--kv-plan", str(out), "--limit", "8", "--json", str(swept), "--quiet"])
    cells = json.loads(swept.read_text())["cells"]
    assert [(c["bits"], "kv_plan" in c) for c in cells] == [(None, False), (3, False), (3, True)]
    on_corpus = tmp_path / "corpus-plan.json"
    on_corpus.write_text(json.dumps({**data, "evidence": {**data["evidence"], "calibration": {"source": "builtin:corpus"}}}))
    with pytest.raises(SystemExit):
        main(["eval", "bb/standard", "--task", "lm", "--kv-plan", str(on_corpus), "--limit", "2"])
    assert "builtin:corpus is evaluation data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "bb/diff", "--task", "bb", "--kv-plan", str(out), "--limit", "8", "--quiet"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: kv plan is for a standard") and "kind differs" in lines[-1]
    with pytest.raises(SystemExit):
        main(["kv-plan", "bb/standard", "--policy", "heads", "--bits", "2", "--calibration", "builtin:bigram-backcopy", "--out", str(tmp_path / "h.json")])
    assert "outside 2–16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["kv-plan", "bb/standard", "--calibration", "builtin:corpus", "--out", str(tmp_path / "c.json")])
    with pytest.raises(SystemExit):
        main(["eval", "bb/standard", "--task", "bb", "--kv-plan", str(out), "--bits", "4"])


def test_calibration_locates_a_planted_massive_activation_and_the_sink_heads(models, tmp_path):
    """A hook adds 10⁴ to one channel of layer 0's output at position 2 of every sequence: only position 2 carries a
    massive activation. The sink masses are the statistics engine's own (`collect`), on the same sequences."""
    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.models.structure import decoder_layers
    from quantdiff.quant.kv_plan import calibrate_kv
    from quantdiff.quant.smoothing import Calibration
    from quantdiff.stats.collect import collect

    model = models["standard"]
    data = tmp_path / "calibration.jsonl"
    rows = torch.randint(0, PRESET.vocab_size, (6, 12), generator=torch.Generator().manual_seed(5)).tolist()
    data.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))

    def plant(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[:, 2, 3] += 1e4

    handle = decoder_layers(model)[0][1].register_forward_hook(plant)
    try:
        calibrated = calibrate_kv(model, None, Calibration(str(data), tokens=72, seq_len=12))
        batches = make_batches(load_sequences(str(data), None, 72, 12, PRESET.vocab_size), 4)
        sink_mass = collect(model, batches, k=1).stats.sinks.summary()["per_head"]
    finally:
        handle.remove()
    assert calibrated.massive_share == {2: 1.0}
    assert derive_plan(calibrated, "massive", 4).layers[1].keep_positions == (2,)
    assert calibrated.sink_mass == sink_mass
