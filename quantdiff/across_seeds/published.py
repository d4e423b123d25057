"""Published multi-seed results of a built-in set of models: the seeds.json that `quantdiff reproduce` wrote for
the multi-seed run those models come from, shipped in the repository's results/<name>/.

A built-in (`bb`, `tiny`) ships one seed's models of a confirmatory run (the run's recipe, with only that seed);
a report on them says so first, measures that seed live and shows the published across-seed tables beside it,
labelled as published: one seed carries no claim, the run's family (its README) does. The document is checked
for its schema before use, so a damaged or foreign file is one error line, never a table of wrong numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.across_seeds.document import SCHEMA, VERSION
from quantdiff.core.errors import LoadError

RESULTS = Path(__file__).resolve().parents[2] / "results"  # the repository's published results (absent when installed)
# built-in name → its published across-seed document: the confirmatory run whose seed 12 the built-in's models are
PUBLISHED = {"bb": RESULTS / "confirm-bb" / "seeds.json", "tiny": RESULTS / "confirm-text" / "seeds.json"}
REQUIRED = {"seeds": list, "arms": dict, "reference": (str, type(None)), "method": dict, "primary": dict, "metrics": dict, "sink_share": dict, "emergence": dict}


def check_document(doc: object, where: Path) -> dict:
    """`doc` if it is a seeds document of this version with every section present; else LoadError naming why."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise LoadError(f"{where} is not a quantdiff across-seed document (schema {SCHEMA!r})")
    if doc.get("version") != VERSION:
        raise LoadError(f"{where} has version {doc.get('version')!r} of {SCHEMA}; this quantdiff reads version {VERSION}")
    for key, kind in REQUIRED.items():
        if not isinstance(doc.get(key), kind):
            raise LoadError(f"{where}: {key!r} is missing or not a {getattr(kind, '__name__', 'valid value')}")
    if not doc["seeds"] or not all(isinstance(s, int) and not isinstance(s, bool) for s in doc["seeds"]):
        raise LoadError(f"{where}: 'seeds' must list the seeds as whole numbers")
    return doc


def published_document(name: str) -> tuple[Path | None, dict | None]:
    """(where the built-in's published document belongs, None for a built-in without one; the document, None
    when it is not there)."""
    path = PUBLISHED.get(name)
    if path is None or not path.is_file():
        return path, None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadError(f"published multi-seed document {path} is unreadable ({type(exc).__name__})") from None
    return path, check_document(doc, path)
