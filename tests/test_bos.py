"""BOS as the model was trained (`models.bos`): every window of every text source and task starts with the model's
BOS token when the model expects one, holding --seq-len tokens with it; `--bos always|never` overrides; input_ids
JSONL stays as given; the stats, sweep and eval JSON record the decision and its reason.

References are naive: the text tokenized once without special tokens and cut by hand into windows of seq_len − 1
after BOS (or seq_len without)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import processors

from quantdiff.cli.app import main
from quantdiff.data import corpus
from quantdiff.eval.tasks.choice import encode_pair
from quantdiff.eval.tasks.registry import make_task
from quantdiff.jobs.stats import StatsOptions, plan
from quantdiff.models.bos import decide_bos
from quantdiff.models.loading import load_tokenizer
from quantdiff.models.names import resolve
from quantdiff.models.pairs import SizePreset, build_pair
from quantdiff.models.tokenizer import BOS, train_bpe

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families. ") * 12
SEQ = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas with the same weights: `adds` has a tokenizer whose post-processor puts BOS first (as
    Llama's do), `plain` one that adds nothing."""
    root = tmp_path_factory.mktemp("bos")
    model = build_pair(SizePreset(hidden_size=32, num_layers=2, num_heads=4, vocab_size=300, max_position_embeddings=256), seed=0)["standard"]
    for name in ("adds", "plain"):
        tokenizer = train_bpe(TEXT, vocab_size=290)
        if name == "adds":
            tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.bos_token_id)])
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "text.txt").write_text(TEXT)
    (root / "records.jsonl").write_text("".join(json.dumps({"text": TEXT[i : i + 150]}) + "\n" for i in range(0, 600, 150)))
    return root


@pytest.fixture
def held_out(monkeypatch):
    """The corpus' held-out and training splits replaced by TEXT: builtin sources and tasks run without the corpus
    installed."""
    monkeypatch.setattr(corpus, "held_out_text", lambda: TEXT)
    monkeypatch.setattr(corpus, "train_text", lambda: TEXT)


def _ids(model_dir, text: str) -> list[int]:
    return load_tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"]


def _rows(model_dir, data: str, tokens: int, seq_len: int = SEQ) -> list[list[int]]:
    """The sequences `quantdiff stats` would run, padding removed."""
    (planned,) = plan(StatsOptions(models=(str(model_dir),), data=data, tokens=tokens, seq_len=seq_len, batch_size=3))
    rows = []
    for batch in planned.batches:
        mask = torch.ones_like(batch.input_ids) if batch.attention_mask is None else batch.attention_mask
        rows += [row[keep.bool()].tolist() for row, keep in zip(batch.input_ids, mask)]
    return rows


def test_the_decision_follows_the_tokenizer_the_recipe_and_the_override(models, tmp_path):
    adds, plain = load_tokenizer(models / "adds"), load_tokenizer(models / "plain")
    assert decide_bos(models / "adds", adds).token_id == adds.bos_token_id == 1
    assert decide_bos(models / "adds", adds).reason == "its tokenizer adds BOS"
    assert decide_bos(models / "plain", plain).token_id is None
    assert decide_bos(models / "plain", plain, "always").token_id == 1 and decide_bos(models / "adds", adds, "never").token_id is None
    for name in ("tiny/standard", "bb/standard"):  # both shipped sets: their confirmatory recipes say bos = true
        shipped = resolve(name)[0]
        assert decide_bos(shipped, load_tokenizer(shipped)).reason == "trained by quantdiff with [train] bos = true"
    shutil.copytree(resolve("tiny/standard")[0], tmp_path / "without")  # a model trained with bos = false
    (tmp_path / "without" / "recipe.toml").write_text("[train]\nbos = false\n")
    assert decide_bos(tmp_path / "without", load_tokenizer(tmp_path / "without")).token_id is None


def test_a_recipe_with_bos_wins_over_a_tokenizer_that_adds_none(models, tmp_path):
    shutil.copytree(models / "plain", tmp_path / "trained")
    (tmp_path / "trained" / "recipe.toml").write_text("[train]\nbos = true\n")
    tokenizer = load_tokenizer(tmp_path / "trained")
    assert decide_bos(tmp_path / "trained", tokenizer).token_id == tokenizer.bos_token_id


