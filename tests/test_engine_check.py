"""The engine check's comparison (benchmarks/engine_check.py) on small fixtures: no engine needed."""

import math

import pytest
import torch

from benchmarks.engine_check import TokenScores, _from_logprob_rows, compare, engine_scores, failure_line, quantdiff_scores


def test_compare_on_hand_computed_scores():
    ours = TokenScores([[-1.0, -1.0], [-1.0]], [[1, 2], [3]])
    theirs = TokenScores([[-2.0, -1.5], [-0.5]], [[1, 5], [3]])
    result = compare(ours, theirs)
    assert result["perplexity_quantdiff"] == pytest.approx(math.e)
    assert result["perplexity_engine"] == pytest.approx(math.exp(4 / 3))
    assert result["top1_agreement"] == pytest.approx(2 / 3)
    assert result["max_logprob_gap"] == pytest.approx(1.0) and result["positions"] == 3


def test_scores_from_logits_match_cross_entropy_and_argmax():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    windows = [[0, 3, 7, 1, 10, 2], [5, 5, 0, 9, 4, 8]]
    scores = _from_logprob_rows([torch.log_softmax(row, -1) for row in logits], windows)
    targets = torch.tensor([w[1:] for w in windows])
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    assert compare(scores, scores)["perplexity_quantdiff"] == pytest.approx(math.exp(nll.item()))
    assert scores.top1 == logits.argmax(-1).tolist()


def test_windows_of_other_lengths_are_one_line():
    with pytest.raises(ValueError, match=r"^the engine scored windows of \[1\] positions, quantdiff \[2\]$"):
        compare(TokenScores([[-1.0, -1.0]], [[0, 0]]), TokenScores([[-1.0]], [[0]]))


def test_a_failed_engine_run_reports_its_exception_not_the_shutdown_noise_after_it():
    stderr = """Traceback (most recent call last):
  File "x.py", line 1, in <module>
    raise RuntimeError("outer")
(EngineCore pid=7) ValueError: shape '[30, 32, 4, 128]' is invalid for input of size 552960
RuntimeError: Engine core initialization failed. See root cause above.
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: leaked semaphores
  warnings.warn('resource_tracker: There appear to be %d '

"""
    assert failure_line(stderr, 1) == "RuntimeError: Engine core initialization failed. See root cause above."
    assert failure_line(stderr.split("RuntimeError: Engine")[0], 1).startswith("(EngineCore pid=7) ValueError: shape")
    assert failure_line("just a line\n", 3) == "just a line" and failure_line("", 3) == "exit 3"


@pytest.mark.slow
def test_transformers_engine_run_beside_quantdiff_agrees_exactly(tmp_path):
    """The whole route — export, the engine run in a subprocess, quantdiff's reload — on the tiny model's W8A8."""
    import json
    import sys

    from quantdiff.models.names import resolve
    from quantdiff.quant.export import export_quantized
    from quantdiff.quant.formats import parse_export

    out = tmp_path / "w8"
    export_quantized(resolve("tiny/standard")[0], out, parse_export("absmax", 8, format="compressed-tensors"))
    windows = [[1, 5, 9, 13, 2, 40], [7, 3, 3, 8, 60, 11]]
    (tmp_path / "windows.json").write_text(json.dumps(windows))
    scores, engine = engine_scores(sys.executable, "transformers", out, tmp_path / "windows.json", "float32")
    assert engine.startswith("transformers ")
    result = compare(quantdiff_scores(out, windows), scores)
    assert result["top1_agreement"] == 1.0 and result["max_logprob_gap"] == 0.0
