"""Issue 45's rules (round 5 of the bad-input probe), each tested as a rule on more than the probe's example:
--force replaces only what quantdiff wrote, GGUF exports keep the model's config or refuse, calibration never
comes from an evaluation split, one position check, KV plans checked against a schema, every input path a
regular file, GGUF headers checked before gguf's reader, and the API's arguments (integers, classes, options
the CLI would refuse, devices, token ids) checked at the boundary."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import quantdiff
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError, DataError, QuantdiffError
from quantdiff.core.savedir import MARKER, atomic_dir, mark
from quantdiff.data.sources import BUILTINS
from quantdiff.models.names import ASSETS
from quantdiff.quant.kv_plan import KVPlan, KVCalibration, derive_plan
from test_reliability import _fails, state  # noqa: F401  (state: a private temporaries registry)

TINY = ASSETS / "tiny" / "standard"


# ---- 1. --force replaces only what quantdiff wrote ------------------------------------------------------------


@pytest.mark.parametrize("foreign", ["notes.txt", "sub/", "sub/deep/plan.json", "model/extra.bin"])
def test_force_refuses_a_directory_holding_anything_quantdiff_did_not_write(tmp_path, state, foreign):
    """Each entry quantdiff writes is listed in the marker; any other file or directory, at any depth (inside a
    pair's model directory too), makes --force refuse by name, and nothing is deleted."""
    out = tmp_path / "P"
    with atomic_dir(out, kind="pair") as tmp:
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text("{}")
        mark(tmp / "model", "model")
    target = out / foreign.rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir() if foreign.endswith("/") else target.write_text("the user's")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    with pytest.raises(ConfigError, match=f"holds {out / foreign.split('/')[0] if foreign.startswith('sub') else out / foreign}.*did not write"):
        with atomic_dir(out, force=True, kind="pair") as tmp:
            (tmp / "new.txt").write_text("x")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_force_replaces_a_directory_holding_only_what_quantdiff_wrote(tmp_path, state):
    out = tmp_path / "R"
    with atomic_dir(out, kind="report") as tmp:
        (tmp / "plots").mkdir()
        (tmp / "plots" / "a.png").write_text("first")
    assert set(json.loads((out / MARKER).read_text())["written"]) == {"plots", "plots/a.png"}
    with atomic_dir(out, force=True, kind="report") as tmp:
        (tmp / "report.md").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.md"]


def test_a_marker_without_a_list_of_files_is_never_replaced(tmp_path, state):
    """A directory marked before markers listed their files (and without a manifest) cannot say what is the
    user's: refused even with --force."""
    out = tmp_path / "old"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"kind": "export", "quantdiff_version": "0.0"}))
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="no list of the files quantdiff wrote"):
        with atomic_dir(out, force=True, kind="export"):
            pass
    assert (out / "notes.txt").read_text() == "the user's"


def test_a_file_added_while_a_forced_replace_runs_is_kept_and_so_is_the_output(tmp_path, state):
    out = tmp_path / "R"
    with atomic_dir(out, kind="report") as tmp:
        (tmp / "report.md").write_text("first")
    with pytest.raises(ConfigError, match="notes.txt.*did not write.*kept as") as info:
        with atomic_dir(out, force=True, kind="report") as tmp:
            (tmp / "report.md").write_text("second")
            (out / "notes.txt").write_text("the user's")
    assert (out / "notes.txt").read_text() == "the user's" and (out / "report.md").read_text() == "first"
    assert (info.value.kept / "report.md").read_text() == "second"


def test_quantize_force_keeps_a_users_file_in_its_export(tmp_path, capsys):
    out = tmp_path / "E"
    main(["quantize", str(TINY), "--bits", "8", "--out", str(out)])
    (out / "notes.txt").write_text("x")
    err = _fails(capsys, ["quantize", TINY, "--bits", "4", "--out", out, "--force"])
    assert str(out / "notes.txt") in err and (out / "notes.txt").read_text() == "x"


def test_a_second_writer_of_the_same_output_keeps_its_finished_temporary(tmp_path, state):
    """Two runs writing one --out: the second finds the first's output and keeps its own under the temporary
    name its error states (the unsure item of the probe: nothing finished is deleted)."""
    out = tmp_path / "E"
    with pytest.raises(ConfigError, match="kept as") as info:
        with atomic_dir(out, kind="export") as tmp:
            (tmp / "config.json").write_text("second")
            with atomic_dir(out, kind="export") as first:
                (first / "config.json").write_text("first")
    assert (out / "config.json").read_text() == "first" and (info.value.kept / "config.json").read_text() == "second"


