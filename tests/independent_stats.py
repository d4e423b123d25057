"""Independent references for the across-seed tests, written out from the definitions with no numpy and no
quantdiff: the sign-flip permutation test by brute force over every sign assignment (Fisher 1935), Holm's
step-down adjustment (Holm 1979), and a seed's metric values read straight from its stats and sweep JSON."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path


def per_seed_values(results: Path, seed: int) -> dict[str, dict[str, float]]:
    """{metric key: {arm: value}} of one seed, read straight from results/seed-<s>/stats.json.gz and sweep.json.gz: Top-1
    overall, per softmax map and per first map (stats' per-head blocks, one per map) from the `topk` lists, each valid quantized
    cell's accuracy (`sweep/…`) and its change from the same model unquantized (`change/…`)."""
    stats = json.loads(gzip.decompress((results / f"seed-{seed}" / "stats.json.gz").read_bytes()))
    sweep = json.loads(gzip.decompress((results / f"seed-{seed}" / "sweep.json.gz").read_bytes()))
    values: dict[str, dict[str, float]] = {}
    for model in stats["models"]:
        for block in ("attention_logits", "hidden_states"):
            values.setdefault(f"table5/{block}/top1", {})[model["name"]] = max(abs(t["value"]) for t in model[block]["topk"])
        maps = [max(abs(t["value"]) for t in head["topk"]) for layer in model["attention_logits"]["per_head"] for head in layer]
        values.setdefault("table5/attention_logits/top1_per_map", {})[model["name"]] = sum(maps) / len(maps)
        # first maps only: a differential head's top-k entries name their map (1 or 2); standard attention's none
        first = [max(abs(t["value"]) for t in head["topk"]) for layer in model["attention_logits"]["per_head"] for head in layer
                 if head["topk"][0].get("map", 1) == 1]
        values.setdefault("table5/attention_logits/top1_per_map1", {})[model["name"]] = sum(first) / len(first)
    cells = [c for c in sweep["cells"] if "accuracy" in c]  # the lm and bb tasks (choice scores acc_norm)
    unquantized = {(c["task"], c["model"]): c["accuracy"] for c in cells if c["bits"] is None}
    for cell in cells:
        if cell["bits"] is not None and cell["valid"]:
            cell_key = f"{cell['task']}/{cell['site']}/{cell['method']}/{cell['bits']}"
            values.setdefault(f"sweep/{cell_key}", {})[cell["model"]] = cell["accuracy"]
            values.setdefault(f"change/{cell_key}", {})[cell["model"]] = cell["accuracy"] - unquantized[cell["task"], cell["model"]]
    return values


def sign_flip(d: list[float]) -> float:
    """Two-sided p: the share of all 2ⁿ sign assignments whose |sum| reaches the observed |sum|."""
    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12 for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


def holm(p: list[float]) -> list[float]:
    """Holm-adjusted p-values in the order given."""
    m, out, running = len(p), [0.0] * len(p), 0.0
    for rank, i in enumerate(sorted(range(m), key=p.__getitem__)):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out
