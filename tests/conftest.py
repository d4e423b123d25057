"""Shared fixtures: tiny seeded models of each supported architecture."""

from __future__ import annotations

import os

import pytest
import torch

from tests.scheduling import DEFAULT_SLOW_SECONDS, heavy_first

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# rich's width off a terminal, whatever the developer's shell exports: every machine sees the same wrapping.
os.environ["COLUMNS"] = "80"
# Each pytest-xdist worker gets its share of the cores (`make test` runs one worker per core): more threads than
# cores only makes the workers wait on each other.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, torch.get_num_threads()) // WORKERS)
torch.set_num_threads(THREADS)
if WORKERS > 1:  # and the processes a test starts take the same share, computing as the worker itself does
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.fixture
def tiny_preset():
    from quantdiff.models.pairs import SizePreset

    # Grouped-query attention (4 query heads, 2 KV heads) so the GQA path is exercised everywhere.
    return SizePreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=97, max_position_embeddings=128)


@pytest.fixture
def tiny_pair(tiny_preset):
    from quantdiff.models.pairs import build_pair

    return {kind: model.eval() for kind, model in build_pair(tiny_preset, seed=0, attn_implementation="eager").items()}


@pytest.fixture(scope="session")
def smollm2_dir():
    """The built-in real model's dequantized directory: converted once into the user cache (as `quantdiff` does
    for users), then reused by every test and every later run."""
    from quantdiff.models.names import resolve

    return resolve("smollm2")[0]


@pytest.fixture(scope="session")
def gemma3_dir():
    """The second built-in real model (Gemma 3 270M, from five wheels): joined and converted once into the user
    cache (scripts/setup.sh does it), then reused."""
    from quantdiff.models.names import resolve

    return resolve("gemma3")[0]



# Modules whose tests share one expensive module fixture (tests/scheduling.py keeps them together, first).
SHARED_FIXTURE_MODULES = (  # a measurement; two GGUF readers (~25 s each); one process for three stats documents
    "test_real_model.py", "test_gemma3.py", "test_gguf.py", "test_stats_reference.py")


def _slow_seconds(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("slow")
    return None if marker is None else float(marker.kwargs.get("seconds", DEFAULT_SLOW_SECONDS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("randomly") and config.getoption("randomly_reorganize", False):
        return  # scripts/test_isolation.sh: the random order is the point (make test passes -p no:randomly)
    items[:] = heavy_first(items, WORKERS, lambda item: item.path.name in SHARED_FIXTURE_MODULES, _slow_seconds)
