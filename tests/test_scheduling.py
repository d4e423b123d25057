"""tests/scheduling.py against pytest-xdist's own worksteal scheduler: the blocks it assumes are the ones xdist
sends, and the heavy tests land at their fronts."""

from __future__ import annotations

import pytest
from xdist.scheduler.worksteal import WorkStealingScheduling

from tests.scheduling import block_sizes, heavy_first


class _Config:
    def __init__(self, workers: int):
        self.workers = workers

    def getvalue(self, name: str):
        assert name == "tx"
        return [f"{self.workers}*popen"]


class _Node:
    """What the scheduler reads of a worker (its gateway's id) and the one call it makes to hand it tests."""

    shutting_down = False

    def __init__(self, number: int):
        self.gateway = type("Gateway", (), {"id": f"gw{number}"})()
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices


@pytest.mark.parametrize("count, workers", [(1702, 2), (1701, 2), (1702, 3), (1702, 16), (5, 2), (40, 16)])
def test_block_sizes_are_the_blocks_xdist_sends(count, workers):
    scheduler = WorkStealingScheduling(_Config(workers))
    nodes = [_Node(i) for i in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, [f"t{i}" for i in range(count)])
    scheduler.schedule()
    assert [len(node.sent) for node in nodes] == block_sizes(count, workers)
    assert sum((node.sent for node in nodes), []) == list(range(count))  # contiguous, in order


def test_heavy_tests_open_the_blocks_longest_first_and_every_test_stays():
    # 20 items: s* share a fixture, h<seconds> are slow, q* quick.
    names = ["q0", "h10", "s0", "q1", "h50", "q2", "s1", "h20", "q3", "h40", "q4", "q5", "q6", "q7", "q8", "q9",
             "q10", "q11", "h30", "q12"]
    seconds = {name: float(name[1:]) for name in names if name.startswith("h")}
    order = heavy_first(names, 3, lambda n: n.startswith("s"), seconds.get)
    assert sorted(order) == sorted(names)
    blocks, start = [], 0
    for size in block_sizes(len(names), 3):
        blocks.append(order[start:start + size])
        start += size
    assert blocks[0][:2] == ["s0", "s1"]  # together, first, on one worker
    assert blocks[1][:3] == ["h50", "h20", "h10"] and blocks[2][:2] == ["h40", "h30"]  # dealt to the lighter block
    assert [n for n in order if n.startswith("q")] == [f"q{i}" for i in range(13)]  # the rest keep their order
    assert all(not n.startswith(("h", "s")) for block in blocks for n in block[-3:])  # every block ends quick


def test_a_selection_too_small_for_the_blocks_runs_heavy_first():
    order = heavy_first(["q0", "h5", "h9", "h1"], 2, lambda n: False, lambda n: float(n[1:]) if n[0] == "h" else None)
    assert order == ["h9", "h5", "h1", "q0"]  # three heavy tests do not fit the second block of two
