"""Real checkpoints: what transformers' own `save_pretrained` writes loads in quantdiff exactly as transformers
itself loads it (its key conversions included: GPT-NeoX's embed_out, per-expert MoE tensors fused in memory),
and only the files transformers will load are checked, before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quantdiff
from quantdiff.core.errors import LoadError
from quantdiff.models import loading
from test_architectures import EXTENDED, SUPPORTED, _inputs, _tiny

# Families whose saved names differ from their in-memory ones: transformers converts them while loading.
CONVERTED = {"gpt_neox", "deepseek_v3", "mixtral", "qwen3_moe", "olmoe"}
FAST = {**SUPPORTED, **{t: {} for t in CONVERTED - set(SUPPORTED)}}


def _round_trip(model_type: str, overrides: dict, directory) -> None:
    _tiny(model_type, overrides).save_pretrained(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    ours = quantdiff.load(directory, device="cpu")
    assert ours.config._attn_implementation == "quantdiff"
    theirs = reference.state_dict()
    assert ours.state_dict().keys() == theirs.keys()
    assert all(torch.equal(t, theirs[name]) for name, t in ours.state_dict().items())
    ids, mask = _inputs()
    with torch.no_grad():
        diff = (ours(input_ids=ids, attention_mask=mask).logits - reference(input_ids=ids, attention_mask=mask).logits)[mask.bool()]
    assert diff.abs().max().item() <= 1e-5, f"{model_type}: max |Δ output| {diff.abs().max().item():.2e}"


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_save_pretrained_round_trip_equals_transformers_own_load(model_type, tmp_path):
    _round_trip(model_type, FAST[model_type], tmp_path)


@pytest.mark.slow(seconds=0.5)  # each family; the set is the minute
@pytest.mark.parametrize("model_type", sorted(set(EXTENDED) - set(FAST)))
def test_every_other_family_round_trips(model_type, tmp_path):
    _round_trip(model_type, {}, tmp_path)


def test_the_converted_families_really_store_other_names(tmp_path):
    """Otherwise the round trips above would not test transformers' key conversion at all."""
    for model_type in sorted(CONVERTED):
        model = _tiny(model_type, FAST[model_type])
        model.save_pretrained(tmp_path / model_type)
        assert set(load_file(tmp_path / model_type / "model.safetensors")) != set(model.state_dict()), model_type


@pytest.fixture
def mixtral_dir(tmp_path):
    _tiny("mixtral", {}).save_pretrained(tmp_path / "mixtral")
    return tmp_path / "mixtral"


def _edit(directory, change) -> None:
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change, words", [
    (lambda t: t.pop("model.layers.0.block_sparse_moe.experts.1.w1.weight"), "model.layers.0.mlp.experts.gate_up_proj"),
    (lambda t: t.__setitem__("model.layers.1.block_sparse_moe.experts.0.w2.weight", torch.zeros(5, 3)), "model.layers.1.mlp.experts.down_proj"),
    (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)), "unexpected model.layers.0.extra.weight"),
], ids=["missing-expert", "wrong-shape-expert", "unexpected"])
def test_converted_checkpoints_are_still_exact(mixtral_dir, change, words):
    """Name problems in a converted family come from transformers' own loading report, in one line."""
    _edit(mixtral_dir, change)
    with pytest.raises(LoadError, match="does not hold exactly the tensors") as info:
        quantdiff.load(mixtral_dir, device="cpu")
    assert words in str(info.value) and "\n" not in str(info.value)


def test_config_larger_than_the_checkpoint_is_refused_before_allocating(mixtral_dir, monkeypatch):
    config = json.loads((mixtral_dir / "config.json").read_text())
    config.update(hidden_size=32 * 1024, intermediate_size=64 * 1024)  # ≈ 60 GB in float32
    (mixtral_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("allocated the model"))
    with pytest.raises(LoadError, match="refused before allocating"):
        quantdiff.load(mixtral_dir, device="cpu")


def test_a_model_larger_than_memory_is_refused_with_its_size(mixtral_dir, monkeypatch):
    monkeypatch.setattr(loading, "available_memory", lambda: 1000)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("allocated the model"))
    with pytest.raises(LoadError, match=r"needs 0\.0 GB of memory, 0\.0 GB are available"):
        quantdiff.load(mixtral_dir, device="cpu")


def _copy_of_tiny(tmp_path):
    import shutil

    from test_bad_input import SOURCE

    shutil.copytree(SOURCE, tmp_path / "m")
    return tmp_path / "m"


def test_a_stray_unindexed_file_no_longer_hides_a_missing_tensor(tmp_path):
    """Before: every *.safetensors was checked, transformers read only model.safetensors and initialised the
    missing tensor randomly, and `quantize` shipped it. Now the files transformers reads are the ones checked."""
    from test_bad_input import _stray_file_holds_missing

    directory = _copy_of_tiny(tmp_path)
    true_weight = load_file(directory / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    _stray_file_holds_missing(directory)
    theirs, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.0.mlp.up_proj.weight"}  # the earlier silent random weight
    assert not torch.equal(theirs.model.layers[0].mlp.up_proj.weight, true_weight)
    with pytest.raises(LoadError, match="missing model.layers.0.mlp.up_proj.weight"):
        quantdiff.load(directory, device="cpu")


@pytest.mark.parametrize("everywhere", [False, True], ids=["one-header-i32", "all-integer"])
def test_integer_tensors_are_no_longer_cast_and_run(tmp_path, everywhere):
    """Before: an I32 header (the float bits read as integers) was cast to float and run: q_proj max ≈ 1e9."""
    from test_bad_input import _all_integer, _header_dtype

    directory = _copy_of_tiny(tmp_path)
    if everywhere:
        _all_integer(directory)
    else:
        _header_dtype(directory, "model.layers.0.self_attn.q_proj.weight", "I32")
        theirs = AutoModelForCausalLM.from_pretrained(directory)
        assert theirs.model.layers[0].self_attn.q_proj.weight.abs().max() > 1e8  # the earlier wrong number
    with pytest.raises(LoadError, match=r"as I32.*floating point"):
        quantdiff.load(directory, device="cpu")
