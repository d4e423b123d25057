"""End to end: `quantdiff reproduce` on a micro recipe trains the pair, then writes a report whose tables agree
with the JSON beside them."""

from __future__ import annotations

import json
import re

import pytest

from quantdiff.data import corpus
from quantdiff.cli.app import main

MICRO_RECIPE = """
[data]
corpus = "janeaustenr"
retrieval_max_needles = 1
[model]
hidden_size = 32
num_layers = 2
num_heads = 2
vocab_size = 300
max_position_embeddings = 128
[train]
steps = 6
batch_size = 4
seq_len = 128
warmup_steps = 2
checkpoint_every = 3
eval_every = 3
eval_batches = 1
device = "cpu"
bos = true
[tasks]
lm_tokens = 512
choice_items = 6
retrieval_contexts = [128]
retrieval_needles = [1]
retrieval_examples = 4
[analysis]
stats_tokens = 512
seq_len = 128
bits = [8, 4]
methods = ["absmax", "llm_int8"]
sites = ["logits", "qk"]
"""


def _tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table as rows of cells (header included, separator dropped)."""
    tables, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def _close(text: str, value: float) -> bool:
    return float(text) == pytest.approx(value, rel=1e-3, abs=1e-9)


@pytest.mark.slow(seconds=12)
def test_reproduce_micro_recipe_end_to_end(tmp_path, monkeypatch, capsys):
    if corpus.find_rdata() is None:
        pytest.skip("corpus not installed (scripts/setup.sh installs it)")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "micro.toml").write_text(MICRO_RECIPE)
    main(["reproduce", "micro.toml", "--out", "rep", "--tasks", "choice,retrieval", "--real-model", "none"])
    assert "report -> rep/report.md" in capsys.readouterr().out.replace("\\", "/")
    assert (tmp_path / "runs" / "micro" / "diff" / "model.safetensors").is_file()

    stats = json.loads((tmp_path / "rep" / "stats.json").read_text())
    sweep = json.loads((tmp_path / "rep" / "sweep.json").read_text())
    report = (tmp_path / "rep" / "report.md").read_text()
    tables = _tables(report)

    table5 = next(t for t in tables if t[0][:3] == ["source", "model", "activation"])
    ours = [row for row in table5 if row[0] == "ours"]
    assert len(ours) == 4
    for row in ours:
        model = next(m for m in stats["models"] if m["name"] == row[1])
        block = model["attention_logits" if row[2] == "attention logits" else "hidden_states"]
        topk = [v["value"] if isinstance(v, dict) else v for v in block["topk"]]
        for cell, k in zip(row[3:8], (1, 2, 3, 10, 100)):
            assert _close(cell, topk[k - 1]) if len(topk) >= k else cell == "–"
        assert _close(row[8], block["median"])
    assert any(row[0] == "paper (3B)" for row in table5)

    cells = sweep["cells"]
    assert {c["task"] for c in cells} == {"choice", "retrieval"}
    # LLM.int8 decomposes a matmul, so it runs on Q·Kᵀ (site qk) only; absmax runs at both sites.
    assert {(c["method"], c["bits"], c["site"]) for c in cells if c["bits"]} == {
        (m, b, s) for m, s in (("absmax", "logits"), ("absmax", "qk"), ("llm-int8", "qk")) for b in (8, 4)}
    sweep_tables = [t for t in tables if t[0][:3] == ["source", "model", "method"] and t[1][0] == "ours"]
    assert len(sweep_tables) == 4  # (choice, retrieval) × (logits, qk)
    checked = 0
    for table in sweep_tables:
        header = table[0]
        for row in table[1:]:
            for column, text in zip(header[3:], row[3:]):
                bits = None if column == "unquantized" else int(column.split("-")[0])
                candidates = [c for c in cells if c["model"] == row[1] and c["bits"] == bits and (bits is None or c["method"] == row[2])]
                assert candidates, (row, column)
                values = [c.get("acc_norm", c.get("accuracy")) for c in candidates]
                assert any(_close(text, v) for v in values), (row, column, values)
                checked += 1
    assert checked >= 2 * 2 * 3  # 2 models × 2 methods × (reference + 2 widths), per table at least
    assert sorted(p.name for p in (tmp_path / "rep").glob("sweep_*.png")) == ["sweep_choice.png", "sweep_retrieval.png"]

    # emergence: the train logs' outlier series, plotted and tabled
    assert (tmp_path / "rep" / "emergence.png").stat().st_size > 1000
    logs = {kind: json.loads((tmp_path / "runs" / "micro" / kind / "train_log.json").read_text()) for kind in ("standard", "diff")}
    assert all(len(log["outliers"]) >= 2 for log in logs.values())
    _check_emergence_table(report, logs)
    assert "(builtin:corpus, BOS first (as the pair was trained))" in report and stats["data"]["source"] == "builtin:corpus, BOS first (as the pair was trained)"
    assert all(m["sinks"]["heads_scored"] > 0 for m in stats["models"])


def _check_emergence_table(report: str, logs: dict[str, dict]) -> None:
    """The Emergence section has one table per quantity, a row per eval step and a column per train log."""
    section = report.split("## Emergence of outliers during training", 1)[1].split("\n## ", 1)[0]
    tables = dict(zip(re.findall(r"^\*\*(.+)\*\*$", section, flags=re.M), _tables(section)))
    quantities = {"Top-1 attention logit (abs)": ("attention_logits", "top1"), "Top-1 hidden state (abs)": ("hidden_states", "top1"),
                  "sink score (share of heads > ε)": ("sink", "score")}
    first = next(iter(logs.values()))["outliers"]
    for label, (block, key) in quantities.items():
        header, rows = tables[label][0], tables[label][1:]
        assert header == ["step", "tokens", *logs]
        assert [int(r[0]) for r in rows] == [e["step"] for e in first]
        assert [r[1] for r in rows] == [f"{e['tokens']:,}" for e in first]
        for kind, log in logs.items():
            column = header.index(kind)
            for row, entry in zip(rows, log["outliers"]):
                assert float(row[column]) == pytest.approx(entry[block][key], rel=1e-2, abs=1e-9), (kind, label)
    assert "![emergence.png](emergence.png)" in section


def test_emergence_section_and_plot_from_train_logs(tmp_path):
    from quantdiff.across_seeds.curves import emergence_curves
    from quantdiff.report.emergence import emergence_markdown, plot_emergence, read_series

    def entry(step: int, logit: float, hidden: float, score: float) -> dict:
        return {"step": step, "tokens": step * 1000, "attention_logits": {"top1": logit}, "hidden_states": {"top1": hidden},
                "sink": {"score": score, "mean": score / 2}}

    logs = {"standard": [entry(10, 5.0, 20.0, 0.0), entry(20, 9.0, 400.0, 0.5)], "diff": [entry(10, 4.0, 10.0, 0.0), entry(20, 3.0, 30.0, 0.0)]}
    dirs = {}
    for kind, series in logs.items():
        dirs[kind] = tmp_path / kind
        dirs[kind].mkdir()
        (dirs[kind] / "train_log.json").write_text(json.dumps({"kind": kind, "outliers": series}))
    series = read_series(dirs)
    assert series == logs
    curves = emergence_curves({"0": series})
    assert list(curves) == ["attention_logits/top1", "hidden_states/top1", "sink/score", "sink/mean"]  # never-logged quantities left out
    assert curves["hidden_states/top1"]["arms"]["standard"]["low"] == [None, None]  # one seed: no band
    plot_emergence(curves, tmp_path / "emergence.png")
    assert (tmp_path / "emergence.png").stat().st_size > 1000
    _check_emergence_table("## Emergence of outliers during training\n\n" + emergence_markdown(curves), {k: {"outliers": v} for k, v in logs.items()})
    (dirs["diff"] / "train_log.json").write_text(json.dumps({"kind": "diff"}))  # an old log: no series
    assert list(read_series(dirs)) == ["standard"]
    assert emergence_markdown({}).startswith("Not tracked")


def test_emergence_across_seeds_is_the_mean_with_a_band_where_a_seed_lacks_a_step(tmp_path):
    from quantdiff.across_seeds.curves import emergence_curves
    from quantdiff.report.emergence import emergence_markdown, plot_emergence

    def entry(step: int, score: float) -> dict:
        return {"step": step, "tokens": step * 10, "sink": {"score": score}}

    series = {"1": {"a": [entry(5, 0.0), entry(10, 0.5)]}, "2": {"a": [entry(5, 0.25), entry(10, 1.0)]}, "3": {"a": [entry(5, 0.5)]}}
    curve = emergence_curves(series)["sink/score"]["arms"]["a"]
    assert curve["steps"] == [5, 10] and curve["n"] == [3, 2] and curve["per_seed"]["3"] == [0.5, None]
    # t(0.975, 2) = 4.302653 and t(0.975, 1) = 12.706205 (tables)
    assert curve["mean"][0] == pytest.approx(0.25) and curve["high"][0] == pytest.approx(0.25 + 4.302653 * 0.25 / 3 ** 0.5, rel=1e-6)
    assert curve["mean"][1] == pytest.approx(0.75) and curve["low"][1] == pytest.approx(0.75 - 12.706205 * 0.25, rel=1e-6)
    text = emergence_markdown(emergence_curves(series), seeds=3)
    assert "mean over 3 seeds" in text and f"| 10 | 100 | 0.75 [{curve['low'][1]:.3g}, {curve['high'][1]:.3g}] |" in text
    plot_emergence(emergence_curves(series), tmp_path / "bands.png")
    assert (tmp_path / "bands.png").stat().st_size > 1000


def test_reproduce_refuses_a_foreign_directory(tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["reproduce", "tiny", "--out", str(out)])
    assert exit_info.value.code != 0
    assert "not empty" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep me"


def test_real_model_section_says_why_when_the_model_cannot_load(tmp_path):
    import io

    from rich.console import Console

    from quantdiff.jobs.real_model import run_real_model

    # 80 columns, as rich uses on a pipe: the message must stay one line, whatever the length of the path.
    console = Console(file=io.StringIO(), width=80)
    section = run_real_model(str(tmp_path / "no-such-model"), tmp_path, "cpu", console)
    assert section.startswith("## Real pretrained models") and f"`{tmp_path / 'no-such-model'}`: not measured: " in section
    (line,) = console.file.getvalue().splitlines()
    assert line.startswith(f"real model '{tmp_path / 'no-such-model'}' not measured: ")
    assert not (tmp_path / "real_model.json").exists()


@pytest.mark.parametrize("real_model, message", [
    ("tiny", "--real-model 'tiny' names 2 models (standard, diff); name one of them, e.g. tiny/standard"),
    ("tiny/diff,bb", "--real-model 'bb' names 6 models"),
    ("{nan}", "model.layers.1.self_attn.q_proj.weight in {nan} holds NaN or Inf values: refusing to measure"),
], ids=["built-in-pair", "second-name-a-group", "nan-weight"])
def test_reproduce_refuses_a_real_model_it_cannot_measure_before_any_work(tmp_path, capsys, monkeypatch, real_model, message):
    """A name standing for several models (once `ValueError: too many values to unpack`) and a model with a NaN
    weight (once a TypeError on its null accuracy, after the whole analysis) are one line before anything runs."""
    from tests.test_bad_input import _nan_model
    import quantdiff.jobs.trained_runs as trained_runs

    nan = _nan_model(tmp_path, "model.layers.1.self_attn.q_proj.weight")
    monkeypatch.setattr(trained_runs, "find_runs", lambda *a: pytest.fail("the analysis started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["reproduce", "tiny", "--out", str(tmp_path / "rep"), "--real-model", real_model.format(nan=nan)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and message.format(nan=nan) in err, err
    assert not (tmp_path / "rep").exists()


def test_a_real_model_named_as_one_of_a_group_is_checked_and_measured_alone():
    from quantdiff.jobs.real_model import check_real_models, resolve_one

    check_real_models("tiny/diff, tiny/standard")
    assert resolve_one("tiny/diff").name == "diff"


def test_the_kernels_line_names_the_accelerator_and_claims_no_cpu_pinning_there(monkeypatch):
    """A reproduce on CUDA computed on GPU kernels: the Setup line must not call them the pinned CPU kernels (the
    H200 run's report did)."""
    import torch

    from quantdiff.jobs import measure_arms

    cpu_line = measure_arms.kernels_line("cpu")
    assert cpu_line.startswith(torch.backends.cpu.get_cpu_capability()) and "MKL_CBWR=" in cpu_line
    monkeypatch.setattr("quantdiff.core.device.resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu_line = measure_arms.kernels_line("cuda")
    assert gpu_line.startswith("CUDA, NVIDIA H200, torch ") and "not pinned" in gpu_line
    assert "MKL_CBWR" not in gpu_line and "AVX2" not in gpu_line
