"""Multi-seed training and its report: the seed list is validated, every seed trains every arm into
OUT/seed-<s>/ with the losses the pre-change code gave for that seed (tests/data/bb_micro_loss_trace.json),
an interrupted run resumes without touching finished seeds, and `reproduce` summarises the seeds in a
seeds.json that is recomputed here independently (numpy, statistics and closed-form t quantiles) from the
per-seed JSON beside it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from quantdiff.core.errors import ConfigError
from quantdiff.eval.tasks.registry import headline_metric
from quantdiff.train import loop as training
from quantdiff.train.recipe import parse_recipe
from quantdiff.train.seeds import for_seed, run_dirs, seed_list, train_seeds, unfinished
from tests.test_bad_input import tree_hashes

TRACE = json.loads((Path(__file__).parent / "data" / "bb_micro_loss_trace.json").read_text())
ARMS = ("standard", "diff", "standard-sgd")
# The recipe the trace was made with (one run per seed, `seed = s`, at commit c26f97c); here with a seed list, and
# `init` set to what every run then used (transformers' init: the default became the authors', issue 42).
MICRO_BB = """
[data]
corpus = "bigram-backcopy"
retrieval_fraction = 0.0

[model]
hidden_size = 16
num_layers = 2
num_heads = 2
vocab_size = 83
max_position_embeddings = 16

[train]
steps = 8
batch_size = 8
seq_len = 16
lr = 7e-3
min_lr = 2e-3
warmup_steps = 2
adam_beta2 = 0.99
bos = true
grad_clip = 0.0
SEEDS
init = "transformers"
dtype = "float32"
device = "cpu"
checkpoint_every = 4
eval_every = 4
eval_batches = 1
outlier_sequences = 2

[tasks]
lm_tokens = 256
bb_sequences = 8

[analysis]
stats_tokens = 256
seq_len = 16
bits = [8, 4]
methods = ["absmax", "llm_int8"]
sites = ["logits", "qk", "linear"]

[[arms]]
name = "standard"
kind = "standard"

[[arms]]
name = "diff"
kind = "diff"

[[arms]]
name = "standard-sgd"
kind = "standard"
optimizer = "sgd"
lr = 0.03
momentum = 0.9
weight_decay = 1e-4
"""
# The saved trace holds the losses as the train log rounds them (5 decimals). On the machine that made it they
# agree exactly; another CPU's kernels may round a last bit differently, hence the tolerance of 2 log units.
TRACE_TOLERANCE = 2e-5


def micro(seeds: str = "seeds = [0, 7]"):
    return parse_recipe(MICRO_BB.replace("SEEDS", seeds), "micro")


@pytest.mark.parametrize("seeds, message", [
    ("seeds = []", "non-empty list"),
    ("seeds = 3", "seeds must be a list"),
    ("seeds = [1, true]", "list of integers, got \\[1, true\\]"),
    ("seeds = [1.5]", "list of integers, got \\[1.5\\]"),
    ("seeds = [-1]", "must be in 0..2\\*\\*64 - 1, got -1"),
    (f"seeds = [{2**64}]", "must be in 0..2"),
    ("seeds = [3, 4, 3]", "lists a seed twice"),
    ("seed = 5\nseeds = [3, 4]", "seed 5 is not one of seeds"),
])
def test_a_bad_seed_list_is_refused_by_name(seeds, message):
    with pytest.raises(ConfigError, match=message):
        micro(seeds)


def test_seed_lists_and_the_single_seed_layout():
    single = micro("seed = 3")
    assert seed_list(single) == (3,) and run_dirs(single, "out") == {3: Path("out")}  # unchanged: OUT/<arm>
    several = micro("seed = 7\nseeds = [0, 7]")
    assert seed_list(several) == (0, 7) and run_dirs(several, "out") == {0: Path("out/seed-0"), 7: Path("out/seed-7")}
    assert for_seed(several, 0).train.seed == 0 and for_seed(several, 0).train.seeds == [0, 7]
    assert run_dirs(micro("seeds = [2]"), "out") == {2: Path("out/seed-2")}  # a seed list keeps its layout, even of one


def _losses(out: Path, seed: int) -> dict[str, dict]:
    logs = {arm: json.loads((out / f"seed-{seed}" / arm / "train_log.json").read_text()) for arm in ARMS}
    assert all(log["seed"] == seed for log in logs.values())
    return logs


def _matches_trace(logs: dict[str, dict], seed: int) -> None:
    for arm, log in logs.items():
        saved = TRACE["seeds"][str(seed)][arm]
        assert log["train_loss_curve"] == pytest.approx(saved["train_loss_curve"], rel=0, abs=TRACE_TOLERANCE), (seed, arm)
        assert log["held_out_loss"] == pytest.approx(saved["held_out_loss"], rel=1e-5), (seed, arm)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Seeds 0 and 7 of the micro recipe, trained as an interrupted run resumed: seed 0 first alone, then the
    list grown to [0, 7] and interrupted in seed 7, then resumed."""
    out = tmp_path_factory.mktemp("seeds") / "runs"
    assert set(train_seeds(micro("seeds = [0]"), out)) == {0}
    finished = {p: p.stat().st_mtime_ns for p in (out / "seed-0").rglob("*") if p.is_file()}
    recipe = micro()
    assert train_seeds(recipe, out, stop_after=4) is None
    assert unfinished(out, recipe) == [out / "seed-7"]
    assert json.loads((out / "seed-7" / training.CHECKPOINT / "state.json").read_text())["seed"] == 7
    runs = train_seeds(recipe, out)
    assert runs == {s: {arm: out / f"seed-{s}" / arm for arm in ARMS} for s in (0, 7)} and not unfinished(out, recipe)
    assert {p: p.stat().st_mtime_ns for p in (out / "seed-0").rglob("*") if p.is_file()} == finished  # untouched
    return out


