"""What a new user meets first: `quantdiff pair`'s output runs every command, and library calls print nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from quantdiff.cli.app import main
from quantdiff.data import corpus
from quantdiff.models.loading import load_tokenizer

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. " * 30


def test_a_pair_runs_stats_and_eval_as_written(tmp_path, monkeypatch):
    """`quantdiff pair P && quantdiff stats P/standard --tokens 256 --seq-len 64` (the corpus replaced by TEXT)."""
    monkeypatch.setattr(corpus, "held_out_text", lambda: TEXT)
    main(["pair", str(tmp_path / "P")])
    tokenizer = load_tokenizer(tmp_path / "P" / "standard")
    assert len(tokenizer) == 259 and tokenizer.decode(tokenizer(TEXT[:40])["input_ids"]) == TEXT[:40]  # every byte, losslessly
    main(["stats", str(tmp_path / "P" / "standard"), "--tokens", "256", "--seq-len", "64", "--quiet", "--json", str(tmp_path / "s.json")])
    entry = json.loads((tmp_path / "s.json").read_text())["models"][0]
    assert entry["tokens"] == 256 and entry["bos"]["reason"] == "its tokenizer adds no BOS"
    main(["eval", str(tmp_path / "P" / "diff"), "--task", "lm", "--limit", "1", "--context", "64", "--quiet", "--json", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["cells"][0]["tokens"] == 63
    main(["stats", str(tmp_path / "P"), "--tokens", "64", "--seq-len", "64", "--quiet", "--json", str(tmp_path / "s.json")])
    assert [m["name"] for m in json.loads((tmp_path / "s.json").read_text())["models"]] == ["standard", "diff"]  # the pair as a whole


def test_loading_from_python_prints_nothing():
    root = str(Path(__file__).resolve().parents[1])  # this checkout's quantdiff, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", "import quantdiff; quantdiff.load('tiny/diff'); quantdiff.load_tokenizer('tiny/diff')"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr
