"""Redraw the published charts from the JSON committed beside them, nothing measured again (issue 43's audit):

- results/bb/sweep_bb.png, results/bb/emergence.png and results/confirm-text/emergence.png from their seeds.json,
  as `quantdiff reproduce` draws a multi-seed run's (`quantdiff.jobs.reproduce_seeds`);
- results/gpu/report/emergence.png and results/cpu-sinks/emergence.png from their train logs' `outliers` series,
  as `quantdiff reproduce` draws one seed's.

    .venv/bin/python scripts/replot_published.py
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.across_seeds.curves import emergence_curves
from quantdiff.core.documents import read_document
from quantdiff.jobs.reproduce_seeds import seed_points
from quantdiff.report.emergence import plot_emergence
from quantdiff.report.sweep_report import plot_sweep

REPO = Path(__file__).resolve().parent.parent
ONE_SEED = {  # chart: (train logs, arms in the recipe's order)
    "results/gpu/report/emergence.png": ("results/gpu/train_logs", ("standard", "diff", "diffv2", "gated", "sink", "standard-sgd")),
    "results/cpu-sinks/emergence.png": ("results/cpu-sinks/train_logs", ("standard", "diff")),
}


def main() -> None:
    bb = REPO / "results/bb"
    doc = json.loads((bb / "seeds.json").read_text())
    # the title reproduce_seeds.multi_seed_report gives the bb task's chart
    plot_sweep(seed_points(doc, "bb"), bb / "sweep_bb.png", "accuracy",
               f"bb: accuracy vs bits, mean and 95% interval over {len(doc['seeds'])} seeds", force=True)
    plot_emergence(doc["emergence"], bb / "emergence.png")
    text = REPO / "results/confirm-text"
    plot_emergence(json.loads((text / "seeds.json").read_text())["emergence"], text / "emergence.png")
    for chart, (logs, arms) in ONE_SEED.items():
        series = {arm: read_document(REPO / logs / f"{arm}.json")["outliers"] for arm in arms}
        (REPO / chart).unlink()  # the committed chart, drawn before plots carried quantdiff's mark: plot_emergence would keep it
        plot_emergence(emergence_curves({"0": series}), REPO / chart)
        print(f"wrote {chart}")
    print("wrote results/bb/sweep_bb.png, results/bb/emergence.png, results/confirm-text/emergence.png")


if __name__ == "__main__":
    main()