def test_every_seed_trains_every_arm_with_the_losses_of_the_code_before_seed_lists(trained):
    for seed in (0, 7):
        _matches_trace(_losses(trained, seed), seed)
    # the seeds differ, the arms of one seed share their initial weights and batches
    assert _losses(trained, 0)["standard"]["train_loss_curve"] != _losses(trained, 7)["standard"]["train_loss_curve"]
    for seed in (0, 7):
        logs = _losses(trained, seed)
        assert logs["standard"]["train_loss_curve"][0] == logs["standard-sgd"]["train_loss_curve"][0]


def test_a_finished_seed_of_another_recipe_is_refused_and_force_retrains(trained, tmp_path):
    other = parse_recipe(MICRO_BB.replace("SEEDS", "seeds = [0, 7]").replace("lr = 7e-3", "lr = 5e-3"), "micro")
    with pytest.raises(ConfigError, match="trained by a different recipe"):
        train_seeds(other, trained)
    with pytest.raises(ConfigError, match="--jobs must be at least 1"):
        train_seeds(micro(), tmp_path, jobs=0)


# Closed-form t quantiles (independent of the code's incomplete-beta inversion): df 1 is the Cauchy
# distribution, t = tan(π(p − ½)); df 2 has t = (2p − 1) / √(2p(1 − p)).
def t975(df: int) -> float:
    p = 0.975
    return {1: math.tan(math.pi * (p - 0.5)), 2: (2 * p - 1) / math.sqrt(2 * p * (1 - p))}[df]


