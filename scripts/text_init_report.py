"""results/text from the runs of recipes/text.toml (issue 42): the final held-out losses, Diff V1's gap to the
standard arm with its interval under each init, and the held-out curves.

    python scripts/text_init_report.py runs/text --out results/text

RUNS holds one multi-seed run directory per init, named by it (runs/text/authors, runs/text/transformers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantdiff.core.atomic import atomic_file
from quantdiff.report.init_check import CRITERION_NATS, init_document, init_markdown, plot_curves


def verdict(document: dict) -> str:
    gap = document["authors"]["arms"]["diff"]["gap_to_standard"]
    inside = abs(gap["mean"]) <= CRITERION_NATS
    return (f"Diff V1's held-out gap to standard on the authors' init: {gap['mean']:+.4f} nats "
            f"[{gap['low']:+.3f}, {gap['high']:+.3f}] over {gap['n']} seeds — "
            + (f"within the plan's {CRITERION_NATS} nats." if inside else f"outside the plan's {CRITERION_NATS} nats."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = {d.name: d for d in sorted(args.runs.iterdir()) if d.is_dir() and any(d.glob("seed-*/*/train_log.json"))}
    document = init_document(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_file(args.out / "init_check.json", force=True) as tmp:
        tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    with atomic_file(args.out / "curves.png", force=True) as tmp:
        plot_curves(document, tmp)
    with atomic_file(args.out / "tables.md", force=True) as tmp:
        tmp.write_text(f"{verdict(document)}\n\n{init_markdown(document)}", encoding="utf-8")
    print(verdict(document))


if __name__ == "__main__":
    main()
