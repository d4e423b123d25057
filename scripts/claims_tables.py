"""The tables issue 54 asks the pages to carry, computed from the per-seed JSON under results/ and printed as
markdown: DIFF V2's and Diff V1's logit results unpacked (map 1 alone, the overall Top-1, Top-1 ÷ median beside
the per-map figure), the regime of each run (with a Gaussian sample of the same size and SmolLM2 beside it), the
power of each confirmatory quantized comparison, and where the arms separate at 2 and 3 bits.

    python scripts/claims_tables.py > /tmp/claims.md

Every interval and p comes from quantdiff.across_seeds (the methods the published families use), so a figure here
and the same figure in a run's report.md agree. Every JSON document is read through `read_json`, the one place to
change when the documents move to another encoding.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from quantdiff.across_seeds.distributions import t_quantile
from quantdiff.across_seeds.intervals import paired, summarize
from quantdiff.across_seeds.metrics import change_key, model_values, sweep_values
from quantdiff.core.documents import read_document

RESULTS = Path(__file__).resolve().parents[1] / "results"
RUNS = ("confirm-text", "confirm-bb", "confirm-bb-v2")
TASK = {"confirm-text": "lm", "confirm-bb": "bb", "confirm-bb-v2": "bb"}
AUTHORS_MIN_HEADS = 8  # the Diff Transformer authors' README: at least 8 differential heads
REFERENCE = "standard"
# the confirmatory arms of each run, compared with standard
ARMS = {"confirm-text": ("diff", "diffv2"), "confirm-bb": ("diff", "diffv2"), "confirm-bb-v2": ("diffv2-matched", "diffv2")}
ARM_NAME = {"standard": "standard", "diff": "Diff V1", "diffv2": "DIFF V2", "diffv2-matched": "DIFF V2, budget-matched", "gated": "gated", "sink": "sink logit", "standard-sgd": "SGD control"}
LOGIT_METRICS = (
    ("table5/attention_logits/top1_per_map", "Top-1 per map (all maps; the confirmatory metric)"),
    ("table5/attention_logits/top1_per_map1", "Top-1 per map, map 1 alone"),
    ("table5/attention_logits/top1", "Top-1 overall (Table 5's quantity)"),
    ("table5/attention_logits/top1_over_median", "Top-1 ÷ median, overall"),
)
CONFIRMATORY_CHANGES = {"confirm-text": (("linear", "absmax", 4),), "confirm-bb": (("linear", "absmax", 4), ("linear", "absmax", 3)),
                        "confirm-bb-v2": (("linear", "absmax", 4), ("linear", "absmax", 3))}
POWER = 0.80
ALPHA = 0.05
GAUSSIAN_SEED = 0


def read_json(path: Path) -> dict:
    """One JSON document of results/ (stored as `path` or, compressed, as `path.gz`: core.documents)."""
    return read_document(path)


def seeds(run: str) -> list[int]:
    return read_json(RESULTS / run / "seeds.json")["seeds"]


def per_seed(run: str) -> dict[str, dict[int, dict[str, float | None]]]:
    """{metric key: {seed: {arm: value}}}: every model metric (metrics.model_values), every sweep cell and every
    quantized cell's change from the same model unquantized."""
    out: dict[str, dict[int, dict[str, float | None]]] = {}
    for seed in seeds(run):
        values = model_values(read_json(RESULTS / run / f"seed-{seed}" / "stats.json"))
        metrics, sweep = sweep_values(read_json(RESULTS / run / f"seed-{seed}" / "sweep.json"))
        values.update(sweep)
        for metric in metrics.values():
            cell = metric.cell
            if cell and cell["bits"] is not None:
                unquantized = sweep[f"sweep/{cell['task']}/unquantized"]
                key = change_key(cell["task"], cell["site"], cell["method"], cell["bits"], cell.get("group_size"))
                values[key] = {a: None if v is None or unquantized.get(a) is None else v - unquantized[a] for a, v in sweep[metric.key].items()}
        for key, by_arm in values.items():
            out.setdefault(key, {})[seed] = by_arm
    return out


def arm_series(values: dict[int, dict[str, float | None]], arm: str) -> dict[int, float | None]:
    return {seed: by_arm.get(arm) for seed, by_arm in values.items()}


def compare(values: dict[int, dict[str, float | None]], arm: str, ratio: bool) -> dict:
    return paired(arm_series(values, REFERENCE), arm_series(values, arm), ratio=ratio)


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:#.{digits}g}"  # 1.20, not 1.2: the pages quote three figures


def signed(x: float, places: int = 4) -> str:
    """+0.0005 / −0.0013: the pages' minus sign."""
    return f"{x:+.{places}f}".replace("-", "−")


def interval(c: dict, ratio: bool, digits: int = 3) -> str:
    if ratio:
        return f"{fmt(c['mean'], digits)}× [{fmt(c['low'], digits)}, {fmt(c['high'], digits)}]"
    return f"{signed(c['mean'])} [{signed(c['low'])}, {signed(c['high'])}]"


