"""SmoothQuant (Xiao et al. 2023, "SmoothQuant", §4): migrate activation outliers into the weights per channel.

For the linear layers reading one normed input X (a decoder layer's q/k/v — and DIFF V2's λ projection — read
the attention input, gate/up the FFN input), with α ∈ [0, 1]:

    s_j = max|X_j|^α / max|W_:,j|^(1−α),    X' = X / s,    W' = W · s  (each input column j of every such W)

so X'W'ᵀ = XWᵀ exactly, while X' has flatter channels and W' absorbs their scale. max|X_j| comes from a
calibration pass over data no task evaluates (`calibrate`), read from the statistics engine's own per-channel
maxima of the linear inputs (`stats.channels.ChannelStats`, fed by the observer of `attention.observe`); the
weight maximum runs over every linear sharing the input, so one s serves them all (the authors' `smooth_ln_fcs`).
Both maxima and s are clamped at 1e-5 as in the authors' code, so a channel the calibration never saw active
gets a finite s.

Where the input is the output of a norm whose output is weight ⊙ normalise(x) (LLaMA's RMSNorm), 1/s folds into
that weight, as SmoothQuant does, and the model computes X' itself. The calibration checks this on the model:
with random scales folded, its logits must equal the unfolded model's. Otherwise (a norm of another form, a
consumer of X that is not a linear layer) each linear divides its own input by s instead: the same function,
computed unfolded. Inputs of the other linears (the attention output and FFN down projections) have no norm
before them and stay unsmoothed, as in SmoothQuant.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from quantdiff.core.typed import checked_class
from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int
from quantdiff.models import structure
from quantdiff.stats.channels import LINEAR_INPUTS, ChannelStats

SCALE_FLOOR = 1e-5  # the authors' clamp of the weight maxima and of s
DEFAULT_ALPHA = 0.5  # the paper's default migration strength
DEFAULT_CALIBRATION_TOKENS = 16384
DEFAULT_CALIBRATION_SEQ_LEN = 256


def check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"the SmoothQuant migration strength α must be a number from 0 to 1, got {alpha!r}")
    return float(alpha)


def smoothing_scales(act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s (D,) float32 for one input: act_absmax (D,) = max|X_j|, weights (out_i, D) of every linear reading X."""
    if not weights:
        raise ConfigError("smoothing scales need at least one linear layer reading the input")
    w_max = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    a_max = act_absmax.float().to(w_max.device)
    return (a_max.clamp(min=SCALE_FLOOR).pow(alpha) / w_max.clamp(min=SCALE_FLOOR).pow(1 - alpha)).clamp(min=SCALE_FLOOR)


@dataclass(frozen=True)
class SmoothingGroup:
    """One linear input of a decoder layer: the module producing it (None: not a module's output) and the
    linear layers reading it, by qualified name."""

    layer: int
    input: str  # one of LINEAR_INPUTS
    norm: str | None
    linears: tuple[str, ...]


@dataclass
class Calibrated:
    """One model's calibration: per-channel maxima of its linear inputs, the groups sharing each input, whether
    the scales fold into the norms, and a JSON record of the data (`record`)."""

    stats: ChannelStats
    groups: list[SmoothingGroup]
    folded: bool
    record: dict = field(default_factory=dict)


# ---- which linears read which input: a probe riding along the calibration pass -------------------------------


class GroupProbe:
    """Hooks that see, per decoder layer, which module produced each linear input the observer reports and which
    nn.Linear layers read that very tensor. Tensors are held only until their layer finishes, so ids are unique."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = structure.decoder_layers(model)
        self.groups: dict[tuple[int, int], SmoothingGroup] = {}
        self._produced: dict[int, tuple[str, torch.Tensor]] = {}
        self._read: dict[int, tuple[torch.Tensor, list[str]]] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    def on_input(self, layer: int, which: int, x: torch.Tensor) -> None:
        self._inputs[which] = x

    @contextmanager
    def attached(self) -> Iterator[GroupProbe]:
        handles = []
        try:
            for index, (prefix, layer) in enumerate(self.layers):
                handles.append(layer.register_forward_pre_hook(lambda *_: self._start()))
                for name, module in layer.named_modules(prefix=prefix):
                    if module is not layer:
                        handles.append(module.register_forward_hook(lambda _m, _a, out, name=name: self._produce(name, out)))
                    if isinstance(module, nn.Linear):
                        handles.append(module.register_forward_pre_hook(lambda _m, args, name=name: self._consume(name, args)))
                handles.append(layer.register_forward_hook(lambda *_, index=index: self._finish(index)))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _start(self) -> None:
        for seen in (self._produced, self._read, self._inputs):
            seen.clear()

    def _produce(self, name: str, out: object) -> None:
        if isinstance(out, torch.Tensor):
            self._produced.setdefault(id(out), (name, out))  # the innermost module: its hook runs first

    def _consume(self, name: str, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self._read.setdefault(id(args[0]), (args[0], []))[1].append(name)

    def _finish(self, index: int) -> None:
        for which, x in self._inputs.items():
            producer = self._produced.get(id(x))
            readers = tuple(dict.fromkeys(self._read.get(id(x), (x, []))[1]))
            self.groups.setdefault((index, which), SmoothingGroup(index, LINEAR_INPUTS[which], producer and producer[0], readers))
        self._start()

    def checked_groups(self, label: str) -> list[SmoothingGroup]:
        """Every decoder layer's two inputs, each read by nn.Linear layers; ConfigError naming what is not."""
        out = []
        for index in range(len(self.layers)):
            for which, name in enumerate(LINEAR_INPUTS):
                group = self.groups.get((index, which))
                if group is None:
                    raise ConfigError(f"smoothing: {label} decoder layer {index} has no {name} input the observer recognises: its structure is not supported")
                if not group.linears:
                    raise ConfigError(f"smoothing: {label} decoder layer {index}: no nn.Linear reads its {name} input directly: its structure is not supported")
                out.append(group)
        return out


