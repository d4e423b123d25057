"""Issue 21's rules, each tested as a rule: nothing the user owns is lost, what appears during a run is never
replaced, file outputs follow the directory rule, names fit their temporaries, training stops on a non-finite
loss, group-wise exports of any (bits, G, width) reload bit for bit, and task sizes are bounded."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quantdiff.cli.app import main  # noqa: E402
from quantdiff.core import atomic  # noqa: E402
from quantdiff.core.atomic import KeptOutput, atomic_file, remove_stale_temporaries  # noqa: E402
from quantdiff.core.errors import ConfigError, DataError  # noqa: E402
from quantdiff.core.owned import written_by_quantdiff  # noqa: E402
from quantdiff.core.savedir import atomic_dir  # noqa: E402
from quantdiff.eval.sweep import Cell  # noqa: E402
from quantdiff.models.names import ASSETS  # noqa: E402
from quantdiff.quant import export as export_module  # noqa: E402
from quantdiff.quant.formats import AbsmaxExport  # noqa: E402
from quantdiff.report.sweep_report import cell_points, plot_sweep  # noqa: E402
from test_bad_input import tree_hashes  # noqa: E402
from test_bigram_backcopy import MICRO as BB_MICRO  # noqa: E402

SOURCE = ASSETS / "tiny" / "diff"
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 8


def _fails(capsys, argv: list) -> str:
    """Run the CLI expecting exactly one `error:` line and a non-zero exit; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code not in (0, None) and err.count("\n") == 1 and err.startswith("error:"), err
    assert "internal error" not in err and "Traceback" not in err
    return err


