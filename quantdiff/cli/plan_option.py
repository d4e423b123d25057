"""`--plan`: evaluate a mixed-precision plan (`quantdiff sensitivity --plan-budget … --out`), checked at the door:
the file as a whole (`precision_plan.load_plan`), its calibration against the evaluation data, and its layer count
against each model's config, before any weights load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.core.errors import ConfigError

PlanOpt = Annotated[Optional[list[Path]], typer.Option("--plan", help="Evaluate a mixed-precision plan (a `quantdiff sensitivity --plan-budget --out` file: a bit width per decoder layer at one site) as one cell; repeat for several (sweep). Not with --bits, --method or --site; refused for a model with another number of layers, or when its calibration data is the evaluation data.")]
# Options that choose a quantization of their own: a plan sets its method, widths, site, scales and layers.
CLASHING = ("--bits", "--method", "--site", "--group-size", "--rotate", "--smooth", "--granularity", "--layers", "--kv-mode")


def refuse_with_plan(plans: list[Path] | None, given: dict[str, object]) -> None:
    """ConfigError naming the first option of CLASHING given (not None) beside --plan."""
    clash = next((flag for flag in CLASHING if given.get(flag) is not None), None)
    if plans and clash is not None:
        raise ConfigError(f"--plan sets the method, bits per layer, site and granularity: {clash} does not apply with it")


def load_precision_plans(paths: list[Path] | None, data: str | Path | None) -> list:
    """Each --plan file as a `PlannedConfig`; refused when calibrated on the evaluation data (compared by
    content, as --kv-plan's calibration is: `check_calibration_source`)."""
    from quantdiff.cli.transform_options import check_calibration_source
    from quantdiff.quant.precision_plan import load_plan, planned_config

    configs = []
    for path in paths or []:
        plan = load_plan(path)
        record = plan.calibration
        check_calibration_source(record["source"], data, flag=f"--plan {path}: its calibration", sha256=record.get("sha256"))
        configs.append(planned_config(plan))
    return configs


def check_plans_fit(configs: list, specs: list[tuple[str, Path]], trust_remote_code: bool = False) -> None:
    """Every plan against every model's decoder-layer count, from its config (before any weights load)."""
    from quantdiff.models.loading import load_config
    from quantdiff.quant.precision_plan import PlannedConfig

    plans = [c.plan for c in configs if isinstance(c, PlannedConfig)]
    for name, path in specs if plans else []:
        count = getattr(load_config(path, trust_remote_code), "num_hidden_layers", None)
        for plan in plans if count is not None else []:
            plan.check_model(count, name)
