"""Quantized export: exact round trips, bitsandbytes/transformers loading, sizes, atomicity, refusal of bad input."""

import json
import os
import pickle
import signal
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from quantdiff import __version__
from quantdiff.models import loading
from quantdiff.attention.backend import taps
from quantdiff.cli.app import main
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.quant.checkpoint import is_quantdiff_checkpoint, load_quantized
from quantdiff.quant.export import export_quantized
from quantdiff.quant.formats import AbsmaxExport, Bnb4bitExport, LLMInt8Export, parse_export
from quantdiff.quant.packing import pack_codes, packed_size, unpack_codes
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.quant.sites import AbsmaxMethod, LinearSite, LLMInt8Method, LogitsSite, QuantConfig, fake_quant_weight, linear_targets, quantized
from tests import forked

PRESET = SizePreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=97, max_position_embeddings=64)
IDS = torch.randint(0, PRESET.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{kind: model directory} with a tokenizer file to copy and a pickle that must never travel."""
    root = tmp_path_factory.mktemp("src")
    out = {}
    for kind, model in build_pair(PRESET, seed=0).items():
        model.save_pretrained(root / kind)
        (root / kind / "tokenizer.json").write_text('{"fake": "tokenizer"}')
        (root / kind / "pytorch_model.bin").write_bytes(b"not for export")
        out[kind] = root / kind
    return out


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _in_memory(source, config):
    """The source model with a quantization applied in memory, and its logits."""
    model = loading.load(source, device="cpu")
    with quantized(model, config):
        return model, _logits(model)


# ---- packing ------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 16), n=st.integers(0, 70), seed=st.integers(0, 2**16))
def test_packing_round_trip_is_dense(bits, n, seed):
    q = 2 ** (bits - 1) - 1
    codes = torch.randint(-q, q + 1, (n,), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits) == -(-n * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, (n,)).long(), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_that_fill_whole_bytes_unpack_as_the_bit_stream_says(bits):
    """The shift-and-mask path of 2- and 4-bit codes against the layout read bit by bit, LSB first."""
    packed = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(bits), dtype=torch.int64).to(torch.uint8)
    stream = [(byte >> i) & 1 for byte in packed.tolist() for i in range(8)]
    naive = [sum(stream[c * bits + i] << i for i in range(bits)) - (2 ** (bits - 1) - 1) for c in range(len(stream) // bits)]
    assert unpack_codes(packed, bits, (len(naive),)).tolist() == naive


def _naive_bit_stream(codes: torch.Tensor, bits: int) -> list[int]:
    """The layout's definition, one bit at a time: code + qmax, LSB first, little-endian bytes, zero-padded."""
    stream = [(int(c) + 2 ** (bits - 1) - 1) >> b & 1 for c in codes.reshape(-1) for b in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(bit << i for i, bit in enumerate(stream[j : j + 8])) for j in range(0, len(stream), 8)]


@pytest.mark.parametrize("bits", range(2, 17))
def test_packing_is_the_layouts_bit_stream_across_chunks(bits, monkeypatch):
    """Every width against the definition, on codes that span several chunks (the chunk made small), the last
    one partial, the extreme codes included."""
    from quantdiff.quant import packing

    monkeypatch.setattr(packing, "_CHUNK", 16)
    q = 2 ** (bits - 1) - 1
    codes = torch.cat([torch.tensor([-q, q, 0]), torch.randint(-q, q + 1, (54,), generator=torch.Generator().manual_seed(bits))])
    packed = pack_codes(codes.view(3, 19), bits)
    assert packed.tolist() == _naive_bit_stream(codes, bits)
    assert torch.equal(unpack_codes(packed, bits, (3, 19)).long(), codes.view(3, 19))


def test_four_bits_are_two_per_byte_low_nibble_first():
    packed = pack_codes(torch.tensor([-7, 7, 0, 1]), 4)  # stored as code + 7: 0, 14, 7, 8
    assert packed.tolist() == [0 | 14 << 4, 7 | 8 << 4]


# ---- round trips -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [*range(2, 9), 16], ids=lambda b: f"bits={b}")
def test_absmax_round_trip_is_exact(sources, tmp_path, bits):
    kind = "diff" if bits % 2 else "standard"
    export_quantized(sources[kind], tmp_path / "q", AbsmaxExport(bits))
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    model, expect = _in_memory(sources[kind], QuantConfig(AbsmaxMethod(bits), LinearSite(inputs=False)))
    params = dict(reloaded.named_parameters())
    targets = linear_targets(model, LinearSite())
    assert len(targets) == 7 * PRESET.num_layers
    for fqn, module in targets:
        assert torch.equal(params[f"{fqn}.weight"], fake_quant_weight(module.weight, AbsmaxMethod(bits))), fqn
    for name, value in model.state_dict().items():  # everything else is kept as it was
        if not any(name == f"{fqn}.weight" for fqn, _ in targets):
            assert torch.equal(reloaded.state_dict()[name], value), name
    assert torch.equal(_logits(reloaded), expect)


@pytest.mark.parametrize("group_size", [16, 48], ids=["G=16", "G=48-ragged"])  # widths 64 and 256: 48 leaves a shorter last group
def test_groupwise_absmax_round_trip_is_exact(sources, tmp_path, group_size):
    export_quantized(sources["standard"], tmp_path / "q", AbsmaxExport(4, group_size))
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert section["granularity"] == f"group-{group_size}" and section["group_size"] == group_size
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    method = AbsmaxMethod(4, weight_group_size=group_size)
    model, expect = _in_memory(sources["standard"], QuantConfig(method, LinearSite(inputs=False)))
    params = dict(reloaded.named_parameters())
    for fqn, module in linear_targets(model, LinearSite()):
        grouped = fake_quant_weight(module.weight, method)
        assert torch.equal(params[f"{fqn}.weight"], grouped), fqn
        assert not torch.equal(grouped, fake_quant_weight(module.weight, AbsmaxMethod(4))), fqn  # groups differ from rows
    assert torch.equal(_logits(reloaded), expect)


def test_llm_int8_round_trip_quantizes_activations_too(sources, tmp_path):
    export_quantized(sources["diff"], tmp_path / "q", LLMInt8Export())
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    model, expect = _in_memory(sources["diff"], QuantConfig(LLMInt8Method(8), LinearSite()))
    params = dict(reloaded.named_parameters())
    for fqn, module in linear_targets(model, LinearSite()):
        assert torch.equal(params[f"{fqn}.weight"], fake_quant_weight(module.weight, LLMInt8Method(8)))
    assert torch.equal(_logits(reloaded), expect)
    for handle in reloaded.quantdiff_handles:
        handle.remove()
    with torch.no_grad():
        assert not torch.equal(_logits(reloaded), expect)  # the run-time activation quantization really acted


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_4bit_round_trip_is_exact(sources, tmp_path, quant_type):
    import bitsandbytes.functional as bnbF

    export_quantized(sources["standard"], tmp_path / "q", Bnb4bitExport(quant_type))
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    model = loading.load(sources["standard"], device="cpu")
    params = dict(reloaded.named_parameters())
    for fqn, module in linear_targets(model, LinearSite()):
        packed, state = bnbF.quantize_4bit(module.weight.detach(), blocksize=64, quant_type=quant_type)
        assert torch.equal(params[f"{fqn}.weight"], bnbF.dequantize_4bit(packed, state)), fqn
    with torch.no_grad():
        for fqn, module in linear_targets(model, LinearSite()):
            module.weight.copy_(params[f"{fqn}.weight"])
    assert torch.equal(_logits(reloaded), _logits(model))


def test_recorded_attention_quantization_is_reapplied(sources, tmp_path):
    attention = QuantConfig(AbsmaxMethod(4), LogitsSite())
    export_quantized(sources["diff"], tmp_path / "q", AbsmaxExport(6), attention=attention)
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    model = loading.load(sources["diff"], device="cpu")
    with quantized(model, QuantConfig(AbsmaxMethod(6), LinearSite(inputs=False))), quantized(model, attention):
        expect = _logits(model)
    assert torch.equal(_logits(reloaded), expect)


def test_tied_embeddings_round_trip_and_lm_head_refusal(tmp_path):
    model = build_pair(SizePreset(hidden_size=64, num_layers=1, num_heads=4, vocab_size=50, tie_word_embeddings=True))["standard"]
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ConfigError, match="tied"):
        export_quantized(tmp_path / "src", tmp_path / "q", AbsmaxExport(4), include_lm_head=True)
    assert not (tmp_path / "q").exists()
    export_quantized(tmp_path / "src", tmp_path / "q", AbsmaxExport(4))
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_include_lm_head(sources, tmp_path):
    summary = export_quantized(sources["standard"], tmp_path / "q", AbsmaxExport(8), include_lm_head=True)
    assert "lm_head" in summary.modules and summary.skipped == []
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    source_head = loading.load(sources["standard"], device="cpu").lm_head.weight
    assert torch.equal(reloaded.lm_head.weight, fake_quant_weight(source_head, AbsmaxMethod(8)))


