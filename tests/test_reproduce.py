"""End to end: `quantdiff reproduce` on a micro recipe trains the pair, then writes a report whose tables agree
with the JSON beside them."""

from __future__ import annotations

import json

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


@pytest.mark.slow
def test_reproduce_micro_recipe_end_to_end(tmp_path, monkeypatch, capsys):
    if corpus.find_rdata() is None:
        pytest.skip("corpus not installed (scripts/setup.sh installs it)")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "micro.toml").write_text(MICRO_RECIPE)
    main(["reproduce", "micro.toml", "--out", "rep", "--tasks", "choice,retrieval"])
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


def test_reproduce_refuses_a_foreign_directory(tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["reproduce", "tiny", "--out", str(out)])
    assert exit_info.value.code != 0
    assert "not empty" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep me"