# ---- 2. GGUF exports hold the model's config or refuse it ----------------------------------------------------


def _edited_tiny(tmp_path: Path, **fields) -> Path:
    source = tmp_path / "src"
    shutil.copytree(TINY, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **fields}))
    return source


@pytest.mark.parametrize("fields", [{"hidden_act": "gelu"}, {"hidden_act": "relu"}, {"pretraining_tp": 2}],
                         ids=["gelu", "relu", "pretraining_tp"])
def test_a_gguf_export_refuses_config_fields_the_file_cannot_hold(tmp_path, capsys, fields):
    source = _edited_tiny(tmp_path, **fields)
    (name, value), = fields.items()
    err = _fails(capsys, ["quantize", source, "--format", "gguf", "--bits", "8", "--out", tmp_path / "m.gguf"])
    assert f"cannot hold {name}={value!r}" in err and not (tmp_path / "m.gguf").exists()


def test_the_gguf_read_back_compares_the_reloaded_config(tmp_path, capsys, monkeypatch):
    """With the up-front refusal out of the way, the read-back itself catches the changed activation."""
    from quantdiff.quant import gguf_export

    monkeypatch.setattr(gguf_export, "check_held", lambda *args: None)
    source = _edited_tiny(tmp_path, hidden_act="gelu")
    err = _fails(capsys, ["quantize", source, "--format", "gguf", "--bits", "8", "--out", tmp_path / "m.gguf"])
    assert "export check failed" in err and "hidden_act='gelu' (read back as 'silu')" in err
    assert not (tmp_path / "m.gguf").exists()


# ---- 3. calibration never comes from an evaluation split -----------------------------------------------------


def test_every_builtin_source_declares_its_split():
    from quantdiff.data.sources import BUILTIN_SPLITS, EVALUATION_SPLIT

    assert set(BUILTIN_SPLITS) == set(BUILTINS)
    assert {s for s, split in BUILTIN_SPLITS.items() if split == EVALUATION_SPLIT} == {"builtin:corpus", "builtin:retrieval"}


@pytest.mark.parametrize("source", ["builtin:corpus", "builtin:retrieval"])
def test_evaluation_data_is_refused_as_calibration_everywhere(tmp_path, capsys, source):
    with pytest.raises(ConfigError, match="is evaluation data"):
        quantdiff.Calibration(source)
    for argv in (["kv-plan", "bb/standard", "--calibration", source, "--out", tmp_path / "p.json"],
                 ["eval", "tiny/standard", "--task", "lm", "--bits", "8", "--site", "linear", "--smooth", "0.5", "--calibration", source],
                 ["quantize", "tiny/standard", "--smooth", "0.5", "--calibration", source, "--out", tmp_path / "q"]):
        assert "is evaluation data" in _fails(capsys, argv)


def test_a_plan_calibrated_on_evaluation_data_is_refused_for_every_task(tmp_path, capsys):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(_plan_document(source="builtin:retrieval")))
    for task in ("bb", "lm"):
        assert "is evaluation data" in _fails(capsys, ["eval", "bb/standard", "--task", task, "--kv-plan", plan])


# ---- 4. one position check -----------------------------------------------------------------------------------


def test_positions_beyond_the_model_are_refused_not_clamped(tmp_path, capsys):
    """bb's models have 64 positions: kv-plan, calibration and the API refuse 65 as stats does."""
    for argv in (["kv-plan", "bb/standard", "--seq-len", "65", "--out", tmp_path / "p.json"],
                 ["stats", "bb/standard", "--seq-len", "65"]):
        assert "65 tokens exceeds the model's 64 positions" in _fails(capsys, argv)
    config = quantdiff.load("bb/standard", device="cpu").config
    with pytest.raises(DataError, match="64 positions"):
        quantdiff.Calibration("builtin:corpus-train", seq_len=65).length(config)
    assert quantdiff.Calibration("builtin:corpus-train").length(config) == 64  # unset: the default, cut to the model


# ---- 5. KV plans: a schema checked before use ----------------------------------------------------------------


