"""The sensitivity map on the console (a table per site) and as a figure (layer × damage, an outlier measure overlaid)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from quantdiff.core.atomic import atomic_file
from quantdiff.core.owned import plot_metadata
from quantdiff.report.numbers import number

OVERLAID = "input_top1"  # the outlier measure drawn beside the damage


def sensitivity_tables(result: dict) -> list[Table]:
    """One table per site: each layer's damage beside its outlier statistics, then the rank correlations."""
    tables = []
    for site in result["sites"]:
        table = Table(title=f"{result['model']}: {result['method']} {site['bits']}-bit, site {site['site']}, one layer at a time")
        for column in ("layer", "KL mean", "KL p99", "same top-1", "Δ loss", "Top-1 |input|", "Top-1 ÷ median", "kurtosis", "int8 features", "sink heads", "massive"):
            table.add_column(column, justify="right")
        for entry in site["layers"]:
            d, o = entry["damage"], entry["outliers"]
            table.add_row(str(entry["layer"]), number(d["kld_mean"]), number(d["kld_p99"]), f"{d['same_top1']:.3f}", number(d["delta_loss"]),
                          number(o["input_top1"]), number(o["hidden_top1_over_median"]), number(o["hidden_kurtosis"]),
                          str(o["outlier_features"]), str(o["sink_heads"]), "yes" if o["massive"] else "")
        rho = ", ".join(f"{name} {'–' if value is None else f'{value:+.2f}'}" for name, value in site["spearman"].items())
        additive = site.get("additivity")
        check = "" if additive is None else (f"; Σ one-layer KL {number(additive['sum_of_layers'])} vs whole site "
                                             f"{number(additive['measured_whole']['kld_mean'])}")
        table.caption = f"Spearman ρ with KL mean: {rho}{check}"
        tables.append(table)
    return tables


def plan_lines(result: dict, out: Path | None = None) -> list[str]:
    """The precision plan of a sensitivity result, if any: each layer's width, the average, predicted against
    measured whole-plan damage, and where the plan was written."""
    plan = result.get("plan")
    if plan is None:
        return []
    widths = " ".join(f"{e['layer']}:{e['bits']}" for e in plan["layers"])
    predicted, measured = plan["predicted_kld_mean"], plan["measured_kld_mean"]
    return [f"plan ({plan['method']} @{plan['site']}, widths {'/'.join(map(str, plan['candidates']))}, budget {plan['budget_bits']:g} bits): layer:bits {widths}",
            f"average {plan['average_bits']:.3f} bits; mean KL predicted {number(predicted)} (sum of one-layer damages), "
            f"measured {number(measured)} (whole plan, same tokens; ratio {predicted / measured if measured else float('nan'):.2f})"]\
        + ([] if out is None else [f"plan -> {out}"])


def plot_sensitivity(result: dict, path: str | Path, force: bool = False) -> None:
    """Per site a panel: mean KL per layer (log scale, bars) and the layers' Top-1 |input| (line, right axis);
    layers holding the massive activation marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = result["sites"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, site in zip(axes[:, 0], panels):
        layers = [e["layer"] for e in site["layers"]]
        kld = [max(e["damage"]["kld_mean"], 1e-12) for e in site["layers"]]
        colours = ["tab:red" if e["outliers"]["massive"] else "tab:blue" for e in site["layers"]]
        ax.bar(layers, kld, color=colours)
        ax.set_yscale("log")
        ax.set_xlabel("decoder layer quantized alone")
        ax.set_ylabel("mean KL (nats)")
        other = ax.twinx()
        other.plot(layers, [e["outliers"][OVERLAID] for e in site["layers"]], color="black", marker=".", linewidth=1)
        other.set_yscale("log")
        other.set_ylabel("Top-1 |input|")
        rho = site["spearman"].get(OVERLAID)
        ax.set_title(f"{result['model']} {result['method']} {site['bits']}-bit, site {site['site']} "
                     f"(red: massive activation; Spearman ρ {'–' if rho is None else f'{rho:+.2f}'})")
    fig.tight_layout()
    with atomic_file(path, force, "--plot") as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", dpi=130, metadata=plot_metadata())
    plt.close(fig)
