"""Real pretrained models (the built-ins `smollm2`, SmolLM2-135M-Instruct, and `gemma3`, Gemma 3 270M with BOS
first) against independent computations.

transformers' own eager model, hooked, is the reference for the statistics: the hidden-state Top-1 (value, layer,
position, channel) from forward hooks on the decoder layers (`output_hidden_states[-1]` would be after the final
norm), the sink score from eager attention weights, and the LLM.int8 outlier features from the inputs of
q_proj and gate_proj. The quantization results are checked where the real model shows them: absmax 8-bit on
the linear layers loses to LLM.int8 by more than the sampling error, and exports reload to the sweep's figures.
One quantdiff-loaded model and one measurement are shared by the whole module.
"""

from __future__ import annotations

import math

import pytest
import torch

from quantdiff.cli.app import main
from quantdiff.data.sources import make_batches
from quantdiff.jobs.real_model import RealModelPlan, measure
from quantdiff.quant.checkpoint import load, load_quantized
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, fake_quant_weight, linear_targets
from quantdiff.report.numbers import number
from quantdiff.report.real_model import binomial_error, real_models_markdown
from quantdiff.stats.collect import collect_stats
from quantdiff.stats.histogram import QUANTILE_RELATIVE_ERROR
from quantdiff.stats.massive import massive_activation
from tests.once import computed_once

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the city begins with a small settlement on the river, where farmers traded grain and wool. "
    "Over the centuries the market grew, a bridge was built, and merchants from distant towns arrived each spring. "
    "By the time the railway came, the old walls had been pulled down and the streets filled with new houses, "
    "schools and workshops, while the river carried coal and timber to the sea."
)
SEQ = 38
# reference + absmax/LLM.int8 8-bit @linear, at the published (non-causal, per-sequence) scales: the LLM.int8 paper's
# result below, and what an llm-int8 export reloads to (bitsandbytes picks a forward's outlier columns over its tokens).
# 4 lm windows of 256 tokens (the report's 8 halved, for the suite's time): absmax 8-bit loses 0.061 in accuracy
# to LLM.int8 there, against two standard errors of 0.039 (0.056 on 8 windows), and the weight-only rows stay far
# apart (perplexity 50 against 80); the exports' reload checks are exact at any size.
PLAN = RealModelPlan(stats_tokens=256, seq_len=128, windows=4, bits=(8,), sites=("linear",), granularity="tensor")


@pytest.fixture(scope="module")
def real(smollm2_dir):
    """(model on the quantdiff backend, tokenizer, directory)."""
    from quantdiff.models.loading import load_tokenizer

    return load(smollm2_dir, device="cpu"), load_tokenizer(smollm2_dir), smollm2_dir


@pytest.fixture(scope="module")
def measured(real, tmp_path_factory):
    """The real-model measurement, made once for the run whichever workers run the tests that read it."""
    model, tokenizer, path = real
    return computed_once(tmp_path_factory, "smollm2-measured", lambda: measure(model, tokenizer, "smollm2", str(path), PLAN))


