"""report.md's across-seed sections, built from a seeds.json document (across_seeds.document) alone.

Every summary is written as `mean [low, high]` (the 95% interval of across_seeds.intervals; a ratio's mean is
geometric and written with ×); one seed gives the value alone. The primary comparisons the recipe named come
first, with their Holm-adjusted p (Holm 1979) and a verdict worded by it; every other p is unadjusted and
labelled exploratory. When the recipe is a confirmatory plan (the document's `primary.plan`), that family is
titled "Confirmatory family", with the plan's commit and the findings of scripts/plan_check.py where the report
directory holds them, and every other section is labelled exploratory. The same sections render a published
multi-seed document beside what a report measured live on one shipped seed (`live_beside_published`).
"""

from __future__ import annotations

import quantdiff.report.paper as paper
from quantdiff.across_seeds.metrics import (BOS_RATIO, CHANGE_PREFIX, KURTOSIS_HIDDEN, KURTOSIS_LOGITS, MODEL_METRICS, SINK_LOGIT_MASS, SINK_MASS, SINK_MIN,
                                            SINK_SCORE, TOP1_HIDDEN, TOP1_HIDDEN_RELATIVE, TOP1_LOGITS, TOP1_LOGITS_PER_MAP, TOP1_LOGITS_RELATIVE)
from quantdiff.report.markdown import md_table
from quantdiff.report.numbers import MISSING


def _g(x: float | None) -> str:
    return MISSING if x is None else f"{x:.3g}"


def interval(summary: dict, times: bool = False) -> str:
    """`mean [low, high]` (with × for a ratio); the mean alone for one seed."""
    unit = "×" if times else ""
    if summary.get("mean") is None:
        return MISSING
    text = f"{_g(summary['mean'])}{unit}"
    return text if summary.get("low") is None else f"{text} [{_g(summary['low'])}, {_g(summary['high'])}]"


def _p(p: float | None) -> str:
    if p is None:
        return MISSING
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def _share(entry: dict) -> str:
    if not entry["n"]:
        return MISSING
    return f"{entry['k']} of {entry['n']} ({entry['share']:.0%} [{entry['low']:.0%}, {entry['high']:.0%}])"


def plan(doc: dict) -> str | None:
    """The confirmatory plan the document's recipe is (`recipes/confirm-<name>.toml`), None: not a plan."""
    return doc["primary"].get("plan")  # documents written before plans lack the key


def _summary(doc: dict, key: str, arm: str) -> dict:
    """One arm's summary of a metric; {} where the document has none (one written before the metric existed)."""
    return doc["metrics"].get(key, {}).get("arms", {}).get(arm, {})


def method_markdown(doc: dict) -> str:
    """How the intervals and p-values were made, over which seeds, and which comparisons are primary."""
    seeds, method, n = ", ".join(map(str, doc["seeds"])), doc["method"], len(doc["seeds"])
    primary = doc["primary"]
    named = (f"**The confirmatory family**, as the plan `{plan(doc)}` named it before any of its models trained"
             if plan(doc) else "**Primary comparisons**, as the recipe names them")
    family = (f"{named} (`[analysis] primary_metrics` × `primary_arms`): "
              f"{', '.join(f'`{a}`' for a in primary['arms'])} against `{doc['reference']}` on {', '.join(f'`{m}`' for m in primary['metrics'])} "
              f"({len(primary['comparisons'])} comparisons), corrected by {primary['correction']}, at family-wise α = {primary['alpha']:g}. "
              "Every other p in this report is unadjusted and **exploratory**: it suggests, it does not establish."
              if primary["comparisons"] else "The recipe names no primary comparisons: every p in this report is unadjusted and **exploratory**.")
    return (f"{len(doc['seeds'])} seeds ({seeds}); every seed trains every arm on the same batches, so arms are compared "
            f"seed by seed with `{doc['reference']}`. 95% intervals: {method['description']} Tests: {method['tests']} "
            f"The sign-flip test enumerates all 2^n sign assignments up to n = {method['exact_up_to']} seeds and draws "
            f"{method['resamples']:,} random ones (numpy seed {method['resample_seed']}) above; here: {method['sign_flip']}, "
            f"so its smallest possible p is {2 / 2 ** n if n <= method['exact_up_to'] else 1 / (method['resamples'] + 1):.2g}.\n\n{family}\n\n"
            "Per-seed values: `seeds.json` (`metrics.<key>.arms.<arm>.per_seed`).")


