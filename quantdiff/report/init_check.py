"""The natural-text check of an initialisation (recipes/text.toml): each arm's final held-out loss, seed by seed,
and its gap to the standard arm, paired by seed, under each initialisation that was trained.

Read from the train logs that `quantdiff train` wrote (OUT/<init>/seed-<s>/<arm>/train_log.json); every number
of the report is one of theirs or computed from them here. The interval of a gap is Student's t over the per-seed
differences (across_seeds.intervals.paired), 95%.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantdiff.across_seeds.intervals import paired, summarize
from quantdiff.core.errors import ConfigError

REFERENCE = "standard"
CRITERION_NATS = 0.05  # recipes/text.toml's plan: Diff V1's gap to standard within this


def read_logs(run: Path) -> dict[str, dict[str, dict]]:
    """{arm: {seed: train log}} of one multi-seed run directory."""
    logs: dict[str, dict[str, dict]] = {}
    for path in sorted(run.glob("seed-*/*/train_log.json")):
        seed = path.parent.parent.name.removeprefix("seed-")
        logs.setdefault(path.parent.name, {})[seed] = json.loads(path.read_text(encoding="utf-8"))
    if REFERENCE not in logs:
        raise ConfigError(f"{run}: no {REFERENCE} arm's train logs (OUT/seed-<s>/{REFERENCE}/train_log.json)")
    return logs


def init_document(runs: dict[str, Path]) -> dict:
    """{init: {arms: {arm: {per_seed, mean…, gap}}, curves, unigram}} for each run directory, keyed by the init its
    logs record (a directory whose logs disagree with its name is refused)."""
    document = {}
    for name, run in runs.items():
        logs = read_logs(run)
        inits = {log.get("init", "transformers") for by_seed in logs.values() for log in by_seed.values()}
        if inits != {name}:
            raise ConfigError(f"{run}: its train logs record init {', '.join(sorted(inits))}, not {name}")
        losses = {arm: {seed: log["held_out_loss"] for seed, log in by_seed.items()} for arm, by_seed in logs.items()}
        document[name] = {
            "seeds": sorted(losses[REFERENCE]),
            "unigram_entropy": summarize([log["unigram_entropy"] for log in logs[REFERENCE].values()]),
            "arms": {arm: {"held_out": summarize(list(values.values())) | {"per_seed": values},
                           "gap_to_standard": None if arm == REFERENCE else paired(losses[REFERENCE], values, ratio=False)}
                     for arm, values in losses.items()},
            "curves": {arm: {seed: log["held_out_curve"] for seed, log in by_seed.items()} for arm, by_seed in logs.items()},
        }
        document[name]["gap_curves"] = {arm: gap_curve(document[name]["curves"], arm) for arm in logs if arm != REFERENCE}
    return document


def gap_curve(curves: dict[str, dict[str, list]], arm: str) -> list[list[float]]:
    """[step, the arm's held-out loss minus the standard arm's, averaged over the seeds both have] at each eval step."""
    seeds = [seed for seed in curves[arm] if seed in curves[REFERENCE]]
    steps = [step for step, _ in curves[REFERENCE][seeds[0]]]
    return [[step, sum(curves[arm][s][i][1] - curves[REFERENCE][s][i][1] for s in seeds) / len(seeds)] for i, step in enumerate(steps)]


def _interval(block: dict) -> str:
    if block["low"] is None:
        return f"{block['mean']:+.3f}"
    return f"{block['mean']:+.3f} [{block['low']:+.3f}, {block['high']:+.3f}]"


def init_markdown(document: dict) -> str:
    """One table per init: final held-out loss per arm (mean over seeds, per seed) and the paired gap to standard."""
    lines = []
    for init, block in document.items():
        lines += [f"### init = \"{init}\" (seeds {', '.join(block['seeds'])}; unigram entropy "
                  f"{block['unigram_entropy']['mean']:.3f} nats)", "",
                  "| arm | held-out loss, mean | per seed | gap to standard, mean [95% t interval] | seeds above standard |",
                  "|---|---|---|---|---|"]
        for arm, row in block["arms"].items():
            per_seed = ", ".join(f"{row['held_out']['per_seed'][s]:.3f}" for s in block["seeds"] if s in row["held_out"]["per_seed"])
            gap = row["gap_to_standard"]
            above = "—" if gap is None else f"{gap['other_higher']} of {gap['n']}"
            lines.append(f"| {arm} | {row['held_out']['mean']:.3f} | {per_seed} | {'—' if gap is None else _interval(gap)} | {above} |")
        lines += ["", "Gap to standard during training (held-out loss at each eval step, mean over seeds):", ""]
        for arm, curve in block["gap_curves"].items():
            lines.append(f"- {arm}: " + ", ".join(f"step {int(step)} {gap:+.3f}" for step, gap in curve))
        lines.append("")
    return "\n".join(lines)


def plot_curves(document: dict, path: Path) -> Path:
    """Held-out loss against step, each arm's mean over seeds with its per-seed range shaded, one panel per init."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(document), figsize=(6 * len(document), 4), sharey=True, squeeze=False)
    for ax, (init, block) in zip(axes[0], document.items()):
        for arm, by_seed in block["curves"].items():
            steps = [step for step, _ in next(iter(by_seed.values()))]
            values = [[loss for _, loss in curve] for curve in by_seed.values()]
            mean = [sum(column) / len(column) for column in zip(*values)]
            line, = ax.plot(steps, mean, label=arm)
            ax.fill_between(steps, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)], color=line.get_color(), alpha=0.2)
        ax.axhline(block["unigram_entropy"]["mean"], color="grey", linestyle=":", label="unigram entropy")
        ax.set(title=f"init = {init}", xlabel="step", ylabel="held-out loss (nats)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # the path may be a temporary name without the suffix
    plt.close(fig)
    return path
