"""LLaMA with another attention module: the scaffolding quantdiff's own model kinds share (DIFF V2, gated, sink).

Each kind keeps LLaMA's pre-norm decoder layer (RMSNorm, SwiGLU MLP), embeddings, rotary embedding, LM head and
their forwards, and swaps in its own attention class, a `VariantAttention`: LLaMA's attention forward (projections,
RoPE, KV cache, the call through transformers' attention registry) with hooks for what the kind changes.
`VariantDecoderLayer`, `VariantModel` and `VariantForCausalLM` are LLaMA's classes with the swapped-in class named
by a class attribute; `declare_kind` declares them for a kind and registers it with the Auto classes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


class VariantAttention(LlamaAttention):
    """LLaMA's attention forward with the kinds' two hooks: extra arguments for the attention function
    (`attention_arguments`) and what happens to the heads' outputs (B, T, Hq, d) before W_O (`combine_heads`).
    `eager` is the attention function attn_implementation="eager" runs (LLaMA's, unless a kind needs another)."""

    eager: Callable = staticmethod(eager_attention_forward)

    def attention_arguments(self) -> dict:
        return {}

    def combine_heads(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager)
        dropout = 0.0 if not self.training else self.attention_dropout
        out, weights = interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **self.attention_arguments(), **kwargs)
        out = self.combine_heads(out, hidden_states)  # (B, T, H, d)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


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


def declare_kind(module: str, name: str, model_type: str, config_class: type, attention_class: type, base: type = LlamaPreTrainedModel) -> tuple[type, ...]:
    """The classes of one kind — `<name>DecoderLayer`, `<name>PreTrainedModel` (on `base`), `<name>Model` and
    `<name>ForCausalLM`, declared in `module` — with `model_type` registered with transformers' Auto classes
    (AutoConfig, AutoModel, AutoModelForCausalLM; idempotent). Returned in that order."""

    def declare(suffix: str, bases: tuple[type, ...], doc: str, **attributes) -> type:
        return type(f"{name}{suffix}", bases, {"__module__": module, "__doc__": doc, **attributes})

    layer = declare("DecoderLayer", (VariantDecoderLayer,), f"LLaMA's pre-norm decoder layer with {attention_class.__name__}.", attention_class=attention_class)
    pretrained = declare(
        "PreTrainedModel", (base,), f"The {model_type} base: config class, decoder layers and attention modules declared.",
        config_class=config_class, _no_split_modules=[layer.__name__], _can_record_outputs={"hidden_states": layer, "attentions": attention_class},
    )  # fmt: skip
    model = declare("Model", (pretrained, VariantModel), f"LLaMA's decoder stack (its forward) over {layer.__name__}s.", decoder_layer_class=layer)
    causal_lm = declare("ForCausalLM", (pretrained, VariantForCausalLM), f"LLaMA's causal-LM head over a {model.__name__}.", model_class=model)
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm, exist_ok=True)
    return layer, pretrained, model, causal_lm