@pytest.mark.parametrize("data", ["text.txt", "records.jsonl", "builtin:corpus", "builtin:corpus-train"])
def test_every_window_of_a_text_source_starts_with_bos_and_holds_seq_len_tokens(models, held_out, data):
    source = data if data.startswith("builtin:") else str(models / data)
    texts = [TEXT] if data != "records.jsonl" else [json.loads(line)["text"] for line in (models / data).read_text().splitlines()]
    expected = []  # by hand: each text's tokens in windows of SEQ - 1, each after BOS
    for text in texts:
        ids = _ids(models / "adds", text)
        expected += [[1] + ids[i : i + SEQ - 1] for i in range(0, len(ids), SEQ - 1)]
    rows = _rows(models / "adds", source, tokens=200)
    assert rows == expected[: len(rows)][:-1] + [expected[len(rows) - 1][: len(rows[-1])]]
    assert sum(map(len, rows)) == 200 and len(rows[0]) == SEQ and all(len(r) <= SEQ for r in rows)  # BOS included
    plain = _rows(models / "plain", source, tokens=200)  # no BOS: windows of SEQ text tokens
    ids = _ids(models / "plain", texts[0])
    assert plain[0] == ids[:SEQ] and 1 not in plain[0]


def test_retrieval_documents_start_with_bos(models, held_out):
    rows = _rows(models / "adds", "builtin:retrieval", tokens=512, seq_len=256)  # four needles need about 170 tokens
    assert sum(map(len, rows)) == 512 and all(r[0] == 1 and 1 not in r[1:] and len(r) <= 256 for r in rows)


def test_input_ids_records_stay_as_given(models, tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [5, 6, 7]}\n{"input_ids": [8, 9]}\n')
    (planned,) = plan(StatsOptions(models=(str(models / "adds"),), data=str(tmp_path / "ids.jsonl"), tokens=5, seq_len=SEQ))
    assert planned.batches[0].input_ids[0].tolist() == [5, 6, 7] and planned.bos.token_id is None
    assert planned.bos.reason == "input_ids records used as given"


def test_tasks_open_every_sequence_with_bos(models, held_out):
    tokenizer = load_tokenizer(models / "adds")
    ids = _ids(models / "adds", TEXT)
    lm = make_task("lm", tokens=64, context=SEQ)
    with_bos, without = lm.prepare(tokenizer, None, 1), lm.prepare(tokenizer, None, None)
    assert with_bos.windows[0] == [1] + ids[: SEQ - 1] and with_bos.windows[1] == [1] + ids[SEQ - 1 : 2 * SEQ - 2]
    assert without.windows[0] == ids[:SEQ]
    (models / "choice.jsonl").write_text(json.dumps({"ctx": "It is a truth", "endings": ["universally", "of a wife"], "label": 0}) + "\n")
    choice = make_task("choice", path=models / "choice.jsonl").prepare(tokenizer, None, 1)
    assert [context for context, _ in choice.requests] == [[1, *_ids(models / "adds", "It is a truth")]] * 2
    assert encode_pair(tokenizer, "", " a man", 1)[0] == [1]  # an empty context: BOS alone, not twice
    retrieval = make_task("retrieval", context_tokens=128, n_needles=1, examples=2).prepare(tokenizer, None, 1)
    for item, example in zip(retrieval.items, make_task("retrieval", context_tokens=127, n_needles=1, examples=2).make_examples(tokenizer)):
        assert item.prompt_ids[0] == 1 and len(item.prompt_ids) + len(item.answer_ids) <= 128
        assert item.prompt_ids[1:] == _ids(models / "adds", example.prompt)  # the same document, one token shorter
        span = tokenizer.decode([item.prompt_ids[p] for p in item.answer_positions])
        assert span.strip() == example.needles[example.query_index][1]  # still the needle's value after the shift


