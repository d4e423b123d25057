"""The tracked tree travels to a lent device (issue 58): the device tool carries at most 64 MiB, the tree and the
carried wheels together, so the tree must stay well below it. Per-seed documents are stored as .json.gz
(quantdiff.core.documents) to keep it so."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from quantdiff.core.documents import read_document

REPO = Path(__file__).resolve().parents[1]
LIMIT = 40 * 2**20  # 24 MiB below the carry limit, for the wheels (~10 MiB) and what later results add


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    return [REPO / name.decode() for name in listed if name]


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_tracked_tree_stays_under_40_mib():
    total = sum(p.stat().st_size for p in _tracked() if p.is_file())
    assert total <= LIMIT, f"the tracked tree is {total / 2**20:.1f} MiB: compress the per-seed documents (gzip -n)"


def test_a_document_is_read_from_its_compressed_sibling_when_the_plain_file_is_absent(tmp_path):
    (tmp_path / "plain.json").write_text('{"a": 1}')
    subprocess.run(["gzip", "-n", str(tmp_path / "plain.json")], check=True)  # leaves only plain.json.gz
    assert read_document(tmp_path / "plain.json") == {"a": 1}
    (tmp_path / "plain.json").write_text('{"a": 2}')  # a plain file, when present, is the one read
    assert read_document(tmp_path / "plain.json") == {"a": 2}


def test_published_per_seed_documents_are_stored_compressed_without_name_or_time():
    stored = [p for p in _tracked() if p.name.endswith(".json.gz")]
    assert len(stored) >= 72  # bb, confirm-bb and confirm-text: every seed's stats and sweep
    for path in stored:
        header = path.read_bytes()[:10]
        assert header[3] & 0x08 == 0 and header[4:8] == b"\0\0\0\0", f"{path}: compress with gzip -n"  # no FNAME, no MTIME
