"""The confirmatory plans of issue 43 (recipes/confirm-bb.toml, recipes/confirm-text.toml) and what their report
rests on: the plans hold what their headers promise; the quantized-minus-unquantized metrics, their p-values and
Holm's adjustment recompute from results/bb's per-seed JSON by brute force; a recipe may name change/ keys of its
own cells only; scripts/plan_check.py passes a run trained from the committed plan after the commit and fails
every departure from it; and the per-map Top-1 equals a naive float64 forward of the shipped bb models."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantdiff.core.documents import read_document
from quantdiff.core.errors import ConfigError
from quantdiff.train.recipe import load_recipe
from tests.independent_stats import holm, per_seed_values, sign_flip

ROOT = Path(__file__).resolve().parents[1]
RESULTS_BB = ROOT / "results" / "bb"
PLANS = {"confirm-bb": 4, "confirm-text": 3}  # recipe: number of primary metrics (× 2 arms)


# ---- a. the plans ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PLANS)
def test_the_plans_fix_fresh_seeds_the_authors_init_the_causal_quantizer_and_256_sequences(name):
    recipe = load_recipe(name)
    seeds = set(recipe.train.seeds)
    assert len(seeds) == len(recipe.train.seeds) >= 10 and not seeds & set(range(12))  # none of results/bb's 0-11
    assert not seeds & set(load_recipe("text").train.seeds) and not seeds & set(load_recipe("bb").train.seeds)
    assert recipe.train.init == "authors" and recipe.analysis.granularity == "row"
    analysis = recipe.analysis
    assert len(analysis.primary_metrics) == PLANS[name] and analysis.primary_arms == ["diff", "diffv2"]
    assert "standard" in recipe.arm_names and {"diff": "diff", "diffv2": "diffv2"}.items() <= {a.name: a.kind for a in recipe.arms}.items()
    assert analysis.stats_tokens // analysis.seq_len >= 256  # the statistics' sequences
    if recipe.synthetic:
        assert recipe.tasks.bb_sequences >= 256
    else:
        assert recipe.tasks.lm_tokens // analysis.seq_len >= 256
    assert analysis.primary_metrics[:2] == ["table5/attention_logits/top1_per_map", "table5/hidden_states/top1"]
    assert all(m.startswith("change/") and "/linear/absmax/" in m for m in analysis.primary_metrics[2:])


# ---- b. the change metrics on results/bb's per-seed JSON --------------------------------------------------------

SEEDS = [0, 1, 2, 3, 4, 5]
CHANGES = ["change/bb/linear/absmax/4", "change/bb/qk/llm-int8/4"]


def test_change_metrics_and_their_holm_family_recompute_from_the_per_seed_json():
    from quantdiff.across_seeds.document import seeds_document

    stats = {str(s): read_document(RESULTS_BB / f"seed-{s}" / "stats.json") for s in SEEDS}
    sweeps = {str(s): read_document(RESULTS_BB / f"seed-{s}" / "sweep.json") for s in SEEDS}
    kinds = {m["name"]: m["kind"] for m in stats["0"]["models"]}
    arms = ["diff", "diffv2"]
    doc = seeds_document("bb", kinds, "standard", stats, sweeps, {str(s): {} for s in SEEDS}, CHANGES, arms)
    expected = {s: per_seed_values(RESULTS_BB, s) for s in SEEDS}
    p = []
    for key in CHANGES:
        block = doc["metrics"][key]
        assert block["label"].endswith(", quantized − unquantized") and block["comparison"] == "arm − reference"
        for arm in kinds:
            assert block["arms"][arm]["per_seed"] == pytest.approx({str(s): expected[s][key][arm] for s in SEEDS}, abs=1e-12)
        for arm in arms:
            d = [expected[s][key][arm] - expected[s][key]["standard"] for s in SEEDS]
            pair = block["paired"][arm]
            assert list(pair["per_seed"].values()) == pytest.approx(d, abs=1e-12)
            assert pair["mean"] == pytest.approx(sum(d) / len(d), abs=1e-12) and pair["test"] == "sign-flip"
            assert pair["p"] == pytest.approx(sign_flip(d), rel=1e-12)
            p.append(pair["p"])
    assert len(set(p)) > 1  # the family's p differ, so Holm's ordering matters below
    adjusted = holm(p)
    comparisons = doc["primary"]["comparisons"]
    assert [(c["metric"], c["arm"]) for c in comparisons] == [(k, a) for k in CHANGES for a in arms]
    assert [c["holm_p"] for c in comparisons] == pytest.approx(adjusted, rel=1e-12)
    assert [c["detected"] for c in comparisons] == [h <= 0.05 for h in adjusted]
    # a change metric no plan names is not computed: the sweep cells stay as they are
    assert "change/bb/logits/absmax/4" not in doc["metrics"] and "sweep/bb/linear/absmax/4" in doc["metrics"]


# ---- c. a recipe names change/ keys of its own cells only -------------------------------------------------------


def _recipe_with(tmp_path: Path, metrics: str) -> Path:
    text = (ROOT / "recipes" / "confirm-bb.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("primary_metrics = "))
    path = tmp_path / "plan.toml"
    path.write_text(text.replace(line, f"primary_metrics = {metrics}"))
    return path


def test_a_recipe_accepts_the_change_keys_of_its_cells_and_refuses_others_by_name(tmp_path):
    ok = load_recipe(_recipe_with(tmp_path, '["change/bb/qk/llm-int8/2", "change/bb/logits/absmax/16"]'))
    assert ok.analysis.primary_metrics == ["change/bb/qk/llm-int8/2", "change/bb/logits/absmax/16"]
    for absent in ("change/bb/linear/absmax/5", "change/lm/linear/absmax/4", "change/bb/logits/llm-int8/4x"):
        with pytest.raises(ConfigError, match=f"unknown metric '{absent}'") as raised:
            load_recipe(_recipe_with(tmp_path, f'["{absent}"]'))
        assert "\n" not in str(raised.value)


# ---- d. scripts/plan_check.py on a temporary repository ---------------------------------------------------------

PLAN_CHECK_SPEC = importlib.util.spec_from_file_location("plan_check", ROOT / "scripts" / "plan_check.py")
plan_check = importlib.util.module_from_spec(PLAN_CHECK_SPEC)
PLAN_CHECK_SPEC.loader.exec_module(plan_check)
TINY_PLAN = (ROOT / "recipes" / "confirm-bb.toml").read_text().replace(
    "seeds = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]", "seeds = [30, 31]").replace("seed = 12\n", "seed = 30\n")
FINDINGS = ["recipe unchanged since the plan commit", "plan commit is an ancestor of HEAD",
            "every planned seed × arm trained, and nothing else", "every model trained from the plan commit's recipe",
            "every model loads, and no two seeds of an arm hold the same weights",
            "every model's train log names its directory's seed",
            "every model's train log records its provenance (commit, start, finish)",
            "every start and resume ran committed code that contains the plan commit",
            "every model started training after the plan commit"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def planned(tmp_path) -> tuple[Path, Path, Path]:
    """(repository, its committed recipe, a run trained after the commit from exactly that recipe, by code that
    contains it)."""
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    recipe = repo / "recipes" / "plan.toml"
    recipe.write_text(TINY_PLAN)
    _git(repo, "init", "-q")
    _git(repo, "add", "recipes/plan.toml")
    _git(repo, "commit", "-q", "-m", "the plan")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "the code that trained")
    after = int(_git(repo, "show", "-s", "--format=%ct", "HEAD")) + 10
    run = tmp_path / "run"
    for seed in (30, 31):
        for arm in load_recipe(recipe).arm_names:
            _model(run, seed, arm, after, commit=_git(repo, "rev-parse", "HEAD"))
    return repo, recipe, run


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _model(run: Path, seed: int, arm: str, started: float, recipe: str = TINY_PLAN, commit: str | None = None) -> None:
    """A model directory as `quantdiff train` writes one: weights that differ by seed, config, recipe and log."""
    d = run / f"seed-{seed}" / arm
    d.mkdir(parents=True, exist_ok=True)
    (d / "recipe.toml").write_text(recipe)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.full((2,), float(seed))}, d / "model.safetensors")
    history = [{"at": _utc(started), "from_step": 0, "git_commit": commit, "git_dirty": False}]
    log = {"seed": seed, "git_commit": commit, "git_dirty": False, "started_at": _utc(started), "finished_at": _utc(started + 60), "history": history}
    (d / "train_log.json").write_text(json.dumps(log))


def _edit_log(run: Path, model: str, **fields) -> None:
    path = run / model / "train_log.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _failed(result: dict) -> list[str]:
    return [finding for finding, ok in result["findings"].items() if not ok]


def test_plan_check_passes_a_run_trained_from_the_committed_plan_after_it(planned):
    repo, recipe, run = planned
    result = plan_check.check(recipe, run, repo)
    assert list(result["findings"]) == FINDINGS and result["passed"] and _failed(result) == []
    assert result["plan_commit"] == _git(repo, "rev-parse", "HEAD~1") and result["models"] == 12
    assert (result["missing"], result["unplanned"], result["recipe_differs"]) == ([], [], [])


def test_plan_check_fails_a_model_trained_from_another_recipe(planned):
    repo, recipe, run = planned
    (run / "seed-31" / "gated" / "recipe.toml").write_text(TINY_PLAN.replace("steps = 1200", "steps = 1300"))
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["every model trained from the plan commit's recipe"] and result["recipe_differs"] == ["seed-31/gated"]


def test_plan_check_fails_a_missing_and_an_unplanned_model(planned):
    repo, recipe, run = planned
    (run / "seed-30" / "diff" / "model.safetensors").unlink()
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["every planned seed × arm trained, and nothing else"] and result["missing"] == ["seed-30/diff"]
    after = int(_git(repo, "show", "-s", "--format=%ct", "HEAD")) + 10
    _model(run, 30, "diff", after, commit=_git(repo, "rev-parse", "HEAD"))
    _model(run, 32, "diff", after, commit=_git(repo, "rev-parse", "HEAD"))  # a seed added after the plan
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["every planned seed × arm trained, and nothing else"] and result["unplanned"] == ["seed-32/diff"]


def test_plan_check_fails_a_model_started_before_the_plan_whatever_its_file_times(planned):
    repo, recipe, run = planned
    before = int(_git(repo, "show", "-s", "--format=%ct", "HEAD~1")) - 60
    _edit_log(run, "seed-30/standard", started_at=_utc(before))
    assert _failed(plan_check.check(recipe, run, repo)) == ["every model started training after the plan commit"]
    os.utime(run / "seed-30" / "standard" / "model.safetensors", (before, before))  # file times are not read
    _edit_log(run, "seed-30/standard", started_at=_utc(before + 3600))
    assert plan_check.check(recipe, run, repo)["passed"]


def test_plan_check_fails_code_without_the_plan_or_with_uncommitted_changes_and_lists_resumes(planned, capsys, monkeypatch, tmp_path):
    repo, recipe, run = planned
    other = _git(repo, "commit-tree", "HEAD^{tree}", "-m", "code that never saw the plan")  # no parent: not after the plan
    start = json.loads((run / "seed-31" / "sink" / "train_log.json").read_text())["history"][0]
    resume = {"at": start["at"], "from_step": 600, "git_commit": other, "git_dirty": False}
    _edit_log(run, "seed-31/sink", history=[start, resume])
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["every start and resume ran committed code that contains the plan commit"] and result["code_without_plan"] == ["seed-31/sink"]
    assert [e["from_step"] for e in result["starts"]["seed-31/sink"]] == [0, 600]
    _edit_log(run, "seed-31/sink", history=[start, resume | {"git_commit": start["git_commit"], "git_dirty": True}])
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["every start and resume ran committed code that contains the plan commit"] and result["uncommitted_code"] == ["seed-31/sink"]
    _edit_log(run, "seed-31/sink", history=[start, resume | {"git_commit": start["git_commit"]}])
    monkeypatch.setattr(plan_check, "ROOT", repo)
    monkeypatch.setattr("sys.argv", ["plan_check.py", str(recipe), str(run), "--out", str(tmp_path / "check.json")])
    assert plan_check.main() == 0
    assert f"seed-31/sink: started {start['at']}, resumed at steps 600" in capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "check.json").read_text())["starts"]["seed-31/sink"][1]["from_step"] == 600


def test_plan_check_reports_logs_without_provenance_as_not_recorded(planned):
    """A run trained before train logs recorded their code and times: not passed on file times."""
    repo, recipe, run = planned
    for log in run.glob("seed-*/*/train_log.json"):
        log.write_text(json.dumps({"seed": int(log.parent.parent.name.removeprefix("seed-"))}))
    result = plan_check.check(recipe, run, repo)
    assert not result["passed"] and len(result["provenance_not_recorded"]) == 12 and result["first_model_written_at"] is None
    assert _failed(result) == FINDINGS[6:]


def test_plan_check_fails_identical_seeds_and_a_log_of_another_seed(planned):
    repo, recipe, run = planned
    (run / "seed-31" / "diff" / "model.safetensors").write_bytes((run / "seed-30" / "diff" / "model.safetensors").read_bytes())
    _edit_log(run, "seed-30/gated", seed=31)
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == FINDINGS[4:6]
    assert result["identical_weights"] == ["seed-30/diff", "seed-31/diff"] and result["log_seed_differs"] == ["seed-30/gated"]


@pytest.mark.parametrize("damage, words", [
    (lambda run: (run / "seed-abc").mkdir(), "seed-abc is not a seed directory"),
    (lambda run: (run / "seed-32").symlink_to(run / "seed-30"), "seed-32 is a symlink"),
    (lambda run: ((run / "seed-31" / "diff" / "model.safetensors").unlink(),
                  (run / "seed-31" / "diff" / "model.safetensors").symlink_to(run / "seed-30" / "diff" / "model.safetensors")), "model.safetensors is a symlink"),
    (lambda run: (run / "seed-31" / "diff" / "model.safetensors").write_bytes(b"weights"), "diff is not a model: it does not load"),
], ids=["seed-abc", "symlinked-seed", "symlinked-weights", "not-a-model"])
def test_plan_check_refuses_what_is_not_a_seed_or_not_a_model_in_one_line(planned, damage, words):
    repo, recipe, run = planned
    damage(run)
    with pytest.raises(SystemExit, match=words) as info:
        plan_check.check(recipe, run, repo)
    assert str(info.value).startswith("error: ") and "\n" not in str(info.value)


def test_plan_check_fails_a_plan_changed_after_its_commit(planned):
    repo, recipe, run = planned
    recipe.write_text(TINY_PLAN.replace("steps = 1200", "steps = 1300"))  # edited, not committed
    assert _failed(plan_check.check(recipe, run, repo)) == ["recipe unchanged since the plan commit"]
    _git(repo, "commit", "-q", "-am", "a later change to the plan")  # edited and committed: the plan is still the first commit
    result = plan_check.check(recipe, run, repo)
    assert _failed(result) == ["recipe unchanged since the plan commit"] and result["plan_commit"] == _git(repo, "rev-parse", "HEAD~2")


def test_plan_check_refuses_a_recipe_outside_the_repository_or_never_committed(planned, tmp_path):
    repo, _, run = planned
    (tmp_path / "elsewhere.toml").write_text(TINY_PLAN)
    with pytest.raises(SystemExit, match="is not inside the repository"):
        plan_check.check(tmp_path / "elsewhere.toml", run, repo)
    (repo / "recipes" / "new.toml").write_text(TINY_PLAN)
    with pytest.raises(SystemExit, match="was never committed"):
        plan_check.check(repo / "recipes" / "new.toml", run, repo)


# ---- e. the per-map Top-1 against a naive forward of the shipped bb models ---------------------------------------


@pytest.mark.parametrize("arm", ["standard", "diffv2"])
def test_per_map_top1_is_the_mean_of_each_maps_naive_largest_logit(arm):
    import naive_llama
    from test_diffv2 import naive

    from quantdiff.across_seeds.metrics import model_values
    from quantdiff.data.sources import Batch
    from quantdiff.models.loading import load
    from quantdiff.models.names import ASSETS
    from quantdiff.stats.collect import collect_stats
    from quantdiff.stats.schema import model_entry

    model = load(ASSETS / "bb" / arm, device="cpu", tile_size=16)
    ids = torch.randint(1, model.config.vocab_size, (3, 64), generator=torch.Generator().manual_seed(5))
    ids[:, 0] = 0 if model.config.bos_token_id is None else model.config.bos_token_id
    with torch.no_grad():
        entry = model_entry(arm, "shipped", collect_stats(model, [Batch(ids, None, 0)], k=8), arm)
        scores = (naive(model, ids) if arm == "diffv2" else naive_llama.forward(model, ids))["scores"]  # per layer (B, maps, T, T)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    per_map = [layer[:, m][..., causal].abs().max().item() for layer in scores for m in range(layer.shape[1])]
    assert len(per_map) == sum(len(layer) for layer in entry["attention_logits"]["per_head"])
    assert len(per_map) == model.config.num_hidden_layers * (4 if arm == "diffv2" else 2)  # DIFF V2: two maps per head
    got = model_values({"models": [entry]})["table5/attention_logits/top1_per_map"][arm]
    assert got == pytest.approx(sum(per_map) / len(per_map), rel=1e-4)
    assert max(per_map) - min(per_map) > 1e-2 * max(per_map)  # the maps differ: a mean over the wrong maps would show


# ---- the confirmatory report --------------------------------------------------------------------------------------


def _report_copy(tmp_path: Path) -> Path:
    """A report directory holding results/bb's seeds 0-5 (per-seed JSON only: what a rebuild reads)."""
    import shutil

    copy = tmp_path / "rep"
    copy.mkdir()
    shutil.copy(RESULTS_BB / ".quantdiff-output", copy)
    for s in SEEDS:
        shutil.copytree(RESULTS_BB / f"seed-{s}", copy / f"seed-{s}")
    return copy


