"""The statistics pass is byte-identical to stored reference documents on SmolLM2, Gemma 3 and the bb arms.

Each document is what `quantdiff stats` wrote (its --json, gzipped) before the speed work: that work must not move
a single bit of any statistic. Only each model's "path" is normalised before comparing: it is where this checkout
or this user's cache lives, not a result. Both runs compute on the kernels training pins (AVX2, MKL_CBWR=AVX2) and
2 threads, in a fresh process (here one for the three cases). MKL's code path still follows the CPU's vendor (its AVX2 branch is Intel's only; an
AMD CPU takes MKL's AUTO branch), so there is one set per vendor: `GenuineIntel/` written at commit cc901eb on the
machine of that round (its vendor was not recorded; CI's machine agreed with it and an AMD EPYC does not),
`AuthenticAMD/` written on an AMD EPYC by the same statistics code (commit 0d0f650's, identical to cc901eb's on the
first machine). `AuthenticAMD/bb.json.gz` was rewritten when the sink-logit mass was added (ADDED below): the
document it replaced equals the new one with that block taken out, byte for byte. The `bb` case measures the shipped
bb arms, which issue 54 replaced (seed 12 of recipes/confirm-bb.toml): `GenuineIntel/bb.json.gz` was rewritten then
from those models by the same statistics code, on an Intel CPU; AMD's bb document could not be rewritten there and was
removed. A case without its vendor's document is skipped, naming the command that writes it.

Rewrite them deliberately, after a change meant to alter statistics, from the repository root:
`python tests/test_stats_reference.py [case …]` (this CPU vendor's set).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantdiff.train.determinism import ENVIRONMENT, cpu_vendor

REFERENCES = Path(__file__).parent / "data" / "stats_reference" / cpu_vendor()
# Multi-tile passes: tiles on, below and above the diagonal; Gemma 3's 512-key sliding window spans tiles;
# bb's --tokens leaves its last batch right-padded (the explicit-mask path) and includes the sink kind.
CASES = {
    "smollm2": ["smollm2", "--tokens", "1024", "--seq-len", "512", "--batch-size", "2", "--tile-size", "128"],
    "gemma3": ["gemma3", "--tokens", "1024", "--seq-len", "1024", "--batch-size", "1", "--tile-size", "256"],
    "bb": ["bb", "--tokens", "2000", "--seq-len", "64", "--batch-size", "8", "--tile-size", "16"],
}
COMMON = ["--top-k", "8", "--no-compile", "--quiet"]
PATH_LINE = re.compile(rb'^( *"path": )".*"(,?)$', re.MULTILINE)
# Statistics added after a vendor's set was written (each a JSON object on its own lines): where that set's
# document lacks one, it is taken out of the written document before the comparison; a set that has it (written
# since) compares it too. Adding a statistic moves no bit of the others, which is what the comparison is for.
ADDED = ("sink_logit",)  # the mass a sink-logit head's learned logit absorbs (issue 43)


REPO = Path(__file__).resolve().parent.parent


# One fresh process writes every case's document, one `quantdiff stats` after another: a process per case would
# import torch and transformers three times for ~5 s of statistics each.
DRIVER = """
import json, sys
from quantdiff.cli.app import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as stop:
        if stop.code:
            raise
"""


def _write(cases: list[str], out: Path) -> dict[str, bytes]:
    """{case: the document `quantdiff stats` wrote}, all written by one pinned process (out: a directory)."""
    env = {**os.environ, **ENVIRONMENT, "OMP_NUM_THREADS": "2"}  # read by ATen and MKL as the process starts
    argvs = [["stats", *CASES[case], *COMMON, "--json", str(out / f"{case}.json")] for case in cases]
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-2000:]
    return {case: (out / f"{case}.json").read_bytes() for case in cases}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, bytes]:
    return _write(sorted(CASES), tmp_path_factory.mktemp("stats_reference"))


def _normalised(document: bytes) -> bytes:
    return PATH_LINE.sub(rb'\1"<path>"\2', document)


def _without_additions(written: bytes, reference: bytes) -> bytes:
    """`written` less the ADDED statistics that `reference` predates."""
    for key in ADDED:
        if f'"{key}": '.encode() not in reference:
            written = re.sub(rb'\n( *)"' + key.encode() + rb'": \{\n.*?\n\1\},?(?=\n)', b"", written, flags=re.S)
    return written


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_stats_json_is_byte_identical_to_reference(case, written):
    if not (REFERENCES / f"{case}.json.gz").is_file():
        pytest.skip(f"no {case} reference document for {REFERENCES.name} CPUs: write it with python tests/test_stats_reference.py {case}")
    reference = gzip.decompress((REFERENCES / f"{case}.json.gz").read_bytes())
    assert _normalised(_without_additions(written[case], reference)) == _normalised(reference)


if __name__ == "__main__":
    import tempfile

    REFERENCES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for name, document in _write(sys.argv[1:] or sorted(CASES), Path(scratch)).items():
            (REFERENCES / f"{name}.json.gz").write_bytes(gzip.compress(document, mtime=0))
