"""Faults: a process killed mid-write, a full disk, --force next to precious files, odd output targets.

Each leaves no complete-looking output and nothing stale once the next run has finished."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from quantdiff.cli.app import main
import quantdiff.core.atomic as atomic
from quantdiff.core.atomic import atomic_file, remove_stale_temporaries, writable_target
from quantdiff.core.errors import ConfigError
from quantdiff.core.savedir import MARKER, atomic_dir
from quantdiff.models.names import ASSETS
from quantdiff.quant.checkpoint import load_quantized
from tests import forked
from tests.test_bad_input import tree_hashes

SOURCE = ASSETS / "tiny" / "diff"
ROOT = Path(__file__).resolve().parents[1]

# Runs `quantdiff ARGS...` with the first write into a temporary (a file or directory whose name holds
# ".tmp-") cut short: half the bytes, then "WRITTEN" on stdout and a hang until the test kills it.
KILL_DRIVER = textwrap.dedent(
    """
    import pathlib, sys, time
    import safetensors.torch as st
    import quantdiff.quant.export as export

    def hang(path, data):
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        print("WRITTEN", flush=True)
        time.sleep(300)

    real_write_text, real_save = pathlib.Path.write_text, export.save_file

    def write_text(self, text, *args, **kwargs):
        if ".tmp-" in str(self) and self.suffix == ".json" and "config" not in self.name:
            hang(self, text.encode())
        return real_write_text(self, text, *args, **kwargs)

    def save_file(tensors, filename, metadata=None):
        hang(filename, st.save(tensors, metadata=metadata))

    pathlib.Path.write_text = write_text
    export.save_file = save_file
    from quantdiff.cli.app import main
    main(sys.argv[1:])
    """
)


def _killed_mid_write(args: list[str]) -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    proc = forked.start(code=KILL_DRIVER, args=args, cwd=Path.cwd(), env=env)  # a process of its own (tests/forked.py)
    try:
        assert proc.readline().strip() == "WRITTEN"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_sigkill_during_quantize_then_the_next_run_succeeds_and_cleans_up(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    source_hashes = tree_hashes(src)
    out = tmp_path / "q"
    _killed_mid_write(["quantize", str(src), "--out", str(out), "--bits", "4"])
    assert not out.exists()  # nothing complete-looking under the target name
    assert [name.startswith(".q.tmp-") for name in _hidden(tmp_path)] == [True]  # the killed run's temporary
    main(["quantize", str(src), "--out", str(out), "--bits", "4"])
    assert _hidden(tmp_path) == []  # the stale temporary is gone
    assert load_quantized(out, device="cpu") is not None and (out / MARKER).is_file()
    assert tree_hashes(src) == source_hashes


def test_sigkill_during_stats_json_then_the_next_run_succeeds_and_cleans_up(tmp_path):
    target = tmp_path / "s.json"
    _killed_mid_write(["stats", "tiny/diff", "--tokens", "128", "--quiet", "--json", str(target)])
    assert not target.exists()
    (stale,) = _hidden(tmp_path)
    assert stale.startswith(".s.tmp-") and stale.endswith(".json")
    main(["stats", "tiny/diff", "--tokens", "128", "--quiet", "--json", str(target)])
    assert json.loads(target.read_text())["schema"] == "quantdiff.stats"
    assert _hidden(tmp_path) == []


# ---- only what quantdiff provably made is cleaned ----------------------------------------------------------


def _registry(state: Path, writer: dict, paths: list[Path]) -> Path:
    """A registry as a writer process leaves it: who it was, then the temporaries it recorded."""
    file = state / "quantdiff" / "temporaries" / f"{writer['pid']}-{writer['start']}.paths"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("".join(json.dumps(line) + "\n" for line in [writer, *map(str, paths)]))
    return file


def _lookalikes(directory: Path) -> list[Path]:
    """A user's files whose names merely look like quantdiff's temporaries."""
    notes = directory / ".mynotes.tmp-999999-1-keep"
    notes.write_text("my notes")
    old = directory / ".report.old-999998-1-x"
    old.mkdir()
    (old / "draft.md").write_text("my draft")
    return [notes, old]


def test_stale_temporaries_are_the_recorded_ones_of_ended_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    me = atomic._identity()
    ended = {**me, "pid": 2**22 + 12345, "start": 5}
    work = tmp_path / "work"
    work.mkdir()
    dead_file, dead_dir, live, remote = (work / f".{name}.tmp-{n:016x}" for n, name in enumerate("adaa", start=1))
    for path in (dead_file, live, remote):
        path.write_text("x")
    dead_dir.mkdir()
    (dead_dir / "model.safetensors").write_text("half")
    ended_registry = _registry(tmp_path / "state", ended, [dead_file, dead_dir, work / f".gone.tmp-{5:016x}"])
    _registry(tmp_path / "state", me, [live])  # this process still runs
    _registry(tmp_path / "state", {**ended, "host": "another-host", "pid": 7}, [remote])  # cannot tell: kept
    user = _lookalikes(work)
    before = tree_hashes(work)
    assert sorted(remove_stale_temporaries()) == sorted([dead_file, dead_dir])
    assert not ended_registry.exists() and live.exists() and remote.exists()
    assert all(path.exists() for path in user)
    assert {k: v for k, v in tree_hashes(work).items() if "mynotes" in k or "report.old" in k} == {
        k: v for k, v in before.items() if "mynotes" in k or "report.old" in k
    }


def test_lookalike_files_survive_every_writer(tmp_path, capsys):
    """Writes into a directory holding a user's temporary-looking names: files, JSON, directories, plots."""
    user = _lookalikes(tmp_path)
    before = {k: v for k, v in tree_hashes(tmp_path).items()}
    main(["quantize", "tiny/diff", "--out", str(tmp_path / "q"), "--bits", "8"])
    main(["stats", "tiny/diff", "--tokens", "64", "--quiet", "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path)])
    after = tree_hashes(tmp_path)
    assert all(path.exists() for path in user)
    assert {k: after[k] for k in before} == before


# ---- disk full ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_progress_bars():
    """As under the real command line, where main() disables them before transformers is imported."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


@pytest.fixture
def full_disk(tmp_path, no_progress_bars):
    """A 256 KiB tmpfs: smaller than any model quantdiff writes."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize(
    "command",
    [
        ["quantize", "tiny/diff", "--out", "{disk}/q", "--bits", "8"],
        ["pair", "{disk}/p", "--hidden-size", "256", "--layers", "4"],
        ["stats", "tiny/diff", "--tokens", "128", "--quiet", "--plot", "{disk}/plots"],
        ["stats", "tiny/diff", "--tokens", "128", "--quiet", "--json", "{disk}/s.json"],
    ],
    ids=["quantize", "pair", "stats-plot", "stats-json"],
)
def test_full_disk_gives_one_line_and_leaves_nothing(full_disk, capsys, command):
    if command[0] == "stats":  # fill the disk so that even small plots and JSON cannot be written
        (full_disk / "ballast").write_bytes(b"\0" * (256 * 1024 - 4096))
    before = tree_hashes(full_disk)
    with pytest.raises(SystemExit) as exit_info:
        main([arg.replace("{disk}", str(full_disk)) for arg in command])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error: no space left on device"), err
    assert tree_hashes(full_disk) == before  # no partial file, no temporary, no empty directory


@pytest.mark.parametrize("disk", ["tmpfs", "dev-full"])
def test_a_gguf_export_onto_a_full_disk_says_so_and_keeps_the_old_file(tmp_path, capsys, monkeypatch, no_progress_bars, disk):
    """GGUF tensors went through numpy's tofile, whose short write was `internal error: OSError: N requested and
    M written`; now the disk-full line of every other format. A 256 KiB tmpfs (root only) fills during the tensor
    writes, where that happened; the writer's file opened on /dev/full (anywhere) fails at the header's first write."""
    import gguf.gguf_writer

    where = tmp_path
    if disk == "tmpfs":
        where = tmp_path / "small"
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True).returncode:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
    elif not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    else:
        monkeypatch.setattr(gguf.gguf_writer, "open", lambda _path, mode: open("/dev/full", mode), raising=False)
    try:
        (where / "x.gguf").write_bytes(b"the old export")
        before = tree_hashes(where)
        with pytest.raises(SystemExit) as exit_info:
            main(["quantize", "tiny/standard", "--format", "gguf", "--bits", "8", "--out", str(where / "x.gguf"), "--force"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error: no space left on device"), err
        assert tree_hashes(where) == before  # the old file whole, no temporary left
    finally:
        if disk == "tmpfs":
            unmounted = subprocess.run(["umount", str(where)]).returncode == 0
            if not unmounted:
                subprocess.run(["umount", "-l", str(where)])  # never left mounted
            assert unmounted, "busy: the export left a descriptor open on the disk"


# ---- --force and output targets ----------------------------------------------------------------------------


def test_force_replaces_only_quantdiff_outputs(tmp_path, capsys):
    src = tmp_path / "models" / "src"
    shutil.copytree(SOURCE, src)
    (tmp_path / "models" / "notes.txt").write_text("unrelated")
    before = tree_hashes(tmp_path / "models")
    out = tmp_path / "q"
    main(["quantize", str(src), "--out", str(out), "--bits", "8"])
    main(["quantize", str(src), "--out", str(out), "--bits", "4", "--force"])  # ours: replaced
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    main(["pair", str(tmp_path / "p"), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "259"])
    main(["pair", str(tmp_path / "p"), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "259", "--force"])
    for target in (src, tmp_path / "models"):
        with pytest.raises(SystemExit):
            main(["quantize", str(src), "--out", str(target), "--force"])
    with pytest.raises(SystemExit):  # an exported model, marked by quantdiff, is still refused as its own input
        main(["quantize", str(out), "--out", str(out), "--force"])
    assert tree_hashes(tmp_path / "models") == before
    assert capsys.readouterr().err.count("error:") == 3


def test_outputs_keep_the_umask_modes(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("x")
        with atomic_file(tmp_path / "g.txt") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "g.txt").stat().st_mode & 0o777 == 0o644


def test_symlinks_are_written_through_and_special_files_refused(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with atomic_file(link, force=True) as tmp:  # "old" is the user's: replaced only with --force
        tmp.write_text("new")
    assert link.is_symlink() and real.read_text() == "new" and real.stat().st_mode & 0o777 == 0o600
    os.mkfifo(tmp_path / "fifo")
    for special in (tmp_path / "fifo", Path("/dev/null")):
        with pytest.raises(ConfigError, match="not a regular file"):
            writable_target(special)
    assert Path("/dev/null").is_char_device()


# ---- exports: symlinked --out, umask modes, identical bytes, no code unless trusted, interrupts ---------------


def test_force_through_a_symlinked_out_replaces_its_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "q", tmp_path / "L"
    main(["quantize", "tiny/diff", "--out", str(target), "--bits", "8"])
    link.symlink_to(target)
    main(["quantize", "tiny/diff", "--out", str(link), "--bits", "4", "--force"])
    assert link.is_symlink() and json.loads((target / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert _hidden(tmp_path) == []  # no `.L.old-…` or `.q.old-…` left behind


def test_export_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        main(["quantize", "tiny/diff", "--out", str(tmp_path / "q"), "--bits", "4"])
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "q").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    assert (tmp_path / "q").stat().st_mode & 0o777 == 0o755


def test_exports_of_the_same_input_are_byte_identical(tmp_path):
    for name in ("a", "b", "c"):  # safetensors writes its metadata in hash-map order: one of these would differ
        main(["quantize", "tiny/diff", "--out", str(tmp_path / name), "--bits", "4", "--attention-bits", "8"])
    assert tree_hashes(tmp_path / "a") == tree_hashes(tmp_path / "b") == tree_hashes(tmp_path / "c")


def _with_own_code(src: Path) -> None:
    """A source carrying its own code: a .py file and auto_map entries (unused by causal-LM loading)."""
    (src / "modeling_extra.py").write_text("RAN = True\n")
    for name, entry in (("config.json", {"AutoModelForSequenceClassification": "modeling_extra.Model"}),
                        ("tokenizer_config.json", {"AutoTokenizer": ["modeling_extra.Tokenizer", None]})):
        settings = json.loads((src / name).read_text())
        (src / name).write_text(json.dumps({**settings, "auto_map": entry}))


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trust-remote-code"])
def test_exports_carry_code_only_when_trusted(tmp_path, trusted):
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    _with_own_code(src)
    source_hashes = tree_hashes(src)
    main(["quantize", str(src), "--out", str(tmp_path / "q"), "--bits", "4", *(["--trust-remote-code"] if trusted else [])])
    out = tmp_path / "q"
    config = json.loads((out / "config.json").read_text())
    assert (out / "modeling_extra.py").exists() == trusted
    assert ("auto_map" in config) == trusted and ("auto_map" in json.loads((out / "tokenizer_config.json").read_text())) == trusted
    assert config["quantization_config"]["trust_remote_code"] is trusted
    assert load_quantized(out, device="cpu") is not None  # the recorded section matches the weights' metadata
    assert tree_hashes(src) == source_hashes


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test, also when pytest was started with SIGINT ignored (nohup, `&`)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _default_sigint() -> None:
    """A child's SIGINT back to its default before exec, so Python installs its handler whatever ignored it here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_export_is_written_waits_for_the_write_then_leaves_nothing(tmp_path, monkeypatch, python_sigint):
    """The interrupt is held while safetensors and torch write and verify (inside their C++ code it became a
    TypeError about 'UntypedStorage'), then raised: the temporary goes, nothing appears under --out."""
    import quantdiff.quant.export as export
    from quantdiff.quant.formats import parse_export

    real_save, finished = export.save_file, []

    def save_file(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the weights start to be written
        real_save(*args, **kwargs)
        finished.append(True)

    monkeypatch.setattr(export, "save_file", save_file)
    with pytest.raises(KeyboardInterrupt):
        export.export_quantized(SOURCE, tmp_path / "q", parse_export("absmax", "4", 6.0))
    assert finished == [True]  # the write was not cut inside library code
    assert list(tmp_path.iterdir()) == []  # no output, no temporary


# ---- Signals, invalid cells, resume state, bounds --------------------------------------------------------

# Runs `quantdiff ARGS...`, printing "READY" and pausing at one point of the run: "import" as torch starts to
# import (start-up), "collect" after the first batch was measured (mid-run).
SIGNAL_DRIVER = textwrap.dedent(
    """
    import builtins, sys, time

    def ready():
        print("READY", flush=True)
        time.sleep(300)

    point, args = sys.argv[1], sys.argv[2:]
    if point == "import":
        real_import = builtins.__import__

        def importing(name, *rest, **kwargs):
            if name == "torch" and "torch" not in sys.modules:
                ready()
            return real_import(name, *rest, **kwargs)

        builtins.__import__ = importing
    else:
        import quantdiff.stats.collect as collect

        real_run = collect.StatsCollector.run

        def run(self, *a, **k):
            real_run(self, *a, **k)
            ready()

        collect.StatsCollector.run = run
    from quantdiff.cli.app import main
    main(args)
    """
)


@pytest.mark.parametrize(
    "point, signum",
    [("import", signal.SIGINT), ("import", signal.SIGTERM), ("collect", signal.SIGINT), ("collect", signal.SIGTERM)],
    ids=["sigint-during-imports", "sigterm-during-imports", "sigint-mid-run", "sigterm-mid-run"],
)
def test_a_signal_gives_its_exit_code_one_line_and_no_output(tmp_path, point, signum):
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    before = tree_hashes(tmp_path)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    args = ["stats", str(src), "--tokens", "512", "--batch-size", "1", "--seq-len", "64", "--quiet",
            "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "plots")]
    if point == "import":  # torch must not have been imported: a fresh interpreter
        proc = subprocess.Popen([sys.executable, "-c", SIGNAL_DRIVER, point, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)
        try:
            assert proc.stdout.readline().strip() == "READY"
            proc.send_signal(signum)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        returncode = proc.returncode
    else:  # mid-run: a process of its own, forked from one that has imported quantdiff (tests/forked.py)
        child = forked.start(code=SIGNAL_DRIVER, args=[point, *args], cwd=ROOT, env=env, default_sigint=True)
        assert child.readline().strip() == "READY"
        child.send_signal(signum)
        done = child.wait(timeout=120)
        out, err, returncode = done.stdout, done.stderr, done.returncode
    name = signal.Signals(signum).name
    assert returncode == 128 + signum, (returncode, err)
    assert out == "" and err.splitlines() == [f"error: {'interrupted' if name == 'SIGINT' else 'terminated'} by {name}"], err
    assert tree_hashes(tmp_path) == before  # no JSON, no plots, no temporaries; the source untouched


# Runs `quantdiff ARGS...` as the process's own run (main() on sys.argv) and sends itself SIGNUM at POINT:
# "returning" as the command returns, its outputs written; "settled" once main has the command's outcome;
# "exited" after main returned, as the interpreter exits. raise_signal runs the handler before it returns.
LATE_SIGNAL_DRIVER = textwrap.dedent(
    """
    import signal, sys
    import quantdiff.cli.app as app

    point, signum, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point == "returning":
        real_build = app.build_app

        def build_app():
            command = real_build()

            def run(*a, **k):
                result = command(*a, **k)
                signal.raise_signal(signum)
                return result

            return run

        app.build_app = build_app
    elif point == "settled":
        real_outcome = app._outcome

        def outcome(argv):
            result = real_outcome(argv)
            signal.raise_signal(signum)
            return result

        app._outcome = outcome
    sys.argv = ["quantdiff", *args]
    app.main()
    if point == "exited":
        signal.raise_signal(signum)
    """
)


@pytest.mark.parametrize(
    "point, signum, reported",
    [("returning", signal.SIGTERM, True), ("settled", signal.SIGINT, True), ("exited", signal.SIGTERM, False)],
    ids=["sigterm-as-the-command-returns", "sigint-after-the-outcome", "sigterm-as-the-process-exits"],
)
def test_a_signal_after_the_last_write_is_one_line_or_none_never_a_kill(tmp_path, point, signum, reported):
    """The window between the last write and exit once ended the process with status -15/-2 and no line: now a
    signal up to main's last check is its `error:` line and 128 + the signal, and one after it leaves the run's
    own status (0); the outputs are whole either way."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    args = ["stats", str(SOURCE), "--tokens", "128", "--quiet", "--json", str(tmp_path / "s.json")]
    if point == "exited":  # the interpreter's own exit is the window: a fresh interpreter
        proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL_DRIVER, point, str(int(signum)), *args], capture_output=True,
                              text=True, env=env, timeout=300, preexec_fn=_default_sigint)
    else:  # inside main: a process of its own, forked from one that has imported quantdiff (tests/forked.py)
        proc = forked.run(code=LATE_SIGNAL_DRIVER, args=[point, str(int(signum)), *args], cwd=ROOT, env=env,
                          default_sigint=True, timeout=300)
    name = signal.Signals(signum).name
    line = f"error: {'interrupted' if name == 'SIGINT' else 'terminated'} by {name}"
    assert (proc.returncode, proc.stderr.splitlines()) == ((128 + signum, [line]) if reported else (0, [])), proc.stderr
    assert json.loads((tmp_path / "s.json").read_text())["schema"].startswith("quantdiff.")  # written whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # no temporary left


def test_a_typer_exit_code_is_not_dropped(monkeypatch):
    """Outside standalone mode click returns the code of typer.Exit (and of a Ctrl-C it caught): main exits with it."""
    import typer

    import quantdiff.cli.commands.info as info

    def leave() -> None:
        raise typer.Exit(4)

    monkeypatch.setattr(info, "info", leave)
    with pytest.raises(SystemExit) as exit_info:
        main(["info"])
    assert exit_info.value.code == 4


def _all_nan_model(tmp_path: Path) -> Path:
    from tests.test_bad_input import _nan_model

    return _nan_model(tmp_path, "model.embed_tokens.weight")


def test_non_finite_logits_make_sweep_cells_invalid_not_chance(tmp_path, capsys):
    """An all-NaN model once scored acc 0.25 (argmax over NaN picks a token anyway); now null and flagged."""
    src = _all_nan_model(tmp_path)
    json_path, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["sweep", str(src), "--task", "choice", "--limit", "4", "--bits", "4", "--quiet", "--json", str(json_path), "--plot", str(plot)])
    assert not [w for w in caught if "legend" in str(w.message)]
    out, err = capsys.readouterr()
    cells = json.loads(json_path.read_text())["cells"]
    assert len(cells) == 2 and all(c["acc"] is None and c["acc_norm"] is None and c["valid"] is False for c in cells)
    assert all(c["nonfinite_logits"] > 0 and c["items"] == 4 for c in cells)
    assert err.count("warning: ") == 2 and "scored positions' logits were non-finite" in err  # on stderr although --quiet
    assert all(line.startswith("warning: ") for line in err.splitlines()), err
    assert out == ""  # --quiet: no table
    assert plot.stat().st_size > 0  # the chart copes with cells that have no value
    main(["sweep", str(src), "--task", "choice", "--limit", "4", "--bits", "4"])
    out = capsys.readouterr().out
    assert "invalid" in out and "0.25" not in out


def test_non_finite_logits_make_eval_lm_invalid_not_zero(tmp_path, capsys):
    """`eval --task lm` once reported accuracy 0.0 as if valid."""
    from quantdiff.eval.sweep import cells_from_json

    src = _all_nan_model(tmp_path)
    main(["eval", str(src), "--task", "lm", "--limit", "2", "--quiet", "--json", str(tmp_path / "e.json")])
    doc = json.loads((tmp_path / "e.json").read_text())
    (cell,) = doc["cells"]
    assert cell["accuracy"] is None and cell["loss"] is None and cell["valid"] is False
    (back,) = cells_from_json(doc)
    assert not back.valid and "valid" not in back.metrics
    assert "warning:" in capsys.readouterr().err


def test_finite_logits_keep_cells_valid(tmp_path):
    from quantdiff.eval.scoring import counting_scored_logits, note_scored

    import torch

    with counting_scored_logits() as scored:
        note_scored(torch.tensor([[0.0, 1.0], [float("inf"), 0.0], [0.0, float("nan")]]))
    assert scored.nonfinite == 2
    main(["eval", "tiny/diff", "--task", "lm", "--limit", "2", "--quiet", "--json", str(tmp_path / "e.json")])
    (cell,) = json.loads((tmp_path / "e.json").read_text())["cells"]
    assert cell["valid"] is True and cell["nonfinite_logits"] == 0 and 0 < cell["accuracy"] < 1


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A run of test_train's recipe stopped after step 3 of 6 (checkpoint saved), on its synthetic corpus."""
    from quantdiff.train.loop import train_pair
    from quantdiff.train.recipe import parse_recipe
    from tests.test_train import RECIPE, synthetic_corpus

    root = tmp_path_factory.mktemp("interrupted")
    (root / "r.toml").write_text(RECIPE)
    with pytest.MonkeyPatch.context() as patch:
        synthetic_corpus.__wrapped__(patch)
        assert train_pair(parse_recipe(RECIPE, "r"), root / "run", stop_after=3, console=_silent()) is None
    return root


def _silent():
    from rich.console import Console

    return Console(quiet=True)


def _state_edit(**fields):
    def edit(run: Path) -> None:
        path = run / ".checkpoint" / "state.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return edit


def _remove_tokenizer(run: Path) -> None:
    shutil.rmtree(run / ".checkpoint" / "tokenizer")


RESUME_CASES = [
    ("step-negative", _state_edit(step=-50), "step -50 is not a whole number in 0..6"),
    ("step-beyond-recipe", _state_edit(step=10**9), "step 1000000000 is not a whole number in 0..6"),
    ("step-string", _state_edit(step="abc"), "step 'abc'"),
    ("step-not-its-curves", _state_edit(step=2), "loss of standard must hold one finite number per step (2)"),
    ("loss-string", _state_edit(loss="nope"), "loss must map standard and diff to lists"),
    ("loss-entry-string", _state_edit(loss={"standard": ["x"] * 3, "diff": [1.0] * 3}), "loss of standard"),
    ("held-out-wrong-steps", _state_edit(held_out={"standard": [[2, 1.0]], "diff": [[3, 1.0]]}), "held_out of standard"),
    ("elapsed-negative", _state_edit(elapsed_s=-1), "elapsed_s -1"),
    ("unknown-field", _state_edit(extra=1), "unknown field 'extra'"),
    ("tokenizer-removed", _remove_tokenizer, "its tokenizer does not load"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in RESUME_CASES], ids=[c[0] for c in RESUME_CASES])
def test_a_resumed_state_is_checked_against_the_recipe(interrupted_run, tmp_path, capsys, monkeypatch, edit, message):
    """A step of −50 once trained 56 steps, and 10⁹ saved the 3-step model as the finished pair: now refused."""
    from tests.test_train import synthetic_corpus

    synthetic_corpus.__wrapped__(monkeypatch)
    shutil.copytree(interrupted_run, tmp_path / "w")
    run = tmp_path / "w" / "run"
    edit(run)
    before = tree_hashes(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(tmp_path / "w" / "r.toml"), "--out", str(run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("error: corrupt training checkpoint") and message in err, err
    assert "Traceback" not in err and tree_hashes(tmp_path) == before  # no pair saved, checkpoint untouched


def test_a_resumed_state_as_written_still_resumes(interrupted_run, tmp_path, monkeypatch):
    """The checks accept what a run writes, a null held-out loss included (measured, not guarded: read back as
    NaN). A training loss is never null: the run stops at the first non-finite one (test_reliability_round6_train)."""
    import math

    from quantdiff.train.loop import Checkpoint
    from quantdiff.train.recipe import parse_recipe
    from tests.test_train import RECIPE

    shutil.copytree(interrupted_run, tmp_path / "w")
    checkpoint = Checkpoint(tmp_path / "w" / "run")
    state = json.loads((checkpoint.dir / "state.json").read_text())
    assert state["step"] == 3 and len(state["loss"]["diff"]) == 3
    assert [s for s, _ in state["held_out"]["diff"]] == [3]
    state["held_out"]["diff"][0][1] = None
    (checkpoint.dir / "state.json").write_text(json.dumps(state))
    loaded = checkpoint.load_state(parse_recipe(RECIPE, "r"))
    assert loaded["step"] == 3 and math.isnan(loaded["held_out"]["diff"][0][1])


def test_needle_documents_are_checked_in_tokens_before_training(tmp_path, capsys, monkeypatch):
    """A recipe that fits at one token per word, but not in the trained tokenizer's tokens (a 300-token vocabulary
    splits needle words): refused before any step, where it once failed in training or after it."""
    from quantdiff.train.recipe import parse_recipe
    from tests.test_train import RECIPE, synthetic_corpus

    synthetic_corpus.__wrapped__(monkeypatch)
    small = RECIPE.replace("seq_len = 160", "seq_len = 40")
    parse_recipe(small, "r")  # passes the word-level check
    (tmp_path / "r.toml").write_text(small)
    before = tree_hashes(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(tmp_path / "r.toml"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and len(err.splitlines()) == 1, err
    assert "cannot hold" in err and "tokens of the trained tokenizer" in err
    assert tree_hashes(tmp_path) == before


def test_quiet_still_warns_of_non_finite_activations_on_stderr(tmp_path, capsys):
    src = _all_nan_model(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["stats", str(src), "--tokens", "64", "--quiet", "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "plots")])
    assert not [w for w in caught if "legend" in str(w.message)]
    out, err = capsys.readouterr()
    assert out == "" and "warning: nan: 100.0% of attention logits were non-finite" in err, err
    assert all(line.startswith("warning: ") for line in err.splitlines()), err  # the plots cope, silently
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
