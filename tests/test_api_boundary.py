"""The Python API checks its arguments at the boundary, with the CLI's checks: every bad argument is one
`QuantdiffError` line naming the parameter, never a raw TypeError, IndexError or ValueError from inside."""

from __future__ import annotations

import pytest
import torch

import quantdiff
from quantdiff.data.sources import make_batches


@pytest.fixture(scope="module")
def model():
    return quantdiff.load("tiny/diff", device="cpu")


IDS = torch.tensor([[1, 2, 3, 4]])
CASES = [
    ("collect-empty-tensor", lambda m: quantdiff.collect_stats(m, torch.zeros(0, dtype=torch.long)), "holds no tokens"),
    ("collect-empty-rows", lambda m: quantdiff.collect_stats(m, torch.zeros(2, 0, dtype=torch.long)), "holds no tokens"),
    ("collect-empty-list", lambda m: quantdiff.collect_stats(m, []), "non-empty list of Batch"),
    ("collect-float-ids", lambda m: quantdiff.collect_stats(m, torch.ones(4)), "integer token ids"),
    ("collect-bool-ids", lambda m: quantdiff.collect_stats(m, torch.ones(4, dtype=torch.bool)), "integer token ids"),
    ("collect-3d-ids", lambda m: quantdiff.collect_stats(m, torch.ones(1, 2, 3, dtype=torch.long)), "shape (T,) or (B, T)"),
    ("collect-id-beyond-vocabulary", lambda m: quantdiff.collect_stats(m, torch.tensor([1, 10**6])), "token id 1000000 outside"),
    ("collect-negative-id", lambda m: quantdiff.collect_stats(m, torch.tensor([1, -1])), "token id -1 outside"),
    ("collect-longer-than-positions", lambda m: quantdiff.collect_stats(m, torch.ones(1, 257, dtype=torch.long)), "257 tokens exceeds the model's 128 positions"),
    ("collect-batch-beyond-vocabulary", lambda m: quantdiff.collect_stats(m, make_batches([[1, 10**6]], 1)), "outside the model's vocabulary"),
    ("collect-list-of-lists", lambda m: quantdiff.collect_stats(m, [[1, 2, 3]]), "Batch objects, got a list holding a list"),
    ("collect-k-0", lambda m: quantdiff.collect_stats(m, IDS, k=0), "k must be a positive integer, got 0"),
    ("collect-k-float", lambda m: quantdiff.collect_stats(m, IDS, k=2.5), "k must be a positive integer"),
    ("collect-batch-size-0", lambda m: quantdiff.collect_stats(m, IDS, batch_size=0), "batch_size must be a positive integer"),
    ("collect-not-a-model", lambda m: quantdiff.collect_stats("tiny/diff", IDS), "model must be a torch model loaded with quantdiff.load"),
    ("collect-untapped-model", lambda m: quantdiff.collect_stats(torch.nn.Linear(2, 2), IDS), "no quantdiff attention taps"),
    ("load-tile-size-negative", lambda m: quantdiff.load("tiny/diff", tile_size=-3), "tile_size"),
    ("load-dtype-unknown-string", lambda m: quantdiff.load("tiny/diff", dtype="int8"), "dtype must be a floating type"),
    ("load-dtype-integer", lambda m: quantdiff.load("tiny/diff", dtype=torch.int8), "dtype must be a floating torch.dtype"),
    ("load-unknown-keyword", lambda m: quantdiff.load("tiny/diff", tilesize=3), "load() has no parameter 'tilesize'"),
    ("load-name-not-a-string", lambda m: quantdiff.load(3), "model must be a model name or path"),
    ("load-empty-name", lambda m: quantdiff.load(""), "got an empty string"),
    ("load-bad-device", lambda m: quantdiff.load("tiny/diff", device="gpu7"), "unknown device"),
    ("load-trust-remote-code-string", lambda m: quantdiff.load("tiny/diff", trust_remote_code="yes"), "trust_remote_code must be True or False"),
    ("tokenizer-name-not-a-string", lambda m: quantdiff.load_tokenizer(None), "model must be a model name or path"),
    ("quantized-config-string", lambda m: quantdiff.quantized(m, "absmax").__enter__(), "config must be a QuantConfig"),
    ("quantized-model-string", lambda m: quantdiff.quantized("tiny/diff", None).__enter__(), "model must be a torch model"),
    ("apply-config-dict", lambda m: quantdiff.apply_quantization(m, {"method": "absmax"}), "config must be a QuantConfig"),
    ("export-format-string", lambda m: quantdiff.export_quantized("tiny/diff", "q", "absmax"), "fmt must be an export format"),
    ("export-out-integer", lambda m: quantdiff.export_quantized("tiny/diff", 5, quantdiff.parse_export("absmax", 4)), "out must be a directory path"),
    ("export-unknown-keyword", lambda m: quantdiff.export_quantized("tiny/diff", "q", quantdiff.parse_export("absmax", 4), bits=4), "no parameter 'bits'"),
    ("export-force-string", lambda m: quantdiff.export_quantized("tiny/diff", "q", quantdiff.parse_export("absmax", 4), force="no"), "force must be True or False"),
    ("export-model-list", lambda m: quantdiff.export_quantized(["tiny/diff"], "q", quantdiff.parse_export("absmax", 4)), "model must be a model name or path"),
    ("parse-config-float-bits", lambda m: quantdiff.parse_config("absmax", 4.5, "logits"), "bits must be an integer"),
    ("parse-export-text-bits", lambda m: quantdiff.parse_export("absmax", "four"), "bits must be an integer"),
    ("parse-config-unknown-granularity", lambda m: quantdiff.parse_config("absmax", 4, "qk", granularity="token"), "unknown granularity 'token'"),
    ("kv-cache-model-string", lambda m: quantdiff.kv_cache("tiny/diff", bits=4), "model must be a loaded model"),
    ("kv-cache-plan-string", lambda m: quantdiff.kv_cache(m, plan="first-4bit.json"), "plan must be a KVPlan"),
    ("kv-cache-group-zero", lambda m: quantdiff.kv_cache(m, bits=4, group_size=0), "group size must be a positive integer"),
    # Issue 32: every public function checks its call and its arguments, as `load` does.
    ("parse-config-transform-number", lambda m: quantdiff.parse_config("absmax", 4, "linear", transform=42), "transform must be None, a HadamardRotation or a Smoothing"),
    ("parse-config-transform-name", lambda m: quantdiff.parse_config("absmax", 4, "linear", transform="hadamard"), "transform must be None, a HadamardRotation"),
    ("parse-config-unknown-keyword", lambda m: quantdiff.parse_config("absmax", 4, "linear", rotate="hadamard"), "parse_config(): got an unexpected keyword argument 'rotate'"),
    ("parse-config-missing-site", lambda m: quantdiff.parse_config("absmax", 4), "parse_config(): missing a required argument: 'site'"),
    ("parse-export-unknown-keyword", lambda m: quantdiff.parse_export("absmax", 4, groupsize=32), "parse_export(): got an unexpected keyword argument 'groupsize'"),
    ("collect-unknown-keyword", lambda m: quantdiff.collect_stats(m, IDS, top_k=3), "collect_stats(): got an unexpected keyword argument 'top_k'"),
    ("calibrated-configs-string", lambda m: quantdiff.calibrated_configs("x", m, None), "configs must be a list of QuantConfig"),
    ("calibrated-configs-none-item", lambda m: quantdiff.calibrated_configs([None], m, None), "a list holding a NoneType"),
    ("calibrated-configs-not-a-model", lambda m: quantdiff.calibrated_configs([], "tiny/diff", None), "model must be a torch model"),
    ("calibrated-configs-bos-text", lambda m: quantdiff.calibrated_configs([], m, None, bos_id="<s>"), "bos_id must be a token id"),
    ("quantized-extra-argument", lambda m: quantdiff.quantized(m, None, False, 3).__enter__(), "quantized(): too many positional arguments"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments_are_one_quantdiff_error_line(model, tmp_path, monkeypatch, call, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(quantdiff.QuantdiffError) as raised:
        call(model)
    assert message in str(raised.value) and "\n" not in str(raised.value), raised.value
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_dtype_names_are_the_dtypes(model):
    loaded = quantdiff.load("tiny/diff", device="cpu", dtype="bfloat16")
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert next(quantdiff.load("tiny/diff", device="cpu", dtype="torch.float32", tile_size=0).parameters()).dtype == torch.float32


def test_good_arguments_still_work(model):
    stats = quantdiff.collect_stats(model, torch.tensor([5, 6, 7, 8]), k=3, batch_size=1)
    assert stats.summary()["hidden_states"]["count"] == 4 * 128 * len(model.model.layers)  # tokens × width × layers


def test_a_transform_object_is_still_taken(model):
    config = quantdiff.parse_config("absmax", 4, "linear", transform=quantdiff.HadamardRotation())
    with quantdiff.quantized(model, config):
        quantdiff.collect_stats(model, IDS)
    assert quantdiff.calibrated_configs([config], model, None) == [config]  # nothing to calibrate for a rotation
