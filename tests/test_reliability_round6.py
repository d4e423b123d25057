"""Issue 53's rules on plans, labels and value boundaries (round 6 of the bad-input probe), each tested as a rule
on more than the probe's example: every public number normalised once at the door, plans that carry their
calibration data's hash and a budget their layers keep, one non-finite guard, and cells labelled with what ran."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import quantdiff
from quantdiff.core.errors import ConfigError
from quantdiff.quant.kv_plan import KVCalibration, KVPlan, LayerPlan, derive_plan
from test_reliability import _fails
from test_reliability_round5 import _plan_document, _set  # a valid plan document, and a way to break one field


# ---- one boundary for numbers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    return quantdiff.load("tiny/standard", device="cpu")


@pytest.mark.parametrize("integer", [np.int16(4), np.uint8(4), np.int64(4)], ids=["int16", "uint8", "int64"])
def test_numpy_integers_become_ints_at_every_public_door(tiny_model, integer):
    """kv_cache's bits once reached generate as np.int16 (2 ** (bits - 1) overflowed there), parse_export's
    group_size the export as np.uint8 (64 * 4 wraps): both are Python ints once past the door."""
    cache = quantdiff.kv_cache(tiny_model, bits=integer, group_size=np.uint8(16))
    assert all(type(b) is int for layer in cache.layers for b in layer.plan.kv_bits)
    assert all(type(layer.layout.group_size) is int and layer.layout.group_size == 16 for layer in cache.layers)
    for fmt in (quantdiff.parse_export("absmax", integer, group_size=np.uint8(64)),
                quantdiff.parse_export("absmax", integer, format="compressed-tensors", group_size=np.uint8(64))):
        assert (fmt.bits, fmt.group_size) == (4, 64) and type(fmt.bits) is int and type(fmt.group_size) is int
    assert type(quantdiff.parse_export("absmax", 8, format="gguf").bits) is int
    ids = torch.tensor([[1, 2, 3, 4]])
    out = tiny_model.generate(ids, max_new_tokens=2, do_sample=False, cache=quantdiff.kv_cache(tiny_model, bits=integer))
    assert out.shape == (1, 6)


@pytest.mark.parametrize("call,named", [
    (lambda m: quantdiff.kv_cache(m, bits=True), "kv_cache(): bits"), (lambda m: quantdiff.kv_cache(m, bits=4, group_size=True), "kv_cache(): group_size"),
    (lambda m: quantdiff.parse_export("absmax", 4, group_size=True), "parse_export(): group_size"),
    (lambda m: quantdiff.parse_export("llm-int8", 8, threshold=True), "parse_export(): threshold"),
    (lambda m: quantdiff.collect_stats(m, torch.ones(1, 4, dtype=torch.long), k=True), "collect_stats(): k"),
    (lambda m: quantdiff.calibrated_configs([], m, None, bos_id=False), "calibrated_configs(): bos_id"),
], ids=["kv-bits", "kv-group", "export-group", "export-threshold", "stats-k", "bos-id"])
def test_a_bool_where_a_number_is_asked_is_refused_naming_the_parameter(tiny_model, call, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")) as info:
        call(tiny_model)
    assert "\n" not in str(info.value)


def test_the_export_formats_store_numpy_integers_as_ints():
    from quantdiff.quant.compressed_tensors import CompressedTensorsExport
    from quantdiff.quant.formats import AbsmaxExport
    from quantdiff.quant.gguf_format import GGUFExport

    for fmt in (AbsmaxExport(np.int8(4), np.uint8(64)), CompressedTensorsExport(np.int8(4), np.uint8(64))):
        assert type(fmt.bits) is int and type(fmt.group_size) is int
    assert type(GGUFExport(np.int64(8)).bits) is int
    with pytest.raises(ConfigError, match="AbsmaxExport: bits"):
        AbsmaxExport(True)


# ---- plans: strict field types, a budget the layers keep, the right flag -------------------------------------


@pytest.mark.parametrize("path,raw,named", [
    (("version",), "9" * 5000, "an integer of 5,000 digits is not a plan value"),
    (("layers", 0, "keep_positions"), "[" + "1" * 4400 + "]", "an integer of 4,400 digits"),
    (("version",), "1.0", "version 1.0 is not supported"),
    (("layers", 0, "layer"), "0.0", "layers[0].layer must be an integer"),
    (("layers", 1, "layer"), "true", "layers[1].layer must be an integer"),
], ids=["version-digits", "position-digits", "version-float", "layer-float", "layer-bool"])
def test_a_plan_field_of_the_wrong_json_type_is_one_line(tmp_path, path, raw, named):
    """`raw`: the field's JSON text as a hand-edited file holds it (Python will not print a 5,000-digit int)."""
    file = tmp_path / "p.json"
    file.write_text(json.dumps(_set(_plan_document(), path, "@raw@")).replace('"@raw@"', raw))
    with pytest.raises(ConfigError) as info:
        KVPlan.load(file)
    assert "\n" not in str(info.value) and named in str(info.value), info.value