def _interval(values: list[float], log: bool = False) -> tuple[float, float, float]:
    x = np.log(values) if log else np.asarray(values, dtype=float)
    half = t975(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    back = np.exp if log else (lambda v: v)
    return float(back(x.mean())), float(back(x.mean() - half)), float(back(x.mean() + half))


def _check_summary(summary: dict, values: list[float], log: bool = False) -> None:
    mean, low, high = _interval(values, log)
    assert summary["n"] == len(values)
    assert (summary["mean"], summary["low"], summary["high"]) == pytest.approx((mean, low, high), rel=1e-9, abs=1e-12)


LOG_KEYS = ("table5/attention_logits/top1_over_median", "table5/hidden_states/top1_over_median", "sinks/bos_peak_over_median",
            "table5/attention_logits/kurtosis", "table5/hidden_states/kurtosis")  # geometric means


def _independent_values(report: Path, seed: int) -> dict[str, dict[str, float | None]]:
    """{metric key: {arm: value}} read straight from seed-<s>/stats.json and sweep.json."""
    stats = json.loads((report / f"seed-{seed}" / "stats.json").read_text())
    sweep = json.loads((report / f"seed-{seed}" / "sweep.json").read_text())
    values: dict[str, dict] = {key: {} for key in LOG_KEYS + ("table5/attention_logits/top1", "table5/hidden_states/top1",
                                                              "table5/attention_logits/top1_per_map", "table5/attention_logits/top1_per_map1",
                                                              "sinks/score", "sinks/max",
                                                              "sinks/min", "sinks/sink_logit_max")}
    for m in stats["models"]:
        for block in ("attention_logits", "hidden_states"):
            top1 = max(abs(t["value"]) for t in m[block]["topk"])
            values[f"table5/{block}/top1"][m["name"]] = top1
            values[f"table5/{block}/top1_over_median"][m["name"]] = top1 / m[block]["median"]
            values[f"table5/{block}/kurtosis"][m["name"]] = m[block]["kurtosis"]
        # one per_head block per softmax map, each over the same number of logits in every kind
        maps = [max(abs(t["value"]) for t in head["topk"]) for layer in m["attention_logits"]["per_head"] for head in layer]
        assert len({head["count"] for layer in m["attention_logits"]["per_head"] for head in layer}) == 1
        values["table5/attention_logits/top1_per_map"][m["name"]] = sum(maps) / len(maps)
        # first maps by head index, as the stats schema defines them: Diff V1 heads 0…H/2−1, DIFF V2 the even heads
        first = [top for layer in m["attention_logits"]["per_head"] for h, top in enumerate(
                 max(abs(t["value"]) for t in head["topk"]) for head in layer)
                 if m["kind"] not in ("diff", "diffv2") or (h < m["heads"] // 2 if m["kind"] == "diff" else h % 2 == 0)]
        values["table5/attention_logits/top1_per_map1"][m["name"]] = sum(first) / len(first)
        values["sinks/score"][m["name"]] = m["sinks"]["score"]
        values["sinks/max"][m["name"]] = max(max(row) for row in m["sinks"].get("combined", m["sinks"]["per_head"]))
        values["sinks/min"][m["name"]] = min(min(row) for row in m["sinks"].get("combined", m["sinks"]["per_head"]))
        values["sinks/sink_logit_max"][m["name"]] = m["sinks"]["sink_logit"]["max"] if "sink_logit" in m["sinks"] else None
        values["sinks/bos_peak_over_median"][m["name"]] = m["hidden_states"]["first_position"]["max"] / m["hidden_states"]["median"]
    for c in sweep["cells"]:
        key = f"sweep/{c['task']}/unquantized" if c["bits"] is None else f"sweep/{c['task']}/{c['site']}/{c['method']}/{c['bits']}"
        values.setdefault(key, {})[c["model"]] = c[headline_metric(c["task"])] if c["valid"] else None
    return values


@pytest.fixture(scope="module")
def report(trained, tmp_path_factory) -> Path:
    from quantdiff.cli.app import main

    out = tmp_path_factory.mktemp("report") / "rep"
    main(["reproduce", str(trained), "--out", str(out), "--real-model", "none"])
    return out


def test_reproduce_summarises_the_seeds_as_an_independent_recomputation_does(report):
    doc = json.loads((report / "seeds.json").read_text())
    assert doc["seeds"] == [0, 7] and list(doc["arms"]) == list(ARMS) and doc["reference"] == "standard"
    values = {seed: _independent_values(report, seed) for seed in (0, 7)}
    assert set(doc["metrics"]) == set(values[0])
    for key, block in doc["metrics"].items():
        log = key in LOG_KEYS
        for arm in ARMS:
            per_seed = [values[s][key][arm] for s in (0, 7)]
            assert block["arms"][arm]["per_seed"] == {"0": per_seed[0], "7": per_seed[1]}
            if per_seed == [None, None]:  # measured for no seed (the sink logit's mass: none of these arms has one)
                assert block["arms"][arm]["n"] == 0 and (arm == "standard" or block["paired"][arm]["n"] == 0)
                continue
            if len(set(per_seed)) > 1:
                _check_summary(block["arms"][arm], per_seed, log)
            else:
                summary = block["arms"][arm]
                assert (summary["low"], summary["mean"], summary["high"]) == pytest.approx((per_seed[0],) * 3)
            if arm == "standard":
                continue
            reference = [values[s][key]["standard"] for s in (0, 7)]
            ratio = key.startswith("table5/") or log
            compared = [r / a for r, a in zip(reference, per_seed)] if ratio else [a - r for r, a in zip(reference, per_seed)]
            pair = block["paired"][arm]
            assert list(pair["per_seed"].values()) == pytest.approx(compared, rel=1e-12)
            # two seeds a, b: of the four sign assignments, ±(a + b) always reach |a + b| and ±(a − b) only when
            # a·b ≤ 0, so the sign-flip p is 1 or ½; the t test on two log ratios (1 degree of freedom, the
            # Cauchy distribution) has p = 1 − 2·atan(|t|)/π
            assert pair["family"] == "exploratory" and "holm_p" not in pair
            if not ratio:
                assert (pair["test"], pair["p"]) == ("sign-flip", 1.0 if compared[0] * compared[1] <= 0 else 0.5)
            elif len(set(compared)) > 1:
                logs = np.log(compared)
                t = abs(logs.mean()) / (logs.std(ddof=1) / math.sqrt(2))
                assert (pair["test"], pair["p"]) == ("t", pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-9))
            if len(set(compared)) > 1:
                _check_summary(pair, compared, log=ratio)
            neutral = 1.0 if ratio else 0.0
            higher = sum(c > neutral for c in compared) if ratio else sum(c < neutral for c in compared)
            assert (pair["reference_higher"], pair["equal"]) == (higher, sum(c == neutral for c in compared))
    for arm in ARMS:  # share of seeds with a sink head, Clopper-Pearson's closed forms at k = 0 and k = n
        k = sum(values[s]["sinks/score"][arm] > 0 for s in (0, 7))
        share = doc["sink_share"][arm]
        assert (share["k"], share["n"]) == (k, 2)
        if k == 0:
            assert (share["low"], share["high"]) == pytest.approx((0.0, 1 - 0.025 ** 0.5))
        if k == 2:
            assert (share["low"], share["high"]) == pytest.approx((0.025 ** 0.5, 1.0))


def test_the_emergence_curves_are_the_seeds_mean_with_a_t_band(report, trained):
    doc = json.loads((report / "seeds.json").read_text())
    curve = doc["emergence"]["hidden_states/top1"]["arms"]["diff"]
    logs = {s: json.loads((trained / f"seed-{s}" / "diff" / "train_log.json").read_text()) for s in (0, 7)}
    assert curve["steps"] == [4, 8] and curve["tokens"] == [4 * 8 * 16, 8 * 8 * 16]
    for i in range(2):
        values = [logs[s]["outliers"][i]["hidden_states"]["top1"] for s in (0, 7)]
        mean, low, high = _interval(values)
        assert (curve["mean"][i], curve["low"][i], curve["high"][i]) == pytest.approx((mean, low, high))
        assert [curve["per_seed"][str(s)][i] for s in (0, 7)] == values


def test_the_multi_seed_report_states_its_method_and_shows_intervals(report):
    text = (report / "report.md").read_text()
    assert "Student t over the per-seed values" in text and "Clopper-Pearson" in text and "2 seeds (0, 7)" in text
    doc = json.loads((report / "seeds.json").read_text())
    top1 = doc["metrics"]["table5/hidden_states/top1"]["arms"]["diff"]
    assert "| diff | diff | " in text and f"{top1['mean']:.3g} [{top1['low']:.3g}, {top1['high']:.3g}]" in text
    assert "seeds: standard higher / arm higher / equal" in text
    assert {p.name for p in report.glob("*.png")} == {"sweep_bb.png", "emergence.png"}
    assert sorted(p.name for p in (report / "seed-7").iterdir()) == ["stats.json", "sweep.json"]


def test_rebuild_recomputes_seeds_json_and_the_report_from_the_per_seed_json_alone(report, tmp_path):
    """The same document as reproduce wrote; with a recipe naming primary comparisons, the family is Holm-corrected
    and the report states it. Nothing is trained or measured: the seed directories are read-only inputs."""
    import shutil

    from quantdiff.jobs.reproduce_seeds import main as rebuild_main

    copy = tmp_path / "rep"
    shutil.copytree(report, copy)
    recipe = tmp_path / "micro.toml"
    recipe.write_text(MICRO_BB.replace("SEEDS", "seeds = [0, 7]"))
    assert rebuild_main([str(copy), "--recipe", str(recipe)]) == 0
    rebuilt, written = json.loads((copy / "seeds.json").read_text()), json.loads((report / "seeds.json").read_text())
    assert rebuilt == {**written, "recipe": "micro"}  # the recipe named by --recipe's file
    assert "recomputed from the per-seed JSON" in (copy / "report.md").read_text()
    recipe.write_text(recipe.read_text().replace('sites = ["logits", "qk", "linear"]', 'sites = ["logits", "qk", "linear"]\n'
                      'primary_metrics = ["table5/hidden_states/top1", "sweep/bb/linear/absmax/4"]\nprimary_arms = ["diff", "standard-sgd"]'))
    assert rebuild_main([str(copy), "--recipe", str(recipe)]) == 0
    doc = json.loads((copy / "seeds.json").read_text())
    comparisons = doc["primary"]["comparisons"]
    assert [(c["metric"], c["arm"]) for c in comparisons] == [(k, a) for k in ("table5/hidden_states/top1", "sweep/bb/linear/absmax/4") for a in ("diff", "standard-sgd")]
    p = [c["p"] for c in comparisons]
    order = sorted(range(4), key=p.__getitem__)
    holm, running = [0.0] * 4, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (4 - rank) * p[i]))
        holm[i] = running
    assert [c["holm_p"] for c in comparisons] == pytest.approx(holm)
    assert doc["metrics"]["table5/hidden_states/top1"]["paired"]["diff"]["family"] == "primary"
    assert doc["metrics"]["table5/attention_logits/top1"]["paired"]["diff"]["family"] == "exploratory"
    text = (copy / "report.md").read_text()
    assert "## Primary comparisons with `standard`, Holm-corrected" in text and "(4 comparisons), corrected by Holm (1979)" in text
    (copy / ".quantdiff-output").unlink()
    assert rebuild_main([str(copy), "--recipe", str(recipe)]) == 1  # not a report quantdiff wrote: nothing replaced


