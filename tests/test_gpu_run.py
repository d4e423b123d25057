"""scripts/gpu_run.sh, the one command a lent GPU runs (issues 36, 46), end to end on CPU at its --smoke size: what
comes back under $OUT, the sizing of the steps, the report, a second call that skips what the first finished,
and bad input refused in one line.

The smoke run is the smallest that still runs every step of the script (issue 46: it cost ~197 s of one core
before): the next call's recipe (recipes/gpu-regime-bb.toml, issue 58) as 1-layer 32-wide arms in float32 for a few
steps, each arm's model brought back (--models), the real-model step on 1-layer stand-ins
of SmolLM2 and Gemma 3 on 1 × 32 tokens, one repeat per timing, nothing compiled; and its second call skips the
preflight too, so it costs a second instead of the preflight's imports. What it still proves: the script's
control flow (preflight, caps, done-markers, resume by call, sizing from the probe, publishing after every step)
and that each step's command runs with the arguments the GPU call gives it (recipe keys, benchmark flags, the
real models' configs loading as transformers models on the quantdiff backend), with its output in the files that
come back. Not what a GPU does: CUDA, the compiled statistics, the real sizes and their timings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from quantdiff.data import corpus
from quantdiff.train.recipe import parse_recipe

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_run.sh"
STEPS = {"cuda-tests", "bench-stats", "bench-real", "bench-quant", "bench-train", "bench-bf16", "probe", "train", "reproduce"}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OUT"}  # the device tool's variable
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env={**env, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.pipeline  # ~2 one-core minutes: make test-isolation (CI) runs it, make test does not
@pytest.mark.slow(seconds=115)
@pytest.mark.skipif(corpus.find_rdata() is None and not (REPO / ".whl" / "corpus").is_dir(),
                    reason="corpus not installed (python -m quantdiff.data.corpus --install)")
def test_smoke_run_returns_its_results_and_a_second_call_skips_what_is_done(tmp_path):
    # The next call's recipe (issue 58), all its arms, with their models brought back
    recipe, out, work = REPO / "recipes" / "gpu-regime-bb.toml", tmp_path / "out", tmp_path / "work"
    arms = parse_recipe(recipe.read_text(encoding="utf-8"), "gpu").arm_names
    result = _run("--smoke", "--models", "--recipe", str(recipe), "--out", str(out), "--work", str(work), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # What the device tool brings back: at most 8 plain files of at most 16 MiB, here all at the top.
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["benchmarks.txt", "report.md", "results.tar.gz", "summary.json", *(f"model-{arm}.tar.gz" for arm in arms)])
    assert len(files) <= 8
    for arm in arms:  # --models: the weights, loadable as saved
        with tarfile.open(out / f"model-{arm}.tar.gz") as archive:
            assert {f"{arm}/model.safetensors", f"{arm}/config.json"} <= set(archive.getnames())
    assert all((out / name).is_file() and (out / name).stat().st_size <= 16 * 2**20 for name in files)

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["schema"], summary["mode"], summary["calls"], summary["report"]) == ("quantdiff.gpu_run", "smoke", 1, True)
    assert {s["name"]: s["status"] for s in summary["steps"]} == dict.fromkeys(STEPS, "ok")
    assert summary["preflight"]["torch"] == torch.__version__
    assert Path(summary["preflight"]["corpus"]).resolve().is_relative_to((work / "corpus").resolve())  # the one-novel copy
    sizing = summary["sizing"]
    assert sizing["step_s"] > 0 and 4 <= sizing["steps"] <= sizing["ceiling"] == 8
    assert sorted(r["arm"] for r in summary["train"]) == sorted(arms)
    assert all(r["steps"] == sizing["steps"] and r["tokens"] == sizing["steps"] * 4 * 128 for r in summary["train"])

    bench = (out / "benchmarks.txt").read_text()
    assert "stats/eager" in bench and "fake-quant logits int8" in bench and "Diff / standard throughput" in bench
    assert "# bench-bf16.log" in bench and re.search(r"^diff +bf16\+float32-combine +seed 0: \d", bench, re.M)
    assert "# bench-real.log" in bench and "## 6. stats pass on the built-in models' architectures, stand-in weights" in bench
    for model in ("smollm2", "gemma3"):  # each measured against both plain forwards
        assert re.search(rf"^{model} \(1 layers, d\d+, vocab 300\): eager .* stats .* eager, .* sdpa$", bench, re.M)
    assert "Table 5" in (out / "report.md").read_text()

    with tarfile.open(out / "results.tar.gz") as archive:
        names = set(archive.getnames())
        assert {"report/report.md", "report/stats.json", "report/sweep.json", "preflight.json", "sizing.json"} <= names
        assert {f"logs/{step}.log" for step in STEPS} <= names
        assert not any(name.endswith(".safetensors") for name in names)  # no weights
        for arm in arms:
            log = json.load(archive.extractfile(f"train/{arm}/train_log.json"))
            assert log["steps"] == sizing["steps"] and len(log["outliers"]) == sizing["steps"] // sizing["every"]  # emergence tracked
            saved = parse_recipe(archive.extractfile(f"train/{arm}/recipe.toml").read().decode(), "gpu")
            assert saved.train.steps == sizing["steps"] and saved.train.bos and saved.data.corpus_names == ("bigram-backcopy",)
        assert json.load(archive.extractfile("reproduce.json"))["schema"] == "quantdiff.reproduce"

    again = _run("--smoke", "--models", "--recipe", str(recipe), "--out", str(out), "--work", str(work), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"== {step}: done in an earlier call, skipped" in again.stdout for step in STEPS)
    assert "preflight:" not in again.stdout  # the same machine and wheels: its preflight stands
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calls"] == 2 and [s["call"] for s in summary["steps"]] == [1] * len(STEPS)


def test_the_real_architectures_are_the_built_in_models(smollm2_dir, gemma3_dir):
    """The configs the real-model step builds its stand-ins from are those of the converted models, unchanged."""
    for name, converted in (("smollm2", smollm2_dir), ("gemma3", gemma3_dir)):
        committed = REPO / "benchmarks" / "real_configs" / name / "config.json"
        assert json.loads(committed.read_text()) == json.loads((converted / "config.json").read_text())


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--out"], "--out needs a value"),
    (["--smoke", "--recipe", "no-such.toml"], "no recipe file 'no-such.toml'"),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path, args, message):
    result = _run(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_run_refuses_a_machine_without_cuda(tmp_path):
    result = _run("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: no CUDA device")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["preflight"]["cuda_available"] is False