@pytest.mark.parametrize("policy,bits,keep,named", [
    ("first", [[4, 4], [4, 4]], (0,), "average 4 bits, not its budget_bits 8"),  # the probe: budget 8, every head at 4
    ("heads", [[9, 8], [8, 8]], (), "average 8.25 bits, not its budget_bits 8"),
    ("massive", [[9, 7], [8, 8]], (3,), "policy massive holds every KV head at its budget of 8 bits"),
    ("uniform", [[8, 8], [8, 8]], (0,), "policy uniform keeps no position"),
    ("first", [[8, 8], [8, 8]], (1,), "policy first keeps the same first positions"),
], ids=["probe", "heads-average", "massive-mixed", "uniform-keeps", "first-not-a-prefix"])
def test_a_plan_whose_layers_do_not_keep_its_budget_is_refused_by_file_and_api(tmp_path, policy, bits, keep, named):
    doc = _plan_document()
    doc.update(policy=policy, budget_bits=8, layers=[{"layer": i, "kv_bits": row, "keep_positions": list(keep)} for i, row in enumerate(bits)])
    file = tmp_path / "p.json"
    file.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=named):
        KVPlan.load(file)
    with pytest.raises(ConfigError, match=named):
        KVPlan(policy, 8, doc["model"], tuple(LayerPlan(tuple(row), keep) for row in bits))


def test_every_policy_derives_a_plan_that_keeps_its_budget():
    """The rule is how plans are made: each policy's plan passes it (heads: sinks up a step, as many down)."""
    shape = {"kind": "standard", "layers": 2, "kv_heads": [2, 2], "query_heads": 2, "head_dim": 32}
    calibrated = KVCalibration(shape, [[0.9, 0.1], [0.5, 0.0]], {0: 1.0, 3: 0.7}, {"source": "builtin:corpus-train", "seq_len": 64})
    for policy in ("uniform", "first", "massive", "heads"):
        plan = derive_plan(calibrated, policy, 4, keep_first=2)
        heads = [b for layer in plan.layers for b in layer.kv_bits]
        assert sum(heads) == 4 * len(heads), policy
    assert [layer.kv_bits for layer in derive_plan(calibrated, "heads", 4).layers] == [(5, 3), (5, 3)]


@pytest.mark.parametrize("single", [True, False], ids=["file", "directory"])
def test_kv_plan_over_a_users_file_names_out_before_calibrating(tmp_path, capsys, monkeypatch, single):
    import quantdiff.jobs.kv_plan as job

    monkeypatch.setattr(job, "calibrate_kv", lambda *a, **k: pytest.fail("calibrated before checking --out"))
    out = tmp_path / ("plan.json" if single else "plans")
    target = out if single else out / "first-4bit.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("the user's")
    argv = ["kv-plan", "bb/standard", "--out", out] + ([] if single else ["--bits", "4,8"])
    assert f"--out {target} exists and was not written by quantdiff" in _fails(capsys, argv)
    assert target.read_text() == "the user's"


# ---- provenance by content ----------------------------------------------------------------------------------


TEXT = "The calibration text of this test, which no task evaluates. " * 40


