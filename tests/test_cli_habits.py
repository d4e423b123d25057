"""One set of habits across commands: every command takes --quiet (only warnings and errors reach the terminal)
and --json (its result as a JSON document, "schema": "quantdiff.<command>", '-' for stdout), each spelled and
explained the same way everywhere, and every help opens with one line saying what the command answers."""

from __future__ import annotations

import json
import os

import pytest
import typer

from quantdiff.cli.app import COMMANDS, build_app, main
from quantdiff.cli.options import JSON_HELP, QUIET_HELP
from test_bigram_backcopy import MICRO as BB_MICRO

TEXT = "the river ran past the mill and the lantern lit the garden while a letter waited by the window " * 40
# Options several commands take that must be explained with the same words wherever they appear.
SAME_EVERYWHERE = ("--quiet", "--json", "--device", "--bos", "--revision")
# test_bigram_backcopy's micro recipe (four arms, four steps), measured at one cell.
MICRO_BB = BB_MICRO + '[analysis]\nstats_tokens = 64\nseq_len = 16\nbits = [4]\nmethods = ["absmax"]\nsites = ["linear"]\n'


@pytest.fixture(autouse=True)
def no_transformers_bars():
    """As the CLI runs them: `quantdiff` turns transformers' own progress bars off before importing it (cli.app),
    which in this process, where transformers is already imported, takes its logging switch."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    yield
    if enabled:
        logging.enable_progress_bar()


def _commands() -> dict:
    return typer.main.get_command(build_app()).commands


def _run(capsys, *args) -> tuple[str, str]:
    main([str(a) for a in args])
    captured = capsys.readouterr()
    return captured.out, captured.err


def _fails(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_every_command_takes_quiet_and_json_with_one_meaning():
    commands = _commands()
    assert set(commands) == {name for name, *_ in COMMANDS}
    for name, command in commands.items():
        options = {opt: param for param in command.params for opt in param.opts}
        assert options["--quiet"] is options["-q"] and options["--quiet"].help == QUIET_HELP, name
        assert options["--json"].help == JSON_HELP, name


def test_an_option_several_commands_take_is_explained_the_same_everywhere():
    helps: dict[str, dict[str, str]] = {}
    for name, command in _commands().items():
        for param in command.params:
            for opt in set(param.opts) & set(SAME_EVERYWHERE):
                helps.setdefault(opt, {})[name] = param.help
    assert len(helps["--device"]) >= 4 and len(helps["--bos"]) >= 3 and len(helps["--revision"]) >= 2
    for opt, by_command in helps.items():
        assert len(set(by_command.values())) == 1, (opt, by_command)


def test_each_help_opens_with_one_line_saying_what_the_command_answers():
    group = typer.main.get_command(build_app())
    for name, command in {"quantdiff": group, **_commands()}.items():
        first = command.help.strip().split("\n\n")[0]
        assert "\n" not in first and len(first) <= 120 and first.endswith(("?", ".", ")")), (name, first)
    assert group.help.startswith("Where are a model's activation outliers, and how many bits does it survive?")


def test_quiet_pair_info_and_quantize_print_nothing_and_their_json_holds_the_result(tmp_path, capsys, monkeypatch):
    from quantdiff.api import load

    monkeypatch.chdir(tmp_path)
    assert _run(capsys, "pair", "P", "--hidden-size", "32", "--layers", "2", "-q", "--json", "pair.json") == ("", "")
    pair = json.loads((tmp_path / "pair.json").read_text())
    assert pair["schema"] == "quantdiff.pair" and pair["trained"] is False
    counts = {kind: sum(p.numel() for p in load(tmp_path / "P" / kind).parameters()) for kind in ("standard", "diff")}
    assert {m["kind"]: m["parameters"] for m in pair["models"]} == counts
    lambdas = sum(p.numel() for name, p in load(tmp_path / "P" / "diff").named_parameters() if "lambda" in name)
    assert {m["kind"]: m["added_parameters"] for m in pair["models"]} == {"standard": 0, "diff": lambdas} and lambdas > 0

    out, err = _run(capsys, "info", "P/diff", "--json", "-")  # stdout is the JSON alone; the table goes to stderr
    (model,) = json.loads(out)["models"]
    config = json.loads((tmp_path / "P" / "diff" / "config.json").read_text())
    assert (model["layers"], model["heads"], model["attention"]) == (config["num_hidden_layers"], config["num_attention_heads"], "diff")
    assert model["parameters"] == counts["diff"] and "quantdiff models" in err

    assert _run(capsys, "quantize", "P/standard", "--bits", "4", "--out", "w4", "--quiet", "--json", "q.json") == ("", "")
    doc = json.loads((tmp_path / "q.json").read_text())
    written = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert doc["schema"] == "quantdiff.quantize" and doc["quantization"].items() <= written.items() and doc["eval"] is None
    assert (doc["quantization"]["method"], doc["quantization"]["bits"]) == ("absmax", 4)
    assert doc["bytes"]["export"] == os.path.getsize(tmp_path / "w4" / "model.safetensors")
    assert len(doc["quantization"]["modules"]) == 2 * 7 and doc["quantization"]["skipped_modules"] == ["lm_head"]  # q, k, v, o, gate, up, down per layer


def test_quiet_sweep_eval_and_stats_print_nothing_but_write_their_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "words.txt").write_text(TEXT)
    _run(capsys, "pair", "P", "--hidden-size", "32", "--layers", "1", "-q")
    common = ["--task", "lm", "--data", "words.txt", "--context", "16", "--limit", "1"]
    assert _run(capsys, "sweep", "P/standard", *common, "--bits", "4", "-q", "--json", "s.json") == ("", "")
    assert _run(capsys, "eval", "P/standard", *common, "-q", "--json", "e.json") == ("", "")
    sweep, single = (json.loads((tmp_path / name).read_text()) for name in ("s.json", "e.json"))
    assert sweep["cells"][0] == single["cells"][0]  # the sweep's reference is the eval's unquantized cell
    assert _run(capsys, "stats", "P/standard", "--data", "words.txt", "--tokens", "32", "--seq-len", "16", "-q", "--json", "st.json") == ("", "")
    assert json.loads((tmp_path / "st.json").read_text())["schema"] == "quantdiff.stats"
    out, _ = _run(capsys, "eval", "P/standard", *common)  # without --quiet the table is the output
    assert "task: lm" in out


def test_a_json_result_never_lands_in_what_the_command_writes_or_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(capsys, "pair", "P", "--hidden-size", "32", "--layers", "1", "-q")
    assert "which this command replaces" in _fails(capsys, "pair", "P", "--force", "-q", "--json", "P/pair.json")
    assert "lies inside the input model" in _fails(capsys, "quantize", "P/standard", "--out", "w4", "--json", "P/standard/config.json")
    assert "which this command replaces" in _fails(capsys, "quantize", "P/standard", "--out", "w4", "--json", "w4/q.json")
    (tmp_path / "mine.json").write_text('{"my": "numbers"}')
    assert "was not written by quantdiff" in _fails(capsys, "info", "P/diff", "-q", "--json", "mine.json")
    assert (tmp_path / "mine.json").read_text() == '{"my": "numbers"}' and not (tmp_path / "w4").exists()


def test_quiet_train_and_reproduce_print_nothing_and_their_json_names_what_they_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "micro.toml").write_text(MICRO_BB)
    assert _run(capsys, "train", "micro.toml", "--out", "runs", "--quiet", "--json", "t.json") == ("", "")
    runs = json.loads((tmp_path / "t.json").read_text())
    assert runs["schema"] == "quantdiff.train" and [r["arm"] for r in runs["runs"]] == ["standard", "diff", "diffv2", "standard-sgd"]
    for record in runs["runs"]:
        log = json.loads((tmp_path / record["path"] / "train_log.json").read_text())
        assert record["held_out_loss"] == log["held_out_loss"] and record["parameters"] == log["parameters"]

    assert _run(capsys, "reproduce", "runs", "--out", "rep", "--items", "4", "--real-model", "none", "-q", "--json", "r.json") == ("", "")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "quantdiff.reproduce" and doc["report"] == os.path.join("rep", "report.md")
    assert doc["files"] == sorted(str(p.relative_to(tmp_path / "rep")) for p in (tmp_path / "rep").rglob("*") if p.is_file())
    assert {"report.md", "stats.json", "sweep.json"} <= set(doc["files"])