# ---- applying the scales ------------------------------------------------------------------------------------

Undo = Callable[[], None]


def _swap(module: nn.Module, name: str, value: torch.Tensor, undo: list[Undo]) -> None:
    original = getattr(module, name)
    setattr(module, name, nn.Parameter(value.to(original.dtype), requires_grad=False))
    undo.append(lambda: setattr(module, name, original))  # the very same Parameter comes back


def group_scales(model: nn.Module, calibrated: Calibrated, alpha: float) -> list[tuple[SmoothingGroup, torch.Tensor]]:
    """(group, s) for every group, from the calibration's maxima and the model's current weights."""
    modules = dict(model.named_modules())
    out = []
    for group in calibrated.groups:
        weights = [modules[name].weight for name in group.linears]
        act = calibrated.stats.input_absmax[group.layer, LINEAR_INPUTS.index(group.input)]
        out.append((group, smoothing_scales(act, weights, alpha).to(weights[0].device)))
    return out


def apply_smoothing(model: nn.Module, calibrated: Calibrated, alpha: float, undo: list[Undo], fold: bool | None = None) -> list[tuple[nn.Linear, torch.Tensor]]:
    """Smooth `model` in place (undo steps appended): every group's linears get W·s; folded (default: when the
    calibration found it exact), the norm's weight becomes weight / s, else the returned (linear, s) pairs must
    divide their own inputs by s. Returns [] when folded."""
    fold = calibrated.folded if fold is None else fold
    modules = dict(model.named_modules())
    unfolded = []
    for group, s in group_scales(model, calibrated, alpha):
        for name in group.linears:
            linear = modules[name]
            _swap(linear, "weight", linear.weight.detach().float() * s, undo)
            if not fold:
                unfolded.append((linear, s))
        if fold:
            norm = modules[group.norm]
            _swap(norm, "weight", norm.weight.detach().float() / s, undo)
    return unfolded


def divide_inputs(pairs: list[tuple[nn.Linear, torch.Tensor]], undo: list[Undo]) -> None:
    """Unfolded smoothing: each linear's input divided by its s, by a forward pre-hook (registered first, so a
    quantizer's hook sees X / s)."""
    for linear, s in pairs:
        hook = linear.register_forward_pre_hook(lambda _m, args, s=s: ((args[0].float() / s).to(args[0].dtype), *args[1:]))
        undo.append(hook.remove)


def _single_weight_norm(model: nn.Module, group: SmoothingGroup) -> bool:
    """The producer carries exactly one parameter, a weight of the input's width (RMSNorm's shape)."""
    if group.norm is None:
        return False
    module = dict(model.named_modules())[group.norm]
    params = list(module.parameters())
    weight = getattr(module, "weight", None)
    return len(params) == 1 and isinstance(weight, nn.Parameter) and weight.dim() == 1 and weight.shape[0] == model.config.hidden_size