def plan_markdown(doc: dict) -> str:
    """The plan a confirmatory family comes from: its file, its commit and what scripts/plan_check.py found."""
    check = doc["primary"].get("plan_check")
    if check is None:
        return (f"The plan: `{plan(doc)}`. Not checked against the trained run in this report: `python scripts/plan_check.py "
                f"{plan(doc)} <run directory> --out <this directory>/plan_check.json`, then rebuild this report "
                "(`python -m quantdiff.jobs.reproduce_seeds <this directory>`).")
    lines = [f"The plan: `{check['recipe']}`, committed in {check['plan_commit']} ({check['plan_committed_at']}). "
             f"scripts/plan_check.py on the run's {check['models']} models (written {check['first_model_written_at']} to "
             f"{check['last_model_written_at']}), `plan_check.json`:", ""]
    lines += [f"- {'ok' if ok else '**failed**'}: {finding}" for finding, ok in check["findings"].items()]
    if not check["passed"]:
        lines += ["", "**The plan check failed: until that is explained, this family is not confirmatory evidence.**"]
    return "\n".join(lines)


def primary_markdown(doc: dict) -> str:
    """The primary comparisons: estimate, unadjusted and Holm-adjusted p, and what may be said of each."""
    primary, metrics, reference = doc["primary"], doc["metrics"], doc["reference"]
    if not primary["comparisons"]:
        return "None named in the recipe (`[analysis] primary_metrics`, `primary_arms`)."
    rows = []
    for item in primary["comparisons"]:
        block = metrics.get(item["metric"])
        pair = (block or {}).get("paired", {}).get(item["arm"])
        if pair is None:
            rows.append([item["metric"], item["arm"], "not measured", MISSING, MISSING, MISSING, MISSING, "untested"])
            continue
        ratio = block["comparison"] == "reference ÷ arm"
        what = f"{reference} ÷ {item['arm']}" if ratio else f"{item['arm']} − {reference}"
        verdict = MISSING if item["detected"] is None else ("difference detected" if item["detected"] else "no difference detected")
        rows.append([block["label"], what, interval(pair, times=ratio), f"{pair['reference_higher']} / {pair['other_higher']} / {pair['equal']}",
                     pair["test"], _p(item["p"]), _p(item["holm_p"]), verdict])
    header = ["metric", "comparison", "mean [95% CI]", f"seeds: {reference} higher / arm higher / equal", "test", "p", "Holm p",
              f"at family-wise α = {primary['alpha']:g}"]
    untested = sum(item["p"] is None for item in primary["comparisons"])
    note = f"\n\n{untested} of the {len(primary['comparisons'])} comparisons untested: each counts in Holm's correction as p = 1." if untested else ""
    return md_table(header, rows) + note


def table5_markdown(doc: dict) -> str:
    """Top-1 |attention logit| (overall and per softmax map) and |hidden state| per arm across seeds, then the
    scale-free measures (each Top-1 over its median, the kurtosis of |x|: geometric means), the paper's 3B values
    below."""
    columns = (TOP1_LOGITS, TOP1_LOGITS_PER_MAP, TOP1_HIDDEN, TOP1_LOGITS_RELATIVE, TOP1_HIDDEN_RELATIVE, KURTOSIS_LOGITS, KURTOSIS_HIDDEN)
    rows = [[arm, kind, *(interval(_summary(doc, m.key, arm), times=m.log) for m in columns)] for arm, kind in doc["arms"].items()]
    rows += [[f"paper (3B) {name}", kind, f"{paper.TABLE5[kind]['attention_logits'][0]:g}", MISSING, f"{paper.TABLE5[kind]['hidden_states'][0]:g}",
              *[MISSING] * 4] for kind, name in (("standard", "Transformer"), ("diff", "DIFF"))]
    header = ["arm", "kind", *(f"{m.label}: {'geometric mean' if m.log else 'mean'} [95% CI]" for m in columns)]
    return md_table(header, rows)


