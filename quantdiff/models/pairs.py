"""Matched standard/differential models built from one size preset.

transformers' DiffLlama with the *same* config as a Llama has the same parameter count plus the four
λ vectors per layer: its `num_attention_heads = H` projections are paired (head i with head i + H/2)
into H/2 differential heads whose value width is doubled — exactly the paper's "half the heads" rule.

DIFF V2 (kind "diffv2") keeps every size of the baseline, as the authors' reference module does when it switches
between the baseline and V2 (the same d_model, heads, KV heads and head width): H output heads of the baseline's
width d = D/H, 2H query heads, the baseline's KV heads and W_O. Built so, it is *not* parameter-matched: per layer
it has D·H·d = D² more query weights and D·H λ weights, and per token 2·(D² + D·H) more projection FLOPs plus the
QKᵀ and AV products of H more query heads. The V2 authors' blog says Q2's parameters are "borrowed from other parts
of the model" and that V2 is compared with a Transformer of equal budget, so `budget_matched` gives that model
too: the same attention, its SwiGLU MLP narrowed by (D² + D·H) / 3D so that the count equals the baseline's.

The gated kind (models/gated.py) is the standard model plus a head-wise output gate, D·H weights per layer; the
sink kind (models/sink.py) the standard model plus one sink logit per head, H per layer. Both keep every size of
the baseline, so their counts exceed the standard model's by exactly those parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from quantdiff.core.errors import ConfigError
from quantdiff.models.diffv2 import DiffV2Config, DiffV2ForCausalLM
from quantdiff.models.gated import GatedConfig, GatedForCausalLM
from quantdiff.models.init import LEGACY_INIT, check_init, fold, initialise
from quantdiff.models.sink import SinkConfig, SinkForCausalLM
from quantdiff.core.memory import check_fits

KINDS = ("standard", "diff")  # the pair that training, the built-in models and reproduce use
EXTRA_KINDS = ("diffv2", "gated", "sink")  # quantdiff's own model types: `pair --diffv2/--gated/--sink`, recipe arms
ALL_KINDS = (*KINDS, *EXTRA_KINDS)
ModelConfig = LlamaConfig | DiffLlamaConfig | DiffV2Config | GatedConfig | SinkConfig
_MODEL_CLASSES = {
    LlamaConfig: LlamaForCausalLM, DiffLlamaConfig: DiffLlamaForCausalLM, DiffV2Config: DiffV2ForCausalLM,
    GatedConfig: GatedForCausalLM, SinkConfig: SinkForCausalLM,
}
# Names of the parameters a kind adds to softmax attention (DiffLlama's λ vectors, DIFF V2's W_λ, the gated kind's
# output gate, the sink kind's — and GPT-OSS's — sink logits): a dotted name part starting with one of these.
ADDED_PARAMETER_PREFIXES = ("lambda_", "output_gate_proj", "sinks")


@dataclass(frozen=True)
class SizePreset:
    """One size for both kinds. `num_heads` counts the baseline's heads; Diff gets num_heads / 2 pairs."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None = num_heads (no grouped-query attention)
    intermediate_size: int | None = None  # None = SwiGLU's usual 8/3 · hidden, rounded up to 32
    vocab_size: int = 512
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        kv = self.num_kv_heads or self.num_heads
        if self.hidden_size <= 0 or self.num_layers <= 0 or self.num_heads <= 0 or self.vocab_size <= 0:
            raise ConfigError("model sizes must be positive")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")
        if self.num_heads % 2:
            raise ConfigError(f"num_heads={self.num_heads} is odd: Diff pairs heads, so it must be even")
        if self.num_heads % kv:
            raise ConfigError(f"num_kv_heads={kv} does not divide num_heads={self.num_heads}")
        if kv % 2:
            raise ConfigError(f"num_kv_heads={kv} is odd: DiffLlama splits V across KV heads, so it must be even")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError("head dimension must be even for rotary embeddings")

    def parameter_estimate(self) -> int:
        """Parameters of the standard model from the sizes alone (Diff adds a few λ vectors): embeddings, output
        layer unless tied, and per layer the attention projections, the SwiGLU MLP and two norms."""
        head_dim = self.hidden_size // self.num_heads
        kv_width = (self.num_kv_heads or self.num_heads) * head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv_width
        layer = attention + 3 * self.hidden_size * self.intermediate + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + self.hidden_size

    def check_memory(self, copies: int, what: str, models: int = len(KINDS)) -> None:
        """Refuse, before building anything, sizes whose `copies` float32 copies of `models` models cannot fit."""
        check_fits(models * copies * 4 * self.parameter_estimate(), what)

    @property
    def intermediate(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 32) * 32


def _common_kwargs(preset: SizePreset) -> dict:
    return dict(
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads or preset.num_heads,
        intermediate_size=preset.intermediate,
        vocab_size=preset.vocab_size,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=preset.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        rms_norm_eps=1e-5,
    )