def folding_is_exact(model: nn.Module, groups: list[SmoothingGroup], input_ids: torch.Tensor) -> bool:
    """Do random scales folded into the norms leave the logits unchanged? (False also when a producer is not a
    one-weight norm.) The scales are exp(N(0, 1)) per channel, seeded, so every channel is moved."""
    if not all(_single_weight_norm(model, g) for g in groups):
        return False
    generator = torch.Generator().manual_seed(0)
    stats = ChannelStats.empty(len(structure.decoder_layers(model)), model.config.hidden_size)
    stats.input_absmax.copy_(torch.randn(stats.input_absmax.shape, generator=generator).exp())
    probe = Calibrated(stats, groups, folded=True)
    with torch.inference_mode():
        reference = model(input_ids=input_ids, use_cache=False).logits.float()
        undo: list[Undo] = []
        try:
            apply_smoothing(model, probe, alpha=1.0, undo=undo, fold=True)  # α = 1: s = max|X| = the random scales
            folded = model(input_ids=input_ids, use_cache=False).logits.float()
        finally:
            while undo:
                undo.pop()()
    dtype = next(model.parameters()).dtype
    tolerance = max(1e-4, 16 * torch.finfo(dtype).eps) * float(reference.abs().max().clamp(min=1.0))
    return bool((folded - reference).abs().max() <= tolerance)


# ---- the calibration pass -------------------------------------------------------------------------------------


@checked_class
@dataclass(frozen=True)
class Calibration:
    """Where the activation maxima come from: `tokens` tokens of a data source (`data.sources`: a file,
    builtin:corpus-train, builtin:bigram-backcopy, …) in sequences of at most `seq_len` (`length`)."""

    source: str
    tokens: int = DEFAULT_CALIBRATION_TOKENS
    seq_len: int | None = None

    def __post_init__(self) -> None:
        from quantdiff.data.sources import check_calibration_split, check_token_budget

        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"calibration data must name a data source, got {self.source!r}")
        check_calibration_split(self.source, "calibration data")
        for name, value, least in (("tokens", self.tokens, 1), ("seq_len", self.seq_len, 2)):
            if name == "seq_len" and value is None:
                continue
            if as_int(value) is None or value < least:
                raise ConfigError(f"calibration {name} must be an integer of at least {least}, got {value!r}")
            object.__setattr__(self, name, as_int(value))  # a numpy integer is stored (and written to JSON) as an int
        check_token_budget(self.tokens, "--calibration-tokens")

    def to_dict(self) -> dict:
        return {"source": self.source, "tokens": self.tokens, "seq_len": self.seq_len}

    def length(self, config) -> int:
        """The sequence length for a model of `config`: `seq_len` as given, refused beyond the model's positions
        (`eval.bounds.check_positions`); unset, DEFAULT_CALIBRATION_SEQ_LEN or the model's positions if fewer."""
        from quantdiff.eval.bounds import check_positions

        if self.seq_len is None:
            return min(DEFAULT_CALIBRATION_SEQ_LEN, getattr(config, "max_position_embeddings", None) or DEFAULT_CALIBRATION_SEQ_LEN)
        return check_positions(self.seq_len, config, "calibration sequences")


def calibrate(model: nn.Module, tokenizer, calibration: Calibration, bos_id: int | None = None, batch_size: int = 4) -> Calibrated:
    """The calibration pass: per-channel maxima of every decoder layer's linear inputs (the statistics engine's
    observer and `ChannelStats`), the linears sharing each input, and whether scales fold exactly into the norms.
    `tokenizer` may be None for pre-tokenized sources; `bos_id` opens every sequence cut from text, as the model
    is evaluated (`models.bos`): a model trained with BOS first has its outlier channels there."""
    from quantdiff.attention.observe import observe
    from quantdiff.data.sources import load_sequences, make_batches
    from quantdiff.stats.collect import StatsCollector
    from quantdiff.stats.nonfinite import in_stats, refuse_nonfinite

    config = model.config
    seq_len = calibration.length(config)
    tokenize = None if tokenizer is None else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    sequences = load_sequences(calibration.source, tokenize, calibration.tokens, seq_len, config.vocab_size, bos_id, tokenizer)
    batches = make_batches(sequences, batch_size, getattr(config, "pad_token_id", None) or 0)
    collector = StatsCollector(model, k=1, compile=False)  # only its linear-input channel statistics are used
    probe = GroupProbe(model)

    def on_input(layer: int, which: int, x: torch.Tensor) -> None:
        probe.on_input(layer, which, x)
        collector.on_linear_input(layer, which, x)

    with probe.attached(), observe(model, on_linear_input=on_input), torch.inference_mode():
        for batch in batches:
            collector.run(model, batch)
    refuse_nonfinite(structure.model_label(model), in_stats(collector.stats), "smoothing scales (channel maxima)")
    groups = probe.checked_groups(structure.model_label(model))
    device = next(model.parameters()).device
    folded = folding_is_exact(model, groups, batches[0].input_ids[:1].to(device))
    record = {**calibration.to_dict(), "tokens": sum(map(len, sequences)), "sequences": len(sequences), "seq_len": seq_len, "bos_id": bos_id, "folded": folded}
    return Calibrated(collector.stats.linear_inputs, groups, folded, record)
