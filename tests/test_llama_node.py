"""benchmarks/llama_node.py: the comparison against a naive float64 loop (no engine needed), the reasons the
engine is missing, and, where node-llama-cpp is installed, llama.cpp on the shipped tiny model's unquantized GGUF
export, which it must compute as quantdiff does."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks import llama_node

ENGINE = llama_node.engine_dir()
ENGINE_MISSING = llama_node.missing(ENGINE)


def _naive(reference: list[torch.Tensor], engine: list[np.ndarray], windows: list[list[int]]) -> dict:
    """KL(p ‖ q), same top-1 and Δ loss position by position, entry by entry, in Python floats."""
    kls, same, nll_p, nll_q = [], [], [], []
    for logits, theirs, window in zip(reference, engine, windows):
        for t in range(len(window) - 1):
            row = [float(x) for x in logits[t]]
            top = max(row)
            log_z = top + math.log(sum(math.exp(x - top) for x in row))
            log_p = [x - log_z for x in row]
            log_q = [float(x) for x in theirs[t]]
            kls.append(sum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q)))
            same.append(log_p.index(max(log_p)) == log_q.index(max(log_q)))
            nll_p.append(-log_p[window[t + 1]])
            nll_q.append(-log_q[window[t + 1]])
    return {"kld_mean": sum(kls) / len(kls), "kld_max": max(kls), "same_top1": sum(same) / len(same),
            "delta_loss": (sum(nll_q) - sum(nll_p)) / len(kls), "max_logprob_gap": max(abs(a - b) for a, b in zip(nll_p, nll_q))}


def test_agreement_equals_a_naive_float64_loop():
    generator = torch.Generator().manual_seed(0)
    windows = [[3, 1, 4, 1, 5, 9], [2, 6, 5, 3]]
    reference = [torch.randn(len(w), 11, generator=generator) * 3 for w in windows]
    # the engine: the same logits, perturbed, as log-probabilities of float32 probabilities (as llama_cpp_check.mjs writes)
    engine = [torch.log_softmax(r[:-1].double() + 0.3 * torch.randn(r.shape[0] - 1, 11, generator=generator, dtype=torch.float64), -1)
              .exp().float().double().log().numpy() for r in reference]
    result = llama_node.agreement(reference, engine, windows)
    expected = _naive(reference, engine, windows)
    assert result["tokens"] == 8
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key  # per_token rounds q's log-probabilities to float32


def test_an_underflowed_engine_probability_stays_finite_and_counts_as_nothing():
    """ggml's float32 softmax gives 0 beyond ~103 nats below the top: read as the smallest float32, ln q is finite."""
    windows = [[0, 1, 2]]
    reference = [torch.tensor([[0.0, 5.0, -200.0], [0.0, 5.0, -200.0], [0.0, 0.0, 0.0]])]
    probabilities = torch.softmax(reference[0][:-1].double(), -1).float().numpy().astype(np.float64)
    assert (probabilities[:, 2] == 0).all()
    engine = [np.log(np.maximum(probabilities, llama_node.SMALLEST_FLOAT32))]
    result = llama_node.agreement(reference, engine, windows)
    assert math.isfinite(result["kld_max"]) and result["kld_max"] < 1e-6 and result["same_top1"] == 1.0


def test_positions_that_differ_are_one_line():
    with pytest.raises(ValueError, match=r"^llama.cpp scored \[1\] positions per window, the windows have \[2\]$"):
        llama_node.agreement([torch.zeros(3, 4)], [np.zeros((1, 4))], [[0, 1, 2]])


def test_a_missing_engine_is_named_with_its_install_command(tmp_path, monkeypatch):
    assert llama_node.missing(tmp_path) == (f"node-llama-cpp is not installed in {tmp_path}: run `bash scripts/install_llama_engine.sh` "
                                            "(or set QUANTDIFF_LLAMA_NODE to its folder)")
    monkeypatch.setattr(llama_node.shutil, "which", lambda name: None)
    assert llama_node.missing(tmp_path).startswith("node is not on PATH")
    with pytest.raises(RuntimeError, match="^node is not on PATH"):
        llama_node.engine_distributions(tmp_path / "x.gguf", [[1, 2]], tmp_path)
    monkeypatch.setenv("QUANTDIFF_LLAMA_NODE", str(tmp_path / "engine"))
    assert llama_node.engine_dir() == tmp_path / "engine"


