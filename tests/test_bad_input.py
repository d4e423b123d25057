"""Bad input, table-driven: every case exits non-zero with exactly one `error:` line on stderr, no traceback,
and leaves the whole working directory (sources, unrelated files, outputs) byte-identical — nothing partial."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantdiff.cli.app import main
from quantdiff.core.errors import LoadError
from quantdiff.models.names import ASSETS
from tests import forked

SOURCE = ASSETS / "tiny" / "diff"  # a trained model with its tokenizer; copied before every case


def tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256 (or the kind of a non-file)} of everything under root, hidden entries included."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link->" + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if path.is_dir() else "special"
    return out


def _edit_weights(directory: Path, change) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _truncate(d: Path) -> None:
    file = d / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _huge_header(d: Path) -> None:
    (d / "model.safetensors").write_bytes((10**15).to_bytes(8, "little") + b"{}")


def _pickles_only(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")


def _remote_code(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="evil_remote", auto_map={"AutoModelForCausalLM": "evil.Model"})
    (d / "config.json").write_text(json.dumps(config))
    (d / "evil.py").write_text("raise SystemExit('remote code ran')\n")


def _broken_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text("{not json")


def _bad_data(tmp: Path) -> None:
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')


def _unrelated_dir(tmp: Path) -> None:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("irreplaceable")


def _fifo(tmp: Path) -> None:
    os.mkfifo(tmp / "pipe.json")


_RECIPE_BASE = "[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 4\nvocab_size = 300\nmax_position_embeddings = 64\n"


def _recipe(text: str):
    return lambda tmp: (tmp / "r.toml").write_text(_RECIPE_BASE + "[train]\nsteps = 4\nbatch_size = 2\nseq_len = 32\n" + text)


def _run_dir_not_ours(tmp: Path) -> None:
    _recipe("[data]\nretrieval_max_needles = 2\n")(tmp)
    (tmp / "run" / "standard").mkdir(parents=True)
    (tmp / "run" / "standard" / "data.csv").write_text("not a model")


def _marked(directory: Path, kind: str, files: dict[str, str]) -> None:
    """A directory quantdiff wrote as `kind` (its marker) with a few files."""
    directory.mkdir(parents=True)
    (directory / ".quantdiff-output").write_text(json.dumps({"kind": kind, "quantdiff_version": "0"}) + "\n")
    for name, text in files.items():
        (directory / name).write_text(text)


def _marked_pair(tmp: Path) -> None:
    _marked(tmp / "P", "pair", {})
    for kind in ("standard", "diff"):
        _marked(tmp / "P" / kind, "model", {"config.json": "{}", "model.safetensors": f"weights of {kind}"})


def _marked_report(tmp: Path) -> None:
    _marked(tmp / "R", "report", {"report.md": "# an earlier report"})


def _link(name: str, target: str):
    """tmp/name -> tmp/target (target may not exist yet: a dangling link still leads there)."""
    return lambda tmp: (tmp / name).symlink_to(tmp / target)


def _words(tmp: Path) -> None:
    (tmp / "words.txt").write_text("some words to read\n")


# Loading: exactly what will be loaded, checked before anything is allocated.
def _stray_file_holds_missing(d: Path) -> None:
    """model.safetensors lacks a tensor that an unindexed file beside it holds: transformers never reads that file."""
    tensors = load_file(d / "model.safetensors")
    save_file({"model.layers.0.mlp.up_proj.weight": tensors.pop("model.layers.0.mlp.up_proj.weight")}, d / "extra.safetensors")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _header_dtype(d: Path, name: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in the header only (same byte size): the bytes are reinterpreted."""
    file = d / "model.safetensors"
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    file.write_bytes(data[:8] + text + data[8 + length :])


def _config(**changes):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps(config))
    return edit


def _config_list(d: Path) -> None:
    (d / "config.json").write_text(json.dumps([json.loads((d / "config.json").read_text())]))


def _sharded(d: Path, shards: dict[str, list[str]], index: dict[str, str]) -> None:
    """Split model.safetensors into the shards named (all other tensors in the first) and write an index."""
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    rest = [n for n in tensors if not any(n in names for names in shards.values())]
    for i, (file, names) in enumerate(shards.items()):
        save_file({n: tensors[n] for n in names + (rest if i == 0 else [])}, d / file, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def _index_names_missing_shard(d: Path) -> None:
    names = list(load_file(d / "model.safetensors"))
    _sharded(d, {"a.safetensors": []}, {n: "a.safetensors" for n in names} | {names[0]: "b.safetensors"})


def _tensor_in_two_shards(d: Path) -> None:
    names = list(load_file(d / "model.safetensors"))
    both = "model.layers.0.mlp.up_proj.weight"
    _sharded(d, {"a.safetensors": [both], "b.safetensors": [both]}, {n: "a.safetensors" for n in names} | {"x": "b.safetensors"})


def _all_integer(d: Path) -> None:
    _edit_weights(d, lambda t: t.update({k: v.round().to(torch.int32) for k, v in t.items()}))


MISSING = lambda t: t.pop("model.layers.0.mlp.up_proj.weight")  # noqa: E731
UNEXPECTED = lambda t: t.__setitem__("model.extra.weight", torch.zeros(3))  # noqa: E731
NAN_WEIGHT = lambda t: t["model.layers.1.self_attn.q_proj.weight"].__setitem__((0, 0), float("nan"))  # noqa: E731
WRONG_SHAPE = lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(5, 3))  # noqa: E731

