"""`quantdiff kv-plan` as a job: calibrate one model on data no task evaluates, derive a KV-cache precision plan per
(policy, bit width) from its statistics (`quant.kv_plan`), and write each as a versioned JSON file."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from pathlib import Path

from quantdiff.core.errors import ConfigError
from quantdiff.quant.kv_plan import POLICIES, KVPlan, calibrate_kv, derive_plan, plan_file_name


@dataclass(frozen=True)
class PlanRequest:
    """What `kv-plan` was asked for; `out` is a .json file for one (policy, bits), else a directory."""

    model: str
    policies: tuple[str, ...]
    bits: tuple[int, ...]
    out: Path
    calibration: str
    calibration_tokens: int
    seq_len: int | None  # None: 256, or the model's positions if fewer
    keep_first: int = 1
    step: int = 1
    bos: str = "auto"
    device: str | None = None
    force: bool = False
    trust_remote_code: bool = False
    json_path: Path | None = None  # the command's --json: checked with the outputs

    @property
    def single(self) -> bool:
        return len(self.policies) == 1 and len(self.bits) == 1


def check_request(request: PlanRequest) -> None:
    """Every option, before a model loads; ConfigError in one line."""
    for policy in request.policies:
        if policy not in POLICIES:
            raise ConfigError(f"unknown --policy {policy!r} (choose from {', '.join(POLICIES)})")
    if request.single != (request.out.suffix == ".json"):
        raise ConfigError("--out is a .json file for one policy at one bit width, else a directory for one file per (policy, bits)")
    if request.out.exists() and not request.single and not request.out.is_dir():
        raise ConfigError(f"--out {request.out} exists and is not a directory")
    for flag, value in (("--calibration-tokens", request.calibration_tokens), ("--seq-len", request.seq_len), ("--keep-first", request.keep_first), ("--step", request.step)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")


def plan_paths(request: PlanRequest) -> list[Path]:
    """The file of each (policy, bits) the request asks for, in the order `run` derives them."""
    if request.single:
        return [request.out]
    return [request.out / plan_file_name(policy, bits) for policy, bits in product(request.policies, request.bits)]


def run(request: PlanRequest) -> list[tuple[Path, KVPlan | None, str | None]]:
    """(path, plan, None) per plan written, (path, None, reason) per (policy, bits) that cannot be met; a single
    request that cannot be met is an error."""
    from quantdiff.cli.transform_options import check_calibration_source
    from quantdiff.core.atomic import writable_target, write_json
    from quantdiff.core.device import resolve_device
    from quantdiff.core.outputs import check_outputs
    from quantdiff.models.bos import check_mode, decide_bos
    from quantdiff.models.inputs import model_inputs
    from quantdiff.models.loading import load_tokenizer
    from quantdiff.eval.bounds import check_positions
    from quantdiff.models.loading import load_config
    from quantdiff.models.names import check_one_model, resolve_models
    from quantdiff.quant.checkpoint import load
    from quantdiff.quant.smoothing import Calibration

    check_request(request)
    check_mode(request.bos)
    check_calibration_source(request.calibration, None)
    target = resolve_device(request.device, "--device")
    resolved = resolve_models([request.model])
    check_one_model(request.model, [path for _, path in resolved], "MODEL")
    [(name, path)] = resolved
    if request.seq_len is not None:  # before any work, as every command checks its positions
        check_positions(request.seq_len, load_config(path, request.trust_remote_code), "--seq-len")
    calibration_inputs = [] if request.calibration.startswith("builtin:") else [request.calibration]
    check_outputs({"--out": request.out, "--json": request.json_path}, model_inputs([request.model], [path]) + calibration_inputs)
    for target_path in plan_paths(request):  # a file quantdiff did not write is refused before the calibration runs
        writable_target(target_path, request.force, "--out")
    tokenizer = load_tokenizer(path)
    bos = decide_bos(path, tokenizer, request.bos)
    model = load(path, device=target, trust_remote_code=request.trust_remote_code)
    calibrated = calibrate_kv(model, tokenizer, Calibration(request.calibration, request.calibration_tokens, request.seq_len), bos.token_id)
    calibrated.shape["name"] = name
    out = []
    for (policy, bits), target_path in zip(product(request.policies, request.bits), plan_paths(request)):
        try:
            plan = derive_plan(calibrated, policy, bits, request.keep_first, request.step)
        except ConfigError as exc:
            if request.single:
                raise
            out.append((target_path, None, str(exc)))
            continue
        if not request.single:
            request.out.mkdir(parents=True, exist_ok=True)
        write_json(target_path, plan.to_dict(), indent=1, force=request.force, flag="--out")
        out.append((target_path, plan, None))
    return out
