"""Session data that every pytest-xdist worker needs, computed by one of them."""

from __future__ import annotations

import json
import os
from typing import Callable

import pytest
from filelock import FileLock


def computed_once(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], object]):
    """`compute()`'s JSON-ready result, computed by one pytest-xdist worker and read by the others (xdist's
    documented pattern for session data: a file lock in the run's shared base directory). A module fixture
    alone is built again by every worker that runs one of its tests."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:  # each worker has its own basetemp under the run's
        root = root.parent
    path = root / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