# (id, argv with {src} = a copy of the model and {tmp} = the working directory, setup of {src}, setup of {tmp},
#  a piece of the expected message)
CASES = [
    ("missing-path", ["info", "{tmp}/nope"], None, None, "neither an existing path"),
    ("not-a-model", ["info", "{tmp}"], None, None, "no config.json"),
    ("pickles-only", ["info", "{src}"], _pickles_only, None, "pickled"),
    ("truncated-safetensors", ["info", "{src}"], _truncate, None, "truncated"),
    ("huge-header-length", ["info", "{src}"], _huge_header, None, "header claims"),
    ("remote-code", ["info", "{src}"], _remote_code, None, "evil_remote"),
    ("missing-tensor", ["info", "{src}"], lambda d: _edit_weights(d, MISSING), None, "missing model.layers.0.mlp.up_proj.weight"),
    ("unexpected-tensor", ["stats", "{src}", "--tokens", "64"], lambda d: _edit_weights(d, UNEXPECTED), None, "unexpected model.extra.weight"),
    ("wrong-shape", ["info", "{src}"], lambda d: _edit_weights(d, WRONG_SHAPE), None, "wrong shape model.layers.0.mlp.up_proj.weight"),
    ("broken-tokenizer", ["stats", "{src}", "--tokens", "64"], _broken_tokenizer, None, "no usable tokenizer"),
    ("bad-data-line", ["stats", "{src}", "--data", "{tmp}/bad.jsonl"], None, _bad_data, "line 2"),
    ("quantize-bits-9", ["quantize", "{src}", "--out", "{tmp}/q", "--bits", "9"], None, None, "bits"),
    # '-' is stdout for --json only: any other output named '-' once became a directory or file called '-'
    ("stats-plot-stdout", ["stats", "{src}", "--tokens", "64", "--plot", "-"], None, None, "--plot -: '-' (stdout) is for --json only"),
    ("sweep-plot-stdout", ["sweep", "{src}", "--plot", "-"], None, None, "--plot -: '-' (stdout) is for --json only"),
    ("quantize-out-stdout", ["quantize", "{src}", "--out", "-"], None, None, "--out -: '-' (stdout) is for --json only"),
    ("pair-out-stdout", ["pair", "-"], None, None, "-: '-' (stdout) is for --json only"),
    ("sweep-empty-bits-item", ["sweep", "{src}", "--bits", "16,8,,4"], None, None, "empty item"),
    ("sweep-repeated-bits", ["sweep", "{src}", "--bits", "8,4,8"], None, None, "twice"),
    ("sweep-repeated-method", ["sweep", "{src}", "--method", "absmax,absmax"], None, None, "twice"),
    ("threshold-with-absmax", ["quantize", "{src}", "--out", "{tmp}/q", "--threshold", "3"], None, None, "--threshold does nothing"),
    ("attention-method-alone", ["quantize", "{src}", "--out", "{tmp}/q", "--attention-method", "llm-int8"], None, None, "without --attention-bits"),
    ("attention-site-alone", ["quantize", "{src}", "--out", "{tmp}/q", "--attention-site", "qk"], None, None, "without --attention-bits"),
    ("eval-data-without-eval", ["quantize", "{src}", "--out", "{tmp}/q", "--limit", "3"], None, None, "without --eval"),
    ("llm-int8-threshold-negative", ["quantize", "{src}", "--out", "{tmp}/q", "--method", "llm-int8", "--bits", "8", "--threshold", "-1"], None, None, "--threshold must be positive"),
    ("llm-int8-threshold-nan", ["quantize", "{src}", "--out", "{tmp}/q", "--method", "llm-int8", "--bits", "8", "--threshold", "nan"], None, None, "--threshold must be positive"),
    ("pair-context-0", ["pair", "{tmp}/p", "--context", "0"], None, None, "--context must be positive"),
    ("pair-layers-negative", ["pair", "{tmp}/p", "--layers", "-2"], None, None, "--layers must be positive"),
    ("info-device-nonsense", ["info", "{src}", "--device", "nonsense"], None, None, "unknown device"),
    ("stats-device-nonsense", ["stats", "{src}", "--device", "nonsense"], None, None, "unknown device"),
    ("sweep-device-nonsense", ["sweep", "{src}", "--device", "nonsense"], None, None, "unknown device"),
    ("eval-device-nonsense", ["eval", "{src}", "--device", "nonsense"], None, None, "unknown device"),
    ("reproduce-device-nonsense", ["reproduce", "tiny", "--out", "{tmp}/r", "--device", "nonsense"], None, None, "unknown device"),
    ("quantize-out-is-source", ["quantize", "{src}", "--out", "{src}", "--force"], None, None, "is the input model"),
    ("quantize-out-is-parent", ["quantize", "{src}", "--out", "{tmp}", "--force"], None, None, "contains the input model"),
    ("quantize-out-unrelated", ["quantize", "{src}", "--out", "{tmp}/mine", "--force"], None, _unrelated_dir, "not written by quantdiff"),
    ("quantize-out-empty-string", ["quantize", "{src}", "--out", "", "--force"], None, None, "must name the directory to write"),
    ("pair-out-unrelated", ["pair", "{tmp}/mine", "--force"], None, _unrelated_dir, "not written by quantdiff"),
    ("reproduce-out-unrelated", ["reproduce", "tiny", "--out", "{tmp}/mine", "--force"], None, _unrelated_dir, "not written by quantdiff"),
    ("stats-per-layer-quiet", ["stats", "{src}", "--quiet", "--per-layer"], None, None, "--per-layer does nothing with --quiet"),
    ("no-command", [], None, None, "no command given"),
    ("unknown-option", ["info", "{src}", "--colour"], None, None, "No such option"),
    ("stats-json-fifo", ["stats", "{src}", "--json", "{tmp}/pipe.json"], None, _fifo, "not a regular file"),
    ("train-negative-lr", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("lr = -1\n"), "lr must be a positive"),
    ("train-nan-lr", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("lr = nan\n"), "lr must be a positive"),
    ("train-min-lr-above-lr", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("lr = 1e-3\nmin_lr = 1e-2\n"), "min_lr"),
    ("train-negative-warmup", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("warmup_steps = -5\n"), "warmup_steps"),
    ("train-needles-do-not-fit", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe(""), "cannot hold"),
    ("train-force-over-foreign-dir", ["train", "{tmp}/r.toml", "--out", "{tmp}/run", "--force"], None, _run_dir_not_ours, "not written by quantdiff"),
    ("train-device-nonsense", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe('device = "nonsense"\n'), "[train] device"),
    ("train-binary-recipe", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, lambda t: (t / "r.toml").write_bytes(b"\xff\xfe\x00\x81"), "not UTF-8"),
    # A directory is replaced only with --force, and only by a command writing the same kind
    ("reproduce-over-model-without-force", ["reproduce", "tiny", "--out", "{tmp}/P/standard"], None, _marked_pair, "is not empty"),
    ("reproduce-over-model-with-force", ["reproduce", "tiny", "--out", "{tmp}/P/standard", "--force"], None, _marked_pair, "holds a quantdiff model, not a report"),
    ("reproduce-over-pair-with-force", ["reproduce", "tiny", "--out", "{tmp}/P", "--force"], None, _marked_pair, "holds a quantdiff pair, not a report"),
    ("reproduce-over-report-without-force", ["reproduce", "tiny", "--out", "{tmp}/R"], None, _marked_report, "is not empty"),
    ("quantize-over-report-with-force", ["quantize", "{src}", "--out", "{tmp}/R", "--force"], None, _marked_report, "not an export"),
    ("quantize-over-model-with-force", ["quantize", "{src}", "--out", "{tmp}/P/diff", "--force"], None, _marked_pair, "holds a quantdiff model"),
    ("pair-over-report-with-force", ["pair", "{tmp}/R", "--force"], None, _marked_report, "not a pair"),
    ("train-over-report-with-force", ["train", "{tmp}/r.toml", "--out", "{tmp}/run", "--force"], None,
     lambda t: (_recipe("[data]\nretrieval_max_needles = 2\n")(t), _marked(t / "run" / "standard", "report", {"report.md": "#"})), "not a model"),
    # Outputs never land on what a command reads (paths compared after resolving symlinks)
    ("stats-json-over-config", ["stats", "{src}", "--json", "{src}/config.json"], None, None, "lies inside the input model"),
    ("stats-json-link-to-weights", ["stats", "{src}", "--json", "{tmp}/link.json"], None, _link("link.json", "src/model.safetensors"), "lies inside the input model"),
    ("stats-json-dangling-link-into-model", ["stats", "{src}", "--json", "{tmp}/link.json"], None, _link("link.json", "src/new.json"), "lies inside the input model"),
    ("stats-plot-is-model", ["stats", "{src}", "--plot", "{src}"], None, None, "is the input model"),
    ("stats-plot-link-to-model", ["stats", "{src}", "--plot", "{tmp}/plots"], None, _link("plots", "src"), "is the input model"),
    ("stats-json-over-data", ["stats", "{src}", "--data", "{tmp}/words.txt", "--json", "{tmp}/words.txt"], None, _words, "is the input file"),
    ("sweep-json-into-model", ["sweep", "{src}", "--json", "{src}/sweep.json"], None, None, "lies inside the input model"),
    ("sweep-plot-link-into-model", ["sweep", "{src}", "--plot", "{tmp}/fig.png"], None, _link("fig.png", "src/fig.png"), "lies inside the input model"),
    ("sweep-json-and-plot-same-path", ["sweep", "{src}", "--json", "{tmp}/a.png", "--plot", "{tmp}/a.png"], None, None, "name the same path"),
    ("eval-json-link-to-weights", ["eval", "{src}", "--json", "{tmp}/link.json"], None, _link("link.json", "src/model.safetensors"), "lies inside the input model"),
    ("quantize-out-inside-model", ["quantize", "{src}", "--out", "{src}/q"], None, None, "lies inside the input model"),
    ("quantize-out-link-to-model", ["quantize", "{src}", "--out", "{tmp}/L", "--force"], None, _link("L", "src"), "is the input model"),
    ("quantize-out-holds-eval-data", ["quantize", "{src}", "--out", "{tmp}/R", "--force", "--eval", "lm", "--data", "{tmp}/R/report.md"], None, _marked_report, "contains the input file"),
    # An output under a regular file is named as such (mkdir would say only "File exists")
    ("stats-json-under-a-file", ["stats", "{src}", "--json", "{tmp}/words.txt/x.json"], None, _words, "words.txt is not a directory"),
    ("stats-plot-under-a-file", ["stats", "{src}", "--plot", "{tmp}/words.txt/plots"], None, _words, "words.txt is not a directory"),
    ("eval-json-under-a-file", ["eval", "{src}", "--json", "{tmp}/words.txt/x.json"], None, _words, "words.txt is not a directory"),
    ("quantize-out-under-a-file", ["quantize", "{src}", "--out", "{tmp}/words.txt/q"], None, _words, "words.txt is not a directory"),
    ("pair-out-under-a-file", ["pair", "{tmp}/words.txt/p"], None, _words, "words.txt is not a directory"),
    # NaN weights are refused by name before quantizing (they have no scale, and NaN never compares equal)
    ("quantize-nan-weights", ["quantize", "{src}", "--out", "{tmp}/q"], lambda d: _edit_weights(d, NAN_WEIGHT), None, "q_proj.weight in"),
    # Loading: exactly what will be loaded, checked before anything is allocated.
    ("stray-unindexed-file-hides-nothing", ["quantize", "{src}", "--out", "{tmp}/q"], _stray_file_holds_missing, None, "missing model.layers.0.mlp.up_proj.weight"),
    ("header-dtype-f32-to-i32", ["stats", "{src}", "--tokens", "64"], lambda d: _header_dtype(d, "model.layers.0.self_attn.q_proj.weight", "I32"), None, "stores model.layers.0.self_attn.q_proj.weight as I32"),
    ("integer-tensors-throughout", ["info", "{src}"], _all_integer, None, "as I32 and"),
    ("index-names-missing-shard", ["info", "{src}"], _index_names_missing_shard, None, "b.safetensors, which does not exist"),
    ("tensor-in-two-shards", ["info", "{src}"], _tensor_in_two_shards, None, "stored in both a.safetensors and b.safetensors"),
    ("config-hidden-size-disagrees", ["info", "{src}"], _config(hidden_size=65536, intermediate_size=65536), None, "wrong shape"),
    ("config-hidden-size-text", ["info", "{src}"], _config(hidden_size="abc"), None, "hidden_size must be a positive integer, got 'abc'"),
    ("config-layers-fraction", ["stats", "{src}"], _config(num_hidden_layers=2.5), None, "num_hidden_layers must be a positive integer, got 2.5"),
    ("config-heads-zero", ["info", "{src}"], _config(num_attention_heads=0), None, "num_attention_heads must be a positive integer, got 0"),
    ("config-heads-not-dividing", ["info", "{src}"], _config(num_attention_heads=3, head_dim=None), None, "num_attention_heads (3) does not divide hidden_size (128)"),
    ("config-heads-disagree-with-weights", ["info", "{src}"], _config(num_attention_heads=3), None, "wrong shape model.layers.0.self_attn.o_proj.weight [128, 128] (model: [128, 96])"),
    ("config-json-list", ["info", "{src}"], _config_list, None, "must hold a JSON object, not a list"),
    ("config-falcon-head-dim", ["info", "{src}"], _config(model_type="falcon", architectures=["FalconForCausalLM"], head_dim=16), None, "head_dim"),
    ("info-hub-id-dotdot", ["info", "org/.."], None, None, "nor a valid hub id"),
    ("info-hub-id-inner-dotdot", ["info", "org/a..b"], None, None, "nor a valid hub id"),
    ("eval-mistyped-local-path", ["eval", "fx/nope"], None, None, "no such local directory, and not in the hub cache"),
    ("quantize-revision-on-local-dir", ["quantize", "{src}", "--out", "{tmp}/q", "--revision", "main"], None, None, "--revision applies to hub ids only"),
    ("info-revision-on-built-in", ["info", "tiny", "--revision", "main"], None, None, "--revision applies to hub ids only"),
    ("gguf-corrupt", ["info", "{tmp}/x.gguf"], None, lambda t: (t / "x.gguf").write_bytes(b"GGUF" + bytes(64)), "unreadable GGUF file"),
]
if not torch.cuda.is_available():
    CASES += [
        ("info-device-cuda-without-gpu", ["info", "{src}", "--device", "cuda"], None, None, "CUDA is not available"),
        ("stats-device-cuda-without-gpu", ["stats", "{src}", "--device", "cuda"], None, None, "CUDA is not available"),
        ("reproduce-device-cuda-without-gpu", ["reproduce", "tiny", "--out", "{tmp}/r", "--device", "cuda"], None, None, "CUDA is not available"),
        ("sweep-device-cuda-without-gpu", ["sweep", "{src}", "--device", "cuda:0"], None, None, "CUDA is not available"),
    ]


