"""The real models through every export format that claims their architecture (issue 53): SmolLM2 (Llama) and
Gemma 3 (Gemma3ForCausalLM), written by `quantdiff quantize` and read back as the toy tests read theirs
(tests/test_export_formats.py): every weight what the format stores, the config the source's but for fields the
file cannot hold and that change no logit. GGUF maps Llama, not Gemma 3: that refusal is by name.

Pairs, chosen so each format meets each architecture once at ~1 min an export: nf4 and fp4 are one layout
(`Bnb4bitExport`), so SmolLM2 takes nf4 and Gemma 3 fp4; SmolLM2's compressed-tensors W8A8 and W4A16 exports are
tests/test_export_formats.py's slow tests, so only Gemma 3 takes them here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from quantdiff.api import load
from quantdiff.cli.app import main
from quantdiff.models import loading
from quantdiff.models.names import resolve
from quantdiff.quant.export import stored_weights
from quantdiff.quant.formats import parse_export
from tests.test_export_formats import _naive_q8_0

FORMATS = {  # id: (quantize arguments, parse_export's method, bits[, format])
    "absmax": (["--bits", "8"], ("absmax", 8)),
    "llm-int8": (["--method", "llm-int8", "--bits", "8"], ("llm-int8", 8)),
    "nf4": (["--method", "nf4", "--bits", "4"], ("nf4", 4)),
    "fp4": (["--method", "fp4", "--bits", "4"], ("fp4", 4)),
    "ct-w4a16": (["--format", "compressed-tensors", "--bits", "4"], ("absmax", 4, "compressed-tensors")),
    "ct-w8a8": (["--format", "compressed-tensors", "--bits", "8"], ("absmax", 8, "compressed-tensors")),
    "gguf": (["--format", "gguf", "--bits", "8"], ("absmax", 8, "gguf")),
}
PAIRS = [("smollm2", "absmax"), ("smollm2", "llm-int8"), ("smollm2", "nf4"), ("smollm2", "gguf"),
         ("gemma3", "absmax"), ("gemma3", "llm-int8"), ("gemma3", "fp4"), ("gemma3", "ct-w4a16"), ("gemma3", "ct-w8a8")]
# Config fields a reload may differ in, each because the file cannot hold it and it changes no logit: a GGUF
# header holds no special-token id but the tokenizer's (SmolLM2's unk_token_id 0 comes back None), no dtype (read
# back in float32), no name or class list of the source.
UNHELD_HARMLESS = {"gguf": {"unk_token_id", "pad_token_id", "dtype", "torch_dtype", "_name_or_path", "architectures", "transformers_version"}}
ALWAYS_HARMLESS = {"_name_or_path", "transformers_version", "quantization_config", "dtype", "torch_dtype"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """model, format -> its export, written on first use (by name, as README's command) and shared in the module."""
    root, done = tmp_path_factory.mktemp("exports"), {}

    def export(model: str, fmt: str) -> Path:
        if (model, fmt) not in done:
            out = root / f"{model}-{fmt}" / ("q.gguf" if fmt == "gguf" else "q")
            out.parent.mkdir()
            main(["quantize", model, "--out", str(out), "-q", *FORMATS[fmt][0]])
            done[model, fmt] = out
        return done[model, fmt]

    return export


@pytest.mark.slow(seconds=150)  # measured 9 s (smollm2-llm-int8) to 280 s (smollm2-gguf) on a shared 2-core machine
# make test runs SmolLM2's GGUF export (the one that regressed); the other pairs, ~10 one-core minutes together, are
# marked real_exports, which make test leaves to make test-isolation (every module alone, as CI runs it)
@pytest.mark.parametrize("model,fmt", [pytest.param(m, f, marks=() if (m, f) == ("smollm2", "gguf") else pytest.mark.real_exports, id=f"{m}-{f}")
                                       for m, f in PAIRS])
def test_a_real_model_exports_and_reloads_exactly(model, fmt, exported, tmp_path, monkeypatch):
    source_dir = resolve(model)[0]  # the shared cache's conversion, read only
    out = exported(model, fmt)
    method, bits, *container = FORMATS[fmt][1]
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))  # a GGUF read back is dequantized there, not in the shared cache
    source = loading.load(source_dir, device="cpu", dtype=torch.float32)
    back = load(out, device="cpu", dtype=torch.float32)

    ours, theirs = source.config.to_dict(), back.config.to_dict()
    differing = {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)}
    assert differing <= ALWAYS_HARMLESS | UNHELD_HARMLESS.get(fmt, set()), sorted(differing)

    reloaded = dict(back.named_parameters())
    with stored_weights(source, parse_export(method, bits, format=(container or ["quantdiff"])[0])), torch.no_grad():
        unequal = [name for name, p in source.named_parameters() if not torch.equal(p, reloaded[name])]
    assert not unequal, unequal[:5]
    if fmt == "gguf":  # and independently of quantdiff's encoder: ggml's Q8_0 reference rule
        original = loading.load(source_dir, device="cpu", dtype=torch.float32).model.layers[0].self_attn.q_proj.weight.detach()
        assert torch.equal(reloaded["model.layers.0.self_attn.q_proj.weight"], _naive_q8_0(original))


@pytest.mark.slow(seconds=20)
def test_gemma3_to_gguf_is_refused_by_name(tmp_path, capsys):
    """transformers reads Gemma 3 GGUF files, but gguf_export maps no Gemma 3 graph."""
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "gemma3", "--out", str(tmp_path / "g.gguf"), "-q", *FORMATS["gguf"][0]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1 and "Gemma3ForCausalLM" in err, err
    assert not (tmp_path / "g.gguf").exists()


LLAMA_PYTHON = "QUANTDIFF_LLAMA_PYTHON"  # the Python of a llama-cpp-python environment (benchmarks/engine_check.py's --llama-python)


def _llama_python() -> str | None:
    python = os.environ.get(LLAMA_PYTHON)
    if python and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    return None


@pytest.mark.slow(seconds=120)
@pytest.mark.skipif(_llama_python() is None, reason=f"llama.cpp's engine is not installed: set {LLAMA_PYTHON} to a Python with "
                    "llama-cpp-python (built from source, benchmarks/engine_check.py; no prebuilt wheel installs here)")
def test_smollm2_gguf_runs_in_llama_cpp_beside_quantdiff(exported, tmp_path, monkeypatch):
    """The engine check on `quantize smollm2 --format gguf --bits 8`: llama.cpp computes what quantdiff computes,
    within the engine check's recorded verdict for Q8_0 (docs/quantization.md: 0.10 perplexity, top-1 0.955)."""
    from benchmarks.engine_check import compare, engine_scores, quantdiff_scores

    out = exported("smollm2", "gguf")
    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(100, 40000, (2, 65), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "windows.json").write_text(json.dumps(ids))
    scores, engine = engine_scores(_llama_python(), "llama.cpp", out, tmp_path / "windows.json", "float32")
    assert scores is not None, engine
    result = compare(quantdiff_scores(out, ids), scores)
    assert result["top1_agreement"] >= 0.9 and abs(result["perplexity_engine"] / result["perplexity_quantdiff"] - 1) < 0.01, result
