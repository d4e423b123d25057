"""`--kv-mode` on eval and sweep: the named cache layout reaches the kv site and the JSON (with its causality), the
help lists exactly the layouts there are, and every option contradicting a mode is refused in one line naming it."""

import json

import pytest

from quantdiff.cli.commands.sweep import KV_MODES
from quantdiff.quant.kv_layout import LAYOUTS
from tests.test_sweep import run_cli

LM = ("--task", "lm", "--limit", "1", "--context", "32")


def test_the_help_names_every_layout():
    assert KV_MODES == tuple(LAYOUTS)


@pytest.mark.slow(seconds=10)
def test_eval_runs_the_named_mode_and_records_it(tmp_path, capsys):
    losses = {}
    for mode in ("vllm-int8-head", "token", "kivi"):
        code, _, err = run_cli(capsys, "eval", "tiny", *LM, "--bits", "8", "--site", "kv", "--kv-mode", mode, "--json", tmp_path / f"{mode}.json", "-q")
        assert code == 0, err
        cells = json.loads((tmp_path / f"{mode}.json").read_text())["cells"]
        assert {c["kv_mode"] for c in cells} == {mode}
        assert {c["causal"] for c in cells} == {mode != "kivi"}  # kivi's key blocks see later tokens at the site
        losses[mode] = [c["loss"] for c in cells]
    assert losses["vllm-int8-head"] != losses["token"]  # truncated codes are not the rounded ones


def test_sweep_records_the_mode(tmp_path, capsys):
    code, _, err = run_cli(capsys, "sweep", "tiny/diff", *LM, "--bits", "4", "--site", "kv", "--kv-mode", "vllm-int4-head", "--json", tmp_path / "s.json", "-q")
    assert code == 0, err
    cells = json.loads((tmp_path / "s.json").read_text())["cells"]
    assert [c.get("kv_mode") for c in cells] == [None, "vllm-int4-head"]  # the reference, then the cell


@pytest.mark.parametrize("argv, message", [
    (("--bits", "4", "--site", "kv", "--kv-mode", "vllm-int8-head"), "--kv-mode vllm-int8-head stores 8-bit codes: --bits 4 contradicts it"),
    (("--bits", "8", "--site", "kv", "--kv-mode", "vllm-fp8-head", "--group-size", "8"), "--kv-mode vllm-fp8-head fixes its groups (one scale per token and KV head)"),
    (("--bits", "4", "--site", "kv", "--kv-mode", "kivi", "--granularity", "tensor"), "--kv-mode kivi sets its own scales: --granularity tensor contradicts it"),
    (("--bits", "8", "--site", "qk", "--kv-mode", "q8_0"), "--kv-mode q8_0 sets how the kv site quantizes the cache: use it with --site kv, not qk"),
    (("--bits", "8", "--site", "kv", "--kv-mode", "int8"), "unknown --kv-mode 'int8' (choose from kivi, token, q8_0"),
    (("--kv-mode", "q8_0"), "--kv-mode choose how to quantize: give --bits too"),
])  # fmt: skip
def test_contradictions_are_refused_naming_the_mode(capsys, argv, message):
    code, _, err = run_cli(capsys, "eval", "tiny", *LM, *argv)
    assert code != 0 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_sweep_refuses_a_width_the_mode_does_not_have(capsys):
    code, _, err = run_cli(capsys, "sweep", "tiny", *LM, "--bits", "8,4", "--site", "kv", "--kv-mode", "q4_0")
    assert code != 0 and "error: --kv-mode q4_0 stores 4-bit codes: --bits 8 contradicts it (give --bits 4)" in err


def test_a_layouts_group_size_is_recorded_beside_its_name_and_causality_follows_the_layout():
    from quantdiff.eval.sweep import Cell, cells_from_json, cells_to_json, group_size_of, kv_mode_of
    from quantdiff.quant.sites import parse_config

    config = parse_config("absmax", 4, "kv", kv_layout="token", group_size=8)
    assert (kv_mode_of(config), group_size_of(config)) == ("token", 8)
    assert (kv_mode_of(parse_config("absmax", 8, "kv", kv_layout="q8_0")), kv_mode_of(parse_config("absmax", 8, "kv"))) == ("q8_0", None)
    token = Cell("m", "lm", "absmax", 4, "kv", granularity="row", kv_mode="token")
    kivi = Cell("m", "lm", "absmax", 4, "kv", granularity="row", kv_mode="kivi")
    per_tensor = Cell("m", "lm", "absmax", 8, "kv", granularity="row", kv_mode="vllm-fp8-tensor")
    assert token.causal and not kivi.causal and not per_tensor.causal  # the first forward's scale sees all of it
    assert [c.kv_mode for c in cells_from_json(cells_to_json([token, kivi]))] == ["token", "kivi"]