# Signals, invalid cells, resume state, bounds: devices this machine lacks, sizes beyond its memory (refused
# before allocating), a directory given as --data, recipes that leave the models' sizes to defaults.
_ABSENT_ACCELERATORS = [name for name in ("mps", "xpu") if not getattr(torch, name).is_available()]
CASES += [
    (f"{command}-device-{name}-absent", [command, "{src}", "--device", name], None, None, f"{name.upper()} is not available")
    for command, name in zip(("stats", "sweep", "info", "eval"), _ABSENT_ACCELERATORS * 2)
]
CASES += [
    ("stats-top-k-beyond-memory", ["stats", "{src}", "--top-k", str(10**12)], None, None, "--top-k 1,000,000,000,000"),
    ("pair-hidden-size-beyond-memory", ["pair", "{tmp}/p", "--hidden-size", str(10**9)], None, None, "more than the"),
    ("pair-vocab-size-beyond-memory", ["pair", "{tmp}/p", "--vocab-size", str(10**12)], None, None, "of memory of this machine"),
    ("train-vocab-beyond-memory", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None,
     lambda t: (t / "r.toml").write_text(_RECIPE_BASE.replace("vocab_size = 300", f"vocab_size = {10**12}")), "[model] training a pair"),
    ("pair-seed-beyond-torch", ["pair", "{tmp}/p", "--seed", str(10**20)], None, None, "--seed must be in 0..2**64 - 1"),
    ("train-negative-seed", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("seed = -1\n"), "[train] seed must be in"),
    ("stats-tokens-beyond-memory", ["stats", "{src}", "--data", "builtin:retrieval", "--tokens", str(10**15)], None, None, "--tokens 1,000,000,000,000,000"),
    ("stats-data-is-a-directory", ["stats", "{src}", "--data", "{tmp}"], None, None, "--data is a directory, not a file"),
    ("sweep-data-is-a-directory", ["sweep", "{src}", "--task", "lm", "--data", "{tmp}"], None, None, "--data is a directory, not a file"),
    ("train-empty-recipe", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, lambda t: (t / "r.toml").write_text(""),
     "[model] must set hidden_size, num_layers"),
    ("train-recipe-without-width", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None,
     lambda t: (t / "r.toml").write_text(_RECIPE_BASE.replace("hidden_size = 64\n", "")), "[model] must set hidden_size"),
]
# The remedies (--rotate, --smooth, --blocks) and site kv.
CASES += [
    ("sweep-rotate-at-qk", ["sweep", "{src}", "--site", "qk", "--rotate", "hadamard"], None, None, "use it with --site linear only"),
    ("sweep-rotate-unknown", ["sweep", "{src}", "--site", "linear", "--rotate", "givens"], None, None, "unknown rotation 'givens'"),
    ("sweep-rotate-and-smooth", ["sweep", "{src}", "--site", "linear", "--rotate", "hadamard", "--smooth", "0.5"], None, None, "choose one"),
    ("sweep-smooth-alpha-above-1", ["sweep", "{src}", "--site", "linear", "--smooth", "1.5"], None, None, "from 0 to 1, got 1.5"),
    ("sweep-calibration-without-smooth", ["sweep", "{src}", "--site", "linear", "--calibration", "builtin:corpus-train"], None, None,
     "--calibration does nothing without --smooth"),
    ("sweep-calibration-file-missing", ["sweep", "{src}", "--site", "linear", "--smooth", "0.5", "--calibration", "{tmp}/nope.txt"], None, None,
     "--calibration file not found"),
    ("sweep-calibration-is-the-evaluation-data", ["sweep", "{src}", "--task", "lm", "--site", "linear", "--smooth", "0.5", "--calibration", "builtin:corpus"],
     None, None, "builtin:corpus is evaluation data"),
    ("sweep-blocks-one", ["sweep", "{src}", "--task", "lm", "--blocks", "1"], None, None, "--blocks must be at least 2"),
    ("sweep-blocks-with-choice", ["sweep", "{src}", "--task", "choice", "--blocks", "4"], None, None, "with task lm or bb"),
    ("sweep-blocks-beyond-items", ["sweep", "{src}", "--task", "lm", "--limit", "2", "--blocks", "3", "--json", "{tmp}/s.json"], None, None,
     "--blocks must be from 2 to the 2 items"),
    ("eval-llm-int8-at-kv", ["eval", "{src}", "--bits", "8", "--method", "llm-int8", "--site", "kv"], None, None, "llm-int8 is not defined there"),
    ("eval-rotate-without-bits", ["eval", "{src}", "--rotate", "hadamard"], None, None, "give --bits too"),
    ("quantize-rotate-nf4", ["quantize", "{src}", "--bits", "4", "--method", "nf4", "--rotate", "hadamard", "--out", "{tmp}/out"], None, None,
     "--rotate needs --method absmax"),
]