def _check_result(passed: bool) -> dict:
    findings = dict.fromkeys(FINDINGS, True) | ({} if passed else {FINDINGS[3]: False})
    return {"recipe": "recipes/confirm-bb.toml", "plan_commit": "4363ce52ecca70c3aa64936f27e9f94c6ec40518", "plan_committed_at": "2026-11-28T11:39:35+00:00",
            "first_model_written_at": "2026-11-28T12:00:00+00:00", "last_model_written_at": "2026-11-28T15:00:00+00:00", "models": 72,
            "findings": findings, "passed": passed, "seeds": [12], "arms": ["standard"]}


def test_a_plans_report_titles_its_family_confirmatory_and_labels_the_rest_exploratory(tmp_path, capsys):
    from quantdiff.jobs.reproduce_seeds import main as rebuild_main
    from quantdiff.report.seeds_markdown import _p, interval

    report = _report_copy(tmp_path)
    assert rebuild_main([str(report), "--recipe", "confirm-bb"]) == 0
    doc, text = json.loads((report / "seeds.json").read_text()), (report / "report.md").read_text()
    assert doc["primary"]["plan"] == "recipes/confirm-bb.toml" and "plan_check" not in doc["primary"]
    assert "## Confirmatory family: the plan's comparisons with `standard`, Holm-corrected" in text and "## Primary comparisons" not in text
    assert "Not checked against the trained run" in text and "Everything else in this report is **exploratory**" in text
    for heading in ("Largest activation values across seeds (the paper's Table 5, Top-1)", "Accuracy with quantization across seeds (the paper's Figure 8)",
                    "Emergence of outliers during training (across seeds)"):
        assert f"## {heading} (exploratory)\n" in text
    assert "> **Non-causal quantization.**" not in text  # the plan quantizes causally
    # the two untested comparisons still count in the family of 8 (as p = 1): Holm over the 6 alone would be laxer
    comparisons = doc["primary"]["comparisons"]
    assert len(comparisons) == 8 and [c["p"] is None for c in comparisons] == [False] * 6 + [True] * 2
    assert [c["holm_p"] for c in comparisons[:6]] == pytest.approx(holm([c["p"] for c in comparisons[:6]] + [1.0, 1.0])[:6], rel=1e-12)
    assert [c["holm_p"] for c in comparisons[:6]] != pytest.approx(holm([c["p"] for c in comparisons[:6]]), rel=1e-12)
    rows = text.split("## Confirmatory family")[1].split("\n## ")[0].splitlines()
    assert "2 of the 8 comparisons untested: each counts in Holm's correction as p = 1." in rows
    for item in doc["primary"]["comparisons"]:
        if item["metric"] == "change/bb/linear/absmax/3":  # results/bb swept down to 4 bits: measured nowhere, tested never
            assert item["p"] is None and f"| {item['metric']} | {item['arm']} | not measured | – | – | – | – | untested |" in rows
            continue
        label = doc["metrics"][item["metric"]]["label"]
        row = next(r for r in rows if r.startswith(f"| {label} | standard ÷ {item['arm']} |") or r.startswith(f"| {label} | {item['arm']} − standard |"))
        pair = doc["metrics"][item["metric"]]["paired"][item["arm"]]
        verdict = "difference detected" if item["holm_p"] <= 0.05 else "no difference detected"
        assert interval(pair, times=item["metric"].startswith("table5/")) in row and row.endswith(f"| {_p(item['p'])} | {_p(item['holm_p'])} | {verdict} |")
    # the change metric is labelled as such, and the sweep table still shows each cell's accuracy, not its change
    assert "### Quantized − unquantized, each model against itself" in text and "bb accuracy, absmax 4-bit at linear, quantized − unquantized" in text
    linear = text.split("at site `linear`")[1].split("###")[0]
    cell = doc["metrics"]["sweep/bb/linear/absmax/4"]["arms"]["standard"]
    assert f"| standard | absmax | {interval(doc['metrics']['sweep/bb/unquantized']['arms']['standard'])} | " in linear
    assert interval(cell) in next(r for r in linear.splitlines() if r.startswith("| standard | absmax |"))

    (report / "plan_check.json").write_text(json.dumps(_check_result(passed=True)))
    assert rebuild_main([str(report), "--recipe", "confirm-bb"]) == 0
    text = (report / "report.md").read_text()
    assert "committed in 4363ce52ecca70c3aa64936f27e9f94c6ec40518 (2026-11-28T11:39:35+00:00)" in text and "on the run's 72 models" in text
    assert all(f"- ok: {finding}" in text for finding in FINDINGS) and "not confirmatory evidence" not in text
    (report / "plan_check.json").write_text(json.dumps(_check_result(passed=False)))
    assert rebuild_main([str(report), "--recipe", "confirm-bb"]) == 0
    text = (report / "report.md").read_text()
    assert f"- **failed**: {FINDINGS[3]}" in text and "**The plan check failed: until that is explained, this family is not confirmatory evidence.**" in text