def _stops(capsys, argv: list) -> str:
    """Run the CLI expecting it to stop mid-run (after its progress lines) with one `error:` line, the last."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("error:") == 1 and err.strip().splitlines()[-1].startswith("error:"), err
    assert "internal error" not in err and "Traceback" not in err
    return err.strip().splitlines()[-1]


def _runs(argv: list) -> None:
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        assert exc.code in (0, None), exc


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


# ---- 1. data loss: every path read is an input; what appears during a run is never replaced -------------------


def test_a_weight_shard_outside_the_model_directory_is_an_input(tmp_path, capsys):
    """The index may name a shard anywhere; `--json` onto it would overwrite the user's weights."""
    src = tmp_path / "model"
    shutil.copytree(SOURCE, src)
    tensors = load_file(src / "model.safetensors")
    moved = "model.layers.0.mlp.up_proj.weight"
    save_file({moved: tensors.pop(moved)}, tmp_path / "outside.safetensors", metadata={"format": "pt"})
    save_file(tensors, src / "model-a.safetensors", metadata={"format": "pt"})
    (src / "model.safetensors").unlink()
    weight_map = {name: "model-a.safetensors" for name in tensors} | {moved: "../outside.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = tree_hashes(tmp_path)
    err = _fails(capsys, ["stats", src, "--tokens", "16", "--json", tmp_path / "outside.safetensors", "--force"])
    assert "is the input file" in err and "outside.safetensors" in err
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("out, real_model", [("R", "R/mymodel"), ("M/rep", "M")], ids=["out-holds-real-model", "out-inside-real-model"])
def test_reproduce_never_writes_on_or_in_its_real_model(tmp_path, capsys, monkeypatch, out, real_model):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(SOURCE, tmp_path / real_model)
    (tmp_path / real_model / "NOTES.txt").write_text("the user's notes")
    if out == "R":
        (tmp_path / "R" / ".quantdiff-output").write_text(json.dumps({"kind": "report", "quantdiff_version": "0"}))
    before = tree_hashes(tmp_path)
    err = _fails(capsys, ["reproduce", "tiny", "--out", out, "--force", "--real-model", real_model])
    assert "input model" in err
    assert tree_hashes(tmp_path) == before


def _appear_during_export(monkeypatch, make) -> None:
    """Run `make()` while the export is being written (after the checks, before the rename)."""
    original = export_module._verify

    def verify_then_appear(*args):
        original(*args)
        make()

    monkeypatch.setattr(export_module, "_verify", verify_then_appear)


@pytest.mark.parametrize("force", [False, True], ids=["without-force", "with-force"])
def test_a_directory_that_appears_during_a_run_is_kept_and_so_is_the_new_output(tmp_path, capsys, monkeypatch, state, force):
    out = tmp_path / "P"
    _appear_during_export(monkeypatch, lambda: (out.mkdir(), (out / "thesis.tex").write_text("irreplaceable")))
    err = _fails(capsys, ["quantize", "tiny/diff", "--out", out, "--bits", "8", *(["--force"] if force else [])])
    assert ("is not empty" if not force else "not written by quantdiff") in err
    assert (out / "thesis.tex").read_text() == "irreplaceable" and sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    kept = Path(err.strip().rsplit("the new output is kept as ", 1)[1])
    assert kept.parent == tmp_path and (kept / "model.safetensors").is_file() and (kept / "config.json").is_file()
    assert remove_stale_temporaries() == [] and kept.exists()  # never cleaned up as a stale temporary
    with open(next((state / "quantdiff" / "temporaries").glob("*.paths"))) as registry:
        assert str(kept) not in registry.read()


def test_an_empty_directory_made_during_a_run_is_simply_replaced(tmp_path, monkeypatch):
    out = tmp_path / "P"
    _appear_during_export(monkeypatch, out.mkdir)
    _runs(["quantize", "tiny/diff", "--out", out, "--bits", "8"])
    assert (out / "model.safetensors").is_file()


def test_a_file_that_appears_during_a_write_is_kept(tmp_path, state, monkeypatch):
    target = tmp_path / "stats.json"
    with pytest.raises(KeptOutput, match="not written by quantdiff") as raised:
        with atomic_file(target) as tmp:
            tmp.write_text('{"schema": "quantdiff.stats"}')
            target.write_text("the user's")
    assert target.read_text() == "the user's" and raised.value.kept.read_text() == '{"schema": "quantdiff.stats"}'
    # Even in the instant between that check and the rename, the rename itself never replaces what appeared.
    target.unlink()
    monkeypatch.setattr(atomic.os.path, "lexists", lambda path: False)
    with pytest.raises(KeptOutput, match="appeared while quantdiff was writing it"):
        with atomic_file(target) as tmp:
            tmp.write_text('{"schema": "quantdiff.stats"}')
            target.write_text("the user's")
    assert target.read_text() == "the user's"


def test_a_directory_swapped_under_a_forced_replace_is_put_back(tmp_path, state):
    """--force replaces a marked directory: if the marked one is swapped for another between the check and the
    rename, the one found is restored and the new output kept."""
    out = tmp_path / "R"
    with atomic_dir(out, kind="report") as tmp:
        (tmp / "report.md").write_text("first")
    with pytest.raises(KeptOutput, match="not written by quantdiff"):
        with atomic_dir(out, force=True, kind="report") as tmp:
            (tmp / "report.md").write_text("second")
            shutil.rmtree(out)
            out.mkdir()
            (out / "mine.txt").write_text("the user's")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def _dead_registry(state: Path, paths: list) -> None:
    writer = {**atomic._identity(), "pid": 2**22 + 4321, "start": 7}
    file = state / "quantdiff" / "temporaries" / "dead.paths"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(line) + "\n" for line in [writer, *map(str, paths)]))


def test_a_registry_listing_arbitrary_paths_deletes_none_of_them(tmp_path, state):
    """Only names of the temporary pattern, in a directory reached without a symlink, are ever deleted."""
    work = tmp_path / "work"
    (work / "thesis").mkdir(parents=True)
    (work / "thesis" / "chapter.tex").write_text("irreplaceable")
    (work / "notes.txt").write_text("mine")
    (work / "elsewhere").mkdir()
    hidden = work / "elsewhere" / f".x.tmp-{'a' * 16}"
    hidden.write_text("reached only through a link")
    (work / "link").symlink_to(work / "elsewhere")
    ours = work / f".result.json.tmp-{'b' * 16}"
    ours.write_text("a real stale temporary")
    _dead_registry(state, [work / "thesis", work / "notes.txt", work / "link" / hidden.name, work / ".." / "work" / "notes.txt",
                           Path("notes.txt"), work / f".thesis.tmp-{'c' * 15}", ours])
    before = tree_hashes(tmp_path / "work")
    assert remove_stale_temporaries() == [ours]
    after = tree_hashes(tmp_path / "work")
    assert {k: v for k, v in before.items() if ours.name not in k} == after


def _user_plot(path: Path) -> None:
    """A plot the user made with matplotlib (its own default metadata)."""
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    fig.savefig(path)
    plt.close(fig)


