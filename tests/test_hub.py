"""Hub ids resolve through a Hugging Face cache laid out as huggingface_hub lays it out; no hub is ever contacted."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from quantdiff.core.errors import LoadError
from quantdiff.models.names import ASSETS, resolve
from tests import forked

SHA = "0123456789abcdef0123456789abcdef01234567"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _cache_with_tiny(root: Path) -> Path:
    """HF_HUB_CACHE holding 'org/tiny-standard' (refs/main → snapshot) with the shipped standard model's files."""
    repo = root / "models--org--tiny-standard"
    snapshot = repo / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for name in FILES:
        shutil.copy(ASSETS / "tiny" / "standard" / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing below may reach a hub
    return _cache_with_tiny(tmp_path / "hub")


def test_hub_id_resolves_to_its_cached_snapshot(offline_cache):
    assert resolve("org/tiny-standard") == [offline_cache]
    assert resolve("org/tiny-standard", revision=SHA) == [offline_cache]
    assert resolve(f"org/tiny-standard@{SHA}") == [offline_cache]


def test_missing_cache_entry_offline_is_one_line(offline_cache):
    with pytest.raises(LoadError) as info:
        resolve("org/not-cached")
    message = str(info.value)
    assert "\n" not in message and "offline" in message and "not in the hub cache" in message and "org/not-cached" in message


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`quantdiff ARGS` in its own process with the hub variables in its environment, forked from a server that
    imported huggingface_hub before HF_HUB_CACHE pointed here (tests/forked.py; the suite sets HF_HUB_OFFLINE for
    every process, conftest.py). quantdiff reads both variables when it resolves a name (names.hub_snapshot,
    names.hub_offline), so what huggingface_hub's constants took at import cannot decide the outcome: with the
    cache read from the constant instead, this test fails."""
    env = {**os.environ, "COLUMNS": "250", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    return forked.run(list(args), cwd=tmp_path, env=env, timeout=300)


def test_info_loads_a_cached_hub_model_offline(tmp_path):
    _cache_with_tiny(tmp_path / "hub")
    done = _cli(["info", "org/tiny-standard", "--device", "cpu"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout and "standard" in done.stdout

    missing = _cli(["info", "org/absent"], tmp_path)
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:") and "offline" in lines[0], missing.stderr
