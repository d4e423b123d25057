"""The suite's order for pytest-xdist's worksteal scheduler, so that both cores stay busy to the end.

worksteal hands worker i the i-th contiguous block of the collected list (the first ⌊N/n⌋ items, then an even
split of the rest), each worker runs its block from the front, and a worker that runs dry steals the back half of
another's queue. What finishes last is therefore the middle of a block, and a minute-long test there runs alone
while the other core idles (measured: 2 min of one core at the end of a 10-min run). So the heavy tests go to
the fronts of the blocks, longest first, and every block ends in quick tests, which stealing evens out:

- block 0 starts with the modules that share one expensive module fixture (kept on one worker: split across two,
  the second would wait on the first's measurement, tests/once.py, with its core idle);
- the tests marked `slow` are dealt to the other blocks longest first (their `seconds`, else a default), each
  to the block with the least heavy work so far (on one worker, after the shared modules).

Only the order changes: every test still runs, and no test depends on the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")

DEFAULT_SLOW_SECONDS = 10.0  # a `slow` test whose marker names no cost


def block_sizes(count: int, workers: int) -> list[int]:
    """The sizes of the contiguous blocks worksteal first sends to `workers` workers (xdist's check_schedule)."""
    sizes, left = [], count
    for remaining in range(workers, 0, -1):
        sizes.append(left // remaining)
        left -= sizes[-1]
    return sizes


def heavy_first(items: Sequence[Item], workers: int, shared: Callable[[Item], bool],
                slow_seconds: Callable[[Item], float | None]) -> list[Item]:
    """`items` reordered: the `shared` items at the front of block 0, the slow ones (`slow_seconds` not None)
    dealt longest first to the other blocks' fronts, the rest in their order after them."""
    first = [item for item in items if shared(item)]
    slow = sorted((item for item in items if not shared(item) and slow_seconds(item) is not None),
                  key=slow_seconds, reverse=True)  # stable: equal costs keep their order
    quick = [item for item in items if not shared(item) and slow_seconds(item) is None]
    sizes = block_sizes(len(items), max(1, workers))
    heads: list[list[Item]] = [first] + [[] for _ in sizes[1:]]
    load = [0.0] * len(sizes)
    others = range(1, len(sizes)) if len(sizes) > 1 else range(1)  # block 0 already carries the shared modules
    for item in slow:
        block = min(others, key=lambda b: (load[b], b))
        heads[block].append(item)
        load[block] += slow_seconds(item)
    if any(len(head) > size for head, size in zip(heads, sizes)):  # a small selection: heavy first, in one run
        return first + slow + quick
    ordered = []
    for head, size in zip(heads, sizes):
        fill = size - len(head)
        ordered += head + quick[:fill]
        quick = quick[fill:]
    return ordered
