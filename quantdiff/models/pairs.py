"""Matched standard/differential model pairs built from one size preset.

transformers' DiffLlama with the *same* config as a Llama has the same parameter count plus the four
λ vectors per layer: its `num_attention_heads = H` projections are paired (head i with head i + H/2)
into H/2 differential heads whose value width is doubled — exactly the paper's "half the heads" rule.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from quantdiff.core.errors import ConfigError
from quantdiff.core.memory import check_fits

KINDS = ("standard", "diff")


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

    def check_memory(self, copies: int, what: str) -> None:
        """Refuse, before building anything, sizes whose `copies` float32 copies of both models cannot fit."""
        check_fits(len(KINDS) * copies * 4 * self.parameter_estimate(), what)

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


def pair_configs(preset: SizePreset) -> dict[str, LlamaConfig | DiffLlamaConfig]:
    """{'standard': LlamaConfig, 'diff': DiffLlamaConfig} with identical sizes."""
    preset.validate()
    kwargs = _common_kwargs(preset)
    return {"standard": LlamaConfig(**kwargs), "diff": DiffLlamaConfig(lambda_std_dev=0.1, **kwargs)}


SEEDS = range(2**64)  # torch.manual_seed's unsigned range


def check_seed(seed: int, what: str = "seed") -> None:
    if seed not in SEEDS:
        raise ConfigError(f"{what} must be in 0..2**64 - 1, got {seed}")


def build_model(config: LlamaConfig | DiffLlamaConfig, seed: int = 0, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A freshly initialised model; `config` is deep-copied because `_from_config` mutates it."""
    cls = DiffLlamaForCausalLM if isinstance(config, DiffLlamaConfig) else LlamaForCausalLM
    torch.manual_seed(seed)
    return cls._from_config(copy.deepcopy(config), attn_implementation=attn_implementation)


def build_pair(preset: SizePreset, seed: int = 0, attn_implementation: str = "sdpa") -> dict[str, PreTrainedModel]:
    """Both kinds, each initialised from the same seed."""
    configs = pair_configs(preset)  # validates the sizes
    check_seed(seed)
    preset.check_memory(1, f"a pair of {preset.parameter_estimate():,}-parameter models")
    return {kind: build_model(cfg, seed, attn_implementation) for kind, cfg in configs.items()}


def lambda_parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("lambda_"))


def parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def preset_from_dict(data: dict) -> SizePreset:
    known = set(SizePreset.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown model key(s): {', '.join(unknown)}")
    return SizePreset(**data)
