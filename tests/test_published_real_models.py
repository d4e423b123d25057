"""The real models' headline figures in README.md and docs/results.md against the JSON under results/real-models
(issue 43: every published figure has the file it comes from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantdiff.core.documents import read_document

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results" / "real-models"
PAGES = [REPO / "README.md", REPO / "docs" / "results.md"]


def _model(name: str) -> dict:
    [model] = read_document(RESULTS / f"{name}.json")["models"]
    return model


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_headline_figures_are_the_json_s(page):
    text = page.read_text()
    smollm2 = _model("smollm2-stats")["hidden_states"]["massive_activation"]
    assert (smollm2["layer"], smollm2["position"], smollm2["channel"]) == (11, 0, 507)
    assert f"{smollm2['value']:,.0f}" == "23,993" and "23,993" in text
    assert smollm2["ratio"] == pytest.approx(smollm2["value"] / smollm2["layer_median"])  # the ratio is what it says
    assert f"{smollm2['ratio']:,.0f}×" == "14,161×" and "14,161×" in text
    gemma3 = _model("gemma3-stats")
    peak = gemma3["hidden_states"]["massive_activation"]
    assert (peak["layer"], peak["position"], peak["channel"]) == (14, 0, 163)
    assert f"{peak['value']:,.0f}" == "103,795" and "103,795" in text
    sinks = gemma3["sinks"]
    assert sinks["heads_scored"] == 72 and f"{100 * sinks['score']:.0f}%" == "62%" and "62% of the" in text
    assert gemma3["bos"]["added"] is True
    without = _model("gemma3-nobos")
    assert without["bos"]["added"] is False and without["sinks"]["score"] == 0.0  # "no sinks at all" without BOS


def test_the_per_sequence_8_bit_cell_is_the_json_s():
    cells = {(c["method"], c["granularity"]): c for c in json.loads((RESULTS / "smollm2-sweep-tensor.json").read_text())["cells"]}
    text = (REPO / "docs" / "results.md").read_text()
    assert f"{cells[(None, None)]['accuracy']:.3f}" == "0.287"
    absmax = cells[("absmax", "tensor")]
    assert f"{absmax['accuracy']:.4f}" == "0.2255" and "0.2255 on AMD" in text  # the file was measured on an AMD CPU
    assert f"{cells[('llm-int8', 'tensor')]['accuracy']:.3f}" == "0.281" and "keeps 0.281" in text