def kind_configs(preset: SizePreset, kinds: tuple[str, ...] = KINDS) -> dict[str, ModelConfig]:
    """{kind: config} for the given kinds ('standard': Llama, 'diff': DiffLlama, 'diffv2': DIFF V2, 'gated': gated
    attention, 'sink': learned sink logits), one size."""
    preset.validate()
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise ConfigError(f"unknown model kind(s): {', '.join(unknown)} (known: {', '.join(ALL_KINDS)})")
    kwargs = _common_kwargs(preset)
    build = {
        "standard": lambda: LlamaConfig(**kwargs),
        "diff": lambda: DiffLlamaConfig(lambda_std_dev=0.1, **kwargs),
        # 2H query heads of the baseline's width; KV heads, W_O and MLP as the baseline's
        "diffv2": lambda: DiffV2Config(**{**kwargs, "num_attention_heads": 2 * preset.num_heads, "head_dim": preset.hidden_size // preset.num_heads}),
        "gated": lambda: GatedConfig(**kwargs),
        "sink": lambda: SinkConfig(**kwargs),
    }
    return {kind: build[kind]() for kind in kinds}


def budget_matched(config: DiffV2Config, preset: SizePreset) -> DiffV2Config:
    """`config` (a DIFF V2 config of `preset`) with its MLP narrowed so that the model has the standard model's
    parameter count: Q2 and W_λ add D·H·d + D·H weights per layer, a SwiGLU unit costs 3·D, so the intermediate
    width drops by (D·H·d + D·H) / 3D, rounded (within 1.5·D weights per layer of an exact match)."""
    width = preset.hidden_size
    added = width * preset.num_heads * (width // preset.num_heads) + width * preset.num_heads  # Q2, then W_λ
    narrower = preset.intermediate - round(added / (3 * width))
    if narrower < 1:
        raise ConfigError(f"a budget-matched DIFF V2 of hidden_size {width} has no MLP left: its Q2 and λ take {added:,} of the layer's weights")
    matched = copy.deepcopy(config)
    matched.intermediate_size = narrower
    return matched


def pair_configs(preset: SizePreset) -> dict[str, LlamaConfig | DiffLlamaConfig]:
    """{'standard': LlamaConfig, 'diff': DiffLlamaConfig} with identical sizes."""
    return kind_configs(preset, KINDS)


SEEDS = range(2**64)  # torch.manual_seed's unsigned range


def check_seed(seed: int, what: str = "seed") -> None:
    if seed not in SEEDS:
        raise ConfigError(f"{what} must be in 0..2**64 - 1, got {seed}")


def build_model(config: ModelConfig, seed: int = 0, attn_implementation: str = "sdpa", init: str = LEGACY_INIT,
                reparametrised: bool = False) -> PreTrainedModel:
    """A freshly initialised model; `config` is deep-copied because `_from_config` mutates it.

    `init` (models.init): "transformers" (the default here, so throwaway models stay as they were) or "authors" (what
    recipes and `quantdiff pair` default to). Under "authors" the √D embedding multiplier and Diff V1's norm gain
    are parametrisations while `reparametrised` (the form training steps), else folded into the weights: a plain
    model. A kind whose attention SDPA cannot compute (the sink kind: SDPA would drop its sink logits) is built on
    eager attention when SDPA is asked for: the same model, computed exactly."""
    check_init(init, "init", tied=config.tie_word_embeddings)
    cls = _MODEL_CLASSES[type(config)]
    if attn_implementation == "sdpa" and not cls._supports_sdpa:
        attn_implementation = "eager"
    torch.manual_seed(seed)
    model = initialise(cls._from_config(copy.deepcopy(config), attn_implementation=attn_implementation), init)
    return model if reparametrised else fold(model)


def build_pair(preset: SizePreset, seed: int = 0, attn_implementation: str = "sdpa", kinds: tuple[str, ...] = KINDS,
               init: str = LEGACY_INIT) -> dict[str, PreTrainedModel]:
    """The kinds (by default the standard/Diff pair), each initialised from the same seed by `init`, as plain models."""
    configs = kind_configs(preset, kinds)  # validates the sizes
    check_seed(seed)
    preset.check_memory(1, f"{len(configs)} models of {preset.parameter_estimate():,} parameters", models=len(configs))
    return {kind: build_model(cfg, seed, attn_implementation, init) for kind, cfg in configs.items()}


def lambda_parameter_count(model: PreTrainedModel) -> int:
    """Parameters of λ: DiffLlama's four vectors per layer, DIFF V2's projection W_λ."""
    return sum(p.numel() for n, p in model.named_parameters() if any(part.startswith("lambda_") for part in n.split(".")))


def added_parameter_count(model: PreTrainedModel) -> int:
    """Parameters a kind adds to softmax attention: λ (DiffLlama, DIFF V2's W_λ), the gated kind's output gate, sink
    logits (the sink kind, GPT-OSS); 0 for standard attention. (DIFF V2's second query heads live in q_proj.)"""
    return sum(p.numel() for n, p in model.named_parameters() if any(part.startswith(ADDED_PARAMETER_PREFIXES) for part in n.split(".")))


def parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def preset_from_dict(data: dict) -> SizePreset:
    known = set(SizePreset.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown model key(s): {', '.join(unknown)}")
    return SizePreset(**data)
