"""Post-training remedies for outliers, applied to the `linear` site before it quantizes: an online Hadamard
rotation (QuaRot) or SmoothQuant smoothing. Both leave the unquantized model's function unchanged, so whatever
changes under quantization is the remedy's effect.

Config types (`HadamardRotation`, `Smoothing`) ride on `sites.LinearSite.transform`; `apply_transform` installs
one on a model with undo steps, as every site handler does. Smoothing needs a calibration pass per model first
(`calibrated_configs`): its scales depend on the model's activations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

from torch import nn

from quantdiff.core.typed import checked_class
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.quant.hadamard import hadamard_block, rotate
from quantdiff.quant.smoothing import DEFAULT_ALPHA, Calibrated, Calibration, apply_smoothing, calibrate, check_alpha, divide_inputs

Undo = Callable[[], None]


@checked_class
@dataclass(frozen=True)
class HadamardRotation:
    """y = (xH)(WH)ᵀ for every quantized linear: its weight is stored rotated, its input rotated on the fly, and
    the quantizers see both in the rotated basis. H: `hadamard` (block-diagonal Walsh–Hadamard)."""

    name: ClassVar[str] = "hadamard"

    def to_dict(self) -> dict:
        return {"name": self.name}


@checked_class
@dataclass(frozen=True)
class Smoothing:
    """SmoothQuant with migration strength `alpha`, scales from `calibration` (see `quant.smoothing`).
    `calibrated` holds one model's calibration result once `calibrated_configs` has run (not part of equality)."""

    calibration: Calibration
    alpha: float = DEFAULT_ALPHA
    calibrated: Calibrated | None = field(default=None, compare=False, repr=False)

    name: ClassVar[str] = "smooth"

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        if not isinstance(self.calibration, Calibration):
            raise ConfigError("smoothing needs a Calibration (where its activation scales come from)")

    def to_dict(self) -> dict:
        done = {} if self.calibrated is None else {"calibrated": self.calibrated.record}
        return {"name": self.name, "alpha": self.alpha, "calibration": self.calibration.to_dict(), **done}


Transform = HadamardRotation | Smoothing
TRANSFORM_NAMES = (HadamardRotation.name, Smoothing.name)


def transform_from_dict(data: object) -> Transform:
    """The inverse of `to_dict` (a `calibrated` record is not a setting and is left out)."""
    if not isinstance(data, dict) or data.get("name") not in TRANSFORM_NAMES:
        raise ConfigError(f"a linear transform must be an object named one of {', '.join(TRANSFORM_NAMES)}")
    fields = {k: v for k, v in data.items() if k not in ("name", "calibrated")}
    try:
        if data["name"] == HadamardRotation.name:
            return HadamardRotation(**fields)
        return Smoothing(calibration=Calibration(**fields.pop("calibration")), **fields)
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"bad {data['name']} settings: {exc}") from None


def parse_rotation(name: str | None) -> HadamardRotation | None:
    """The CLI's --rotate value."""
    if name is None:
        return None
    if name != HadamardRotation.name:
        raise ConfigError(f"unknown rotation {name!r} (choose from {HadamardRotation.name})")
    return HadamardRotation()


def _rotate_input(module: nn.Module, block: int) -> Undo:
    """A forward pre-hook rotating the module's input; returns its removal."""
    return module.register_forward_pre_hook(lambda _m, args, block=block: (rotate(args[0], block), *args[1:])).remove


def apply_transform(model: nn.Module, transform: Transform, targets: Sequence[nn.Linear], undo: list[Undo]) -> None:
    """Install `transform` (undo steps appended). Rotation: each target's weight becomes WH and a forward pre-hook
    rotates its input; smoothing: every calibrated group's weights become W·s, 1/s folded into the norms or, when
    not foldable, divided out of each input by a pre-hook. Pre-hooks are registered before any quantizer's, so a
    quantizer sees the transformed input."""
    if isinstance(transform, HadamardRotation):
        for module in targets:
            block = hadamard_block(module.in_features)
            original = module.weight
            module.weight = nn.Parameter(rotate(original.detach(), block), requires_grad=False)
            undo.append(lambda module=module, original=original: setattr(module, "weight", original))
            undo.append(_rotate_input(module, block))
        return
    if transform.calibrated is None:
        raise ConfigError("smoothing needs its calibration pass first (quant.transforms.calibrated_configs)")
    divide_inputs(apply_smoothing(model, transform.calibrated, transform.alpha, undo), undo)