@pytest.fixture(scope="module")
def fixed_ids(real):
    ids = real[1](TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2 * SEQ
    return [ids[:SEQ], ids[SEQ : 2 * SEQ]]


def capture_eager(path, ids: list[list[int]]):
    """transformers' eager model on `ids`: decoder-layer outputs, q_proj/gate_proj inputs, attention weights."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    layers = reference.model.layers
    hidden, inputs = {}, {}
    handles = [layer.register_forward_hook(lambda _m, _a, out, i=i: hidden.__setitem__(i, out[0] if isinstance(out, tuple) else out))
               for i, layer in enumerate(layers)]
    for i, layer in enumerate(layers):
        for which, linear in enumerate((layer.self_attn.q_proj, layer.mlp.gate_proj)):
            handles.append(linear.register_forward_pre_hook(lambda _m, args, key=(i, which): inputs.__setitem__(key, args[0])))
    with torch.no_grad():
        out = reference(torch.tensor(ids), output_attentions=True)
    for handle in handles:
        handle.remove()
    return torch.stack([hidden[i] for i in range(len(layers))]), inputs, torch.stack(out.attentions), len(layers)


@pytest.fixture(scope="module")
def eager_capture(real, fixed_ids):
    return capture_eager(real[2], fixed_ids)


@pytest.fixture(scope="module")
def our_stats(real, fixed_ids):
    return collect_stats(real[0], make_batches(fixed_ids, 2))


def _check_against_eager(stats, capture) -> tuple[tuple[int, int, int, int], float, dict]:
    """Our hidden-state Top-1 (value, location, its layer's median) and sink statistics equal eager's; returns
    eager's Top-1 location, value, and our sink summary."""
    hidden, _, attentions, _ = capture  # (L, B, T, D), _, (L, B, H, T, T)
    magnitude = hidden.abs()
    value = magnitude.max()
    layer, sequence, position, channel = (int(i) for i in torch.nonzero(magnitude == value)[0])
    summary = stats.summary()
    top = summary["hidden_states"]["topk"][0]
    assert top["value"] == pytest.approx(float(value), rel=1e-4)
    assert (top["layer"], top["sequence"], top["position"], top["channel"]) == (layer, sequence, position, channel)
    massive = massive_activation(summary["hidden_states"])
    exact_median = float(magnitude[layer].double().median())
    assert massive["layer_median"] == pytest.approx(exact_median, rel=QUANTILE_RELATIVE_ERROR + 1e-4)

    mass = attentions[..., 0].mean(dim=-1).mean(dim=1)  # (L, H): attention on position 0, averaged over queries and sequences
    sinks = stats.sinks.summary()
    assert torch.allclose(torch.tensor(sinks["per_head"], dtype=torch.float64), mass.double(), atol=1e-4)
    assert sinks["score"] == float((mass > sinks["epsilon"]).double().mean())
    return (layer, sequence, position, channel), float(value), sinks


def test_hidden_top1_and_sink_score_equal_eager_hooks(our_stats, eager_capture):
    _, value, sinks = _check_against_eager(our_stats, eager_capture)
    massive = massive_activation(our_stats.summary()["hidden_states"])
    assert massive["massive"] and massive["first_position"] and value > 1e4  # SmolLM2's textbook massive activation
    assert 0.2 < sinks["score"] < 0.9


def test_outlier_features_equal_a_count_at_the_linear_inputs(our_stats, eager_capture):
    _, inputs, _, layers = eager_capture

    def holds(layer: int) -> torch.Tensor:  # (D,) bool: ≥ 6% of the positions of either input reach |x| ≥ 6
        return torch.stack([(inputs[layer, w].abs() >= 6).float().reshape(-1, inputs[layer, w].shape[-1]).mean(0) >= 0.06 for w in (0, 1)]).any(0)

    counts = torch.stack([holds(l) for l in range(layers)]).sum(0)
    expected = torch.nonzero(counts >= 0.25 * layers).view(-1).tolist()
    features = our_stats.summary()["linear_inputs"]["outlier_features"]
    assert features["channels"] == expected
    assert 1 <= features["count"] <= 8  # a handful, where the residual stream would give all 576


def _cell(measured: dict, method: str | None, bits: int | None = None) -> dict:
    return next(c for c in measured["cells"] if c["method"] == method and c["bits"] == bits)


def test_absmax_8bit_linear_loses_to_llm_int8_beyond_sampling_error(measured):
    absmax, int8 = _cell(measured, "absmax", 8), _cell(measured, "llm-int8", 8)
    error = math.hypot(binomial_error(absmax["accuracy"], absmax["tokens"]), binomial_error(int8["accuracy"], int8["tokens"]))
    assert int8["accuracy"] - absmax["accuracy"] > 2 * error
    assert int8["perplexity"] < absmax["perplexity"]


def _lm_loss(model, tokenizer) -> dict:
    from quantdiff.eval.tasks.registry import make_task

    task = make_task("lm", tokens=PLAN.windows * PLAN.context, context=PLAN.context)
    return task.evaluate(model, task.prepare(tokenizer, PLAN.windows))


def test_llm_int8_export_reloads_to_the_sweeps_figure(real, measured, tmp_path):
    main(["quantize", "smollm2", "--bits", "8", "--method", "llm-int8", "--out", str(tmp_path / "int8")])
    reloaded = _lm_loss(load_quantized(tmp_path / "int8"), real[1])
    assert reloaded["loss"] == pytest.approx(_cell(measured, "llm-int8", 8)["loss"], rel=1e-4)


def test_groupwise_export_reloads_exactly_beside_per_channel_and_nf4(real, measured, tmp_path):
    model, tokenizer, _ = real
    main(["quantize", "smollm2", "--bits", "4", "--group-size", "128", "--out", str(tmp_path / "g128")])
    reloaded = load_quantized(tmp_path / "g128")
    params = dict(reloaded.named_parameters())
    method = AbsmaxMethod(4, weight_group_size=128)
    for fqn, module in linear_targets(model, LinearSite()):  # widths 576 and 1536: 576 ends in a group of 64
        assert torch.equal(params[f"{fqn}.weight"], fake_quant_weight(module.weight, method)), fqn
    rows = {row["granularity"]: row for row in measured["weight_only"]}
    assert set(rows) == {"per-output-channel", "group-128", "blockwise-64"}
    assert _lm_loss(reloaded, tokenizer)["perplexity"] == pytest.approx(rows["group-128"]["perplexity"], rel=1e-5)
    section = real_models_markdown([measured])  # the report shows the three side by side
    for row in rows.values():
        assert f"| {row['granularity']} | {number(row['perplexity'])} |" in section, row["granularity"]
    assert rows["blockwise-64"]["perplexity"] < rows["per-output-channel"]["perplexity"]


# Gemma 3 270M, measured as it was trained: BOS first (its GGUF's add_bos_token).


@pytest.fixture(scope="module")
def gemma(gemma3_dir):
    """(model on the quantdiff backend, tokenizer, directory, its BOS id as quantdiff decides it)."""
    from quantdiff.models.bos import decide_bos
    from quantdiff.models.loading import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    return load(gemma3_dir, device="cpu"), tokenizer, gemma3_dir, decide_bos(gemma3_dir, tokenizer).token_id


@pytest.fixture(scope="module")
def gemma_ids(gemma):
    ids = gemma[1](TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2 * SEQ
    return [[gemma[3], *ids[: SEQ - 1]], [gemma[3], *ids[SEQ - 1 : 2 * SEQ - 2]]]


def test_gemma_top1_and_sink_score_with_bos_equal_eager_hooks(gemma, gemma_ids):
    assert gemma[3] == 2  # <bos>, from the GGUF's tokenizer.ggml.add_bos_token
    ours = collect_stats(gemma[0], make_batches(gemma_ids, 2))
    (layer, _, position, channel), value, sinks = _check_against_eager(ours, capture_eager(gemma[2], gemma_ids))
    # The BOS state depends on BOS alone: the same massive activation in every window, as measured over 256-token ones.
    assert (layer, position, channel) == (14, 0, 163) and value == pytest.approx(103_794.86, rel=1e-4)
    assert sinks["score"] > 0.3
    without = collect_stats(gemma[0], make_batches([row[1:] for row in gemma_ids], 2)).sinks.summary()
    assert without["mean"] < sinks["mean"] / 2  # without BOS the attention parked on position 0 mostly goes


def test_gemma_continues_common_patterns_with_bos_first(gemma):
    """A base model of 270M parameters: with BOS first it continues lists and analogies as a trained LM does."""
    model, tokenizer, _, bos = gemma
    assert model.config._attn_implementation == "quantdiff"
    for prompt, expected in (("The capital of France is Paris. The capital of Germany is", "Berlin"), ("Monday, Tuesday, Wednesday,", "Thursday")):
        ids = torch.tensor([[bos, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]])
        with torch.no_grad():
            logits = model(ids).logits
        assert tokenizer.decode(logits[0, -1].argmax()).strip() == expected, prompt