def _plan_document(source: str = "builtin:corpus-train") -> dict:
    shape = {"kind": "standard", "layers": 2, "kv_heads": [2, 2], "query_heads": 2, "head_dim": 32}
    calibrated = KVCalibration(shape, [[0.1, 0.9], [0.2, 0.4]], {}, {"source": source, "seq_len": 64})
    return derive_plan(calibrated, "first", 4).to_dict()


def _set(doc: dict, path: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


BAD_FIELDS = [  # (path, value, what the one line names)
    (("evidence",), None, "evidence must be an object"), (("evidence",), [], "evidence must be an object"),
    (("evidence", "calibration"), "x", "evidence.calibration must be an object"),
    (("evidence", "calibration"), {}, "evidence.calibration.source"),
    (("layers", 0, "keep_positions"), [2**63], "layers[0].keep_positions[0] must be an integer from 0"),
    (("layers", 0, "keep_positions"), [-1], "layers[0].keep_positions[0] must be an integer from 0"),
    (("layers", 0, "keep_positions"), [1.5], "layers[0].keep_positions[0] must be an integer from 0"),
    (("model", "layers"), "2", "model.layers must be an integer from 1"), (("model", "layers"), 0, "model.layers must be an integer from 1"),
    (("model", "kv_heads"), [2], "model.kv_heads lists 1 layers"), (("model", "query_heads"), None, "model.query_heads must be an integer"),
    (("layers", 0, "kv_bits"), [4, "4"], "layers[0].kv_bits[1] must be an integer from 2 to 16"),
    (("layers", 0, "kv_bits"), [4, 17], "layers[0].kv_bits[1] must be an integer from 2 to 16"),
    (("layers", 0, "kv_bits"), [True, 4], "layers[0].kv_bits[0] must be an integer from 2 to 16"),
    (("layers", 0, "layer"), 1, "layers[0] is marked layer 1: entries are applied in list order"),
    (("layers", 0), "x", "layers[0] must be an object"), (("layers",), {}, "layers must be a list"),
    (("budget_bits",), 4.0, "budget_bits must be an integer from 2 to 16"), (("version",), True, "version True is not supported"),
    (("policy",), ["first"], "unknown policy ['first']"), (("quantizer", "keys"), "per token", "quantizer"),
    (("layers", 0, "keep_position"), [0], "unknown field layers[0].'keep_position'"), (("budget",), 4, "unknown field 'budget'"),
    (("model", "heads"), 2, "unknown field model.'heads'"),
]


@pytest.mark.parametrize("path,value,named", BAD_FIELDS, ids=[f"{'.'.join(map(str, p))}={v!r}"[:40] for p, v, _ in BAD_FIELDS])
def test_a_plan_breaking_the_schema_is_one_line_naming_the_field(tmp_path, path, value, named):
    file = tmp_path / "p.json"
    file.write_text(json.dumps(_set(_plan_document(), path, value)))
    with pytest.raises(ConfigError) as info:
        KVPlan.load(file)
    assert "\n" not in str(info.value) and named in str(info.value), info.value


def test_a_plan_that_does_not_name_its_calibration_is_refused(tmp_path, capsys):
    doc = _plan_document()
    file = tmp_path / "p.json"
    file.write_text(json.dumps({key: value for key, value in doc.items() if key != "evidence"}))
    with pytest.raises(ConfigError, match="'evidence' is missing"):
        KVPlan.load(file)
    file.write_text(json.dumps({**doc, "evidence": {}}))
    assert "does not say what it was calibrated on" in _fails(capsys, ["eval", "bb/standard", "--task", "bb", "--kv-plan", file])


def test_a_valid_plan_round_trips(tmp_path):
    file = tmp_path / "p.json"
    file.write_text(json.dumps(_plan_document()))
    plan = KVPlan.load(file)
    assert plan.to_dict() == _plan_document() and plan.layers[0].keep_positions == (0,)


def test_a_plan_giving_a_field_twice_is_refused(tmp_path):
    """JSON keeps the last of two equal keys silently: the plan would not be the one read."""
    file = tmp_path / "p.json"
    file.write_text('{"budget_bits": 8, ' + json.dumps(_plan_document())[1:])
    with pytest.raises(ConfigError, match="'budget_bits' is given twice"):
        KVPlan.load(file)


@pytest.mark.parametrize("content,reason", [(b"[" * 200_000, "nested too deeply"), (b'{"schema": "quantdiff.kv-plan", "x": "\xff"}', "not UTF-8"),
                                            (b"", "not valid JSON")], ids=["nested", "not-utf8", "empty"])
def test_a_damaged_plan_file_is_one_line(tmp_path, content, reason):
    file = tmp_path / "p.json"
    file.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as info:
        KVPlan.load(file)
    assert "\n" not in str(info.value)


# ---- 6. every input path is a regular file -------------------------------------------------------------------


def test_a_device_or_fifo_as_a_plan_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", fifo, tmp_path, tmp_path / ("x" * 300)):
        with pytest.raises(QuantdiffError, match="--kv-plan"):
            KVPlan.load(path)


# ---- 7. GGUF headers checked before gguf's reader ------------------------------------------------------------


MAX_ARRAY_ENTRIES = 1 << 20  # models.gguf_header's limit (asserted below)


def _gguf_header(tensors: int, keys: list[tuple[str, int, bytes]]) -> bytes:
    body = b"".join(struct.pack("<Q", len(k)) + k.encode() + struct.pack("<I", kind) + value for k, kind, value in keys)
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(keys)) + body


