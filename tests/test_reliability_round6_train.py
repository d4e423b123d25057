"""Issue 53, round 6: training checkpoints, markers, and the writers' one boundary.

Each test fails on 505bb40: a flipped checkpoint byte resumed silently, a NaN tensor read as divergence, a null
training loss was resumed as NaN, a checkpoint without hashes resumed without a word, tied embeddings under the
transformers init crashed at the first checkpoint, a truncated marker read as "no marker", EFBIG was an internal
error, and `--out` through a dangling link created directories outside the tree.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantdiff.core.errors import LoadError
from quantdiff.train import loop as training
from quantdiff.train.recipe import parse_recipe
from test_reliability import MICRO, _fails

HASHES = "sha256.json"  # written here, not imported: the test pins the checkpoint's layout


@pytest.fixture
def stopped(tmp_path):
    """A run of MICRO stopped after step 2, its checkpoint kept: (recipe, out, checkpoint directory)."""
    recipe = parse_recipe(MICRO, "r")
    assert training.train_pair(recipe, tmp_path / "run", stop_after=2) is None
    return recipe, tmp_path / "run", tmp_path / "run" / ".checkpoint"


def test_a_flipped_byte_in_a_checkpoint_tensor_file_is_refused_by_name(stopped, tmp_path, capsys):
    recipe, out, ckpt = stopped
    data = bytearray((ckpt / "diff.safetensors").read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: the file still parses
    (ckpt / "diff.safetensors").write_bytes(bytes(data))
    load_file(ckpt / "diff.safetensors")  # still a valid safetensors file: only its hash tells
    (tmp_path / "r.toml").write_text(MICRO)
    err = _fails(capsys, ["train", tmp_path / "r.toml", "--out", out])
    assert f"corrupt training checkpoint {ckpt / 'diff.safetensors'}: its sha256 differs" in err


def test_the_recorded_hashes_are_the_files_sha256(stopped):
    import hashlib

    _, _, ckpt = stopped
    recorded = json.loads((ckpt / HASHES).read_text())
    assert recorded == {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest() for name in ("standard.safetensors", "diff.safetensors")}


def test_a_nan_in_a_checkpoint_tensor_is_named_not_read_as_divergence(stopped):
    recipe, out, ckpt = stopped
    tensors = load_file(ckpt / "standard.safetensors")
    name = next(k for k in tensors if k.startswith("model."))
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, ckpt / "standard.safetensors")
    (ckpt / HASHES).unlink()  # a checkpoint from before hashes: the NaN itself must be caught
    with pytest.raises(LoadError, match=rf"corrupt training checkpoint {ckpt / 'standard.safetensors'}: tensor {name} holds NaN or Inf"):
        training.train_pair(recipe, out)


@pytest.mark.parametrize("value", ["null", "NaN"])
def test_a_non_finite_training_loss_in_a_checkpoint_is_refused(stopped, value):
    recipe, out, ckpt = stopped
    text = (ckpt / "state.json").read_text()
    state = json.loads(text)
    first = state["loss"]["standard"][0]
    (ckpt / "state.json").write_text(text.replace(json.dumps(first), value, 1))
    with pytest.raises(LoadError, match="state.json loss of standard must hold one finite number per step"):
        training.train_pair(recipe, out)


def test_a_checkpoint_without_hashes_resumes_with_a_warning(stopped, tmp_path, capsys):
    recipe, out, ckpt = stopped
    (ckpt / HASHES).unlink()
    (tmp_path / "r.toml").write_text(MICRO)
    capsys.readouterr()
    assert training.train_pair(recipe, out) is not None
    assert f"warning: the checkpoint in {ckpt} records no sha256 of its tensor files" in capsys.readouterr().err


def test_tied_embeddings_under_the_transformers_init_checkpoint_and_resume_exactly(tmp_path):
    """Once an internal error at the first checkpoint (safetensors refuses two names for one tensor)."""
    tied = MICRO.replace("[model]\n", "[model]\ntie_word_embeddings = true\n").replace('device = "cpu"', 'device = "cpu"\ninit = "transformers"')
    recipe = parse_recipe(tied, "r")
    full = training.train_pair(recipe, tmp_path / "full")
    assert training.train_pair(recipe, tmp_path / "run", stop_after=2) is None
    resumed = training.train_pair(recipe, tmp_path / "run")
    for arm in full:
        a, b = load_file(full[arm] / "model.safetensors"), load_file(resumed[arm] / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
        assert json.loads((full[arm] / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_truncated_marker_is_reported_as_damaged_not_missing(stopped, tmp_path, capsys):
    from quantdiff.core.owned import MARKER

    _, out, ckpt = stopped
    marker = ckpt / MARKER
    marker.write_text(marker.read_text()[:20])  # cut mid-JSON, as a full disk would
    (tmp_path / "r.toml").write_text(MICRO)
    err = _fails(capsys, ["train", tmp_path / "r.toml", "--out", out])
    assert f"has a damaged {MARKER}" in err and "no " + MARKER not in err


# ---- one writer boundary: a write the file system refuses is one line naming the output --------------------------

LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG as an error, not the signal that kills by default
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from quantdiff.cli.app import main
main(sys.argv[2:])
"""


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("command, limit, target", [
    (["quantize", "tiny/diff", "--out", "{tmp}/q", "--bits", "8"], 64 << 10, "{tmp}/q"),
    (["pair", "{tmp}/p", "--hidden-size", "64", "--layers", "1"], 64 << 10, "{tmp}/p"),
    (["train", "{tmp}/r.toml", "--out", "{tmp}/run"], 64 << 10, "{tmp}/run/.checkpoint"),
    (["stats", "tiny/diff", "--tokens", "128", "--quiet", "--json", "{tmp}/s.json"], 2 << 10, "{tmp}/s.json"),
], ids=["quantize", "pair", "train", "stats-json"])
def test_a_file_size_limit_is_one_line_naming_the_output(tmp_path, command, limit, target):
    """`ulimit -f` (EFBIG) was an internal SafetensorError in quantize, pair and train, and a line without a path."""
    import os
    from pathlib import Path

    import forked

    (tmp_path / "r.toml").write_text(MICRO)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in command]
    proc = forked.run(code=LIMITED, args=[str(limit), *argv], cwd=Path.cwd(), env=dict(os.environ))
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"error: cannot write {target.replace('{tmp}', str(tmp_path))}: File too large (nothing was written)", proc.stderr
    assert "Traceback" not in proc.stderr


# ---- decided: a dangling --out link writes its target, and creates no directory on the far side --------------------

def test_a_dangling_out_link_creates_no_directories_outside_the_tree(tmp_path, capsys):
    (tmp_path / "tree").mkdir()
    link = tmp_path / "tree" / "q"
    link.symlink_to(tmp_path / "outside" / "deep" / "q")
    err = _fails(capsys, ["quantize", "tiny/diff", "--out", link, "--bits", "8"])
    assert "is a dangling symlink to" in err and "refusing to create directories through a link" in err
    assert not (tmp_path / "outside").exists() and link.is_symlink()
    json_link = tmp_path / "tree" / "s.json"
    json_link.symlink_to(tmp_path / "outside" / "s.json")
    assert "whose directory does not exist" in _fails(capsys, ["stats", "tiny/diff", "--tokens", "128", "--quiet", "--json", json_link])
    assert not (tmp_path / "outside").exists()
