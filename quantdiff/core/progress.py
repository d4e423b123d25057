"""Progress bars with one look for every job: description, bar, done/total, extra columns, elapsed time."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

Advance = Callable[[float], None]  # advance(n): n more units done
StartBar = Callable[[str, int], Advance]  # start(label, total units) -> advance


def progress_bar(*columns: Any, transient: bool = False, console: Any = None, remaining: bool = False):
    """A rich Progress: description, bar, M/N, then `columns`, elapsed (and estimated remaining) time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    tail = (TimeElapsedColumn(), TimeRemainingColumn()) if remaining else (TimeElapsedColumn(),)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *columns, *tail, transient=transient, console=console)


def rate_column(unit: str):
    """A column showing units per second of the task, e.g. "12,345 tok/s"."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:,.0f} {unit}/s" if task.speed else f"– {unit}/s")

    return Rate()


@contextmanager
def task_bars(quiet: bool, *columns: Any, transient: bool = False) -> Iterator[StartBar | None]:
    """Yield start(label, total) -> advance(n), one bar per piece of work (a model, a sweep cell); None when quiet.

    transient: a bar disappears when the next one starts, and the last one when the block ends.
    """
    if quiet:
        yield None
        return
    with progress_bar(*columns, transient=transient) as progress:
        current: list[int] = []

        def start(label: str, total: int) -> Advance:
            if transient:
                for task_id in current:
                    progress.remove_task(task_id)
            current[:] = [progress.add_task(label, total=total)]
            task_id = current[0]
            return lambda n: progress.advance(task_id, n)

        yield start
