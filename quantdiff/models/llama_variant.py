"""LLaMA with another attention module: the scaffolding quantdiff's own model kinds share (DIFF V2, gated, sink).

Each kind keeps LLaMA's pre-norm decoder layer (RMSNorm, SwiGLU MLP), embeddings, rotary embedding, LM head and
their forwards, and swaps in its own attention class. `VariantDecoderLayer`, `VariantModel` and
`VariantForCausalLM` are LLaMA's classes with the swapped-in class named by a class attribute; `project_qkv` and
`attend` are the two halves of LLaMA's attention forward the kinds keep (projections with RoPE and the KV
cache, then the call through transformers' attention registry), so each kind writes only what it changes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def project_qkv(
    attn: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], past_key_values: Cache | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query (B, Hq, T, d), key, value (B, Hkv, S, d)) as LLaMA computes them: projections, RoPE, the KV cache."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    query = attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = attn.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attn.layer_idx)
    return query, key, value


def attend(attn: nn.Module, query, key, value, attention_mask, eager: Callable, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output (B, T, Hq, d), weights or None) through the registry's function for the model's attention
    implementation; `eager` is what attn_implementation="eager" runs."""
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    dropout = 0.0 if not attn.training else attn.attention_dropout
    return interface(attn, query, key, value, attention_mask, dropout=dropout, scaling=attn.scaling, **kwargs)


class VariantDecoderLayer(LlamaDecoderLayer):
    """LLaMA's pre-norm decoder layer (its forward) with `attention_class` as self-attention."""

    attention_class: type[nn.Module]

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class _RegistryAttention:
    """transformers allows `set_attn_implementation` only where it finds, in the class's module source, an attention
    class calling its registry; the kinds call it through `attend`, on every forward."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True


class VariantModel(_RegistryAttention, LlamaModel):
    """LLaMA's decoder stack (its forward) over `decoder_layer_class` layers."""

    decoder_layer_class: type[nn.Module]

    def __init__(self, config: LlamaConfig) -> None:
        LlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class VariantForCausalLM(_RegistryAttention, LlamaForCausalLM):
    """LLaMA's causal-LM head (its forward, generation and tied-weight rules) over a `model_class` model."""

    model_class: type[nn.Module]

    def __init__(self, config: LlamaConfig) -> None:
        LlamaPreTrainedModel.__init__(self, config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def register_kind(model_type: str, config_class: type, model_class: type, causal_lm_class: type) -> None:
    """Make `model_type` loadable through AutoConfig / AutoModel / AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
