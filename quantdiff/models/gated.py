"""Gated attention as a transformers model (model type "quantdiff_gated"): LLaMA with Qiu et al.'s G1 output gate.

Source: Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
Attention-Sink-Free", position G1 (after scaled dot-product attention, before the output projection); reference
code `qiuzh20/gated_attention`, `modeling_qwen3.py`, `Qwen3Attention.forward` (options `headwise_attn_output_gate`
and `elementwise_attn_output_gate`); transformers' `models/qwen3_next/modeling_qwen3_next.py`,
`Qwen3NextAttention.forward`, has the element-wise form. With h heads of width d, x the attention input (after the
layer's RMSNorm) and O_i the output of head i:

    O_i = softmax(Q_i K_g(i)ᵀ / √d + causal mask) V_g(i)         (LLaMA's attention, RoPE, GQA)
    g_{t,i} = sigmoid(x_t · w_i),  w_i the i-th row of W_g ∈ R^{h×D}  (per token t and head i: head-wise)
    output = concat_i(g_{·,i} ⊙ O_i) W_O

Head-wise, not element-wise (the paper's G1 comes in both): the head-wise gate adds D·h parameters per layer, the
element-wise one D·h·d = D² — a quarter more attention weights than the standard arm (without GQA), which would
confound the comparison the gate is trained for. The reference ships both (`gate_headwise`, `gate_elementwise`),
and its README shows the head-wise gate already reducing the first-token sink; with it the standard and
gated arms differ only by the gate (at the bb recipe's size: 256 parameters, 0.2%).

Matched: the gate is a sigmoid of a linear map of the attention input (with a bias exactly when q_proj has one:
the reference's gate rows are part of q_proj; LLaMA's `attention_bias`, off in quantdiff's presets), multiplicative,
one scalar per token and head, applied to the SDPA output before W_O; the attention itself is unchanged. Chosen
here: the reference computes the gate scores in extra rows of `q_proj` (grouped per KV head); here they are their
own `nn.Linear`, `output_gate_proj` — the same functions with the weight rows rearranged — which the `linear` site
and the exports quantize like every other projection. No q/k norm (the reference's `use_qk_norm`): the rest is LLaMA's, as
for the standard arm. Initialisation: every arm's scheme (models/init.py; the reference's is transformers' normal,
std `initializer_range`, for every Linear), so every gate starts near sigmoid(0) = 0.5.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig

from quantdiff.models.llama_variant import VariantAttention, declare_kind

MODEL_TYPE = "quantdiff_gated"


@strict
class GatedConfig(LlamaConfig):
    """A LLaMA config whose attention output is gated per head (G1, head-wise)."""

    model_type = MODEL_TYPE


class GatedAttention(VariantAttention):
    """LLaMA's attention with a sigmoid gate per token and head on its output, before W_O (module docstring)."""

    def __init__(self, config: GatedConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.output_gate_proj = nn.Linear(config.hidden_size, config.num_attention_heads, bias=config.attention_bias)

    def combine_heads(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.output_gate_proj(hidden_states))  # (B, T, h): from the attention input
        return out * gate[..., None].to(out.dtype)


GatedDecoderLayer, GatedPreTrainedModel, GatedModel, GatedForCausalLM = declare_kind(
    __name__, "Gated", MODEL_TYPE, GatedConfig, GatedAttention
)