def test_the_published_multi_seed_tables_sit_beside_the_live_seed(report, monkeypatch, tmp_path):
    from quantdiff.across_seeds import published
    from quantdiff.core.errors import LoadError
    from quantdiff.jobs.reproduce import published_section

    monkeypatch.setitem(published.PUBLISHED, "bb", report / "seeds.json")
    live = json.loads((report / "seed-7" / "stats.json").read_text())
    section = published_section("bb", 7, live)
    doc = json.loads((report / "seeds.json").read_text())
    top1 = doc["metrics"]["table5/attention_logits/top1"]["arms"]["diff"]
    value = top1["per_seed"]["7"]
    assert section.startswith("## Across seeds (multi-seed, published)")
    # measured live on seed 7 = the published value of seed 7, beside the published mean over both seeds
    assert f"| Top-1 attention logit (abs) | diff | {value:.3g} | {value:.3g} | {top1['mean']:.3g} [{top1['low']:.3g}, {top1['high']:.3g}] |" in section
    assert "## Paired comparisons with `standard` (multi-seed, published)" in section
    assert "not among the published seeds" in published_section("bb", 3, live)
    monkeypatch.setitem(published.PUBLISHED, "bb", tmp_path / "absent.json")
    assert "Not available" in published_section("bb", 7, live)
    for broken, message in (({"schema": "x"}, "not a quantdiff across-seed document"), ({**doc, "version": 9}, "version 9"),
                            ({**doc, "seeds": []}, "'seeds' must list"), ({k: v for k, v in doc.items() if k != "metrics"}, "'metrics' is missing")):
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        monkeypatch.setitem(published.PUBLISHED, "bb", tmp_path / "bad.json")
        with pytest.raises(LoadError, match=message):
            published_section("bb", 7, live)


