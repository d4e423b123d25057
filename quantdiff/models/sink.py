"""LLaMA with a learned attention-sink logit per head, as a transformers model (model type "quantdiff_sink").

Source: GPT-OSS as transformers implements it, `models/gpt_oss/modeling_gpt_oss.py`: `GptOssAttention` holds one
parameter `sinks` per head and passes it to the attention function as `s_aux`; `eager_attention_forward` there
appends it as one more logit column of every row before softmax and drops that column afterwards. With h heads of
width d, x the attention input and s_i head i's sink logit:

    ℓ_{t,j} = Q_{t,i} · K_{j,g(i)} / √d                         (LLaMA's logits: RoPE, GQA, causal j ≤ t)
    p_{t,j} = exp(ℓ_{t,j}) / (exp(s_i) + Σ_{j' ≤ t} exp(ℓ_{t,j'}))
    O_{t,i} = Σ_j p_{t,j} V_{j,g(i)}                              (rows sum to 1 − exp(s_i)/(exp(s_i) + Σ exp(ℓ)))

The sink has no value: the mass it takes is attention paid to nothing. With s_i = 0 this is Miller's
"softmax-off-by-one" (Evan Miller, "Attention Is Off By One", 2023), where each row's denominator holds a 1.

Matched: one learned scalar per (layer, head), in each row's softmax denominator only, no value vector, the rest of
the attention unchanged. Chosen here: the rest of the model is LLaMA's (GPT-OSS's MoE, alternating sliding windows
and YaRN are not part of the mechanism); the sinks start at 0 — the model starts as softmax-off-by-one — where
GPT-OSS draws them from N(0, initializer_range); they are 1-D, so training does not decay them (as norms and λ).

Computed exactly by eager attention (GPT-OSS's `eager_attention_forward`, what attn_implementation="eager" runs
and what training uses) and by quantdiff's backend (`s_aux`: the sink starts every row's online softmax). SDPA,
flash and flex attention are declared unsupported: transformers' SDPA function drops `s_aux` without a word, so
asking for it is refused by name rather than computing another model. The sink logit is not a key position:
the attention-logit statistics and the `logits`/`qk` quantization sites see QKᵀ/√d only, and the sink logit is
a float parameter that no site quantizes (the exports store it unquantized, as norms).
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AttentionInterface, LlamaConfig
from transformers import initialization as init
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention_forward
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from quantdiff.models.llama_variant import VariantAttention, declare_kind

MODEL_TYPE = "quantdiff_sink"
# What attn_implementation="eager" runs for this kind: GPT-OSS's eager attention, which appends `s_aux` as a logit
# column. LLaMA's forward (which the kind runs) would pick LLaMA's eager function, which drops `s_aux` without a
# word; a registered implementation is how transformers lets a model name another function, with eager's mask.
EAGER_WITH_SINKS = "quantdiff_sink_eager"
AttentionInterface.register(EAGER_WITH_SINKS, gpt_oss_eager_attention_forward)
AttentionMaskInterface.register(EAGER_WITH_SINKS, eager_mask)


@strict
class SinkConfig(LlamaConfig):
    """A LLaMA config whose attention has a learned sink logit per head."""

    model_type = MODEL_TYPE


class SinkAttention(VariantAttention):
    """LLaMA's attention with one learned sink logit per head in every softmax denominator (module docstring)."""

    def __init__(self, config: SinkConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))

    def attention_arguments(self) -> dict:
        return {"s_aux": self.sinks}  # the argument name of transformers' attention functions (and the backend's)


class SinkPreTrainedBase(LlamaPreTrainedModel):
    """What the sink kind's models add to LLaMA's base: the attention implementations they refuse, the sinks' init."""

    # Their attention functions would ignore `s_aux` (SDPA) or are not checked here (flash, flex): refused by
    # transformers by name; eager and the quantdiff backend compute the sinks.
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        """transformers' choice (its checks, its eager fallback where SDPA is not supported), with "eager" meaning
        the eager attention that computes the sinks."""
        chosen = super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        return EAGER_WITH_SINKS if chosen == "eager" else chosen

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, SinkAttention):
            init.zeros_(module.sinks)


SinkDecoderLayer, SinkPreTrainedModel, SinkModel, SinkForCausalLM = declare_kind(
    __name__, "Sink", MODEL_TYPE, SinkConfig, SinkAttention, base=SinkPreTrainedBase
)