@pytest.fixture(scope="module")
def plan_from_a_file(tmp_path_factory):
    """A plan made by kv-plan in its own directory, from the relative path data.txt: (directory, plan file)."""
    import os

    here = tmp_path_factory.mktemp("made")
    (here / "data.txt").write_text(TEXT)
    before = os.getcwd()
    os.chdir(here)
    try:
        from quantdiff.cli.app import main

        main(["kv-plan", "tiny/standard", "--calibration", "data.txt", "--calibration-tokens", "128", "--seq-len", "32",
              "--out", "plan.json", "--quiet", "--device", "cpu"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    finally:
        os.chdir(before)
    return here, here / "plan.json"


def test_a_plan_records_the_sha256_of_its_calibration_file(plan_from_a_file):
    import hashlib

    here, plan = plan_from_a_file
    record = json.loads(plan.read_text())["evidence"]["calibration"]
    assert record["source"] == "data.txt" and record["sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()


@pytest.mark.parametrize("evaluated", ["the-same-path-elsewhere", "symlink", "copy"])
def test_a_plan_calibrated_on_the_evaluated_bytes_is_refused_wherever_they_lie(plan_from_a_file, tmp_path, monkeypatch, capsys, evaluated):
    """The probe's three escapes: the plan made in another directory (its relative path names another file here),
    a symlink's name, a byte copy. Each is the evaluation data by content."""
    here, plan = plan_from_a_file
    monkeypatch.chdir(tmp_path)
    if evaluated == "the-same-path-elsewhere":
        Path("data.txt").write_text("other text entirely, " * 40)  # what the plan's path names from here: not the data
        data = here / "data.txt"
    elif evaluated == "symlink":
        data = tmp_path / "link.txt"
        data.symlink_to(here / "data.txt")
    else:
        data = tmp_path / "copy.txt"
        data.write_bytes((here / "data.txt").read_bytes())
    line = _fails(capsys, ["eval", "tiny/standard", "--task", "lm", "--data", data, "--kv-plan", plan])
    assert "its calibration holds the same bytes as the evaluation data" in line
    other = tmp_path / "other.txt"
    other.write_text(TEXT + "one more sentence.")
    from quantdiff.cli.transform_options import load_kv_plans

    assert len(load_kv_plans([plan], other)) == 1  # other bytes: the plan applies


def test_smoothing_calibrated_on_a_copy_of_the_evaluated_bytes_is_refused(tmp_path, capsys):
    data, copy = tmp_path / "eval.txt", tmp_path / "calibration.txt"
    data.write_text(TEXT)
    copy.write_text(TEXT)
    line = _fails(capsys, ["eval", "tiny/standard", "--task", "lm", "--data", data, "--bits", "8", "--site", "linear", "--smooth", "0.5", "--calibration", copy])
    assert "--calibration holds the same bytes as the evaluation data" in line


def test_a_plan_from_a_file_without_its_sha256_is_refused(plan_from_a_file, tmp_path, capsys):
    _, plan = plan_from_a_file
    doc = json.loads(plan.read_text())
    del doc["evidence"]["calibration"]["sha256"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    line = _fails(capsys, ["eval", "tiny/standard", "--task", "lm", "--kv-plan", old])
    assert "without recording its sha256" in line
    doc["evidence"]["calibration"]["sha256"] = "abc"
    old.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="evidence.calibration.sha256 must be the 64 hex digits"):
        KVPlan.load(old)


# ---- one non-finite guard -----------------------------------------------------------------------------------


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"], ids=["some-nan", "all-nan"])
def test_kv_plan_refuses_to_derive_a_plan_from_non_finite_activations(tmp_path, capsys, tensor):
    """The probe: NaN attention logits dropped out of every sink mass, which read 0.0, and the plan was written."""
    from test_bad_input import _nan_model

    src, out = _nan_model(tmp_path, tensor), tmp_path / "plan.json"
    line = _fails(capsys, ["kv-plan", src, "--calibration", "builtin:corpus-train", "--calibration-tokens", "128", "--seq-len", "32", "--out", out])
    assert "were non-finite" in line and "(" in line and "NaN" in line and "a kv plan (sink masses, massive positions) would be derived from them" in line
    assert not out.exists()


@pytest.mark.slow(seconds=8)
def test_smoothing_refuses_scales_from_non_finite_linear_inputs(tmp_path, capsys):
    from test_bad_input import _nan_model

    src = _nan_model(tmp_path, "model.embed_tokens.weight")
    line = _fails(capsys, ["eval", src, "--task", "lm", "--limit", "1", "--bits", "8", "--site", "linear", "--smooth", "0.5", "--calibration-tokens", "128"])
    assert "linear inputs were non-finite" in line and "smoothing scales (channel maxima) would be derived from them" in line


def test_the_linear_inputs_count_nan_and_inf_among_observed_positions_only():
    from quantdiff.stats.channels import ChannelStats

    stats = ChannelStats.empty(1, 3)
    x = torch.tensor([[1.0, float("nan"), float("-inf")], [float("nan"), float("inf"), 2.0], [float("nan")] * 3])
    stats.update(0, 1, x, valid=torch.tensor([True, True, False]))  # the third position is padding
    assert (int(stats.nan[0, 1]), int(stats.inf[0, 1]), int(stats.finite[0, 1])) == (2, 2, 2)
    assert float(stats.input_absmax[0, 1].max()) == 2.0
    back = ChannelStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert torch.equal(back.nan, stats.nan) and torch.equal(back.inf, stats.inf)
    merged = ChannelStats.empty(1, 3).merge(stats).merge(back)
    assert int(merged.nan[0, 1]) == 4


def test_stats_eval_and_calibration_say_it_in_the_guards_words():
    from quantdiff.stats.nonfinite import NonFinite, split

    assert split("hidden states", 3, 1, 396).text() == "1.0% of hidden states were non-finite (3 NaN, 1 Inf)"
    assert NonFinite("scored positions' logits", 12).text() == "12 scored positions' logits were non-finite"


# ---- labels that tell the truth -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_tensor_export(tmp_path_factory):
    """tiny/standard exported with 8-bit weights and a recorded NON-CAUSAL kv quantization (4 bits, KIVI)."""
    from quantdiff.cli.app import main

    out = tmp_path_factory.mktemp("export") / "kv-tensor"
    try:
        main(["quantize", "tiny/standard", "--bits", "8", "--attention-bits", "4", "--attention-site", "kv", "--attention-granularity", "tensor",
              "--out", str(out), "--quiet"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    return out


@pytest.mark.slow(seconds=8)
def test_a_cell_of_an_export_says_what_its_recorded_quantizer_ran(kv_tensor_export, tmp_path, capsys):
    """The probe: such an export evaluated as "method": null, "causal": true."""
    from quantdiff.cli.app import main

    out = tmp_path / "cells.json"
    main(["eval", str(kv_tensor_export), "--task", "lm", "--limit", "1", "--json", str(out)])
    [cell] = json.loads(out.read_text())["cells"]
    assert (cell["method"], cell["bits"], cell["site"], cell["granularity"], cell["causal"]) == ("absmax", 4, "kv", "tensor", False)
    assert cell["recorded"] == [{"method": "absmax", "bits": 4, "site": "kv", "granularity": "tensor"}]
    assert "absmax 4b @kv [tensor, non-causal] (recorded in the export)" in capsys.readouterr().out  # the table keeps the brackets
    main(["eval", str(kv_tensor_export), "--task", "lm", "--limit", "1", "--bits", "8", "--json", str(out), "--force"])
    [cell] = json.loads(out.read_text())["cells"]  # a causal cell of its own on top: still not causal
    assert (cell["method"], cell["site"], cell["granularity"], cell["causal"]) == ("absmax", "logits", "row", False)


@pytest.mark.slow(seconds=2)
def test_the_exports_recorded_kv_quantizer_is_named_when_it_blocks_site_kv(kv_tensor_export, capsys):
    line = _fails(capsys, ["eval", kv_tensor_export, "--task", "lm", "--limit", "1", "--bits", "4", "--site", "kv"])
    assert "its export records absmax 4b @kv [tensor, non-causal] (config.json quantization_config.attention)" in line
    assert "already has" not in line


def test_every_run_time_quantizer_an_export_records_is_described():
    from quantdiff.quant.checkpoint import recorded_quantization

    llm_int8 = recorded_quantization({"method": "llm-int8", "threshold": 6.0})
    assert llm_int8 == [{"method": "llm-int8", "bits": 8, "site": "linear", "granularity": "tensor"}]  # bitsandbytes: over the prompt
    attention = quantdiff.parse_config("absmax", 6, "qk", "row").to_dict()
    w8a8 = recorded_quantization({"method": "compressed-tensors", "bits": 8, "attention": attention})
    assert w8a8 == [{"method": "compressed-tensors", "bits": 8, "site": "linear", "granularity": "row"},
                    {"method": "absmax", "bits": 6, "site": "qk", "granularity": "row"}]
    assert recorded_quantization({"method": "absmax", "bits": 4}) == []


def test_a_cell_is_causal_only_when_every_quantizer_that_ran_is():
    from quantdiff.eval.sweep import Cell, cell_label, cells_from_json

    recorded = [{"method": "llm-int8", "bits": 8, "site": "linear", "granularity": "tensor"}]
    own = Cell("m", "lm", "absmax", 8, "logits", {"loss": 1.0}, granularity="row", recorded=recorded)
    assert own.causal is False and own.to_dict()["causal"] is False
    assert cell_label(own) == "absmax 8b @logits + llm-int8 8b @linear [tensor, non-causal] (recorded in the export)"
    [back] = cells_from_json({"cells": [own.to_dict()]})
    assert back == own
    assert Cell("m", "lm", "absmax", 8, "logits", granularity="row").causal is True


def test_eval_refuses_a_granularity_without_bits(capsys):
    line = _fails(capsys, ["eval", "tiny/standard", "--task", "lm", "--granularity", "tensor"])
    assert "--granularity" in line and "give --bits too" in line


# ---- the lm default context ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """tiny/standard with 128 positions (the shipped tiny's own since issue 54, set here all the same)."""
    import shutil

    from quantdiff.models.names import ASSETS

    out = tmp_path_factory.mktemp("short") / "m128"
    shutil.copytree(ASSETS / "tiny" / "standard", out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow(seconds=4)
def test_the_lm_default_context_fits_the_fewest_positions_of_the_models(short_model, tmp_path, capsys):
    """The default 256 once refused a 128-position model ("use at most 128") although no --context was given;
    beside a 256-position model, both get windows of 128, so their cells compare."""
    from quantdiff.cli.app import main
    from quantdiff.cli.task_options import fit_default_context
    from quantdiff.eval.tasks.lm import LMTask
    from quantdiff.models.names import ASSETS

    out = tmp_path / "cells.json"
    main(["eval", str(short_model), "--task", "lm", "--limit", "1", "--json", str(out), "--quiet"])
    assert json.loads(out.read_text())["cells"][0]["tokens"] == 127  # one window of 128 tokens: 127 scored
    long = tmp_path / "m256"  # the same weights with 256 positions (RoPE: the weights do not depend on it)
    shutil.copytree(ASSETS / "tiny" / "standard", long)
    (long / "config.json").write_text(json.dumps({**json.loads((long / "config.json").read_text()), "max_position_embeddings": 256}))
    both = [("short", short_model), ("long", long)]
    assert fit_default_context(LMTask(), None, both).context == 128
    assert fit_default_context(LMTask(context=64), 64, both).context == 64  # given: kept
    assert fit_default_context(LMTask(), None, both[1:]).context == 256
    line = _fails(capsys, ["eval", short_model, "--task", "lm", "--context", "200"])
    assert "200 tokens exceeds the model's 128 positions" in line


def test_a_plan_given_through_the_api_with_a_huge_integer_is_one_line():
    """Past the file reader's digit bound (a dict from the caller), no message may print the integer itself."""
    for path in (("version",), ("policy",), ("layers", 0, "layer"), ("budget_bits",), ("model", "kind")):
        with pytest.raises(ConfigError, match="an integer of 16,610 bits") as info:
            KVPlan.from_dict(_with(path, 10**5000))
        assert "\n" not in str(info.value)


def _with(path: tuple, value) -> dict:
    """A fresh `_plan_document()` with one field set in place to `value` (`_set`'s JSON round trip cannot print it)."""
    from functools import reduce

    doc = _plan_document()
    reduce(lambda node, key: node[key], path[:-1], doc)[path[-1]] = value
    return doc


@pytest.mark.slow(seconds=3)
def test_the_api_names_the_exports_record_when_it_holds_the_site(kv_tensor_export):
    model = quantdiff.load(kv_tensor_export, device="cpu")
    for config in (quantdiff.parse_config("absmax", 4, "kv"), quantdiff.QuantConfig(quantdiff.AbsmaxMethod(4), quantdiff.KVSite(_plan_for(model)))):
        with pytest.raises(ConfigError, match="the model's export records absmax 4-bit at site kv, re-applied on load"):
            with quantdiff.quantized(model, config):
                pass
    with quantdiff.quantized(model, quantdiff.parse_config("absmax", 4, "logits")):  # another site: free
        pass


def _plan_for(model) -> KVPlan:
    from quantdiff.quant.kv_plan import model_shape

    shape = model_shape(model.config)
    return KVPlan("uniform", 4, shape, tuple(LayerPlan((4,) * heads) for heads in shape["kv_heads"]))