def transform_record(transform: Transform | None, model: nn.Module, targets: Sequence[nn.Linear]) -> dict | None:
    """What an output records about a transform: its settings and, for a rotation, the Hadamard block of each
    input width ({width: block}); for smoothing, the calibration actually run and whether the scales were folded."""
    if transform is None:
        return None
    record = transform.to_dict()
    if isinstance(transform, HadamardRotation):
        widths = sorted({m.in_features for m in targets})
        record["blocks"] = {str(width): hadamard_block(width) for width in widths}
    return record


def calibrated_configs(configs: Sequence, model: nn.Module, tokenizer, bos_id: int | None = None) -> list:
    """`configs` (QuantConfigs) with every smoothing transform calibrated on `model`, its sequences opened with
    `bos_id` (None: nothing) as the evaluation's are; one calibration pass per distinct Calibration."""
    done: dict[Calibration, Calibrated] = {}
    out = []
    for config in configs:
        transform = getattr(config.site, "transform", None)
        if isinstance(transform, Smoothing):
            if transform.calibration not in done:
                done[transform.calibration] = calibrate(model, tokenizer, transform.calibration, bos_id)
            smoothing = dataclasses.replace(transform, calibrated=done[transform.calibration])
            config = dataclasses.replace(config, site=dataclasses.replace(config.site, transform=smoothing))
        out.append(config)
    return out


# ---- exports: a transform written into the weights ------------------------------------------------------------


def check_exportable(transform: Transform | None, own_format: bool) -> None:
    """A rotation is stored as rotated weights WH that the loader must complement by rotating the inputs: only
    quantdiff's own format (`own_format`) is read by that loader; other formats load elsewhere and refuse it."""
    if isinstance(transform, HadamardRotation) and not own_format:
        raise ConfigError(
            "--rotate needs --method absmax of --format quantdiff: other formats load in transformers, bitsandbytes, vLLM or llama.cpp, which would not rotate the inputs"
        )


def export_transform(model: nn.Module, source, transform: Transform, targets: Sequence[tuple[str, nn.Linear]], own_format: bool) -> dict:
    """Apply `transform` to `model` for good, before an export encodes its weights, and return what the export's
    quantization_config records: for a rotation the Hadamard block of each module (the loader rotates their
    inputs again: `rotate_inputs`), for smoothing its settings and calibration. Smoothing must fold into the
    norms; then the weights alone hold it, in any format."""
    check_exportable(transform, own_format)
    if isinstance(transform, HadamardRotation):
        apply_transform(model, transform, [module for _, module in targets], undo=[])
        return {"name": transform.name, "modules": {fqn: hadamard_block(module.in_features) for fqn, module in targets}}
    from quantdiff.models.bos import decide_bos
    from quantdiff.models.loading import load_tokenizer

    tokenizer = load_tokenizer(source)
    calibrated = calibrate(model, tokenizer, transform.calibration, decide_bos(source, tokenizer).token_id)
    if not calibrated.folded:
        raise ConfigError("--smooth: the scales do not fold exactly into this model's norms, and an export holds no unfolded smoothing")
    apply_smoothing(model, calibrated, transform.alpha, undo=[], fold=True)
    return dataclasses.replace(transform, calibrated=calibrated).to_dict()


def rotate_inputs(model: nn.Module, blocks: dict[str, int]) -> list[Undo]:
    """A rotated export as loaded: forward pre-hooks rotating the inputs of the modules `blocks` names (fqn →
    Hadamard block); returns their removal steps."""
    modules = dict(model.named_modules())
    undo: list[Undo] = []
    for fqn, block in blocks.items():
        module = modules.get(fqn)
        if not isinstance(module, nn.Linear) or not isinstance(block, int) or block != hadamard_block(module.in_features):
            raise LoadError(f"the recorded rotation of {fqn} (block {block!r}) does not fit this model")
        undo.append(_rotate_input(module, block))
    return undo