def _cells() -> list[Cell]:
    return [Cell("m", "lm", None, None, None, {"accuracy": 0.5}), Cell("m", "lm", "absmax", 8, "logits", {"accuracy": 0.4})]


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_plots_carry_our_mark_and_replace_only_ours(tmp_path, suffix):
    plot = tmp_path / f"figure{suffix}"
    plot_sweep(cell_points(_cells(), "accuracy"), plot, "accuracy", "title")
    assert written_by_quantdiff(plot)
    plot_sweep(cell_points(_cells(), "accuracy"), plot, "accuracy", "title")  # ours: replaced without --force
    foreign = tmp_path / f"precious{suffix}"
    _user_plot(foreign)
    before = foreign.read_bytes()
    assert not written_by_quantdiff(foreign)
    with pytest.raises(ConfigError, match="not written by quantdiff"):
        plot_sweep(cell_points(_cells(), "accuracy"), foreign, "accuracy", "title")
    assert foreign.read_bytes() == before
    plot_sweep(cell_points(_cells(), "accuracy"), foreign, "accuracy", "title", force=True)
    assert written_by_quantdiff(foreign)


def test_json_outputs_replace_only_quantdiff_json_unless_forced(tmp_path, capsys):
    (tmp_path / "words.txt").write_text(TEXT)
    precious = tmp_path / "precious.json"
    precious.write_text('{"my": "results"}')
    common = ["eval", "tiny/diff", "--task", "lm", "--data", tmp_path / "words.txt", "--context", "16", "--limit", "1", "--quiet"]
    err = _fails(capsys, [*common, "--json", precious])
    assert "precious.json exists and was not written by quantdiff" in err and precious.read_text() == '{"my": "results"}'
    _fails(capsys, ["stats", "tiny/diff", "--tokens", "16", "--quiet", "--json", precious])
    assert precious.read_text() == '{"my": "results"}'
    _runs([*common, "--json", precious, "--force"])
    assert json.loads(precious.read_text())["schema"] == "quantdiff.sweep"
    _runs([*common, "--json", precious])  # now ours: replaced without --force
    (tmp_path / "plots").mkdir()
    _user_plot(tmp_path / "plots" / "ccdf_hidden_states.png")
    before = tree_hashes(tmp_path / "plots")
    assert "ccdf_hidden_states.png exists and was not written by quantdiff" in _fails(capsys, ["stats", "tiny/diff", "--tokens", "16", "--quiet", "--plot", tmp_path / "plots"])
    assert tree_hashes(tmp_path / "plots") == before


# ---- 5. other output paths: stdout, symlink loops ------------------------------------------------------------