def _export(method: str, bits: int):
    def make(tmp: Path) -> None:
        from transformers.utils import logging as hf_logging

        from quantdiff.quant.export import export_quantized
        from quantdiff.quant.formats import parse_export

        hf_logging.disable_progress_bar()  # the setup's own load prints nothing the case's check would see
        try:
            export_quantized(SOURCE, tmp / "q", parse_export(method, bits))
        finally:
            hf_logging.enable_progress_bar()
    return make


def _jsonl(text: str):
    return lambda tmp: (tmp / "mixed.jsonl").write_text(text)


# Issue 21: messages that say what is wrong, every recipe value's type (list items too), names within 255 bytes.
CASES += [
    ("quantize-an-absmax-export", ["quantize", "{tmp}/q", "--out", "{tmp}/q2"], None, _export("absmax", 4), "is already quantized (format quantdiff absmax 4-bit)"),
    ("quantize-an-llm-int8-export", ["quantize", "{tmp}/q", "--out", "{tmp}/q2", "--bits", "4", "--method", "nf4"], None, _export("llm-int8", 8),
     "is already quantized (format quantdiff llm-int8 8-bit)"),
    ("quantize-an-nf4-export", ["quantize", "{tmp}/q", "--out", "{tmp}/q2"], None, _export("nf4", 4), "is already quantized (format quantdiff nf4 4-bit)"),
    ("eval-data-empty-string", ["eval", "{src}", "--task", "lm", "--data", ""], None, None, "--data is empty: name a data file"),
    ("stats-data-empty-string", ["stats", "{src}", "--data", ""], None, None, "--data is empty: name a data file"),
    ("stats-jsonl-mixed-lines", ["stats", "{src}", "--data", "{tmp}/mixed.jsonl"], None, _jsonl('{"text": "a b"}\n{"input_ids": [1, 2]}\n'),
     "line 2: has 'input_ids' where the lines before have 'text'"),
    ("stats-jsonl-both-fields", ["stats", "{src}", "--data", "{tmp}/mixed.jsonl"], None, _jsonl('{"text": "a b", "input_ids": [1, 2]}\n'),
     "line 1: has both 'text' and 'input_ids'"),
    ("recipe-needles-true", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("[tasks]\nretrieval_needles = [true]\n"),
     "[tasks] retrieval_needles must be a list of integers, got [true]"),
    ("recipe-needles-fraction", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("[tasks]\nretrieval_needles = [1.5]\n"),
     "[tasks] retrieval_needles must be a list of integers, got [1.5]"),
    ("recipe-contexts-text", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe('[tasks]\nretrieval_contexts = ["a"]\n'),
     '[tasks] retrieval_contexts must be a list of integers, got ["a"]'),
    ("recipe-sites-nested", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe('[analysis]\nsites = [["logits"]]\n'),
     '[analysis] sites must be a list of strings, got [["logits"]]'),
    ("recipe-corpora-number", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("[data]\ncorpora = [1]\n"),
     "[data] corpora must be a list of strings, got [1]"),
    ("recipe-corpus-and-corpora", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe('[data]\ncorpus = "web"\ncorpora = ["kjv"]\n'),
     "[data] sets both corpus and corpora"),
    ("recipe-bigram-backcopy-with-corpora", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None,
     _recipe('[data]\ncorpus = "bigram-backcopy"\ncorpora = ["janeaustenr"]\n'), "[data] bigram-backcopy cannot be mixed with text corpora"),
    ("recipe-retrieval-context-beyond-positions", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None, _recipe("[tasks]\nretrieval_contexts = [100000]\n"),
     "[tasks] retrieval_contexts 100000 exceeds max_position_embeddings=64"),
    ("recipe-arm-name-too-long", ["train", "{tmp}/r.toml", "--out", "{tmp}/run"], None,
     _recipe("[data]\nretrieval_max_needles = 2\n[[arms]]\nname = \"" + "a" * 240 + "\"\n"), "is 240 bytes long: names may have at most 233"),
    ("eval-retrieval-context-beyond-positions", ["eval", "{src}", "--task", "retrieval", "--context", "100000"], None, None, "exceeds the model's 128 positions"),
]

