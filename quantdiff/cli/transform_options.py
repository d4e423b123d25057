"""The CLI's remedy options (`--rotate`, `--smooth`, `--calibration`, `--calibration-tokens`), shared by sweep,
eval and quantize, and the one function that turns them into a linear-site transform."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantdiff.cli.validate import refuse_unused
from quantdiff.core.errors import ConfigError

# Option types only at import time (torch loads when a command runs, not for --help).

RotateOpt = Annotated[Optional[str], typer.Option("--rotate", help="hadamard: quantize each linear layer's input and weight in a Walsh–Hadamard-rotated basis, y = (xH)(WH)ᵀ (QuaRot); block-diagonal with the largest power-of-two block dividing the width. Site linear only.")]
SmoothOpt = Annotated[Optional[float], typer.Option("--smooth", help="SmoothQuant with migration strength α (0–1; the paper's default 0.5) at site linear: scales from a calibration pass (--calibration), folded into the RMSNorm weights where exact.")]
CalibrationOpt = Annotated[Optional[str], typer.Option("--calibration", help="Data for --smooth's activation maxima: a text or JSONL file, builtin:corpus-train (the corpus' training split) or builtin:bigram-backcopy (the Bigram-Backcopy generator's calibration seed stream); default: the latter for task bb, else the former. Never the evaluation data.")]
CalibrationTokensOpt = Annotated[Optional[int], typer.Option("--calibration-tokens", help="Tokens of the calibration pass (default 16384).")]


def default_calibration(task: str | None) -> str:
    from quantdiff.data.sources import BUILTIN_BIGRAM_BACKCOPY, BUILTIN_CORPUS_TRAIN

    return BUILTIN_BIGRAM_BACKCOPY if task == "bb" else BUILTIN_CORPUS_TRAIN


def make_transform(
    rotate: str | None,
    smooth: float | None,
    calibration: str | None,
    calibration_tokens: int | None,
    task: str | None = None,
    data: Path | None = None,
):
    """The transform the options ask for (None: neither); ConfigError for a mix, an unused option, or calibration
    data that is the evaluation data (`task`, `data`: the command's evaluation, None when it evaluates nothing)."""
    from quantdiff.quant.smoothing import DEFAULT_CALIBRATION_TOKENS, Calibration
    from quantdiff.quant.transforms import Smoothing, parse_rotation

    if rotate is not None and smooth is not None:
        raise ConfigError("--rotate and --smooth are two remedies: choose one")
    if smooth is None:
        refuse_unused("without --smooth", calibration=calibration, calibration_tokens=calibration_tokens)
        return parse_rotation(rotate)
    source = default_calibration(task) if calibration is None else calibration  # an empty one is refused below, as --data is
    check_calibration_source(source, data)
    tokens = DEFAULT_CALIBRATION_TOKENS if calibration_tokens is None else calibration_tokens
    if tokens < 1:
        raise ConfigError(f"--calibration-tokens must be positive, got {tokens}")
    return Smoothing(Calibration(source, tokens), smooth)


def check_calibration_source(source: str, data: str | Path | None, flag: str = "--calibration", sha256: str | None = None) -> None:
    """ConfigError when calibration data `source` is missing, is a builtin source of an evaluation split (for every
    command and task: `data.sources.BUILTIN_SPLITS`), or holds what the command evaluates (`data`; None when it
    evaluates no file). Data is compared by content, not by path (docs/reliability.md, "Calibration is never the
    evaluation data"): the same bytes under another name, through a symlink or in a copy are the same data.
    `sha256`: a record of a file used earlier (a plan's calibration), compared in place of the file, which need
    not exist any more."""
    from quantdiff.data.sources import BUILTINS, check_calibration_split, check_data_file, file_sha256

    check_calibration_split(source, flag)
    if source in BUILTINS:
        return
    if sha256 is None:
        check_data_file(source, flag)
    if data is not None and (sha256 or file_sha256(source, flag)) == file_sha256(data, "--data"):
        raise ConfigError(f"{flag} holds the same bytes as the evaluation data (--data {data}): calibrate on other data")


KVPlanOpt = Annotated[Optional[list[Path]], typer.Option("--kv-plan", help="Apply a KV-cache precision plan (a `quantdiff kv-plan` file: bits per layer and KV head, positions kept at 16 bits) at site kv; repeat for several (sweep). Refused for a model of another shape, or when its calibration data is the evaluation data.")]


def load_kv_plans(paths: list[Path] | None, data: str | Path | None, granularity: str = "row") -> list:
    """Each --kv-plan file as a site-kv configuration at its budget and `granularity` (`registry`); ConfigError in
    one line for a bad file or a plan calibrated on the evaluation data."""
    from quantdiff.data.sources import BUILTINS
    from quantdiff.quant.kv_plan import KVPlan
    from quantdiff.quant.registry import granularity as parse_granularity
    from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, check_supported

    configs = []
    for path in paths or []:
        plan = KVPlan.load(path)
        record = plan.evidence.get("calibration", {})
        source = record.get("source")
        if source is None:  # unchecked, it could be the evaluation data
            raise ConfigError(f"--kv-plan {path} does not say what it was calibrated on (evidence.calibration.source): "
                              "refusing it, since its calibration cannot be checked against the evaluation data")
        if source not in BUILTINS and "sha256" not in record:
            raise ConfigError(f"--kv-plan {path} was calibrated on the file {source} without recording its sha256 (evidence.calibration.sha256): "
                              "refusing it, since its calibration cannot be compared with the evaluation data; remake it with quantdiff kv-plan")
        check_calibration_source(source, data, flag=f"--kv-plan {path}: its calibration", sha256=record.get("sha256"))
        config = QuantConfig(AbsmaxMethod(plan.budget_bits, parse_granularity(granularity)), KVSite(plan))
        check_supported(config)
        configs.append(config)
    return configs


def check_kv_plans(configs: list, specs: list[tuple[str, Path]], trust_remote_code: bool = False) -> None:
    """Every kv plan against every model's config, before any weights load (one line for a mismatch)."""
    from quantdiff.models.loading import load_config
    from quantdiff.quant.kv_plan import check_plan_fits

    for name, path in specs if any(getattr(c.site, "plan", None) is not None for c in configs) else []:
        config = load_config(path, trust_remote_code)
        for c in configs:
            if getattr(c.site, "plan", None) is not None:
                check_plan_fits(c.site.plan, config, name)


def calibration_file(transform) -> list[Path]:
    """The calibration data file of a transform, if any: an input that outputs must never overwrite."""
    from quantdiff.data.sources import BUILTINS

    source = getattr(getattr(transform, "calibration", None), "source", None)
    return [Path(source)] if source is not None and source not in BUILTINS else []
