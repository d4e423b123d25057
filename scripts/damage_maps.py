"""Regenerate results/damage/ (issue 55, item 5; results/damage/PLAN.md): per-layer sensitivity maps of the real
models and the shipped bb arms, through `quantdiff sensitivity`, then `summary.json` and the tables of README.md.

    python scripts/damage_maps.py            # every run in RUNS, then the summary
    python scripts/damage_maps.py --summary  # only the summary and tables, from the JSON already there

Each run's exact command and wall time go to runs.json. Exploratory: one token sample per run.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from quantdiff.core.atomic import write_json
from quantdiff.eval.sensitivity import MEASURES

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "damage"
REAL = ("--site", "linear", "--data", "builtin:corpus-train", "--tokens", "128", "--seq-len", "64")
ARMS = ("--site", "linear,kv", "--data", "builtin:bigram-backcopy", "--tokens", "2048")
# (file stem, model, method, bits, granularity, the rest): PLAN.md's table
RUNS: tuple[tuple[str, str, str, int, str, tuple[str, ...]], ...] = (
    *((f"bb-{arm}-absmax-{bits}b", f"bb/{arm}", "absmax", bits, "row", ARMS) for arm in ("standard", "diff", "diffv2") for bits in (2, 3, 4)),
    *((f"{model}-{method}-{bits}b", model, method, bits, "row", REAL)
      for model in ("smollm2", "gemma3") for method in ("absmax", "llm-int8") for bits in (4, 8)),
    ("smollm2-absmax-4b-tensor", "smollm2", "absmax", 4, "tensor", REAL),
)
TOP = 5  # layers listed per map


def command(stem: str, model: str, method: str, bits: int, granularity: str, rest: tuple[str, ...]) -> list[str]:
    """The `quantdiff sensitivity` call writing `stem`.json and `stem`.png under results/damage."""
    return ["quantdiff", "sensitivity", model, "--method", method, "--bits", str(bits), "--granularity", granularity, *rest,
            "--json", f"results/damage/{stem}.json", "--plot", f"results/damage/{stem}.png", "--quiet", "--force"]


def ranked(layers: list[dict]) -> list[dict]:
    """The layers by mean KL, largest first (ties: lower layer first)."""
    return sorted(layers, key=lambda e: (-e["damage"]["kld_mean"], e["layer"]))


def massive_summary(layers: list[dict]) -> dict | None:
    """Where the massive activation sits (the layers flagged `massive`, the first of them being where it appears in
    the residual stream) and what share of the summed one-layer mean KLs those layers carry; None when no layer
    holds one. rank: 1 = the most damaging layer."""
    flagged = [e["layer"] for e in layers if e["outliers"]["massive"]]
    if not flagged:
        return None
    total = sum(e["damage"]["kld_mean"] for e in layers)
    order = [e["layer"] for e in ranked(layers)]
    first = next(e for e in layers if e["layer"] == flagged[0])
    return {
        "layers": flagged,
        "first": flagged[0],
        "first_rank": order.index(flagged[0]) + 1,
        "first_share": first["damage"]["kld_mean"] / total if total else None,
        "flagged_share": sum(e["damage"]["kld_mean"] for e in layers if e["outliers"]["massive"]) / total if total else None,
        "flagged_fraction_of_layers": len(flagged) / len(layers),
    }


def map_summary(result: dict) -> list[dict]:
    """Per site of one sensitivity JSON: the top layers by mean KL with their outlier fields, the massive-activation
    summary, Spearman's ρ and the additivity ratio."""
    out = []
    for site in result["sites"]:
        layers = site["layers"]
        total = sum(e["damage"]["kld_mean"] for e in layers)
        out.append({
            "site": site["site"],
            "layers": len(layers),
            "top": [{"layer": e["layer"], "kld_mean": e["damage"]["kld_mean"], "share": e["damage"]["kld_mean"] / total if total else None,
                     "same_top1": e["damage"]["same_top1"], **e["outliers"]} for e in ranked(layers)[:TOP]],
            "massive": massive_summary(layers),
            "spearman": site["spearman"],
            "additivity": site.get("additivity", {}).get("ratio"),
            "whole_kld_mean": site.get("additivity", {}).get("measured_whole", {}).get("kld_mean"),
        })
    return out