def _pair(tmp: Path) -> None:
    """What `quantdiff pair` writes (its byte-level tokenizer), without the setup's progress bars."""
    from transformers.utils import logging as hf_logging

    from quantdiff.core.savedir import save_pair
    from quantdiff.models.pairs import SizePreset, build_pair
    from quantdiff.models.tokenizer import bytes_tokenizer

    hf_logging.disable_progress_bar()
    try:
        save_pair(build_pair(SizePreset(64, 1, 4, vocab_size=300, max_position_embeddings=32), seed=0), tmp / "P", tokenizer=bytes_tokenizer())
    finally:
        hf_logging.enable_progress_bar()


# Issue 32: a builtin source's ids belong to one tokenizer, a GGUF file holds only a tokenizer transformers reads back.
BB_IDS = "holds token ids of the Bigram-Backcopy character tokenizer"
CASES += [
    ("stats-bigram-backcopy-ids-into-a-text-model", ["stats", "{src}", "--data", "builtin:bigram-backcopy", "--tokens", "64"], None, None, BB_IDS),
    ("quantize-calibrated-on-bigram-backcopy-ids", ["quantize", "{src}", "--out", "{tmp}/q", "--smooth", "0.5", "--calibration", "builtin:bigram-backcopy",
                                                    "--calibration-tokens", "64"], None, None, BB_IDS),
    ("bnb-config-over-plain-weights", ["stats", "{src}", "--tokens", "32"],
     _config(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}), None,
     "declares bitsandbytes quantization, but the checkpoint stores plain float weights"),
    ("info-a-billion-layers", ["info", "{src}"], _config(num_hidden_layers=10**9), None, "describes 1,000,000,000 layers of width 128"),
    ("quantize-a-billion-layers", ["quantize", "{src}", "--out", "{tmp}/q"], _config(num_hidden_layers=10**9), None, "refused before building the model"),
    ("stats-device-empty", ["stats", "{src}", "--device", ""], None, None, "--device is empty: name a device"),
    ("quantize-calibration-empty", ["quantize", "{src}", "--out", "{tmp}/q", "--smooth", "0.5", "--calibration", ""], None, None,
     "--calibration is empty: name a data file"),
    ("gguf-export-of-pair-byte-tokenizer", ["quantize", "{tmp}/P/standard", "--out", "{tmp}/p.gguf", "--format", "gguf", "--bits", "8"], None, _pair,
     "without merges"),
]