def sinks_markdown(doc: dict) -> str:
    """Sink score, sink mass (largest and smallest head), the share of seeds with a sink head (with the exact
    McNemar test against the reference), the BOS peak ÷ median, and, where an arm has a sink logit, the mass it
    absorbs, per arm across seeds (all exploratory)."""
    absorbed = any(_summary(doc, SINK_LOGIT_MASS.key, arm).get("n") for arm in doc["arms"])  # the sink kind only
    rows = []
    for arm in doc["arms"]:
        entry = doc["sink_share"][arm]
        test = entry.get("mcnemar")
        mcnemar = MISSING if test is None else f"{test['reference_only']} / {test['other_only']}, p {_p(test['p'])}"
        rows.append([arm, interval(_summary(doc, SINK_SCORE.key, arm)), interval(_summary(doc, SINK_MASS.key, arm)),
                     interval(_summary(doc, SINK_MIN.key, arm)), _share(entry), mcnemar, interval(_summary(doc, BOS_RATIO.key, arm), times=True),
                     *([interval(_summary(doc, SINK_LOGIT_MASS.key, arm))] if absorbed else [])])
    header = ["arm", "sink score: mean [95% CI]", "sink mass (largest head's mean attention on position 0): mean [95% CI]",
              "smallest head's mean attention on position 0 (Diff: combined map, can be negative): mean [95% CI]",
              "seeds with a sink head (share [95% CI])", f"sink head in {doc['reference']} only / arm only: exact McNemar p",
              "BOS peak ÷ median: geometric mean [95% CI]",
              *(["mass the sink logit absorbs (largest head's share of the softmax denominator, given to no key): mean [95% CI]"] if absorbed else [])]
    return md_table(header, rows)


def _paired_row(metric: dict, arm: str, reference: str, primary: str) -> list[str]:
    pair = metric["paired"][arm]
    ratio = metric["comparison"] == "reference ÷ arm"
    what = f"{reference} ÷ {arm}" if ratio else f"{arm} − {reference}"
    per_seed = ", ".join(_g(v) for v in pair["per_seed"].values())
    family = f"{primary} (Holm p {_p(pair['holm_p'])})" if pair["family"] == "primary" else "exploratory"
    return [metric["label"], what, interval(pair, times=ratio), f"{pair['reference_higher']} / {pair['other_higher']} / {pair['equal']}",
            pair["test"], _p(pair["p"]), family, per_seed]


def paired_markdown(doc: dict, lowest_bits_only: bool = True) -> str:
    """Each arm against the reference, seed by seed: the Table-5 and sink metrics, the sweep cells (only those at
    the lowest bit width of each site and method unless `lowest_bits_only` is off), and the quantized-minus-
    unquantized changes a recipe's family names."""
    reference, metrics = doc["reference"], doc["metrics"]
    if reference is None:
        return "No reference arm (none named `standard` or of kind standard): no paired comparisons."
    keys = [m.key for m in MODEL_METRICS if m.key in metrics]
    cells = {key: block["cell"] for key, block in metrics.items()
             if block.get("cell") and block["cell"]["bits"] is not None and not key.startswith(CHANGE_PREFIX)}
    lowest = {}
    for key, cell in cells.items():
        group = (cell["task"], cell["site"], cell["method"])
        if group not in lowest or cell["bits"] < cells[lowest[group]]["bits"]:
            lowest[group] = key
    keys += list(lowest.values()) if lowest_bits_only else list(cells)
    keys += [key for key in metrics if key.startswith(CHANGE_PREFIX)]
    primary = "confirmatory" if plan(doc) else "primary"
    rows = [_paired_row(metrics[key], arm, reference, primary) for key in keys for arm in doc["arms"]
            if metrics[key].get("paired", {}).get(arm, {}).get("n")]  # none where no seed measured both (the sink logit's mass)
    header = ["metric", "comparison", "mean [95% CI]", f"seeds: {reference} higher / arm higher / equal", "test", "p (unadjusted)", "family", "per seed"]
    return md_table(header, rows)