def p_text(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def logit_table(run: str, data: dict) -> str:
    rows = ["| arm | measure | standard ÷ arm [95% CI] | seeds standard larger / arm larger | p (paired t, uncorrected) |",
            "|---|---|---|---|---|"]
    for arm in ARMS[run]:
        for key, label in LOGIT_METRICS:
            c = compare(data[key], arm, ratio=True)
            rows.append(f"| {ARM_NAME[arm]} | {label} | {interval(c, True)} | {c['reference_higher']} / {c['other_higher']} | {p_text(c['p'])} |")
    map_means = {arm: statistics.fmean(v[arm] for v in data["table5/attention_logits/top1_per_map1"].values()) for arm in (REFERENCE, *ARMS[run])}
    all_means = {arm: statistics.fmean(v[arm] for v in data["table5/attention_logits/top1_per_map"].values()) for arm in (REFERENCE, *ARMS[run])}
    # the per-map mean over all maps is the mean of map 1's and map 2's (each arm has as many of one as the other)
    map2 = {arm: 2 * all_means[arm] - map_means[arm] for arm in ARMS[run]}
    notes = "; ".join(f"{ARM_NAME[a]} map 1 {map_means[a]:.2f}, map 2 {map2[a]:.2f}" for a in ARMS[run])
    return "\n".join(rows) + f"\n\nMean per-map Top-1 |logit| over seeds: standard {map_means[REFERENCE]:.2f}; {notes}.\n"


def gaussian_reference(size: int) -> dict:
    """Top-1 ÷ median and the kurtosis of |x| of one standard-normal sample of `size` values (numpy seed 0)."""
    x = np.abs(np.random.default_rng(GAUSSIAN_SEED).standard_normal(size))
    centred = x - x.mean()
    return {"size": size, "top1_over_median": float(x.max() / np.median(x)),
            "kurtosis": float(np.mean(centred**4) / np.mean(centred**2) ** 2), "top1": float(x.max())}


def differential_heads(run: str) -> int:
    """Diff V1's differential heads per layer: stats count its softmax maps as heads, two per differential head."""
    return next(m for _, m in stats_models(run) if m["name"] == "diff")["heads"] // 2


def stats_models(run: str) -> list[tuple[int, dict]]:
    return [(seed, model) for seed in seeds(run) for model in read_json(RESULTS / run / f"seed-{seed}" / "stats.json")["models"]]


def regime_row(label: str, models: list[dict]) -> str:
    """Geometric means over models of the scale-free measures; the largest activation and its ratio over all
    models; how many models have a sink head (ε 0.3) and a massive activation (quantdiff.stats.massive)."""
    geo = lambda xs: summarize(list(xs), log=True)["mean"]  # noqa: E731
    hidden_ratio = geo(m["hidden_states"]["max"] / m["hidden_states"]["median"] for m in models)
    logit_ratio = geo(m["attention_logits"]["max"] / m["attention_logits"]["median"] for m in models)
    kurtosis = geo(m["hidden_states"]["kurtosis"] for m in models)
    largest = max(models, key=lambda m: m["hidden_states"]["max"])
    # Sun et al.'s criterion is per layer (stats.massive: each layer's Top-1 against its own median), so the
    # largest ratio is over every layer, not only the layer holding the model's overall Top-1
    layer_ratio = max(block["max"] / block["median"] for m in models for block in m["hidden_states"]["per_layer"])
    sinks = sum(((m.get("sinks") or {}).get("score") or 0) > 0 for m in models)
    massive = sum(m["hidden_states"]["massive_activation"]["massive"] for m in models)
    return (f"| {label} | {len(models)} | {hidden_ratio:.1f} | {logit_ratio:.1f} | {kurtosis:,.2f} | {largest['hidden_states']['max']:,.1f} | "
            f"{layer_ratio:,.1f} | {sinks} | {massive} |")


REGIME_HEADER = ("| models | n | Top-1 ÷ median \\|h\\| | Top-1 ÷ median \\|logit\\| | kurtosis of \\|h\\| | largest \\|h\\| | "
                 "largest layer Top-1 \\|h\\| ÷ that layer's median | with a sink head (ε 0.3) | with a massive activation (> 100 and ≥ 1,000× its layer's median) |\n"
                 "|---|---|---|---|---|---|---|---|---|")


def regime_table(run: str, smollm2: dict) -> str:
    models = stats_models(run)
    arms = list(dict.fromkeys(m["name"] for _, m in models))
    rows = [REGIME_HEADER] + [regime_row(ARM_NAME.get(a, a), [m for _, m in models if m["name"] == a]) for a in arms]
    size = models[0][1]["hidden_states"]["count"]
    g = gaussian_reference(size)
    rows.append(f"| Gaussian sample, {size:,} values (numpy seed {GAUSSIAN_SEED}) | 1 | {g['top1_over_median']:.1f} | – | {g['kurtosis']:.2f} | "
                f"{g['top1']:.2f} (σ = 1) | – | – | – |")
    rows.append(regime_row("SmolLM2-135M (results/real-models)", [smollm2]))
    return "\n".join(rows) + "\n"


def mde(sd: float, n: int) -> float:
    """The smallest mean paired difference a two-sided paired t test at ALPHA detects with probability POWER,
    given the observed SD of the differences: (t(1 − α/2, n − 1) + t(power, n − 1)) · sd / √n."""
    return (t_quantile(1 - ALPHA / 2, n - 1) + t_quantile(POWER, n - 1)) * sd / math.sqrt(n)


def power_table(run: str, data: dict) -> str:
    rows = ["| cell | arm − standard | non-zero differences / seeds | smallest attainable p (2^(1−n)) | minimum detectable effect (80% power) | "
            "standard's own change [95% CI] | MDE ÷ standard's loss |", "|---|---|---|---|---|---|---|"]
    for site, method, bits in CONFIRMATORY_CHANGES[run]:
        values = data[change_key(TASK[run], site, method, bits)]
        own = summarize([v for v in arm_series(values, REFERENCE).values() if v is not None])
        for arm in ARMS[run]:
            c = compare(values, arm, ratio=False)
            nonzero = sum(v != 0 for v in c["per_seed"].values())
            effect = mde(c["sd"], c["n"])
            relative = f"{effect / abs(own['mean']):.2f}×" if own["mean"] else "– (standard loses nothing)"
            rows.append(f"| {TASK[run]} {method} {bits}-bit at {site} | {ARM_NAME[arm]} | {nonzero} / {c['n']} | {2.0 ** (1 - nonzero):.3g} | "
                        f"{effect:.5f} | {signed(own['mean'], 5)} [{signed(own['low'], 5)}, {signed(own['high'], 5)}] | {relative} |")
    return "\n".join(rows) + "\n"


def separation_table(run: str, data: dict, bits: tuple[int, ...] = (2, 3), alpha: float = ALPHA) -> str:
    """Every quantized cell at `bits` where an arm's change differs from standard's at p < alpha, uncorrected."""
    rows = ["| cell | arm − standard (change from unquantized) | seeds arm lost more / standard lost more / equal | p (sign-flip, uncorrected) | standard's own change [95% CI] |",
            "|---|---|---|---|---|"]
    tested = 0
    for key, values in data.items():
        parts = key.split("/")
        if not key.startswith("change/") or int(parts[-1]) not in bits:
            continue
        tested += len(ARMS[run])
        own = summarize([v for v in arm_series(values, REFERENCE).values() if v is not None])
        for arm in ARMS[run]:
            c = compare(values, arm, ratio=False)
            if c["p"] is not None and c["p"] < alpha:
                rows.append(f"| {parts[1]} {parts[3]} {parts[4]}-bit at {parts[2]} | {ARM_NAME[arm]} {interval(c, False)} | "
                            f"{c['reference_higher']} / {c['other_higher']} / {c['equal']} | {p_text(c['p'])} | {signed(own['mean'])} [{signed(own['low'])}, {signed(own['high'])}] |")
    return "\n".join(rows) + f"\n\n{len(rows) - 2} of {tested} comparisons at p < {alpha}.\n"


def three_bit_text(data: dict) -> str:
    values = data[change_key("lm", "linear", "absmax", 3)]
    rows = ["| arm | change at 3 bits − standard's change [95% CI] | p (sign-flip) |", "|---|---|---|"]
    for arm in ARMS["confirm-text"]:
        c = compare(values, arm, ratio=False)
        rows.append(f"| {ARM_NAME[arm]} | {interval(c, False)} | {p_text(c['p'])} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    smollm2 = next(m for m in read_json(RESULTS / "real-models" / "smollm2-stats.json")["models"] if m["name"] == "smollm2")
    for run in RUNS:
        data = per_seed(run)
        heads = f"Diff V1: {differential_heads(run)} differential head(s) per layer (the authors ask for at least {AUTHORS_MIN_HEADS}).\n\n" if "diff" in ARMS[run] else ""
        print(f"## {run}\n\n{heads}", end="")
        print(f"### Attention logits, unpacked\n\n{logit_table(run, data)}")
        print(f"### The regime\n\n{regime_table(run, smollm2)}")
        print(f"### Power of the confirmatory quantized comparisons\n\n{power_table(run, data)}")
        print(f"### Where the arms separate at 2 and 3 bits (exploratory, uncorrected)\n\n{separation_table(run, data)}")
        if run == "confirm-text":
            print(f"### 3 bits at linear, the change from unquantized\n\n{three_bit_text(data)}")


if __name__ == "__main__":
    main()
