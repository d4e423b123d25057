"""KV-cache precision plans: per layer and KV head bits, plus positions kept at 16 bits, derived from quantdiff's
own statistics on calibration data and applied at the `kv` site.

The cache is quantized as the `kv` site says (`sites.KVSite`): by default each token as it is written, per KV head
(causal; `quant.kv_cache` applies a plan to a real cache); at granularity tensor as KIVI does over the sequence
(Liu et al. 2024, §3: keys per channel, values per token, absmax). A plan changes two things:

- per-head bits: each (layer, KV head) has its own width, 2–16; 16 is the cache's own precision (left as is);
- kept positions: the keys and values at these positions (indices on the cache's key axis: quantdiff right-pads, so
  the position in the sequence) stay as the model computed them, bit for bit, and (KIVI) the keys' per-channel
  scales are taken over the other positions only. This is IntactKV (Liu et al. 2024, "IntactKV: Improving Large Language
  Model Quantization by Keeping Pivot Tokens Intact") and KVSink / PrefixQuant (Chen et al. 2024): the few tokens
  carrying the massive activations and the attention sinks stay in full precision, so neither their error nor
  their size reaches the other tokens' scales.

Policies (`derive_plan`), each at a budget of b bits:

- `uniform`: every head at b bits, nothing kept (the plain `kv` site);
- `first`: the first N positions kept (the sink tokens: IntactKV's BOS, StreamingLLM's initial tokens), the rest
  at b bits;
- `massive`: the positions that carried a massive activation (Sun et al. 2024's criterion, `stats.massive`, on a
  token standing out among tokens: `KVCalibration`) in at least half of the calibration sequences holding them,
  kept; the rest at b bits. Located on calibration data, never on evaluated items;
- `heads`: per-head bits at an average of exactly b: the sink heads (first-position attention mass above
  ε = 0.3, `stats.sinks`) with the highest mass at b + step, as many of the heads with the lowest mass at
  b − step, the others at b (budget-neutral reallocation, as vLLM issue 38930 and llama.cpp issue 21385 ask).

A plan is per KV head: query heads sharing a KV head (GQA) share its bits; a KV head's sink score is the largest
first-position mass among the query heads reading its keys (for differential attention, the maps' own softmax
masses: the cache's error reaches each map through its own softmax). DiffLlama reads V in two calls of half its
heads each, repeated twice (`attention.backend._quantized_kv`); each call's values get the bits of the cache
heads they are.

The effective bits of a run (`measured_bits`) count every cached element at its width, kept elements at 16:
the average over the (position, KV head) pairs the cache held (all KV heads of a model have one width, so this
is the average per element). Scales are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.core.errors import ConfigError
from quantdiff.models import structure
from quantdiff.quant.kv_layout import KVLayout, fake_quantize
from quantdiff.quant.kv_plan_schema import MAX_POSITION, PLAN_SCHEMA, PLAN_VERSION, POLICIES, QUANTIZER, check_plan_document, read_plan_json
from quantdiff.quant.numerics import PerColumn, PerRow, absmax, check_bits, fake_quantize_with_absmax, rowwise_absmax_quantize
from quantdiff.stats.sinks import SINK_EPSILON

FULL_BITS = 16  # the cache's own precision: elements at 16 bits are not quantized
MASSIVE_SHARE = 0.5  # a position is kept when it carried a massive activation in at least this share of sequences
TOKEN_RATIO = 10.0  # … and its largest |h| is this many times the layer's median over tokens of their largest |h|


# ---- the plan -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    """One layer: bits per KV head and the positions kept at 16 bits."""

    kv_bits: tuple[int, ...]
    keep_positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVPlan:
    """A per-layer, per-KV-head cache precision plan (JSON: `to_dict`, documented in docs/quantization.md).

    `model`: what it was derived for (kind, layers, KV heads per layer, query heads, head width), checked against
    the model it is applied to. `evidence`: the statistics behind it (not read when applying)."""

    policy: str
    budget_bits: int
    model: dict
    layers: tuple[LayerPlan, ...]
    evidence: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"kv plan: unknown policy {self.policy!r} (choose from {', '.join(POLICIES)})")
        check_bits(self.budget_bits)
        if not isinstance(self.model, dict) or not isinstance(self.model.get("kv_heads"), list):
            raise ConfigError(f"kv plan: model must be a dict with a 'kv_heads' list (model_shape), got {self.model!r:.60}")
        if not isinstance(self.layers, tuple) or not all(isinstance(layer, LayerPlan) for layer in self.layers):
            raise ConfigError("kv plan: layers must be a tuple of LayerPlan")
        if len(self.layers) != self.model.get("layers"):
            raise ConfigError(f"kv plan: {len(self.layers)} layer entries for a model of {self.model.get('layers')} layers")
        for index, (layer, heads) in enumerate(zip(self.layers, self.model["kv_heads"])):
            if len(layer.kv_bits) != heads:
                raise ConfigError(f"kv plan: layer {index} gives bits for {len(layer.kv_bits)} KV heads, the model has {heads}")
            for bits in layer.kv_bits:
                check_bits(bits)
            if any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= MAX_POSITION for p in layer.keep_positions):
                raise ConfigError(f"kv plan: layer {index}: kept positions must be integers from 0 to {MAX_POSITION}")
        check_budget(self.policy, self.budget_bits, self.layers)

    def expected_bits(self, seq_len: int) -> float:
        """Average bits per cached element of one sequence of `seq_len` tokens (kept positions at 16)."""
        total = heads = 0
        for layer in self.layers:
            kept = sum(1 for p in set(layer.keep_positions) if p < seq_len)
            total += sum(kept * FULL_BITS + (seq_len - kept) * b for b in layer.kv_bits)
            heads += len(layer.kv_bits)
        return total / (heads * seq_len)

    def record(self) -> dict:
        """What a sweep cell records of the plan (the per-head bits stay in the plan file)."""
        kept = sorted({p for layer in self.layers for p in layer.keep_positions})
        bits = [b for layer in self.layers for b in layer.kv_bits]
        return {"policy": self.policy, "budget_bits": self.budget_bits, "keep_positions": kept,
                "head_bits": {str(b): bits.count(b) for b in sorted(set(bits))}}

    def to_dict(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "version": PLAN_VERSION,
            "policy": self.policy,
            "budget_bits": self.budget_bits,
            "quantizer": dict(QUANTIZER),
            "model": self.model,
            "layers": [{"layer": i, "kv_bits": list(l.kv_bits), "keep_positions": list(l.keep_positions)} for i, l in enumerate(self.layers)],
            "evidence": self.evidence,
        }

    @classmethod
    def from_dict(cls, data: object) -> KVPlan:
        """A plan document, checked against its schema as a whole first (`kv_plan_schema`)."""
        check_plan_document(data)
        model = data["model"]
        layers = tuple(LayerPlan(tuple(int(b) for b in l["kv_bits"]), tuple(int(p) for p in l.get("keep_positions", ()))) for l in data["layers"])
        return cls(data["policy"], int(data["budget_bits"]), model, layers, data["evidence"])

    @classmethod
    def load(cls, path: str | Path) -> KVPlan:
        return cls.from_dict(read_plan_json(path))


def check_budget(policy: str, budget_bits: int, layers: tuple[LayerPlan, ...]) -> None:
    """ConfigError unless the layers keep the budget as `derive_plan` makes plans, since a cell is labelled with the
    budget (docs/reliability.md, "A plan's budget"): the average of the per-head bits over every (layer, KV head)
    is exactly `budget_bits`; `uniform`, `first` and `massive` hold every head at it (only `heads` reallocates
    bits); `uniform` keeps no position, `first` the first N positions in every layer. Kept positions are the
    plan's cost over its budget, listed in the cell's record and measured per run (`measured_bits`)."""
    bits = [b for layer in layers for b in layer.kv_bits]
    if sum(bits) != budget_bits * len(bits):
        raise ConfigError(f"kv plan: its KV heads average {sum(bits) / len(bits):.3g} bits, not its budget_bits {budget_bits}: a cell would be labelled with bits it did not run")
    if policy != "heads" and set(bits) != {budget_bits}:
        raise ConfigError(f"kv plan: policy {policy} holds every KV head at its budget of {budget_bits} bits, this plan has heads at {sorted(set(bits) - {budget_bits})}")
    kept = [tuple(sorted(set(layer.keep_positions))) for layer in layers]
    if policy == "uniform" and any(kept):
        raise ConfigError(f"kv plan: policy uniform keeps no position at 16 bits, this plan keeps {next(k for k in kept if k)[:8]}")
    if policy == "first" and any(k != tuple(range(len(kept[0]))) for k in kept):
        raise ConfigError("kv plan: policy first keeps the same first positions 0 … N−1 in every layer")


def model_shape(config) -> dict:
    """The shape a plan is checked against, from a model's config: kind, layers, KV heads per layer, query heads
    (DiffLlama and DIFF V2: all the maps' heads attention computes) and head width."""
    config = getattr(config, "config", config)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"kind": structure.attention_kind(config), "layers": layers, "kv_heads": [kv] * layers, "query_heads": heads, "head_dim": head_dim}


