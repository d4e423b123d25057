"""`quantdiff stats` end to end: JSON schema, tables, plots, one-line errors with nothing written, torchrun merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from quantdiff.cli.app import main
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.report.stats_report import table5_values
from quantdiff.core.savedir import save_pair
from quantdiff.models.tokenizer import save_tokenizer, train_bpe

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. " * 40


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats_cli")
    preset = SizePreset(hidden_size=32, num_layers=2, num_heads=4, vocab_size=300, max_position_embeddings=128)
    save_pair(build_pair(preset, seed=0), root / "pair")
    tokenizer = train_bpe(TEXT, vocab_size=290)
    for kind in ("standard", "diff"):
        save_tokenizer(tokenizer, root / "pair" / kind)
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return root


def _stats(pair_dir, *args):
    return ["stats", str(pair_dir / "pair" / "standard"), str(pair_dir / "pair" / "diff"), "--data", str(pair_dir / "text.txt"), *args]


def test_pair_writes_versioned_json_and_plots(pair_dir, tmp_path):
    out, plots = tmp_path / "stats.json", tmp_path / "plots"
    main(_stats(pair_dir, "--tokens", "700", "--seq-len", "64", "--batch-size", "3", "--tile-size", "16",
                "--json", str(out), "--plot", str(plots), "--quiet"))
    doc = json.loads(out.read_text())
    assert (doc["schema"], doc["version"]) == ("quantdiff.stats", 2)
    assert 0 < doc["quantile_relative_error"] <= 0.001
    assert [m["name"] for m in doc["models"]] == ["standard", "diff"]
    assert [m["kind"] for m in doc["models"]] == ["standard", "diff"]
    for model in doc["models"]:
        assert model["tokens"] == 700
        for key in ("attention_logits", "hidden_states"):
            values = [e["value"] for e in model[key]["topk"]]
            assert len(values) == 100 and values == sorted(values, reverse=True)
            assert 0 < model[key]["median"] < values[0]
            assert len(model[key]["per_layer"]) == 2
    assert "per_map" in doc["models"][1]["attention_logits"] and "per_map" not in doc["models"][0]["attention_logits"]
    row = table5_values(doc["models"][1])["hidden_states"]
    block = doc["models"][1]["hidden_states"]
    assert (row["Top-1"], row["Top-100"], row["Median"]) == (block["topk"][0]["value"], block["topk"][99]["value"], block["median"])
    assert sorted(p.name for p in plots.iterdir()) == sorted(
        f"{kind}_{key}.png" for kind in ("ccdf", "top1_per_layer") for key in ("attention_logits", "hidden_states")
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_single_model_prints_table5_layout(pair_dir, capsys):
    main(["stats", str(pair_dir / "pair" / "diff"), "--data", str(pair_dir / "text.txt"), "--tokens", "200",
          "--seq-len", "32", "--per-layer"])
    out = capsys.readouterr().out
    for column in ("Top-1", "Top-2", "Top-3", "Top-10", "Top-100", "Median", "attention", "hidden", "per layer"):
        assert column in out


def _bad_model(tmp_path):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    return bad


@pytest.mark.parametrize("case", ["empty-data", "tokens-0", "seq-len-too-long", "missing-data", "data-is-dir", "bad-model", "bad-jsonl"])
def test_bad_input_is_one_line_error_and_writes_nothing(pair_dir, tmp_path, capsys, case):
    out, plots = tmp_path / "out" / "stats.json", tmp_path / "plots"
    model = str(pair_dir / "pair" / "standard")
    data = str(pair_dir / "text.txt")
    extra = []
    if case == "empty-data":
        data = str(tmp_path / "empty.txt")
        (tmp_path / "empty.txt").write_text("")
    elif case == "tokens-0":
        extra = ["--tokens", "0"]
    elif case == "seq-len-too-long":
        extra = ["--seq-len", "129"]
    elif case == "missing-data":
        data = str(tmp_path / "nope.txt")
    elif case == "data-is-dir":
        data = str(tmp_path)
    elif case == "bad-model":
        model = str(_bad_model(tmp_path))
    elif case == "bad-jsonl":
        data = str(tmp_path / "x.jsonl")
        (tmp_path / "x.jsonl").write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(SystemExit) as exc:
        main(["stats", model, str(pair_dir / "pair" / "diff"), "--data", data, "--json", str(out), "--plot", str(plots), "--quiet", *extra])
    assert exc.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert not out.exists() and not plots.exists()


@pytest.mark.slow(seconds=16)
def test_torchrun_two_ranks_write_the_same_json(pair_dir, tmp_path):
    """gloo on CPU: ranks take alternate batches, rank 0 merges; everything but world_size must match exactly."""
    args = _stats(pair_dir, "--tokens", "900", "--seq-len", "48", "--batch-size", "2", "--tile-size", "16", "--quiet")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    single, dist = tmp_path / "single.json", tmp_path / "dist.json"
    main([*args, "--json", str(single)])
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    result = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-port", "29517", "-m", "quantdiff", *args, "--json", str(dist)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = json.loads(single.read_text()), json.loads(dist.read_text())
    assert (one["data"].pop("world_size"), two["data"].pop("world_size")) == (1, 2)
    assert one == two