def test_stats_json_records_each_models_own_convention(models, tmp_path, capsys):
    out = tmp_path / "s.json"
    main(["stats", str(models / "adds"), str(models / "plain"), "--data", str(models / "text.txt"), "--tokens", "64", "--seq-len", str(SEQ), "--json", str(out)])
    printed = capsys.readouterr().out
    adds, plain = json.loads(out.read_text())["models"]
    assert adds["bos"] == {"added": True, "token_id": 1, "token": BOS, "mode": "auto", "reason": "its tokenizer adds BOS"}
    assert plain["bos"] == {"added": False, "token_id": None, "token": None, "mode": "auto", "reason": "its tokenizer adds no BOS"}
    assert "BOS first for some models only" in printed and f"adds: every sequence starts with BOS {BOS} (id 1)" in printed
    main(["stats", str(models / "adds"), "--data", str(models / "text.txt"), "--tokens", "64", "--seq-len", str(SEQ), "--bos", "never", "--quiet", "--json", str(out)])
    assert json.loads(out.read_text())["models"][0]["bos"]["reason"] == "--bos never"


def test_sweep_and_eval_json_record_the_decision(models, tmp_path):
    main(["sweep", str(models / "adds"), str(models / "plain"), "--task", "lm", "--data", str(models / "text.txt"), "--context", str(SEQ),
          "--limit", "2", "--bits", "8", "--quiet", "--json", str(tmp_path / "w.json")])
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["bos"]["adds"]["added"] and not doc["bos"]["plain"]["added"]
    reference = {c["model"]: c for c in doc["cells"] if c["method"] is None}
    assert reference["adds"]["tokens"] == reference["plain"]["tokens"] == 2 * (SEQ - 1)  # BOS is context, never scored
    main(["eval", str(models / "plain"), "--task", "lm", "--data", str(models / "text.txt"), "--context", str(SEQ), "--limit", "1",
          "--bos", "always", "--quiet", "--json", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["bos"]["plain"] == {"added": True, "token_id": 1, "token": BOS, "mode": "always", "reason": "--bos always"}


@pytest.mark.parametrize("argv, words", [
    (["stats", "{m}/adds", "--bos", "sometimes"], "--bos must be one of auto, always, never"),
    (["stats", "{m}/adds", "--data", "{m}/text.txt", "--seq-len", "1"], "leaves no room for text after BOS"),
    (["eval", "bb/standard", "--task", "bb", "--bos", "never"], "task bb's sequences start with BOS by construction"),
], ids=["unknown-mode", "no-room", "bb-never"])
def test_bad_bos_input_is_one_line(models, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main([a.replace("{m}", str(models)) for a in argv])
    err = capsys.readouterr().err
    assert info.value.code != 0 and err.startswith("error:") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_gguf_says_whether_bos_comes_first_where_transformers_tokenizer_does_not(tmp_path, monkeypatch, add_bos):
    from test_gguf import _tiny_llama_gguf

    monkeypatch.setenv("QUANTDIFF_CACHE", str(tmp_path / "cache"))
    letters = "abcdefghijklm"
    _tiny_llama_gguf(tmp_path / "tiny.gguf", tokens=["<pad>", "<s>", "</s>", *letters], add_bos=add_bos)
    (directory,) = resolve(tmp_path / "tiny.gguf")
    tokenizer = load_tokenizer(directory)
    assert tokenizer.add_bos_token is False  # what transformers builds from the file
    (tmp_path / "letters.txt").write_text(letters * 8)
    (planned,) = plan(StatsOptions(models=(str(tmp_path / "tiny.gguf"),), data=str(tmp_path / "letters.txt"), tokens=24, seq_len=8))
    rows = planned.batches[0].input_ids.tolist()
    text = [3 + i for i in range(13)] * 8  # each letter is one token, ids 3..15
    assert rows == ([[1] + text[i : i + 7] for i in (0, 7, 14)] if add_bos else [text[i : i + 8] for i in (0, 8, 16)])
    assert planned.bos.reason == f"the GGUF file's tokenizer.ggml.add_bos_token = {str(add_bos).lower()}"