def test_a_plan_check_of_another_recipe_or_beside_no_plan_is_refused_and_a_changed_plan_is_no_plan(tmp_path, capsys):
    from quantdiff.jobs.reproduce_seeds import main as rebuild_main

    report = _report_copy(tmp_path)
    (report / "plan_check.json").write_text(json.dumps(_check_result(passed=True) | {"recipe": "recipes/confirm-text.toml"}))
    assert rebuild_main([str(report), "--recipe", "confirm-bb"]) == 1 and not (report / "report.md").exists()
    assert capsys.readouterr().out.strip().endswith("checks recipes/confirm-text.toml, but this report's plan is recipes/confirm-bb.toml")
    (report / "plan_check.json").write_text(json.dumps(_check_result(passed=True)))
    assert rebuild_main([str(report), "--recipe", "bb"]) == 1 and "the recipe given is not a confirmatory plan" in capsys.readouterr().out
    (report / "plan_check.json").write_text("{")
    assert rebuild_main([str(report), "--recipe", "confirm-bb"]) == 1 and "plan_check.json is unreadable" in capsys.readouterr().out
    (report / "plan_check.json").unlink()
    changed = tmp_path / "confirm-bb.toml"  # the plan with one byte more: no longer the plan
    changed.write_text((ROOT / "recipes" / "confirm-bb.toml").read_text() + "\n")
    assert rebuild_main([str(report), "--recipe", str(changed)]) == 0
    doc, text = json.loads((report / "seeds.json").read_text()), (report / "report.md").read_text()
    assert doc["primary"]["plan"] is None and "## Primary comparisons with `standard`, Holm-corrected" in text and "Confirmatory" not in text
