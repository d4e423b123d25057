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
from pathlib import Path

import pytest

from quantdiff.cli.app import main
import quantdiff.core.atomic as atomic
from quantdiff.core.atomic import atomic_file, remove_stale_temporaries, writable_target
from quantdiff.core.errors import ConfigError
from quantdiff.core.savedir import MARKER, atomic_dir
from quantdiff.models.names import ASSETS
from quantdiff.quant.checkpoint import load_quantized
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
    proc = subprocess.Popen([sys.executable, "-c", KILL_DRIVER, *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "WRITTEN"
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
    dead_file, dead_dir, live, remote = (work / name for name in (".a.tmp-1", ".d.tmp-2", ".a.tmp-3", ".a.tmp-4"))
    for path in (dead_file, live, remote):
        path.write_text("x")
    dead_dir.mkdir()
    (dead_dir / "model.safetensors").write_text("half")
    ended_registry = _registry(tmp_path / "state", ended, [dead_file, dead_dir, work / ".gone.tmp-5"])
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
    main(["pair", str(tmp_path / "p"), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "64"])
    main(["pair", str(tmp_path / "p"), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "64", "--force"])
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
    with atomic_file(link) as tmp:
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


def test_ctrl_c_while_the_export_is_written_waits_for_the_write_then_leaves_nothing(tmp_path, monkeypatch):
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