# ---- directory contents ------------------------------------------------------------------------------------


def test_directory_config_metadata_and_size(sources, tmp_path):
    summary = export_quantized(sources["diff"], tmp_path / "q", AbsmaxExport(4))
    out = tmp_path / "q"
    assert sorted(p.name for p in out.iterdir()) == [".quantdiff-output", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_bytes() == (sources["diff"] / "tokenizer.json").read_bytes()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quantdiff" and qc["method"] == "absmax" and qc["bits"] == 4
    assert qc["granularity"] == "per-output-channel" and qc["skipped_modules"] == ["lm_head"]
    assert len(qc["modules"]) == 7 * PRESET.num_layers and qc["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["quantdiff_version"] == __version__
    assert json.loads(meta["quantization_config"]) == {k: v for k, v in qc.items() if k != "quant_method"}
    # Size: the 4-bit codes + one float32 scale per channel, against the same weights in bf16.
    quantized_bytes = sum(t.numel() * t.element_size() for k, t in stored.items() if k.endswith((".weight_packed", ".weight_scale")))
    model = loading.load(sources["diff"], device="cpu")
    bf16_bytes = sum(m.weight.numel() * 2 for _, m in linear_targets(model, LinearSite()))
    assert quantized_bytes == summary.quantized_bytes
    assert quantized_bytes <= 0.3 * bf16_bytes, quantized_bytes / bf16_bytes
    assert is_quantdiff_checkpoint(out) and not is_quantdiff_checkpoint(sources["diff"])


# ---- transformers + bitsandbytes ---------------------------------------------------------------------------


def test_llm_int8_export_loads_in_transformers(sources, tmp_path):
    """Same int8 codes and SCB in bnb's modules. Logits: bnb casts activations to float16 before quantizing
    them (we quantize in float32), so a code can move one step; measured ≤ 1% of max |logit|, allowed 3%."""
    from transformers import AutoModelForCausalLM

    export_quantized(sources["diff"], tmp_path / "q", LLMInt8Export())
    ours = load_quantized(tmp_path / "q", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cpu").eval()
    layer = theirs.model.layers[1].mlp.down_proj
    assert type(layer).__name__ == "Linear8bitLt" and layer.weight.dtype == torch.int8
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert torch.equal(layer.weight.data, f.get_tensor("model.layers.1.mlp.down_proj.weight"))
        assert torch.equal(layer.weight.SCB, f.get_tensor("model.layers.1.mlp.down_proj.SCB"))
    expect = _logits(ours)
    torch.testing.assert_close(_logits(theirs), expect, rtol=0, atol=0.03 * expect.abs().max().item())


def test_nf4_export_loads_in_transformers(sources, tmp_path):
    """Dequantized weights equal ours bit for bit (checked before any forward: bnb repacks on the first CPU
    forward). Logits: bnb's CPU 4-bit kernel computes in reduced precision; measured 0.5% of max |logit|."""
    import bitsandbytes.functional as bnbF
    from transformers import AutoModelForCausalLM

    export_quantized(sources["diff"], tmp_path / "q", Bnb4bitExport("nf4"))
    ours = load_quantized(tmp_path / "q", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cpu").eval()
    layer = theirs.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "Linear4bit"
    decoded = bnbF.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert torch.equal(decoded, ours.model.layers[0].self_attn.q_proj.weight)
    expect = _logits(ours)
    torch.testing.assert_close(_logits(theirs), expect, rtol=0, atol=0.03 * expect.abs().max().item())


# ---- bad input and atomicity -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bits", "1"], "bits"),
        (["--bits", "9"], "absmax export takes bits 2–8 or 16"),
        (["--bits", "x"], "bits must be an integer"),
        (["--method", "nf4", "--bits", "8"], "stores 4-bit weights"),
        (["--method", "gptq"], "unknown export method"),
        (["--attention-bits", "17"], "bits"),
        (["--attention-bits", "8", "--attention-site", "linear"], "logits or qk"),
        (["--attention-bits", "8", "--attention-method", "llm-int8"], "use site 'qk'"),
        (["--group-size", "0"], "--group-size must be positive"),
        (["--method", "nf4", "--group-size", "64"], "--group-size does nothing with --method nf4"),
    ],
    ids=["bits=1", "bits=9", "bits=x", "nf4-bits=8", "unknown-method", "attention-bits=17", "attention-linear", "attention-llm-int8-logits",
         "group-size=0", "group-size-nf4"],
)
def test_cli_bad_arguments(sources, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(sources["diff"]), "--out", str(tmp_path / "q"), *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code != 0 and message in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_cli_out_is_a_file_or_not_empty(sources, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep")
    for out, message in [("file", "not a directory"), ("full", "not empty")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["quantize", str(sources["diff"]), "--out", str(tmp_path / out)])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code != 0 and message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


def test_cli_writes_and_summarises(sources, tmp_path, capsys):
    main(["quantize", str(sources["standard"]), "--out", str(tmp_path / "q"), "--bits", "4", "--attention-bits", "6", "--attention-site", "qk"])
    text = capsys.readouterr().out
    assert "absmax 4-bit" in text and "modules quantized: 14" in text and "lm_head" in text and "absmax 6-bit at site qk" in text
    assert is_quantdiff_checkpoint(tmp_path / "q")
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    assert all(tap.operand_quantizer is not None for tap in taps(reloaded))


KILL_DRIVER = textwrap.dedent(
    """
    import sys, time
    import quantdiff.quant.export as export

    real_save = export.save_file

    def save_then_hang(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        print("WRITTEN", flush=True)  # config, tokenizer and weights are on disk: the rename has not happened
        time.sleep(120)

    export.save_file = save_then_hang
    from quantdiff.quant.formats import AbsmaxExport
    export.export_quantized(sys.argv[1], sys.argv[2], AbsmaxExport(4), force=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "replace-with-force"])
def test_killed_export_leaves_nothing_that_looks_complete(sources, tmp_path, existing):
    out = tmp_path / "q"
    if existing:
        export_quantized(sources["diff"], out, AbsmaxExport(8))
        before = {p.name: p.read_bytes() for p in out.iterdir()}
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = forked.start(code=KILL_DRIVER, args=[str(sources["diff"]), str(out)], cwd=tmp_path, env=env)  # a process of its own
    try:
        assert proc.readline().strip() == "WRITTEN"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if existing:  # the old export is untouched and still loads
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        load_quantized(out, device="cpu")
    else:
        assert not out.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "q"]
    assert all(name.startswith(".q.tmp-") for name in leftovers), leftovers  # hidden, never under the target name


class _Exploit:
    def __reduce__(self):
        return (open, ("/dev/null/never", "w"))  # fails loudly if anyone unpickles it


def test_pickles_beside_the_export_are_never_opened(sources, tmp_path, monkeypatch):
    export_quantized(sources["diff"], tmp_path / "q", AbsmaxExport(4))
    expect = _logits(load_quantized(tmp_path / "q", device="cpu"))
    (tmp_path / "q" / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Exploit()}))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    assert torch.equal(_logits(load_quantized(tmp_path / "q", device="cpu")), expect)


def test_load_refuses_foreign_or_mismatched_directories(sources, tmp_path):
    with pytest.raises(LoadError, match="not a quantdiff quantized checkpoint"):
        load_quantized(sources["diff"])
    export_quantized(sources["diff"], tmp_path / "a", AbsmaxExport(4))
    export_quantized(sources["diff"], tmp_path / "b", AbsmaxExport(5))
    os.replace(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    with pytest.raises(LoadError, match="does not belong"):
        load_quantized(tmp_path / "a")


def test_parse_export():
    assert parse_export("absmax", "16") == AbsmaxExport(16)
    assert parse_export("absmax", 4, group_size=128) == AbsmaxExport(4, 128)
    with pytest.raises(ConfigError, match="absmax export option"):
        parse_export("llm-int8", 8, group_size=128)
    assert parse_export("llm-int8", 8, threshold=5.0) == LLMInt8Export(5.0)
    assert parse_export("fp4", 4) == Bnb4bitExport("fp4")


def test_cli_eval_compares_source_and_reloaded_export(tmp_path, monkeypatch):
    from quantdiff.jobs import evaluate
    from quantdiff.models.tokenizer import save_tokenizer, train_bpe

    text = " ".join(f"The cat number {i} sat on the mat and looked at bird {i * 7 % 13}." for i in range(100))
    (tmp_path / "text.txt").write_text(text)
    tokenizer = train_bpe(text, 300)
    preset = SizePreset(hidden_size=64, num_layers=1, num_heads=4, vocab_size=len(tokenizer), max_position_embeddings=64)
    build_pair(preset)["diff"].save_pretrained(tmp_path / "src")
    save_tokenizer(tokenizer, tmp_path / "src")
    seen = []
    monkeypatch.setattr(evaluate, "report", lambda cells, task, json_path, quiet, **_: seen.append(cells))
    args = ["--eval", "lm", "--data", str(tmp_path / "text.txt"), "--context", "32", "--limit", "3", "--force"]
    losses = {}
    for bits in ("16", "2"):
        main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "q"), "--bits", bits, *args])
        source, reloaded = seen.pop()
        assert (source.model, reloaded.model) == ("source", "quantized")
        losses[bits] = (source.metrics["loss"], reloaded.metrics["loss"])
    assert losses["16"][1] == pytest.approx(losses["16"][0], abs=1e-3)  # 16-bit: lossless to display precision
    assert losses["2"][1] != pytest.approx(losses["2"][0], abs=1e-3)  # 2-bit: the export really quantized
    with pytest.raises(SystemExit):  # an unknown task is refused before anything is written
        main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "other"), "--eval", "nope"])
    assert not (tmp_path / "other").exists()


def test_bfloat16_source_round_trips_in_bfloat16(tmp_path):
    build_pair(PRESET)["standard"].to(torch.bfloat16).save_pretrained(tmp_path / "src")
    export_quantized(tmp_path / "src", tmp_path / "q", AbsmaxExport(5))
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["dtype"] == "bfloat16"
    reloaded = load_quantized(tmp_path / "q", device="cpu")
    model, expect = _in_memory(tmp_path / "src", QuantConfig(AbsmaxMethod(5), LinearSite(inputs=False)))
    assert model.dtype == reloaded.dtype == torch.bfloat16
    for fqn, module in linear_targets(model, LinearSite()):
        assert torch.equal(dict(reloaded.named_parameters())[f"{fqn}.weight"], fake_quant_weight(module.weight, AbsmaxMethod(5)))
    assert torch.equal(_logits(reloaded), expect)