@pytest.mark.parametrize("make,reason", [
    (lambda: _gguf_header(0, [("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, MAX_ARRAY_ENTRIES + 1))]), "entries, more than"),
    (lambda: _gguf_header(10**15, []), "more than its"),
    (lambda: _gguf_header(0, [("general.name", 8, struct.pack("<Q", 10**12))]), "header claims more bytes"),
    (lambda: _gguf_header(0, [("general.name", 99, b"")]), "unknown value type"),
    (lambda: b"GGUF" + struct.pack("<IQ", 3, 10**6) + struct.pack("<Q", 2**62), "more than its"),
], ids=["huge-array", "tensor-count", "string-length", "value-type", "key-count"])
def test_a_hostile_gguf_header_is_refused_before_gguf_reads_it(tmp_path, capsys, monkeypatch, make, reason):
    """Refused by `info` (any command reading a GGUF file) with one line, before gguf's reader runs."""
    from quantdiff.models import gguf_header

    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    assert gguf_header.MAX_ARRAY_ENTRIES == MAX_ARRAY_ENTRIES
    file = tmp_path / "m.gguf"
    file.write_bytes(make())
    assert reason in _fails(capsys, ["info", file])


# ---- 8. the API's arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: quantdiff.HadamardRotation(5), lambda: quantdiff.KVSite(plan="x"), lambda: quantdiff.LinearSite(include_lm_head="yes"),
    lambda: quantdiff.AbsmaxMethod(8.0), lambda: quantdiff.Calibration(5), lambda: quantdiff.LLMInt8Method(8, "6"),
    lambda: quantdiff.QuantConfig("absmax", "logits"), lambda: quantdiff.load("x" * 300),
    lambda: quantdiff.parse_config("absmax", 8, "qk", threshold=3.0), lambda: quantdiff.parse_export("absmax", 4, threshold=5.0),
    lambda: quantdiff.parse_export("nf4", 4, threshold=5.0), lambda: quantdiff.parse_config("llm-int8", 8, "linear", granularity="column"),
    lambda: quantdiff.parse_config("absmax", 8, "logits", include_lm_head=True), lambda: quantdiff.parse_config("absmax", 8.0, "logits"),
    lambda: quantdiff.load("tiny/standard", device_map={"": "meta"}), lambda: quantdiff.load("tiny/standard", device_map="meta"),
], ids=["hadamard-arg", "kvsite-plan", "lm-head-str", "bits-float", "calibration-int", "threshold-str", "config-names", "long-name",
        "threshold-absmax", "threshold-export", "threshold-nf4", "granularity-int8", "lm-head-logits", "bits-float-parse",
        "device-map-meta", "device-map-str-meta"])
def test_bad_api_arguments_are_one_quantdiff_error_line(call):
    with pytest.raises(QuantdiffError) as info:
        call()
    assert "\n" not in str(info.value)


def test_integers_of_any_kind_are_integers_and_stored_as_int():
    for bits in (np.int64(8), np.int32(8), np.uint8(8), 8, "8"):
        config = quantdiff.parse_config("absmax", bits, "logits")
        assert config.method.bits == 8 and type(config.method.bits) is int
    assert type(quantdiff.AbsmaxMethod(np.int16(4)).bits) is int
    method = quantdiff.LLMInt8Method(np.int64(8), np.float32(5.5))
    assert (method.bits, method.threshold) == (8, 5.5) and type(method.threshold) is float
    assert json.dumps(quantdiff.parse_config("llm-int8", np.int64(8), "linear").to_dict())


@pytest.fixture(scope="module")
def tiny_model():
    return quantdiff.load("tiny/standard", device="cpu")


def test_token_ids_are_checked_in_int64_and_on_a_real_device(tiny_model):
    vocab = tiny_model.config.vocab_size  # 1536: 0 in int8/uint8
    with pytest.raises(DataError, match="meta device"):
        quantdiff.collect_stats(tiny_model, torch.zeros(1, 8, dtype=torch.long, device="meta"))
    with pytest.raises(DataError, match=f"token id {vocab + 1} outside"):
        quantdiff.collect_stats(tiny_model, torch.full((1, 8), vocab + 1, dtype=torch.int16))
    from quantdiff.data.sources import Batch

    small = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    reference = quantdiff.collect_stats(tiny_model, small.long()).summary()
    assert quantdiff.collect_stats(tiny_model, small).summary() == reference
    assert quantdiff.collect_stats(tiny_model, [Batch(small.to(torch.int8), None, 0)]).summary() == reference


def test_names_standing_for_several_models_are_one_line(tmp_path, capsys):
    for name in ("tiny", "bb"):
        err = _fails(capsys, ["kv-plan", name, "--out", tmp_path / "p.json"])
        assert f"MODEL '{name}' names" in err and f"{name}/standard" in err


# ---- 9. nf4/fp4 exports run where transformers runs them ------------------------------------------------------


@pytest.mark.parametrize("kind", ["gated", "diffv2"])
def test_nf4_of_layers_bitsandbytes_cpu_kernel_cannot_run_is_refused(tmp_path, capsys, kind):
    """bitsandbytes' AVX512-BF16 CPU path packs 32 output rows at a time and asserts they divide the rows."""
    err = _fails(capsys, ["quantize", f"bb/{kind}", "--method", "nf4", "--bits", "4", "--out", tmp_path / "e"])
    assert "not a multiple of 32" in err and not (tmp_path / "e").exists()


# ---- 10. the unsure items, as decided ------------------------------------------------------------------------


def test_train_names_every_environment_value_it_replaces():
    """Run where torch is not yet imported (as `quantdiff train` runs): each replaced value is one note."""
    import subprocess
    import sys

    code = "from quantdiff.train.determinism import pin_environment; print('\\n'.join(pin_environment()))"
    env = {**os.environ, "MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "3"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    notes = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert notes == ["note: this run sets MKL_CBWR=AVX2 (it was AUTO), for bit-identical training",
                     "note: this run trains on 1 thread(s), not OMP_NUM_THREADS=3, for bit-identical training"]


def test_the_sink_kinds_engine_gap_is_float_attention_order():
    """Why W8A8 of bb/sink differs between transformers and quantdiff (docs/reliability.md): unquantized, the
    standard kind agrees exactly (SDPA), the sink kind only to float rounding (GPT-OSS's eager attention appends
    the sink as a column; quantdiff's backend starts the online softmax at it)."""
    from transformers import AutoModelForCausalLM

    from quantdiff.models.names import resolve

    gaps = {}
    for kind in ("standard", "sink"):
        ours = quantdiff.load(f"bb/{kind}", device="cpu")
        ids = torch.randint(0, ours.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        theirs = AutoModelForCausalLM.from_pretrained(resolve(f"bb/{kind}")[0], dtype=torch.float32).eval()
        with torch.no_grad():
            gaps[kind] = float((ours(ids).logits - theirs(ids).logits).abs().max())
    assert gaps["standard"] == 0.0 and 0.0 < gaps["sink"] < 1e-4, gaps


def test_pair_force_keeps_a_file_inside_one_of_its_models(tmp_path, capsys):
    """The probe's case: `pair P --force` deleted P/standard/sentinel.txt and plans kv-plan had written there."""
    out = tmp_path / "P"
    small = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--vocab-size", "300"]
    main(["pair", str(out), *small])
    capsys.readouterr()
    (out / "standard" / "sentinel.txt").write_text("the user's")
    err = _fails(capsys, ["pair", out, *small, "--force"])
    assert str(out / "standard" / "sentinel.txt") in err and (out / "standard" / "sentinel.txt").read_text() == "the user's"
    (out / "standard" / "sentinel.txt").unlink()
    main(["pair", str(out), *small, "--force"])  # only what quantdiff wrote: replaced
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "diff", "standard"]
