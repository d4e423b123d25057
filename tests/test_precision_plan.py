"""Mixed-precision plans (quant/precision_plan.py): the knapsack against brute force, the file's round trip and
its refusals, a plan applied in eval/sweep against its per-width configs applied by hand, and the CLI's refusals."""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

import quantdiff
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError
from quantdiff.quant.precision_plan import APPROXIMATION, PrecisionPlan, allocate, load_plan, planned_config, save_plan
from quantdiff.quant.sites import apply_quantization, parse_config, quantized

CALIBRATION = {"source": "builtin:corpus-train", "tokens": 64, "seq_len": 32, "bos": True, "tokens_sha256": "0" * 64}


def _plan(bits=(8, 4, 4, 4), layers: int | None = None, **changes) -> PrecisionPlan:
    fields = {"model": {"name": "tiny/diff", "decoder_layers": len(bits) if layers is None else layers}, "method": "absmax", "site": "linear",
              "granularity": "row", "budget_bits": 5.0, "candidates": (4, 8), "bits": tuple(bits), "predicted_kld_mean": 0.01,
              "measured_kld_mean": 0.011, "calibration": dict(CALIBRATION)}
    return PrecisionPlan(**{**fields, **changes})


def _fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    assert exc.value.code not in (0, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error:") and "Traceback" not in "\n".join(lines)
    return lines[-1]


# ---- the knapsack -------------------------------------------------------------------------------------------


def _brute_force(damage, budget):
    """Every assignment of widths, the least summed damage with mean width ≤ budget (the reference)."""
    n = len(damage)
    feasible = [sum(d[b] for d, b in zip(damage, combo)) for combo in itertools.product(*[sorted(d) for d in damage]) if sum(combo) <= budget * n + 1e-9]
    return min(feasible)


@pytest.mark.parametrize("seed", range(40))
def test_the_knapsack_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    candidates = sorted(rng.sample([2, 3, 4, 6, 8, 16], rng.randint(2, 3)))
    n = rng.randint(1, 6)
    damage = [{b: rng.random() / b for b in candidates} for _ in range(n)]
    budget = rng.uniform(candidates[0], candidates[-1])
    widths = allocate(damage, budget)
    assert len(widths) == n and all(w in candidates for w in widths)
    assert sum(widths) <= budget * n + 1e-9
    assert sum(d[w] for d, w in zip(damage, widths)) == pytest.approx(_brute_force(damage, budget), rel=1e-12)


def test_the_knapsack_protects_the_most_damaging_layer_and_refuses_an_impossible_budget():
    damage = [{4: 0.1, 8: 0.0}, {4: 5.0, 8: 0.1}, {4: 0.2, 8: 0.0}]
    assert allocate(damage, 16 / 3) == [4, 8, 4]  # one layer at 8 bits fits: the one that costs most at 4
    assert allocate(damage, 4) == [4, 4, 4]
    with pytest.raises(ConfigError, match="below"):
        allocate(damage, 3.9)


# ---- the file -----------------------------------------------------------------------------------------------


def test_a_plan_round_trips_and_describes_itself(tmp_path):
    plan = _plan()
    save_plan(plan, tmp_path / "p.json")
    back = load_plan(tmp_path / "p.json")
    assert back == plan
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["schema"] == "quantdiff.precision-plan" and doc["version"] == 1 and doc["approximation"] == APPROXIMATION
    assert doc["average_bits"] == 5.0 and doc["layers"][0] == {"layer": 0, "bits": 8}
    assert back.bits_per_layer() == {0: 8, 1: 4, 2: 4, 3: 4}
    assert [(c.method.bits, c.layers) for c in back.configs()] == [(4, (1, 2, 3)), (8, (0,))]
    assert quantdiff.load_plan is load_plan


def _document():
    return _plan().to_dict()


MALFORMED = [
    (lambda d: d.update(schema="quantdiff.kv-plan"), "schema"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(extra=1), "unknown field extra"),
    (lambda d: d.pop("measured_kld_mean"), "measured_kld_mean is missing"),
    (lambda d: d.update(model="tiny"), "model must be an object"),
    (lambda d: d["model"].update(name=""), "model.name"),
    (lambda d: d["model"].update(decoder_layers=0), "model.decoder_layers"),
    (lambda d: d.update(method="gptq"), "method must be"),
    (lambda d: d.update(site="mlp"), "site must be"),
    (lambda d: d.update(granularity="block"), "granularity must be"),
    (lambda d: d.update(candidates=[]), "candidates must be"),
    (lambda d: d.update(candidates=[8, 4]), "candidates must be distinct"),
    (lambda d: d.update(candidates=[4, 32]), "candidates[1]"),
    (lambda d: d.update(budget_bits="5"), "budget_bits must be"),
    (lambda d: d.update(budget_bits=9), "budget_bits must be from the narrowest"),
    (lambda d: d.update(average_bits=4.5), "average_bits 4.5 is not the layers' mean"),
    (lambda d: d.update(budget_bits=4.5, average_bits=5.0), "over budget_bits"),
    (lambda d: d.update(layers=d["layers"][:3]), "layers must be a list of 4 entries"),
    (lambda d: d["layers"][1].update(layer=0), "names layer 0 again"),
    (lambda d: d["layers"][1].update(layer=7), "layers[1].layer"),
    (lambda d: d["layers"][1].update(bits=6), "layers[1].bits"),
    (lambda d: d["layers"][1].update(bits=4.0), "layers[1].bits"),
    (lambda d: d["layers"][1].update(extra=1), "unknown field layers[1].extra"),
    (lambda d: d.update(approximation="none"), "approximation"),
    (lambda d: d.update(predicted_kld_mean=-1), "predicted_kld_mean"),
    (lambda d: d.update(measured_kld_mean=None), "measured_kld_mean"),
    (lambda d: d["calibration"].update(tokens_sha256="xyz"), "calibration.tokens_sha256"),
    (lambda d: d["calibration"].update(bos="yes"), "calibration.bos"),
    (lambda d: d["calibration"].update(tokens=0), "calibration.tokens"),
    (lambda d: d["calibration"].update(source="cal.txt"), "calibration.sha256 is missing"),
    (lambda d: d.update(method="llm-int8", site="logits"), "llm-int8"),
]


@pytest.mark.parametrize(("mutate", "named"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_every_malformed_field_is_refused_by_name(tmp_path, mutate, named):
    doc = copy.deepcopy(_document())
    mutate(doc)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as exc:
        load_plan(path)
    assert named in str(exc.value) and "\n" not in str(exc.value)


def test_files_that_are_not_plans_are_refused_in_one_line(tmp_path):
    for text, named in (('{"schema": 1, "schema": 2}', "given twice"), ("{", "not valid JSON"), ("[1]", "not a precision plan")):
        (tmp_path / "p.json").write_text(text)
        with pytest.raises(ConfigError, match=named):
            load_plan(tmp_path / "p.json")
    (tmp_path / "b.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_plan(tmp_path / "b.json")


# ---- applied ------------------------------------------------------------------------------------------------


def test_a_plan_applies_as_its_per_width_configs_by_hand():
    model = quantdiff.load("tiny/diff", device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    plan = _plan(bits=(4, 8, 8, 4), budget_bits=6.0)
    with torch.inference_mode():
        with quantized(model, planned_config(plan)):  # as eval and sweep apply it
            planned = model(input_ids=ids).logits
        handles = [apply_quantization(model, parse_config("absmax", 8, "linear", layers=[1, 2])),
                   apply_quantization(model, parse_config("absmax", 4, "linear", layers=[0, 3]))]
        by_hand = model(input_ids=ids).logits
        for handle in handles:
            handle.remove()
        full = model(input_ids=ids).logits
        uniform = [quantdiff.damage(model, ids, parse_config("absmax", b, "linear"))["kld_mean"] for b in (4, 8)]
    assert torch.equal(planned, by_hand) and not torch.equal(planned, full)
    mixed = quantdiff.damage(model, ids, plan)["kld_mean"]
    assert uniform[1] < mixed < uniform[0]
    with torch.inference_mode(), quantdiff.quantized(model, plan):  # the public API takes the plan itself
        assert torch.equal(model(input_ids=ids).logits, planned)
    with pytest.raises(ConfigError, match="sets 5 decoder layers: the model has 4"):
        quantdiff.apply_quantization(model, _plan(bits=(4, 4, 4, 4, 8), budget_bits=6.0))


@pytest.mark.slow(seconds=6)
def test_eval_with_a_plan_equals_the_per_width_configs_applied_by_hand(tmp_path):
    from quantdiff.cli.task_options import make_cli_task
    from quantdiff.models.bos import decide_bos
    from quantdiff.models.names import resolve_models

    plan = _plan(bits=(4, 8, 4, 4))
    save_plan(plan, tmp_path / "p.json")
    main(["eval", "tiny/diff", "--task", "lm", "--limit", "2", "--context", "64", "--plan", str(tmp_path / "p.json"), "--json", str(tmp_path / "e.json"), "--quiet"])
    [cell] = json.loads((tmp_path / "e.json").read_text())["cells"]
    assert (cell["method"], cell["bits"], cell["site"], cell["granularity"]) == ("absmax", 5.0, "linear", "row")
    assert cell["precision_plan"]["bits_per_layer"] == [4, 8, 4, 4] and cell["precision_plan"]["average_bits"] == 5.0
    from quantdiff.eval.sweep import cell_label, cells_from_json

    [back] = cells_from_json({"cells": [cell]})
    assert back.precision_plan == cell["precision_plan"] and cell_label(back) == "absmax plan 5b avg (4/8) @linear"

    [(_, path)] = resolve_models(["tiny/diff"])
    model = quantdiff.load("tiny/diff", device="cpu")
    tokenizer = quantdiff.load_tokenizer("tiny/diff")
    task = make_cli_task("lm", 8, context=64)
    prepared = task.prepare(tokenizer, 2, decide_bos(path, tokenizer, "auto").token_id)
    handles = [apply_quantization(model, config) for config in plan.configs()]
    with torch.inference_mode():
        metrics = dict(task.evaluate(model, prepared, None))
    for handle in handles:
        handle.remove()
    assert cell["loss"] == metrics["loss"] and cell["accuracy"] == metrics["accuracy"]


# ---- the commands -------------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=10)
def test_sensitivity_writes_the_optimal_plan_and_measures_it(tmp_path, capsys):
    main(["sensitivity", "tiny/diff", "--bits", "4,8", "--site", "linear", "--tokens", "64", "--seq-len", "32", "--plan-budget", "5",
          "--out", str(tmp_path / "p.json"), "--json", str(tmp_path / "s.json")])
    printed = capsys.readouterr().out
    plan = load_plan(tmp_path / "p.json")
    result = json.loads((tmp_path / "s.json").read_text())
    damage = {s["bits"]: [e["damage"]["kld_mean"] for e in s["layers"]] for s in result["sites"]}
    per_layer = [{b: damage[b][i] for b in (4, 8)} for i in range(4)]
    assert plan.average_bits <= 5 and plan.candidates == (4, 8) and plan.model == {"name": "tiny/diff", "decoder_layers": 4}
    assert plan.predicted_kld_mean == pytest.approx(_brute_force(per_layer, 5.0), rel=1e-12)
    assert plan.measured_kld_mean > 0 and result["plan"] == plan.to_dict()
    assert "layer:bits 0:" in printed and "predicted" in printed and "measured" in printed


REFUSED = [
    (["sensitivity", "tiny/diff", "--bits", "4,8", "--plan-budget", "9"], "--plan-budget must be from the narrowest to the widest of --bits (4 to 8)"),
    (["sensitivity", "tiny/diff", "--bits", "4,8", "--site", "linear,kv", "--plan-budget", "5"], "give one --site"),
    (["sensitivity", "tiny/diff", "--bits", "4,8", "--out", "p.json"], "give --plan-budget too"),
    (["eval", "tiny/diff", "--plan", "PLAN", "--bits", "4"], "--bits does not apply"),
    (["eval", "tiny/diff", "--plan", "PLAN", "--method", "absmax"], "--method does not apply"),
    (["sweep", "tiny/diff", "--plan", "PLAN", "--site", "linear"], "--site does not apply"),
    (["sweep", "tiny/diff", "--plan", "PLAN", "--bits", "4"], "--bits does not apply"),
    (["eval", "tiny/diff", "--plan", "OTHER"], "the precision plan for tiny/diff sets 5 decoder layers: tiny/diff has 4"),
    (["sweep", "tiny/diff", "--plan", "OTHER"], "sets 5 decoder layers"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a[:1] + a[2:]) for a, _ in REFUSED])
def test_refusals_name_what_is_wrong(tmp_path, capsys, argv, message):
    save_plan(_plan(), tmp_path / "plan.json")
    save_plan(_plan(bits=(4, 4, 4, 4, 8)), tmp_path / "other.json")
    files = {"PLAN": tmp_path / "plan.json", "OTHER": tmp_path / "other.json", "p.json": tmp_path / "p.json"}
    line = _fails(capsys, [files.get(a, a) for a in argv] + ["--quiet"])
    assert message in line
