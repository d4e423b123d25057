"""Multiple-choice items in HellaSwag's JSONL format (`ctx`, `endings`, `label`): the record type and its files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from quantdiff.core.atomic import atomic_file
from quantdiff.core.errors import DataError


@dataclass(frozen=True)
class ChoiceItem:
    ctx: str
    endings: tuple[str, ...]
    label: int

    def to_dict(self) -> dict:
        return {"ctx": self.ctx, "endings": list(self.endings), "label": self.label}


def _item_from_dict(data: object) -> ChoiceItem:
    """One JSONL record; the reason it is unusable as a ValueError."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in ("ctx", "endings", "label") if key not in data]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    ctx, endings, label = data["ctx"], data["endings"], data["label"]
    if not isinstance(ctx, str) or not ctx.strip():
        raise ValueError("'ctx' must be a non-empty string")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e for e in endings):
        raise ValueError("'endings' must be a list of at least two non-empty strings")
    if isinstance(label, str) and label.strip().isdigit():  # the HF copy of HellaSwag stores labels as strings
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise ValueError(f"'label' must be an index into the {len(endings)} endings, got {data['label']!r}")
    return ChoiceItem(ctx, tuple(endings), label)


def read_jsonl(path: str | Path) -> list[ChoiceItem]:
    """Items of a HellaSwag-format file; DataError naming the file and line of the first bad record."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            items.append(_item_from_dict(json.loads(line)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise DataError(f"{path}:{number}: bad multiple-choice record: {str(exc).splitlines()[0]}") from None
    if not items:
        raise DataError(f"{path} holds no multiple-choice items")
    return items


def write_jsonl(items: Sequence[ChoiceItem], path: str | Path) -> None:
    """Write the items (a cache file: replaced whatever it holds)."""
    with atomic_file(path, force=True) as tmp:
        tmp.write_text("".join(json.dumps(item.to_dict(), ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
