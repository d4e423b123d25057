"""Corpus decoding and split, tokenizer, and the needle-document generator."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from transformers import AutoTokenizer

from quantdiff.data import corpus
from quantdiff.core.errors import DataError
from quantdiff.data.needles import VALUE_LENGTH, Filler, make_needle_example
from quantdiff.models.tokenizer import BOS, EOS, PAD, save_tokenizer, train_bpe

WORDS = "the lady walked to the house and spoke with her sister about a letter from town".split()


def synthetic_text(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 14))).capitalize() + "." for _ in range(n_sentences))


def r_character_vector(strings: list[str | None]) -> bytes:
    """An R lazy-load block written from R's serialisation spec: XDR header, STRSXP, CHARSXPs (None = NA)."""
    body = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    body += struct.pack(">ii", 16, len(strings))
    for s in strings:
        if s is None:
            body += struct.pack(">ii", 9, -1)
        else:
            raw = s.encode("utf-8")
            body += struct.pack(">ii", 0x00040009, len(raw)) + raw
    return struct.pack(">i", len(body)) + zlib.compress(body)


def test_parse_rdata_decodes_each_block_and_na():
    blob = r_character_vector(["EMMA", "", "Chapter I", "café — naïve", None]) + r_character_vector(["PERSUASION"])
    assert corpus.parse_rdata(blob) == [["EMMA", "", "Chapter I", "café — naïve", ""], ["PERSUASION"]]


def test_rdata_blocks_split_at_each_vector_and_any_block_alone_parses():
    first, second = r_character_vector(["EMMA", "Chapter I"]), r_character_vector(["PERSUASION", None])
    blocks = corpus.rdata_blocks(first + second)
    assert [stored for stored, _ in blocks] == [first, second]
    assert [data for _, data in blocks] == [zlib.decompress(b[4:]) for b in (first, second)]
    assert corpus.parse_rdata(blocks[1][0]) == [["PERSUASION", ""]]


def test_parse_rdata_rejects_other_formats():
    with pytest.raises(DataError):
        corpus.parse_rdata(struct.pack(">i", 4) + zlib.compress(b"RDA2\nnot xdr"))


def test_chapters_drop_front_matter_and_join_paragraph_lines():
    lines = ["TITLE", "by someone", "", "CHAPTER I", "", "First line", "continues here.", "", "Second.", "CHAPTER II", "Third."]
    assert corpus.chapters(lines) == ["First line continues here.\nSecond.", "Third."]


def test_held_out_choice_is_a_stable_hash_of_novel_and_chapter():
    picks = [corpus.is_held_out("EMMA", i) for i in range(2000)]
    assert picks == [corpus.is_held_out("EMMA", i) for i in range(2000)]
    assert 0.07 < sum(picks) / len(picks) < 0.13  # fraction 0.1
    assert picks != [corpus.is_held_out("PERSUASION", i) for i in range(2000)]


def test_missing_corpus_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CORPUS_DIR", str(tmp_path))
    monkeypatch.setattr(corpus, "SYSTEM_ROOT", tmp_path)
    corpus.read_novels.cache_clear()
    corpus.split_text.cache_clear()
    try:
        with pytest.raises(DataError, match="python -m quantdiff.data.corpus --install"):
            corpus.train_text()
    finally:
        corpus.read_novels.cache_clear()
        corpus.split_text.cache_clear()


@pytest.mark.skipif(corpus.find_rdata() is None, reason="corpus not installed (python -m quantdiff.data.corpus --install)")
def test_real_corpus_splits_are_disjoint_chapters():
    novels = corpus.read_novels()
    assert len(novels) == 6
    train, held = corpus.train_text(), corpus.held_out_text()
    assert 3_000_000 < len(train) and 200_000 < len(held) < len(train) / 5
    held_paragraphs = [p for p in held.split("\n") if len(p) > 200]
    assert held_paragraphs and not any(p in train for p in held_paragraphs[:50])