@pytest.mark.slow(seconds=40)
@pytest.mark.skipif(ENGINE_MISSING is not None, reason=f"llama.cpp's engine is not installed: {ENGINE_MISSING}")
def test_llama_cpp_computes_the_unquantized_tiny_gguf_as_quantdiff_does(tmp_path, monkeypatch):
    """An F32 GGUF (`--bits 16`) involves no quantization on either side: the two engines differ only in the
    order of float32 additions. Measured on these windows: KL max 3.9e-8, top-1 1.000, largest |Δ log p| 0.0004;
    the Q8_0 export of the same model gives KL max 9.9e-5 and |Δ log p| 0.015 (llama.cpp's 8-bit activations), so
    the bounds tell "no quantization anywhere" from "quantized somewhere"."""
    from quantdiff.models.names import resolve
    from quantdiff.quant.formats import parse_export
    from quantdiff.quant.gguf_export import export_gguf

    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))  # the GGUF read back is dequantized there
    out = tmp_path / "f32.gguf"
    export_gguf(resolve("tiny/standard")[0], out, parse_export("absmax", 16, format="gguf"))
    windows = torch.randint(3, 2000, (2, 64), generator=torch.Generator().manual_seed(0)).tolist()
    engine, version = llama_node.engine_distributions(out, windows, ENGINE)
    result = llama_node.agreement(llama_node.quantdiff_logits(out, windows), engine, windows)
    assert version.startswith("node-llama-cpp ") and result["tokens"] == 126
    assert result["kld_max"] < 1e-5 and result["same_top1"] == 1.0 and result["max_logprob_gap"] < 0.01, result


@pytest.mark.slow(seconds=40)
@pytest.mark.skipif(ENGINE_MISSING is not None, reason=f"llama.cpp's engine is not installed: {ENGINE_MISSING}")
def test_llama_cpp_runs_a_mixed_precision_plan_gguf_as_quantdiff_reads_it(tmp_path, monkeypatch):
    """`quantize --plan` to GGUF (issue 55): tensors of one layer in Q8_0, of the others in Q4_0, in one file that
    llama.cpp loads and computes as quantdiff's forward of the same file does, within the bounds the uniform Q8_0
    export of SmolLM2 meets (tests/test_real_exports.py: KL 0.0022, top-1 0.966 measured)."""
    import gguf

    from quantdiff.cli.app import main
    from quantdiff.models.loading import load_config
    from quantdiff.models.names import resolve
    from quantdiff.quant.precision_plan import save_plan
    from tests.test_precision_plan import _plan

    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    layers = load_config(resolve("tiny/standard")[0]).num_hidden_layers
    bits = (8,) + (4,) * (layers - 1)
    save_plan(_plan(bits=bits, budget_bits=8.0), tmp_path / "plan.json")
    out = tmp_path / "plan.gguf"
    main(["quantize", "tiny/standard", "--plan", str(tmp_path / "plan.json"), "--format", "gguf", "--out", str(out)])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors if t.name.startswith("blk.") and t.name.endswith("_q.weight")}
    assert types == {f"blk.{i}.attn_q.weight": "Q8_0" if i == 0 else "Q4_0" for i in range(layers)}, types
    windows = torch.randint(3, 2000, (2, 64), generator=torch.Generator().manual_seed(0)).tolist()
    engine, _ = llama_node.engine_distributions(out, windows, ENGINE)
    result = llama_node.agreement(llama_node.quantdiff_logits(out, windows), engine, windows)
    assert result["kld_mean"] < 0.01 and result["same_top1"] >= 0.9 and abs(result["delta_loss"]) < 0.01, result