@pytest.mark.slow(seconds=26)
def test_seeds_in_worker_processes_train_what_one_process_trains(tmp_path):
    import subprocess
    import sys

    train_seeds(micro(), tmp_path / "parallel", jobs=2)
    # one process, pinned as the workers are: `quantdiff train` started afresh (this one has imported torch)
    (tmp_path / "micro.toml").write_text(MICRO_BB.replace("SEEDS", "seeds = [0, 7]"))
    subprocess.run([sys.executable, "-m", "quantdiff", "train", str(tmp_path / "micro.toml"), "--out", str(tmp_path / "sequential"), "--quiet"],
                   check=True, capture_output=True, timeout=300)
    for seed in (0, 7):
        parallel, sequential = _losses(tmp_path / "parallel", seed), _losses(tmp_path / "sequential", seed)
        for arm in ARMS:
            assert parallel[arm]["determinism"] == sequential[arm]["determinism"]
            assert parallel[arm]["determinism"]["pinned"]
            assert parallel[arm]["train_loss_curve"] == sequential[arm]["train_loss_curve"]
            assert parallel[arm]["held_out_loss"] == sequential[arm]["held_out_loss"]
        _matches_trace(parallel, seed)
        assert (tmp_path / "parallel" / f"seed-{seed}" / "train_output.txt").read_text().count("held-out loss") == len(ARMS)