def check_plan_fits(plan: KVPlan, config, label: str) -> None:
    """ConfigError in one line when the plan was derived for another shape of model (`config`: the model's)."""
    have = model_shape(config)
    for key in ("kind", "layers", "kv_heads", "query_heads", "head_dim"):
        if plan.model.get(key) != have[key]:
            raise ConfigError(f"kv plan is for a {_shape_text(plan.model)} model, not {label} ({_shape_text(have)}): {key} differs")


def _shape_text(shape: dict) -> str:
    kv = shape.get("kv_heads") or []
    kv_text = str(kv[0]) if kv and len(set(kv)) == 1 else str(kv)
    return f"{shape.get('kind')}, {shape.get('layers')}-layer, {shape.get('query_heads')}-query-head, {kv_text}-KV-head, head width {shape.get('head_dim')}"


# ---- the quantizer ------------------------------------------------------------------------------------------


class PlanKVQuantizer:
    """One layer's cache quantizer under a plan (`attention.backend.KVQuantizer` protocol).

    Keys per channel and values per token (KIVI), each KV head at its own bits; kept positions (IntactKV) pass
    through untouched and do not enter the keys' scales. `keys` runs first in every attention call and leaves
    the positions it kept for `values`; DiffLlama's second call of a layer reads values only (the backend reuses
    the quantized keys), and `values` counts the calls to know which half of the cache heads it holds.
    Counts the (position, KV head) pairs it quantized and their bits, for `measured_bits`."""

    def __init__(self, layer: LayerPlan, halves: bool, causal: bool = True, group_size: int | None = None, layout: KVLayout | None = None) -> None:
        self.causal = causal  # each row (token, KV head) on its own scale, as the `token` layout writes it; else KIVI's
        self.group_size = group_size
        self.layout = layout  # a cache layout (`quant.kv_layout`): the cache's own quantizers, kept positions out of key scales
        self.bits = layer.kv_bits
        self.keep = torch.tensor(sorted(set(layer.keep_positions)), dtype=torch.long)
        self.halves = halves
        self.bit_sum = 0.0
        self.position_heads = 0
        self._kept: torch.Tensor | None = None
        self._value_calls = 0

    def _check_heads(self, heads: int, what: str) -> None:
        if heads != len(self.bits):
            raise ConfigError(f"kv plan: attention reads {what} of {heads} KV heads, the plan gives bits for {len(self.bits)}")

    def _kept_positions(self, length: int, device: torch.device) -> torch.Tensor | None:
        """(1, 1, S, 1) bool: the kept positions among the first `length`; None when the plan keeps none."""
        if not self.keep.numel():
            return None
        positions = torch.arange(length, device=device)
        return torch.isin(positions, self.keep.to(device)).view(1, 1, length, 1)

    def keys(self, key: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """key (B, Hkv, S, D); valid (B, 1, S, 1) bool or None: the positions the cache holds."""
        batch, heads, length, _ = key.shape
        self._check_heads(heads, "keys")
        kept = self._kept_positions(length, key.device)
        quantized = valid if kept is None else kept.logical_not() if valid is None else valid & ~kept
        if self.layout is not None:
            flags = None if kept is None else kept.view(length)
            out = _by_bits(key, self.bits, lambda x, b: fake_quantize(x, b, self.layout, keys=True, kept=flags))
        elif self.causal:
            out = _by_bits(key, self.bits, lambda x, b: rowwise_absmax_quantize(x, b, self.group_size).dequant)
        else:
            out = _by_bits(key, self.bits, lambda x, b: fake_quantize_with_absmax(x, absmax(x, PerColumn(), mask=quantized, batch_dims=2), b))
        held = torch.ones(batch, length, dtype=torch.bool, device=key.device) if valid is None else valid.view(batch, length)
        rows = int(held.sum())
        rows_kept = 0 if kept is None else int((held & kept.view(1, length)).sum())
        self.bit_sum += float(sum(rows_kept * FULL_BITS + (rows - rows_kept) * b for b in self.bits))
        self.position_heads += rows * heads
        self._kept, self._value_calls = kept, 0
        return out if kept is None else torch.where(kept, key, out)

    def values(self, value: torch.Tensor) -> torch.Tensor:
        """value (B, Hkv, S, Dv); for DiffLlama one half of the cache heads, repeated twice, per call."""
        heads, length = value.shape[1], value.shape[2]
        self._check_heads(heads, "values")
        bits = self.bits
        if self.halves:
            half = heads // 2
            bits = tuple(self.bits[j % half + self._value_calls * half] for j in range(heads))
            self._value_calls += 1
        kept = self._kept if self._kept is not None and self._kept.shape[2] == length else self._kept_positions(length, value.device)
        if self.layout is not None:
            out = _by_bits(value, bits, lambda x, b: fake_quantize(x, b, self.layout, keys=False))
        elif self.causal:
            out = _by_bits(value, bits, lambda x, b: rowwise_absmax_quantize(x, b, self.group_size).dequant)
        else:
            out = _by_bits(value, bits, lambda x, b: fake_quantize_with_absmax(x, absmax(x, PerRow()), b))
        return out if kept is None else torch.where(kept, value, out)


def _by_bits(x: torch.Tensor, bits: tuple[int, ...], quantize) -> torch.Tensor:
    """x (B, H, S, D) with the heads of each width below 16 quantized together by quantize(x[:, heads], width)."""
    if len(set(bits)) == 1:
        return x if bits[0] == FULL_BITS else quantize(x, bits[0])
    out = x.clone()
    for width in sorted(set(bits) - {FULL_BITS}):
        index = torch.tensor([h for h, b in enumerate(bits) if b == width], device=x.device)
        out[:, index] = quantize(x.index_select(1, index), width)
    return out


def plan_quantizers(model: nn.Module, plan: KVPlan, causal: bool = True, group_size: int | None = None,
                    layout: KVLayout | None = None) -> list[PlanKVQuantizer]:
    """One quantizer per attention tap, in layer order; the plan checked against the model first. `causal`: rows
    (token, KV head) quantized on their own (the default), else KIVI over the sequence (granularity tensor);
    `layout`: a cache layout's own quantizers instead (`quant.kv_layout`)."""
    check_plan_fits(plan, model.config, structure.model_label(model))
    taps = attention.taps(model)
    if len(taps) != len(plan.layers):
        raise ConfigError(f"kv plan: {structure.model_label(model)} has attention in {len(taps)} layers, the plan covers {len(plan.layers)}")
    return [PlanKVQuantizer(layer, tap.pairing == "halves", causal, group_size, layout) for tap, layer in zip(taps, plan.layers)]


def measured_bits(model: nn.Module) -> float | None:
    """Average bits per cached element over everything the plan's quantizers have quantized (None: nothing yet)."""
    quantizers = [tap.kv_quantizer for tap in attention.taps(model) if isinstance(tap.kv_quantizer, PlanKVQuantizer)]
    held = sum(q.position_heads for q in quantizers)
    return None if not held else sum(q.bit_sum for q in quantizers) / held


# ---- calibration: sink masses and massive-activation positions ----------------------------------------------


@dataclass
class KVCalibration:
    """What the statistics say on calibration data: the model's shape, the first-position attention mass per
    (layer, query head), and per position the share of calibration sequences in which it carried a massive
    activation: in at least one decoder layer's output, an entry above max(100, 1000 × that layer's median |h|)
    (Sun et al.'s criterion) and above TOKEN_RATIO × the layer's median over tokens of their largest |h|. The
    second condition keeps what Sun et al. describe, a few tokens, apart from outlier channels that every token
    carries (Gemma 3's hidden states pass the first condition at nearly every token)."""

    shape: dict
    sink_mass: list[list[float]]
    massive_share: dict[int, float]
    record: dict


def calibrate_kv(model: nn.Module, tokenizer, calibration, bos_id: int | None = None, batch_size: int = 4) -> KVCalibration:
    """One pass of the statistics engine (`stats.collect.StatsCollector`: sink masses, hidden-state medians) over
    `calibration` (`quant.smoothing.Calibration`: data no task evaluates), with the largest |h| over channels kept
    per (sequence, position, layer) to locate the massive activations afterwards."""
    from quantdiff.attention.observe import observe
    from quantdiff.data.sources import BUILTINS, file_sha256, load_sequences, make_batches
    from quantdiff.stats.collect import StatsCollector
    from quantdiff.stats.massive import MIN_MAGNITUDE, MIN_RATIO
    from quantdiff.stats.nonfinite import in_stats, refuse_nonfinite

    config = model.config
    seq_len = calibration.length(config)
    tokenize = None if tokenizer is None else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    sequences = load_sequences(calibration.source, tokenize, calibration.tokens, seq_len, config.vocab_size, bos_id, tokenizer)
    batches = make_batches(sequences, batch_size, getattr(config, "pad_token_id", None) or 0)
    collector = StatsCollector(model, k=1, compile=False)
    peaks: list[list[torch.Tensor]] = []  # per batch, per layer: (B, T) max |h| over channels

    def on_hidden(layer: int, hidden: torch.Tensor) -> None:
        collector.on_hidden(layer, hidden)
        peaks[-1].append(hidden.detach().abs().amax(dim=-1).float().cpu())

    with observe(model, collector.on_logits, on_hidden, on_lambda=collector.sinks.on_lambda), torch.inference_mode():
        for batch in batches:
            peaks.append([])
            collector.run(model, batch)
    refuse_nonfinite(structure.model_label(model), in_stats(collector.stats), "a kv plan (sink masses, massive positions)")
    medians = [collector.stats.hidden.pooled([l]).summary((0.5,))["median"] for l in range(collector.stats.layers)]
    token_peaks = torch.cat([torch.stack(per_layer, dim=-1)[_real(batch)] for batch, per_layer in zip(batches, peaks)])  # (tokens, layers)
    typical = token_peaks.median(dim=0).values
    thresholds = torch.tensor([max(MIN_MAGNITUDE, MIN_RATIO * (m or 0.0), TOKEN_RATIO * float(t)) for m, t in zip(medians, typical)])
    seen = torch.zeros(seq_len, dtype=torch.long)
    flagged = torch.zeros(seq_len, dtype=torch.long)
    for batch, per_layer in zip(batches, peaks):
        real = _real(batch)
        above = (torch.stack(per_layer, dim=-1) > thresholds).any(dim=-1) & real  # (B, T)
        width = real.shape[1]
        seen[:width] += real.sum(dim=0)
        flagged[:width] += above.sum(dim=0)
    share = {p: flagged[p].item() / seen[p].item() for p in range(seq_len) if flagged[p] > 0}
    summary = collector.sinks.summary()
    digest = {} if calibration.source in BUILTINS else {"sha256": file_sha256(calibration.source, "--calibration")}  # provenance by content
    record = {**calibration.to_dict(), **digest, "tokens": sum(map(len, sequences)), "sequences": len(sequences), "seq_len": seq_len, "bos_id": bos_id,
              "layer_thresholds": thresholds.tolist()}
    return KVCalibration(model_shape(config), summary["per_head"], share, record)


def _real(batch) -> torch.Tensor:
    """(B, T) bool: the batch's real tokens (not padding)."""
    return torch.ones_like(batch.input_ids, dtype=torch.bool) if batch.attention_mask is None else batch.attention_mask.bool()


# ---- policies -----------------------------------------------------------------------------------------------


def kv_head_scores(calibrated: KVCalibration) -> list[list[float]]:
    """Per (layer, KV head): the largest first-position mass among the query heads reading its keys."""
    shape = calibrated.shape
    out = []
    for layer, masses in enumerate(calibrated.sink_mass):
        kv = shape["kv_heads"][layer]
        group = len(masses) // kv
        out.append([max(masses[g * group : (g + 1) * group]) for g in range(kv)])
    return out


def derive_plan(calibrated: KVCalibration, policy: str, bits: int, keep_first: int = 1, step: int = 1) -> KVPlan:
    """The plan of `policy` at a budget of `bits` (module docstring); ConfigError when it cannot be met."""
    check_bits(bits)
    if policy not in POLICIES:
        raise ConfigError(f"unknown KV policy {policy!r} (choose from {', '.join(POLICIES)})")
    shape = calibrated.shape
    scores = kv_head_scores(calibrated)
    head_bits = [[bits] * kv for kv in shape["kv_heads"]]
    keep: tuple[int, ...] = ()
    evidence: dict = {"calibration": calibrated.record, "kv_head_sink_mass": scores, "sink_epsilon": SINK_EPSILON}
    if policy == "first":
        if isinstance(keep_first, bool) or not isinstance(keep_first, int) or keep_first < 1:
            raise ConfigError(f"--keep-first must be a positive number of positions, got {keep_first!r}")
        keep = tuple(range(keep_first))
    elif policy == "massive":
        keep = tuple(p for p, s in sorted(calibrated.massive_share.items()) if s >= MASSIVE_SHARE)
        evidence["massive_share"] = {str(p): s for p, s in sorted(calibrated.massive_share.items())}
        evidence["massive_min_share"] = MASSIVE_SHARE
    elif policy == "heads":
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"--step must be a positive number of bits, got {step!r}")
        if bits + step > FULL_BITS or bits - step < 2:
            raise ConfigError(f"per-head bits at an average of {bits} with step {step} need heads at {bits - step} and {bits + step} bits: outside 2–16")
        ranked = sorted(((s, l, h) for l, row in enumerate(scores) for h, s in enumerate(row)), key=lambda t: (-t[0], t[1], t[2]))
        sinks = sum(1 for s, _, _ in ranked if s > SINK_EPSILON)
        moved = min(sinks, len(ranked) - sinks)
        for _, l, h in ranked[:moved]:
            head_bits[l][h] = bits + step
        for _, l, h in ranked[len(ranked) - moved :]:
            head_bits[l][h] = bits - step
        evidence["sink_kv_heads"] = sinks
        evidence["heads_moved"] = moved
    layers = tuple(LayerPlan(tuple(row), keep) for row in head_bits)
    return KVPlan(policy, bits, shape, layers, evidence)


def plan_file_name(policy: str, bits: int) -> str:
    return f"{policy}-{bits}bit.json"