def markdown_top(summary: dict) -> str:
    """One site's top layers as a markdown table."""
    rows = ["| layer | mean KL | share of Σ | same top-1 | Top-1 \\|input\\| | Top-1 \\|h\\| | ÷ median | LLM.int8 features | sink heads | massive |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for e in summary["top"]:
        ratio = "–" if e["hidden_top1_over_median"] is None else f"{e['hidden_top1_over_median']:,.0f}"
        rows.append(f"| {e['layer']} | {e['kld_mean']:.4f} | {e['share']:.1%} | {e['same_top1']:.3f} | {e['input_top1']:,.1f} | {e['hidden_top1']:,.1f} | "
                    f"{ratio} | {e['outlier_features']} | {e['sink_heads']} | {'yes' if e['massive'] else ''} |")
    return "\n".join(rows)


ARM_NAMES = {"standard": "standard", "diff": "Diff V1", "diffv2": "DIFF V2"}


def real_tables(summary: dict, results: dict[str, dict]) -> str:
    """The real models' maps, one row per run: the whole site, the top layers, the massive-activation layers; then
    Spearman's ρ of each outlier measure against mean KL."""
    rows = ["| model | method | bits | granularity | whole-site mean KL | whole-site same top-1 | top 3 layers (share of Σ one-layer KL) | "
            "first massive layer: rank, share | massive layers' share (of layers) | additivity |", "|---|---|---:|---|---:|---:|---|---|---|---:|"]
    rho = ["| model | method | bits | granularity | " + " | ".join(MEASURES) + " |", "|---|---|---:|---|" + "---:|" * len(MEASURES)]
    for stem, run in summary.items():
        if stem.startswith("bb-"):
            continue
        [site] = run["sites"]
        whole, massive = results[stem]["sites"][0]["additivity"]["measured_whole"], site["massive"]
        top = ", ".join(f"{e['layer']} ({e['share']:.0%})" for e in site["top"][:3])
        head = f"| {run['model']} | {run['method']} | {run['bits']} | {run['granularity']} |"
        rows.append(f"{head} {whole['kld_mean']:.3g} | {whole['same_top1']:.3f} | {top} | layer {massive['first']}: {massive['first_rank']} of "
                    f"{site['layers']}, {massive['first_share']:.1%} | {massive['flagged_share']:.0%} ({massive['flagged_fraction_of_layers']:.0%}) | "
                    f"{site['additivity']:.2f} |")
        rho.append(head + " " + " | ".join("–" if site["spearman"][m] is None else f"{site['spearman'][m]:+.2f}" for m in MEASURES) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(rho)


def arms_table(results: dict[str, dict]) -> str:
    """The shipped bb arms' per-layer profiles: each layer's mean KL alone, the whole site's, and the additivity."""
    rows = ["| arm | site | bits | layer 0 alone | layer 1 alone | whole site | whole-site same top-1 | additivity |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for arm, name in ARM_NAMES.items():
        for site_name in ("linear", "kv"):
            for bits in (2, 3, 4):
                site = next(s for s in results[f"bb-{arm}-absmax-{bits}b"]["sites"] if s["site"] == site_name)
                alone = " | ".join(f"{e['damage']['kld_mean']:.3g}" for e in site["layers"])
                whole = site["additivity"]["measured_whole"]
                rows.append(f"| {name} | {site_name} | {bits} | {alone} | {whole['kld_mean']:.3g} | {whole['same_top1']:.3f} | {site['additivity']['ratio']:.2f} |")
    return "\n".join(rows)


def run_all() -> list[dict]:
    records = []
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    for stem, *spec in RUNS:
        argv = command(stem, *spec)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantdiff", *argv[1:]], cwd=ROOT, env=env, check=True)
        records.append({"json": f"{stem}.json", "command": shlex.join(argv), "seconds": round(time.perf_counter() - start, 1)})
        print(f"{stem}: {records[-1]['seconds']} s", flush=True)
        write_json(OUT / "runs.json", records, force=True)
    return records


def summarize() -> None:
    """summary.json, and the tables README.md shows (printed)."""
    summary, results = {}, {}
    for stem, *_ in RUNS:
        result = results[stem] = json.loads((OUT / f"{stem}.json").read_text())
        summary[stem] = {"model": result["model"], "method": result["method"], "bits": result["bits"], "granularity": result["granularity"],
                         "tokens": result["tokens"], "sites": map_summary(result)}
        for site in summary[stem]["sites"] if not stem.startswith("bb-") else ():
            print(f"\n### {stem}: the top layers\n\n{markdown_top(site)}")
    print(f"\n{real_tables(summary, results)}\n\n{arms_table(results)}")
    write_json(OUT / "summary.json", summary, force=True)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--summary"]):
        sys.exit("usage: python scripts/damage_maps.py [--summary]")
    if not sys.argv[1:]:
        run_all()
    summarize()
