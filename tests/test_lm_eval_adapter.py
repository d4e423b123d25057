"""The lm-evaluation-harness adapter, run offline through `lm_eval.simple_evaluate` on a local HellaSwag-format task."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from task_fakes import EXPECTED_ACC, EXPECTED_ACC_NORM, ITEMS, CharTokenizer, UnigramModel, logp
from test_tasks_cloze import synthetic_text

from quantdiff.data.cloze import build_cloze_set
from quantdiff.core.errors import ConfigError
from quantdiff.models.loading import prepare
from quantdiff.models.pairs import SizePreset, build_model, pair_configs
from quantdiff.quant.sites import parse_config, quantized
from quantdiff.data.choice_items import write_jsonl
from quantdiff.eval.tasks.choice import ChoiceTask, encode_pair
from quantdiff.models.tokenizer import train_bpe

TASK_NAME = "quantdiff_tiny_hellaswag"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No hub, and every cache in a temporary directory."""
    for name, value in {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    return tmp_path


def task_config(path, cache_dir) -> dict:
    """HellaSwag's harness settings (multiple_choice, target delimiter " ", acc/acc_norm) on a local JSONL file."""
    return {
        "task": TASK_NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(path.absolute())}, "cache_dir": str(cache_dir)},
        "validation_split": "validation",
        "output_type": "multiple_choice",
        "doc_to_text": "{{ctx}}",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "endings",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }


def harness_scores(lm, path, cache_dir) -> tuple[float, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task_config(path, cache_dir)],
        task_manager=TaskManager(include_defaults=False),  # indexing the ~10k built-in task files takes seconds
        bootstrap_iters=0,
        log_samples=False,
    )
    result = out["results"][TASK_NAME]
    return result["acc,none"], result["acc_norm,none"]


def test_hand_computed_items_through_simple_evaluate(offline):
    from quantdiff.eval.lm_eval_adapter import QuantdiffLM

    path = offline / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    acc, acc_norm = harness_scores(QuantdiffLM(UnigramModel(), CharTokenizer()), path, offline / "datasets")
    assert acc == pytest.approx(EXPECTED_ACC) and acc_norm == pytest.approx(EXPECTED_ACC_NORM)


def test_quantized_model_gives_the_choice_task_numbers(offline):
    from lm_eval.api.model import TemplateLM

    from quantdiff.eval.lm_eval_adapter import QuantdiffLM

    text = synthetic_text(n_paragraphs=30)
    tokenizer = train_bpe(text, vocab_size=300)
    preset = SizePreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256)
    model = prepare(build_model(pair_configs(preset)["diff"], seed=0))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(20)
    path = offline / "cloze.jsonl"
    write_jsonl(build_cloze_set(text, 12, seed=0), path)
    config = parse_config("absmax", 3, "logits")
    lm = QuantdiffLM(copy.deepcopy(model), tokenizer, config, batch_size=5)

    # Our pair encoding is the harness's, including a context with trailing spaces.
    for context, continuation in [("The river ran", " past the mill."), ("Trailing  ", "space"), ("a", " b")]:
        assert encode_pair(tokenizer, context, continuation) == TemplateLM._encode_pair(lm, context, continuation)

    task = ChoiceTask(path=path, batch_size=3)
    with quantized(model, config):
        ours = task.evaluate(model, task.prepare(tokenizer))
    assert harness_scores(lm, path, offline / "datasets") == pytest.approx((ours["acc"], ours["acc_norm"]))


def test_rolling_loglikelihood_and_greedy_generation():
    from lm_eval.api.instance import Instance

    from quantdiff.eval.lm_eval_adapter import QuantdiffLM

    lm = QuantdiffLM(UnigramModel(), CharTokenizer())
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("ab a",), 0)])
    assert rolling == pytest.approx([sum(logp(c) for c in "ab a")], abs=1e-6)  # every character is scored once
    request = Instance("generate_until", {}, ("xyz", {"until": ["b"], "max_gen_toks": 4}), 0)
    assert lm.generate_until([request]) == ["aaaa"]  # the unigram's argmax is "a"
    with pytest.raises(ConfigError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, ("xyz", {"do_sample": True}), 0)])
