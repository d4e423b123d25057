"""LLaMA with another attention module: the scaffolding quantdiff's own model kinds share (DIFF V2, gated, sink).

Each kind keeps LLaMA's pre-norm decoder layer (RMSNorm, SwiGLU MLP), embeddings, rotary embedding, LM head and
their forwards, and swaps in its own attention class, a `VariantAttention`: LLaMA's attention forward itself
(projections, RoPE, KV cache, the call through transformers' attention registry) with what the kind changes put
where it acts: the attention function's arguments, or the heads' outputs before W_O.
`VariantDecoderLayer`, `VariantModel` and `VariantForCausalLM` are LLaMA's classes with the swapped-in class named
by a class attribute; `declare_kind` declares them for a kind and registers it with the Auto classes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)


class VariantAttention(LlamaAttention):
    """LLaMA's attention run by LLaMA's own forward — the installed transformers' forward, with whatever arguments
    it takes today — and the kind's change put where it acts:
    - `attention_arguments()`: keyword arguments for the attention function (LLaMA's forward passes its `**kwargs`
      on to it), e.g. the sink kind's `s_aux`;
    - `combine_heads(out, hidden_states)`: what W_O reads, from the heads' outputs (B, T, H, d) and the attention
      input, or None for none. It runs as o_proj's first input hook for the duration of one call: before any
      quantizer's input hook, and whatever module sits at o_proj (a bitsandbytes layer after a quantized load).
    Not copying the forward is the point: a release that renames or adds an argument (5.24's `cache`) reaches
    LLaMA's forward, which knows it, instead of a copy that does not."""

    combine_heads: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def attention_arguments(self) -> dict:
        return {}

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        arguments = self.attention_arguments()
        clash = sorted(arguments.keys() & kwargs.keys())
        if clash:  # a future release passing one of the kind's own arguments must not be overridden silently
            raise TypeError(f"{type(self).__name__}: transformers now passes {clash} itself, which the kind sets")
        if self.combine_heads is None:
            return super().forward(hidden_states, *args, **kwargs, **arguments)
        handle = self.o_proj.register_forward_pre_hook(self._combining_hook(hidden_states), prepend=True)
        try:
            return super().forward(hidden_states, *args, **kwargs, **arguments)
        finally:
            handle.remove()

    def _combining_hook(self, hidden_states: torch.Tensor) -> Callable:
        def combine(_module: nn.Module, inputs: tuple) -> tuple:
            heads = inputs[0].view(*hidden_states.shape[:-1], -1, self.head_dim)  # (B, T, H, d), as attention returned
            combined = self.combine_heads(heads, hidden_states)
            return (combined.reshape(*hidden_states.shape[:-1], -1).contiguous(), *inputs[1:])

        return combine


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