def test_json_dash_is_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "words.txt").write_text(TEXT)
    _runs(["eval", "tiny/diff", "--task", "lm", "--data", "words.txt", "--context", "16", "--limit", "1", "--json", "-"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["schema"] == "quantdiff.sweep" and doc["cells"][0]["task"] == "lm"
    assert "accuracy" in captured.err and not (tmp_path / "-").exists()  # the table went to stderr
    _runs(["stats", "tiny/diff", "--tokens", "16", "--json", "-"])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["schema"] == "quantdiff.stats" and "Top-1" in captured.err and not (tmp_path / "-").exists()


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_a_self_looping_symlink_output_is_refused_and_kept(tmp_path, capsys, flag):
    loop = tmp_path / ("loop.json" if flag == "--json" else "loop.png")
    loop.symlink_to(loop.name)
    err = _fails(capsys, ["sweep", "tiny/diff", "--task", "lm", flag, loop])
    assert "symlink loop" in err and loop.is_symlink() and os.readlink(loop) == loop.name


# ---- 2. silently wrong: group-wise exports of any (bits, G, width) reload bit for bit ------------------------


def _naive_groupwise(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The definition, group by group: scale = max|w| / qmax over each group of `group` inputs of a row; codes =
    round-half-even(w · qmax / max|w|) (bitsandbytes' multiply by the inverse); dequant = codes · scale."""
    q = 2 ** (bits - 1) - 1
    out = torch.empty_like(weight)
    for row in range(weight.shape[0]):
        for start in range(0, weight.shape[1], group):
            w = weight[row, start : start + group].float()
            amax = w.abs().max()
            inverse = q / amax if amax > 0 else torch.tensor(0.0)
            out[row, start : start + group] = (torch.round(w * inverse).clamp(-q, q) * (amax / q)).to(weight.dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([*range(2, 9), 16]), group=st.one_of(st.integers(1, 200), st.integers(200, 10**6)),
       width=st.integers(1, 160), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_groupwise_exports_of_any_bits_group_and_width_reload_bit_for_bit(tmp_path_factory, bits, group, width, rows, seed):
    """Through the file: encode, safetensors on disk, decode — equal to the naive definition, including G ≥ the
    width (one group per row, whose scale is still (rows, 1)) and G far beyond it."""
    weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 3
    fmt = AbsmaxExport(bits, group)
    file = tmp_path_factory.mktemp("g") / "w.safetensors"
    save_file({k: v.contiguous() for k, v in fmt.encode(weight).items()}, str(file))
    decoded = fmt.decode(load_file(str(file)), weight.shape, weight.dtype)
    assert torch.equal(decoded, _naive_groupwise(weight, bits, min(group, width)))


@pytest.mark.parametrize("group", [128, 352, 100_000], ids=["G=width", "G>width", "G>>width"])
def test_quantize_with_a_group_at_least_the_width_reloads_exactly(tmp_path, group):
    """tiny/diff's linear layers are 128 and 352 wide; before, such exports did not reload at all."""
    import quantdiff
    from quantdiff.quant.sites import AbsmaxMethod, LinearSite, fake_quant_weight, linear_targets

    _runs(["quantize", "tiny/diff", "--out", tmp_path / "q", "--bits", "4", "--group-size", str(group)])
    reloaded = dict(quantdiff.load(tmp_path / "q", device="cpu").named_parameters())
    source = quantdiff.load("tiny/diff", device="cpu")
    for fqn, module in linear_targets(source, LinearSite()):
        assert torch.equal(reloaded[f"{fqn}.weight"], fake_quant_weight(module.weight, AbsmaxMethod(4, weight_group_size=group))), fqn
        assert torch.equal(reloaded[f"{fqn}.weight"], _naive_groupwise(module.weight.detach(), 4, min(group, module.weight.shape[1]))), fqn


# ---- 3. sizes and names bounded before any work ----------------------------------------------------------------


def test_a_retrieval_context_beyond_the_models_positions_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    from quantdiff.eval.tasks import retrieval

    monkeypatch.setattr(retrieval.RetrievalTask, "prepare", lambda *a, **k: pytest.fail("data was built"))
    err = _fails(capsys, ["eval", "tiny/diff", "--task", "retrieval", "--context", "100000"])
    assert "100,000 tokens exceeds the model's 128 positions" in err


def test_a_context_within_positions_but_beyond_memory_is_refused():
    from types import SimpleNamespace

    from quantdiff.core.memory import device_memory
    from quantdiff.eval.bounds import check_sequence_fits, forward_bytes

    config = SimpleNamespace(max_position_embeddings=10**9, vocab_size=50_000, num_attention_heads=16)
    length = 10**6
    assert forward_bytes(8, length, 50_000, 16) > device_memory()
    with pytest.raises(ConfigError, match="of memory of this machine"):
        check_sequence_fits(length, config, 8, "--context")
    with pytest.raises(DataError, match="exceeds the model's 1,000 positions"):
        check_sequence_fits(1001, SimpleNamespace(max_position_embeddings=1000), 1, "--context")


@pytest.mark.parametrize("length", [234, 240, 250, 300])
def test_output_names_too_long_for_their_temporaries_are_refused_before_any_work(tmp_path, capsys, length):
    name = "n" * length
    assert f"is {length} bytes long: names may have at most 233" in _fails(capsys, ["quantize", "tiny/diff", "--out", tmp_path / name])
    assert f"is {length + 5} bytes long" in _fails(capsys, ["stats", "tiny/diff", "--json", tmp_path / f"{name}.json"])
    assert list(tmp_path.iterdir()) == []


def test_the_longest_accepted_name_is_written(tmp_path):
    with atomic_file(tmp_path / ("n" * 228 + ".json")) as tmp:  # 233 bytes: its temporary is exactly 255
        assert len(tmp.name) == 255
        tmp.write_text("{}")


# ---- 5. training: stops on a non-finite loss, keeps the last finite checkpoint; OUT is a directory of its own ---

# The bigram-backcopy test recipe (no corpus, no tokenizer training), with the standard/Diff pair, six steps.
MICRO = (BB_MICRO.split("[[arms]]")[0].replace("steps = 4", "steps = 6").replace("eval_every = 2", "eval_every = 100")
         .replace("outlier_sequences = 2", "outlier_sequences = 0"))


def test_a_non_finite_loss_stops_training_and_keeps_the_last_finite_checkpoint(tmp_path, capsys, monkeypatch):
    from quantdiff.train import loop

    (tmp_path / "r.toml").write_text(MICRO)
    calls = []
    original = loop.lm_loss

    def nan_from_step_4(model, inputs, targets):  # two arms per step: the 7th call is step 4's first arm
        calls.append(1)
        loss = original(model, inputs, targets)
        return loss * float("nan") if len(calls) >= 7 else loss

    monkeypatch.setattr(loop, "lm_loss", nan_from_step_4)
    err = _stops(capsys, ["train", tmp_path / "r.toml", "--out", tmp_path / "run"])
    assert "training diverged: standard's loss is nan at step 4; the checkpoint of step 2 is kept" in err
    state = json.loads((tmp_path / "run" / ".checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and all(v is not None for curve in state["loss"].values() for v in curve)
    weights = load_file(tmp_path / "run" / ".checkpoint" / "standard.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert not (tmp_path / "run" / "standard").exists() and not (tmp_path / "run" / "diff").exists()


def test_a_huge_learning_rate_saves_no_nan_model(tmp_path, capsys):
    (tmp_path / "r.toml").write_text(MICRO.replace("warmup_steps = 1", "warmup_steps = 1\nlr = 1e30\nmin_lr = 0"))
    err = _stops(capsys, ["train", tmp_path / "r.toml", "--out", tmp_path / "run"])
    assert "training diverged" in err and "lower the learning rate" in err
    assert not (tmp_path / "run" / "standard").exists() and not (tmp_path / "run" / "diff").exists()
    for kept in (tmp_path / "run" / ".checkpoint").glob("*.safetensors"):  # a checkpoint, if any, is finite
        assert all(bool(torch.isfinite(t).all()) for t in load_file(kept).values())


@pytest.mark.parametrize("setup, words", [
    (lambda run: (run / ".checkpoint").mkdir(parents=True) or (run / ".checkpoint" / "state.json").write_text("{}"), "not written by quantdiff"),
    (lambda run: (run / ".checkpoint").mkdir(parents=True) or (run / ".checkpoint" / ".quantdiff-output").write_text('{"kind": "report"}'),
     "holds a quantdiff report, not a checkpoint"),
    (lambda run: None, 'dtype = "bf16" runs on CUDA only'),
], ids=["checkpoint-without-marker", "checkpoint-with-wrong-marker", "bf16-on-cpu"])
def test_a_failing_training_run_prints_only_its_error_line(tmp_path, capsys, setup, words):
    """Everything is checked before the first step: no progress line, no 'parameters:' line, then an error."""
    recipe = MICRO if "bf16" not in words else MICRO.replace('device = "cpu"', 'device = "cpu"\ndtype = "bf16"')
    (tmp_path / "r.toml").write_text(recipe)
    setup(tmp_path / "run")
    before = tree_hashes(tmp_path)
    assert words in _fails(capsys, ["train", tmp_path / "r.toml", "--out", tmp_path / "run"])
    assert tree_hashes(tmp_path) == before


def test_train_force_into_a_pair_directory_is_refused(tmp_path, capsys):
    """A pair holds standard, diff and diffv2: retraining two of them would leave a mixed directory."""
    _runs(["pair", tmp_path / "P", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "259", "--diffv2"])
    capsys.readouterr()
    (tmp_path / "r.toml").write_text(MICRO)
    before = tree_hashes(tmp_path)
    assert "is a quantdiff pair directory" in _fails(capsys, ["train", tmp_path / "r.toml", "--out", tmp_path / "P", "--force"])
    assert tree_hashes(tmp_path) == before


def test_the_real_model_section_fits_a_small_model(tmp_path):
    """`reproduce --real-model` on a model 128 wide with 128 positions: the 128-group weight format spans whole
    rows, and windows longer than the positions are cut to them (both crashed the whole report before)."""
    from rich.console import Console

    from quantdiff.jobs.real_model import RealModelPlan, run_real_model

    plan = RealModelPlan(stats_tokens=64, seq_len=300, windows=1, context=300, methods=("absmax",), bits=(8,), sites=("linear",))
    section = run_real_model("tiny/diff", tmp_path, "cpu", Console(file=io.StringIO()), plan)
    doc = json.loads((tmp_path / "real_model.json").read_text())["models"][0]
    assert "not measured" not in section and doc["plan"]["seq_len"] == doc["plan"]["context"] == 128
    assert [row["granularity"] for row in doc["weight_only"]] == ["per-output-channel", "group-128", "blockwise-64"]