def test_tokenizer_round_trips_through_transformers(tmp_path):
    tok = train_bpe(synthetic_text(400), vocab_size=300)
    save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == (PAD, BOS, EOS)
    assert [loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id] == [0, 1, 2]
    assert len(loaded) == 300
    text = "Unseen: naïve café, 1815 — ∑ émoji 🙂\n"  # byte level: nothing is unknown
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert loaded("the lady", add_special_tokens=False)["input_ids"] == tok("the lady", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def filler_and_tokenizer():
    text = synthetic_text(300)
    tok = train_bpe(text, vocab_size=300)
    return Filler.from_tokenizer(text, tok), tok


@pytest.mark.parametrize("n_needles,n_queries", [(1, 1), (3, 1), (4, 4)], ids=lambda v: str(v))
def test_needle_example_layout(filler_and_tokenizer, n_needles, n_queries):
    filler, tok = filler_and_tokenizer
    rng = random.Random(7)
    depths = [rng.random() for _ in range(n_needles)]
    ex = make_needle_example(rng, filler, 400, n_needles, depths, n_queries)
    assert len(tok(ex.text, add_special_tokens=False)["input_ids"]) <= 400
    assert len(tok(ex.text, add_special_tokens=False)["input_ids"]) > 340  # filler fills the budget
    assert ex.prompt.endswith(f" Recall {ex.query_key}")
    assert ex.answer == f" {ex.needles[ex.query_index][1]}."
    for (key, value), (s, e), (ns, ne) in zip(ex.needles, ex.value_spans, ex.needle_spans):
        assert ex.prompt[s:e] == value and len(value.split()) == VALUE_LENGTH
        assert ex.prompt[ns:ne] == f" Remember {key} {value}."
    assert [s for s, _ in ex.needle_spans] == sorted(s for s, _ in ex.needle_spans)  # document order
    assert ex.prompt[slice(*ex.answer_span)] == ex.needles[ex.query_index][1]
    words = [w for _, v in ex.needles for w in v.split()]
    assert len(words) == len(set(words))  # values share no word: the copy is unambiguous
    assert ex.prompt.count(" Recall ") == n_queries


def test_needle_depths_place_needles(filler_and_tokenizer):
    filler, _ = filler_and_tokenizer
    ex = make_needle_example(random.Random(1), filler, 256, 2, [0.0, 1.0])
    first, last = ex.needle_spans
    assert first[0] == 0  # depth 0: the document starts with the needle
    assert ex.prompt[last[1] :].startswith(" Recall ")  # depth 1: right before the query


def test_needle_examples_are_deterministic(filler_and_tokenizer):
    filler, _ = filler_and_tokenizer
    make = lambda: make_needle_example(random.Random(3), filler, 200, 2, [0.2, 0.6], 2)  # noqa: E731
    assert make() == make()


def test_needle_example_rejects_impossible_requests(filler_and_tokenizer):
    filler, _ = filler_and_tokenizer
    with pytest.raises(DataError, match="too short"):
        make_needle_example(random.Random(0), filler, 20, 3, [0.5] * 3)
    with pytest.raises(DataError, match="depths"):
        make_needle_example(random.Random(0), filler, 256, 2, [0.5])


def sword_module(tmp_path, books: list[str]):
    """A zText module written from SWORD's layout: .bzs records (offset, compressed size, size) into .bzz blocks."""
    index, data = b"", b""
    for book in books:
        raw = book.encode("utf-8")
        block = zlib.compress(raw)
        index += struct.pack("<III", len(data), len(block), len(raw))
        data += block
    (tmp_path / "nt.bzs").write_bytes(index)
    (tmp_path / "nt.bzz").write_bytes(data)
    return tmp_path


def test_sword_chapters_drop_notes_and_tags(tmp_path):
    from quantdiff.data import sword

    book = (
        '<milestone type="x-importer"/><title type="main">Matthew</title>'
        '<chapter n="1" osisID="Matt.1" sID="Matt.1"/><w lemma="G1">The</w> <w>book</w>,<note placement="foot">a footnote</note> '
        '<w>of</w> <w>Jesus</w>. <div type="x-p" sID="p1"/>Second <w>paragraph</w>.<chapter eID="Matt.1"/>'
        '<chapter n="2" osisID="Matt.2" sID="Matt.2"/>Now   when Jesus was born.'
    )
    module = sword_module(tmp_path, ["<milestone/>", book])
    assert sword.chapters(module) == {"nt/1/1": "The book, of Jesus.\nSecond paragraph.", "nt/1/2": "Now when Jesus was born."}
    (tmp_path / "nt.bzs").write_bytes(b"\0" * 13)
    with pytest.raises(DataError, match="multiple of 12"):
        sword.chapters(module)


def test_info_nodes_are_documents(tmp_path):
    import gzip

    from quantdiff.data import infotext

    text = "preamble\n\x1f\nFile: py.info,  Node: Top,  Next: Intro,  Up: (dir)\n\nPython\n******\n\x1f\nFile: py.info,  Node: Intro,  Prev: Top\n\nHello world.\n\x1f\nTag Table:\n"
    path = tmp_path / "py.info.gz"
    path.write_bytes(gzip.compress(text.encode()))
    assert infotext.nodes(path) == {"Top": "Python\n******", "Intro": "Hello world."}


def test_mixed_corpora_split_by_document_and_missing_ones_say_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTDIFF_CORPUS_DIR", str(tmp_path))
    monkeypatch.setattr(corpus, "SYSTEM_ROOT", tmp_path / "none")
    corpus.split_text.cache_clear()
    module = tmp_path / "web" / corpus.SOURCES["web"].path
    chapters = "".join(f'<chapter n="{i}" sID="B.{i}"/>verse of chapter {i}. ' for i in range(1, 201))
    sword_module(module.mkdir(parents=True) or module, ["<milestone/>", chapters])
    try:
        train = corpus.split_text("train", 0.1, corpora=("web",))
        held = corpus.split_text(corpus.HELD_OUT_SPLIT, 0.1, corpora=("web",))
        assert set(train.split("\n\n")) | set(held.split("\n\n")) == {f"verse of chapter {i}." for i in range(1, 201)}
        assert 5 < len(held.split("\n\n")) < 40 and not set(train.split("\n\n")) & set(held.split("\n\n"))
        with pytest.raises(DataError, match="--install --corpus kjv"):
            corpus.split_text("train", 0.1, corpora=("web", "kjv"))
    finally:
        corpus.split_text.cache_clear()
        corpus._read_documents.cache_clear()


@pytest.mark.skipif(any(corpus.debian.find_installed(n, corpus.SOURCES[n].path) is None for n in ("web", "kjv", "python-doc")),
                    reason="corpora not installed (python -m quantdiff.data.corpus --install --corpus web --corpus kjv --corpus python-doc)")
def test_real_debian_corpora_have_many_documents():
    sizes = {name: len(corpus.documents(name)) for name in ("web", "kjv", "python-doc")}
    assert sizes["kjv"] == 1189 and sizes["web"] > 1189 and sizes["python-doc"] > 1000  # KJV: 1,189 chapters
    assert "In the beginning" in corpus.documents("kjv")["ot/1/1"]
