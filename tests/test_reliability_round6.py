"""Issue 53's rules on plans, labels and value boundaries (round 6 of the bad-input probe), each tested as a rule
on more than the probe's example: every public number normalised once at the door, plans that carry their
calibration data's hash and a budget their layers keep, one non-finite guard, and cells labelled with what ran."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import quantdiff
from quantdiff.core.errors import ConfigError
from test_reliability import _fails  # noqa: F401


# ---- one boundary for numbers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    return quantdiff.load("tiny/standard", device="cpu")


@pytest.mark.parametrize("integer", [np.int16(4), np.uint8(4), np.int64(4)], ids=["int16", "uint8", "int64"])
def test_numpy_integers_become_ints_at_every_public_door(tiny_model, integer):
    """kv_cache's bits once reached generate as np.int16 (2 ** (bits - 1) overflowed there), parse_export's
    group_size the export as np.uint8 (64 * 4 wraps): both are Python ints once past the door."""
    cache = quantdiff.kv_cache(tiny_model, bits=integer, group_size=np.uint8(16))
    assert all(type(b) is int for layer in cache.layers for b in layer.plan.kv_bits)
    assert all(type(layer.group_size) is int for layer in cache.layers)
    for fmt in (quantdiff.parse_export("absmax", integer, group_size=np.uint8(64)),
                quantdiff.parse_export("absmax", integer, format="compressed-tensors", group_size=np.uint8(64))):
        assert (fmt.bits, fmt.group_size) == (4, 64) and type(fmt.bits) is int and type(fmt.group_size) is int
    assert type(quantdiff.parse_export("absmax", 8, format="gguf").bits) is int
    ids = torch.tensor([[1, 2, 3, 4]])
    out = tiny_model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=quantdiff.kv_cache(tiny_model, bits=integer))
    assert out.shape == (1, 6)


@pytest.mark.parametrize("call,named", [
    (lambda m: quantdiff.kv_cache(m, bits=True), "kv_cache(): bits"), (lambda m: quantdiff.kv_cache(m, bits=4, group_size=True), "kv_cache(): group_size"),
    (lambda m: quantdiff.parse_export("absmax", 4, group_size=True), "parse_export(): group_size"),
    (lambda m: quantdiff.parse_export("llm-int8", 8, threshold=True), "parse_export(): threshold"),
    (lambda m: quantdiff.collect_stats(m, torch.ones(1, 4, dtype=torch.long), k=True), "collect_stats(): k"),
    (lambda m: quantdiff.calibrated_configs([], m, None, bos_id=False), "calibrated_configs(): bos_id"),
], ids=["kv-bits", "kv-group", "export-group", "export-threshold", "stats-k", "bos-id"])
def test_a_bool_where_a_number_is_asked_is_refused_naming_the_parameter(tiny_model, call, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")) as info:
        call(tiny_model)
    assert "\n" not in str(info.value)


def test_the_export_formats_store_numpy_integers_as_ints():
    from quantdiff.quant.compressed_tensors import CompressedTensorsExport
    from quantdiff.quant.formats import AbsmaxExport
    from quantdiff.quant.gguf_format import GGUFExport

    for fmt in (AbsmaxExport(np.int8(4), np.uint8(64)), CompressedTensorsExport(np.int8(4), np.uint8(64))):
        assert type(fmt.bits) is int and type(fmt.group_size) is int
    assert type(GGUFExport(np.int64(8)).bits) is int
    with pytest.raises(ConfigError, match="AbsmaxExport: bits"):
        AbsmaxExport(True)
