"""Issue 53's last items on outputs: names the file system or a writer refuses (not UTF-8, too long on the way,
EINVAL) are one `error:` line naming the output, with no traceback and nothing left behind; and what a losing
concurrent `quantize` to the same --out leaves (docs/reliability.md, "Owned outputs")."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from quantdiff.cli.app import main
from quantdiff.core.atomic import atomic_file, remove_stale_temporaries
from quantdiff.core.errors import ConfigError
from quantdiff.core.savedir import atomic_dir, marked_kind
from quantdiff.models.names import ASSETS
from quantdiff.quant import export as export_module
from quantdiff.quant.export import export_quantized
from quantdiff.quant.formats import parse_export

SOURCE = ASSETS / "tiny" / "standard"
NOT_UTF8 = os.fsdecode(b"q\xff")  # the shell's $'q\xff': a valid Linux name, not valid UTF-8


@pytest.fixture
def state(tmp_path, monkeypatch):
    """This test's own registry of temporaries, so a stale-temporary sweep sees this test's writes alone."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _fails(capsys, argv: list) -> str:
    """Run the CLI expecting exactly one `error:` line, exit 1, no traceback; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error:"), err
    assert "internal error" not in err and "Traceback" not in err
    return err


def _everything(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.relative_to(root).parts[0] != "state")


@pytest.mark.parametrize("out", [NOT_UTF8, f"d{NOT_UTF8}/q"], ids=["name", "directory-on-the-way"])
def test_a_directory_output_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, state, out, monkeypatch):
    """safetensors takes UTF-8 paths only: it used to fail after the work ('internal error: SafetensorError')."""
    monkeypatch.setattr(export_module, "load", lambda *a, **k: pytest.fail("the model was loaded"))  # refused at the door
    err = _fails(capsys, ["quantize", SOURCE, "--bits", "8", "--out", tmp_path / out])
    assert "\\xff" in err and "is not valid UTF-8" in err and "--out" in err
    assert _everything(tmp_path) == []  # no temporary, no directory


def test_a_gguf_file_named_in_any_bytes_is_written(tmp_path, capsys, state):
    """The GGUF writer (Python's open) takes any name Linux does: only safetensors needs UTF-8."""
    main(["quantize", str(SOURCE), "--format", "gguf", "--bits", "8", "--out", str(tmp_path / f"{NOT_UTF8}.gguf"), "-q"])
    assert _everything(tmp_path) == [f"{NOT_UTF8}.gguf"]


@pytest.mark.parametrize("flag,out", [("--out", "{long}/x"), ("--out", "ok/{long}/x.gguf"), ("--json", "ok/{long}/s.json")])
def test_a_directory_name_too_long_on_the_way_is_refused_before_any_directory_is_made(tmp_path, capsys, state, flag, out):
    """mkdir made 'ok/' and then said 'File name too long' about the directory, not the output."""
    long = "a" * 300
    argv = ["stats", SOURCE] if flag == "--json" else ["quantize", SOURCE, "--bits", "8", *(["--format", "gguf"] if out.endswith(".gguf") else [])]
    err = _fails(capsys, [*argv, flag, tmp_path / out.format(long=long)])
    assert "passes through a directory name 300 bytes long" in err and flag in err
    assert _everything(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENAMETOOLONG, errno.EILSEQ])
def test_a_name_the_file_system_refuses_while_writing_is_one_line_and_no_temporary(tmp_path, state, code):
    """EINVAL (a FAT or SMB mount refusing ':'), ENAMETOOLONG (PATH_MAX inside a directory output), EILSEQ:
    raised by the writer itself (an OSError) or wrapped in a library's text (safetensors' '(os error N)')."""
    with pytest.raises(ConfigError) as raised, atomic_file(tmp_path / "s.json") as tmp:
        raise OSError(code, os.strerror(code), str(tmp))
    assert str(raised.value) == f"cannot write {tmp_path / 's.json'}: {os.strerror(code)}, a name the file system refuses (nothing was written)"
    with pytest.raises(ConfigError, match=rf"^cannot write {tmp_path / 'E'}: {os.strerror(code)}, a name"), atomic_dir(tmp_path / "E", kind="export"):
        raise RuntimeError(f"I/O error: {os.strerror(code)} (os error {code})")
    assert _everything(tmp_path) == []


def test_einval_from_the_weights_writer_is_one_cli_line_naming_the_output(tmp_path, capsys, state, monkeypatch):
    def refuse(tensors, path, metadata=None):
        raise OSError(errno.EINVAL, "Invalid argument", path)

    monkeypatch.setattr(export_module, "save_file", refuse)
    err = _fails(capsys, ["quantize", SOURCE, "--bits", "8", "--out", tmp_path / "E"])
    assert err == f"error: cannot write {tmp_path / 'E'}: Invalid argument, a name the file system refuses (nothing was written)\n"
    assert _everything(tmp_path) == []


# ---- two quantize runs to one --out at once ---------------------------------------------------------------------
# The winner is a whole export_quantized call made from inside the loser's run, at the point where the race puts it.


def _bits(export: Path) -> int:
    return json.loads((export / "config.json").read_text())["quantization_config"]["bits"]


def _winner_at_first(original, out: Path, after: bool):
    """`original`, whose first call also runs the winner's whole export to `out` (before or after it): the
    winner's own calls go straight to `original`."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 and not after:
            export_quantized(SOURCE, out, parse_export("absmax", 4))
        result = original(*args, **kwargs)
        if len(calls) == 1 and after:
            export_quantized(SOURCE, out, parse_export("absmax", 4))
        return result

    return wrapped


def test_a_run_the_winner_finishes_before_it_writes_is_refused_and_keeps_nothing(tmp_path, capsys, state, monkeypatch):
    """The loser passed the door, then loaded and quantized while the winner finished: it finds the winner's
    export when it is about to write, and is refused as a later run is. It has written nothing, so there is no
    temporary to keep (the probe's 'a losing concurrent quantize keeps no temporary'; docs/reliability.md)."""
    out = tmp_path / "Q"
    monkeypatch.setattr(export_module, "load", _winner_at_first(export_module.load, out, after=False))
    err = _fails(capsys, ["quantize", SOURCE, "--bits", "8", "--out", out])
    assert err == f"error: output directory {out} is not empty (use --force to replace it)\n"
    assert _bits(out) == 4  # the winner's, untouched
    assert [p.name for p in tmp_path.iterdir() if p.name != "state"] == ["Q"] and remove_stale_temporaries() == []


def test_a_run_the_winner_finishes_while_it_writes_keeps_its_output_under_the_temporary(tmp_path, capsys, state, monkeypatch):
    """The loser was writing when the winner renamed its export into place: the loser's finished output stays
    under its temporary name, which its one line states, and no sweep deletes it."""
    out = tmp_path / "Q"
    monkeypatch.setattr(export_module, "_verify", _winner_at_first(export_module._verify, out, after=True))
    err = _fails(capsys, ["quantize", SOURCE, "--bits", "8", "--out", out])
    assert err.startswith(f"error: output directory {out} is not empty (use --force to replace it); the new output is kept as ")
    kept = Path(err.strip().rsplit(" is kept as ", 1)[1])
    assert marked_kind(kept) == "export" and _bits(kept) == 8
    assert _bits(out) == 4
    assert remove_stale_temporaries() == [] and kept.is_dir()