def sweep_markdown(doc: dict) -> str:
    """One table per (task, site): rows arm × method, columns the unquantized model and each bit width; then,
    where the recipe's family names them, each arm's quantized − unquantized changes."""
    metrics = doc["metrics"]
    cells = [(key, block) for key, block in metrics.items() if block.get("cell") and not key.startswith(CHANGE_PREFIX)]
    out = []
    for task, site in dict.fromkeys((b["cell"]["task"], b["cell"]["site"]) for _, b in cells if b["cell"]["bits"] is not None):
        quantized = [(k, b) for k, b in cells if (b["cell"]["task"], b["cell"]["site"]) == (task, site) and b["cell"]["bits"] is not None]
        reference = next((b for _, b in cells if b["cell"]["task"] == task and b["cell"]["bits"] is None), None)
        bits = sorted({b["cell"]["bits"] for _, b in quantized}, reverse=True)
        rows = []
        for arm in doc["arms"]:
            for method in dict.fromkeys(b["cell"]["method"] for _, b in quantized):
                by_bits = {b["cell"]["bits"]: b["arms"].get(arm, {}) for _, b in quantized if b["cell"]["method"] == method}
                rows.append([arm, method, interval(reference["arms"].get(arm, {})) if reference else MISSING,
                             *[interval(by_bits.get(b, {})) for b in bits]])
        metric = quantized[0][1]["label"].split(",")[0]
        out.append(f"### {metric} at site `{site}`: mean [95% CI]\n\n" + md_table(["arm", "method", "unquantized", *[f"{b}-bit" for b in bits]], rows))
    changes = [block for key, block in metrics.items() if key.startswith(CHANGE_PREFIX)]
    if changes:
        rows = [[arm, *(interval(block["arms"].get(arm, {})) for block in changes)] for arm in doc["arms"]]
        out.append("### Quantized − unquantized, each model against itself: mean [95% CI]\n\n"
                   + md_table(["arm", *(f"{block['label']}: mean [95% CI]" for block in changes)], rows))
    return "\n\n".join(out)


def seeds_sections(doc: dict, label: str = "") -> list[str]:
    """The across-seed sections (with their headings; `label` is added to each heading, e.g. a published source)."""
    tag = f" ({label})" if label else ""
    if plan(doc):  # the plan's family alone is confirmatory: every other section says it is not
        family = (f"## Confirmatory family: the plan's comparisons with `{doc['reference']}`, Holm-corrected{tag}\n\n" + plan_markdown(doc)
                  + "\n\n" + primary_markdown(doc) + "\n\nEverything else in this report is **exploratory**: uncorrected, "
                  "and no claim rests on it alone.")
        explored = " (exploratory)"
    else:
        family = f"## Primary comparisons with `{doc['reference']}`, Holm-corrected{tag}\n\n" + primary_markdown(doc)
        explored = ""
    return [
        f"## Across seeds: method{tag}\n\n" + method_markdown(doc),
        family,
        f"## Largest activation values across seeds (the paper's Table 5, Top-1){explored}{tag}\n\n" + table5_markdown(doc),
        f"## Attention sinks and the BOS peak across seeds (exploratory){tag}\n\n" + sinks_markdown(doc),
        f"## Paired comparisons with `{doc['reference']}`{' (exploratory but for the confirmatory rows)' if explored else ''}{tag}\n\n"
        + paired_markdown(doc),
        f"## Accuracy with quantization across seeds (the paper's Figure 8){explored}{tag}\n\n" + sweep_markdown(doc),
    ]


def live_beside_published(doc: dict, live: dict[str, dict[str, float | None]], seed: int) -> str:
    """A table: each arm's metric measured live on the shipped seed, the published value for that seed, and the
    published mean over all seeds. `live`: {metric key: {arm: value}} (across_seeds.metrics)."""
    rows = []
    key_seed = str(seed)
    for metric in MODEL_METRICS:
        block = doc["metrics"].get(metric.key, {"arms": {}})
        for arm, value in live.get(metric.key, {}).items():
            published = block["arms"].get(arm)
            rows.append([metric.label, arm, _g(value), _g(published["per_seed"].get(key_seed)) if published else MISSING,
                         interval(published, times=metric.log) if published else MISSING])
    header = ["metric", "arm", f"live, shipped seed {seed}", f"published, seed {seed}", f"published, {len(doc['seeds'])} seeds: mean [95% CI]"]
    return md_table(header, rows)