def _cli_error(args: list[str], capsys) -> str:
    from quantdiff.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_multi_seed_commands_are_one_error_line(trained, tmp_path, capsys):
    recipe = tmp_path / "micro.toml"
    recipe.write_text(MICRO_BB.replace("SEEDS", "seeds = [0, 7]"))
    assert "--jobs must be positive" in _cli_error(["train", str(recipe), "--out", str(tmp_path / "o"), "--jobs", "0"], capsys)
    (tmp_path / "bad.toml").write_text(MICRO_BB.replace("SEEDS", "seeds = [1, 1]"))
    assert "lists a seed twice" in _cli_error(["train", str(tmp_path / "bad.toml")], capsys)
    partial = tmp_path / "partial"
    (partial / "seed-7").mkdir(parents=True)
    for arm in ARMS:  # seed 7 as trained by the recipe listing [0, 7]; seed 0 never started
        (partial / "seed-7" / arm).symlink_to(trained / "seed-7" / arm)
    message = _cli_error(["reproduce", str(partial), "--out", str(tmp_path / "r"), "--real-model", "none"], capsys)
    assert "seed-0 is not fully trained" in message
    (tmp_path / "empty").mkdir()
    assert "holds no trained models" in _cli_error(["reproduce", str(tmp_path / "empty"), "--out", str(tmp_path / "r")], capsys)


@pytest.mark.parametrize("damage, named", [
    (lambda arm: _flip_last_byte(arm / "model.safetensors"), "model.safetensors differs from the file written"),
    (lambda arm: (arm / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda arm: (arm / "quantdiff-manifest.json").unlink(), "its quantdiff-manifest.json is missing or unreadable"),
], ids=["flipped-weight-byte", "deleted-tokenizer", "deleted-manifest"])
def test_a_finished_seed_changed_after_training_is_refused_never_skipped_or_retrained(trained, tmp_path, capsys, damage, named):
    """A finished seed was skipped on a re-run unchecked: its arms are now verified against the manifest training
    wrote, and a difference is one line naming the seed and the file; nothing is trained over it."""
    run = tmp_path / "runs"
    shutil.copytree(trained, run, symlinks=True)
    damage(run / "seed-7" / "diff")
    before = tree_hashes(run)
    recipe = tmp_path / "micro.toml"
    recipe.write_text(MICRO_BB.replace("SEEDS", "seeds = [0, 7]"))
    line = f"seed 7: {run / 'seed-7' / 'diff'} is not what training wrote ({named})"
    assert line in _cli_error(["train", str(recipe), "--out", str(run)], capsys)
    assert line in _cli_error(["reproduce", str(run), "--out", str(tmp_path / "r"), "--real-model", "none"], capsys)
    assert tree_hashes(run) == before and not (tmp_path / "r").exists()


def _flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))


def test_a_saved_recipe_trains_the_same_models_unless_training_changed():
    from quantdiff.train.resume_state import same_training

    text = MICRO_BB.replace("SEEDS", "seeds = [0, 7]")
    seven = for_seed(micro(), 7)
    assert same_training(text, seven, 7) and not same_training(text, seven, 0)
    assert same_training(MICRO_BB.replace("SEEDS", "seeds = [7]"), seven, 7)  # seeds added later
    assert same_training(text.replace("stats_tokens = 256", "stats_tokens = 512"), seven, 7)  # analysis: no weight changes
    assert not same_training(text.replace("lr = 7e-3", "lr = 5e-3"), seven, 7)
    assert not same_training(text.replace('name = "diff"', 'name = "diff2"'), seven, 7)
    assert not same_training("not toml [", seven, 7)
    assert same_training(MICRO_BB.replace("SEEDS", "seed = 7"), for_seed(micro("seed = 7"), 7))  # an old log: its recipe's seed


def test_a_single_seed_recipe_keeps_refusing_to_overwrite_its_models(tmp_path):
    from quantdiff.core.savedir import mark

    for arm in ARMS:  # models quantdiff wrote: only --force may replace them
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "config.json").write_text("{}")
        mark(tmp_path / arm, "model")
    with pytest.raises(ConfigError, match="already exist .*--force"):
        train_seeds(micro("seed = 0"), tmp_path)