def _argv(template: list[str], src: Path, tmp: Path) -> list[str]:
    return [a.replace("{src}", str(src)).replace("{tmp}", str(tmp)) for a in template]


@pytest.mark.parametrize("argv, src_setup, tmp_setup, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_error_line_and_changes_nothing(tmp_path, capsys, monkeypatch, argv, src_setup, tmp_setup, message):
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    if src_setup is not None:
        src_setup(src)
    if tmp_setup is not None:
        tmp_setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = tree_hashes(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(argv, src, tmp_path))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_info.value.code not in (0, None), captured
    assert len(lines) == 1 and lines[0].startswith("error:"), captured.err
    assert message in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out and "internal error" not in lines[0]
    assert tree_hashes(tmp_path) == before  # sources, unrelated files: byte-identical; no partial output


@pytest.mark.parametrize("corrupt", ["wrong-shape", "missing"])
def test_transformers_load_report_never_reaches_the_user(tmp_path, corrupt):
    """In a process of its own (forked: tests/forked.py), whose stderr is a file, so that transformers' own log
    handlers (bound to the process's stderr) are seen too."""
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    _edit_weights(src, WRONG_SHAPE if corrupt == "wrong-shape" else MISSING)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = forked.run(["info", str(src)], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error:") and "LOAD REPORT" not in proc.stderr


def test_unexpected_exceptions_become_one_internal_error_line(monkeypatch, capsys):
    import quantdiff.models.names as names

    def explode(*args, **kwargs):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(names, "resolve", explode)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "tiny"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 3 and err.count("\n") == 1
    assert err.startswith("error: internal error: ZeroDivisionError: division by zero second line (run with QUANTDIFF_DEBUG=1")
    monkeypatch.setenv("QUANTDIFF_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["info", "tiny"])


def test_corrupt_training_checkpoint_is_one_load_error(tmp_path):
    from quantdiff.train.loop import Checkpoint
    from quantdiff.train.recipe import load_recipe

    checkpoint = Checkpoint(tmp_path)
    checkpoint.dir.mkdir()
    for text in ("{truncated", "[]", '{"step": 3}'):
        (checkpoint.dir / "state.json").write_text(text)
        with pytest.raises(LoadError, match="corrupt training checkpoint") as info:
            checkpoint.load_state(load_recipe("tiny"))
        assert "\n" not in str(info.value)
    (checkpoint.dir / "standard.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(LoadError, match="corrupt training checkpoint"):
        checkpoint.restore({"standard": torch.nn.Linear(2, 2)}, {"standard": (None, [])})


def _nan_model(tmp_path: Path, tensor: str) -> Path:
    src = tmp_path / "nan"
    shutil.copytree(SOURCE, src)
    _edit_weights(src, lambda t: t[tensor].fill_(float("nan")))
    return src


def _refuse_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"], ids=["some-nan", "all-nan"])
def test_stats_on_nan_weights_writes_strict_json_and_flags_the_table(tmp_path, capsys, monkeypatch, tensor):
    src = _nan_model(tmp_path, tensor)
    monkeypatch.setenv("COLUMNS", "80")  # a pipe: rows must still be whole
    main(["stats", str(src), "--tokens", "256", "--json", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    doc = json.loads((tmp_path / "s.json").read_text(), parse_constant=_refuse_constant)
    block = doc["models"][0]["attention_logits"]
    nan = block["nonfinite"]["nan"]
    share = nan / (nan + block["nonfinite"]["inf"] + block["count"])
    assert nan > 0 and (block["median"] is None or math.isfinite(block["median"]))
    assert f"warning: nan: {share:.1%} of attention logits were non-finite ({nan:,} NaN" in err, err
    # A whole table row on one line although stdout is not a terminal: label, model, six numbers, the count.
    row = next(line for line in out.splitlines() if "attention logits" in line and "│" in line)
    assert row.count("│") == 10 and f"{nan:,} NaN, 0 Inf ({share:.1%})" in row, row


def test_json_writer_is_strict_and_keeps_modes(tmp_path):
    from quantdiff.core.atomic import write_json

    old = os.umask(0o027)
    try:
        write_json(tmp_path / "x.json", {"a": float("nan"), "b": [float("inf"), 1.5]})
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "x.json").read_text(), parse_constant=_refuse_constant) == {"a": None, "b": [None, 1.5]}
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o640


def test_tied_weights_are_stored_once_and_still_checked(tmp_path):
    """A tied lm_head is absent from the checkpoint and loads; the embedding it is tied to may not be missing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdiff.models.loading import load

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    model = load(tmp_path / "tied", device="cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _edit_weights(tmp_path / "tied", lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(LoadError, match="missing model.embed_tokens.weight"):
        load(tmp_path / "tied", device="cpu")


def test_stored_copies_of_computed_buffers_are_not_unexpected(tmp_path):
    """Older LLaMA conversions stored rotary inv_freq per layer: transformers recomputes it; loading goes on."""
    from quantdiff.models.loading import load

    src = tmp_path / "old"
    shutil.copytree(ASSETS / "tiny" / "standard", src)
    _edit_weights(src, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    load(src, device="cpu")
    _edit_weights(src, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.other", torch.ones(8)))
    with pytest.raises(LoadError, match="unexpected model.layers.0.self_attn.rotary_emb.other"):
        load(src, device="cpu")


def test_bigram_backcopy_ids_still_measure_a_bigram_backcopy_model(tmp_path):
    main(["stats", "bb/standard", "--data", "builtin:bigram-backcopy", "--tokens", "64", "-q", "--json", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text())["schema"].startswith("quantdiff.")


def test_index_naming_shards_in_a_subdirectory_and_outside_loads(tmp_path):
    """The weight index decides which files load, wherever they lie (docs/reliability.md, Loading)."""
    d, elsewhere = tmp_path / "m", tmp_path / "elsewhere"
    (d / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SOURCE / name, d / name)
    tensors = load_file(SOURCE / "model.safetensors")
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[::2]}, d / "sub" / "a.safetensors", metadata={"format": "pt"})
    save_file({k: tensors[k] for k in keys[1::2]}, elsewhere / "b.safetensors", metadata={"format": "pt"})
    index = {k: "sub/a.safetensors" if i % 2 == 0 else "../elsewhere/b.safetensors" for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    import quantdiff

    loaded = quantdiff.load(d, device="cpu")
    assert all(torch.equal(loaded.state_dict()[k], tensors[k]) for k in keys if k in loaded.state_dict())
