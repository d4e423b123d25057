"""DIFF Transformer V2 as a transformers model (model type "quantdiff_diffv2"), built from LLaMA's pieces.

Source: the authors' reference module `Diff-Transformer/Diff-Transformer-V2/multihead_flashdiffv2.py` and its
README in microsoft/unilm (January 2026), and their blog post "Differential Transformer V2" (Ye, Dong, Sun, Wei).
With h output heads, h_kv key/value heads of width d, and x the attention input (after the layer's RMSNorm):

    Q = x W_Q ∈ R^{N×2h×d},  K = x W_K, V = x W_V ∈ R^{N×h_kv×d}      (query heads doubled, K/V unchanged)
    Q, K ← RoPE(Q), RoPE(K)
    O_j = softmax(Q_j K_{g(j)}ᵀ / √d + causal mask) V_{g(j)}          j = 0 … 2h−1, g(j) = j // (2h / h_kv)
    λ_{t,i} = sigmoid(x_t · w_i),  w_i the i-th row of W_λ ∈ R^{h×D}    (per token t, per output head i)
    A_i = O_{2i} − λ_{·,i} ⊙ O_{2i+1}                                  i = 0 … h−1 (heads 2i, 2i+1: one GQA group)
    output = concat_i(A_i) W_O,  W_O ∈ R^{(h·d)×D}                      (no per-head RMSNorm, no (1 − λ_init) scale)

Matched exactly: doubled query heads with K/V heads unchanged, the adjacent pairing 0::2 / 1::2 (both heads of a
pair share one GQA group: the authors' README calls the halves pairing wrong), λ = sigmoid of a bias-free linear
projection of the attention input, per token and per output head, the subtraction applied to the attention
*outputs* before W_O, W_O of the baseline's size, no per-head normalisation, causal attention, no biases.

Chosen here (and why):
- RoPE is LLaMA's rotate-half layout; the reference applies flash-attn's interleaved layout. The two differ by a
  fixed permutation of each head's d dimensions applied to Q and K alike, which leaves every logit Q·Kᵀ unchanged:
  the same family of functions, with the weights' rows permuted.
- The rest of the model (pre-norm RMSNorm decoder layers, SwiGLU MLP, embeddings, LM head) is LLaMA's: the
  reference publishes the attention module only.
- Initialisation: every arm's scheme (models/init.py): under the authors' (recipes' default) every nn.Linear, W_λ
  included, is PyTorch's default kaiming-uniform, as the reference's plain nn.Linear layers are; under transformers'
  normal, std `initializer_range`. Either way λ starts centred on sigmoid(0) = 0.5. The reference has no init code.
Not public: the training framework, the initialisation and the sizes used for the blog's experiments.

Config convention (as DiffLlama's): `num_attention_heads` counts the heads attention computes — the 2h query
heads, which quantdiff's taps see as maps 1 (even) and 2 (odd) — and `head_dim` defaults to
hidden_size / (num_attention_heads / 2), so h·d = hidden_size as in the baseline.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LlamaConfig

from quantdiff.models.llama_variant import VariantAttention, declare_kind

MODEL_TYPE = "quantdiff_diffv2"


@strict
class DiffV2Config(LlamaConfig):
    """A LLaMA config whose attention is DIFF V2: `num_attention_heads` = 2h query heads, paired (2i, 2i+1)."""

    model_type = MODEL_TYPE

    def __post_init__(self, **kwargs):
        if self.head_dim is None and self.num_attention_heads >= 2:
            self.head_dim = self.hidden_size // (self.num_attention_heads // 2)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        heads, kv = self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
        if heads % 2:
            raise ValueError(f"DIFF V2 pairs query heads: num_attention_heads={heads} must be even")
        if heads % kv or (heads // kv) % 2:
            raise ValueError(f"DIFF V2 pairs query heads within a GQA group: num_attention_heads={heads} must be an even multiple of num_key_value_heads={kv}")

    @property
    def output_heads(self) -> int:
        """h: the differential heads, one per query pair."""
        return self.num_attention_heads // 2


class DiffV2Attention(VariantAttention):
    """Differential attention V2 (equations in the module docstring); attention itself through the registry."""

    def __init__(self, config: DiffV2Config, layer_idx: int) -> None:
        nn.Module.__init__(self)  # LLaMA's projections have other widths here
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.output_heads * self.head_dim, config.hidden_size, bias=bias)
        self.lambda_proj = nn.Linear(config.hidden_size, config.output_heads, bias=False)

    def combine_heads(self, out: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, 2h, d) -> (B, T, h, d): O_2i − λ_i·O_2i+1, the pairs sharing a GQA group."""
        device = out.device.type
        if torch.is_autocast_enabled(device):
            # Under bf16 autocast λ and the subtraction stay float32 (issue 58), more precise than the reference,
            # whose whole module runs in the training dtype; o_proj casts the result back when it reads it.
            with torch.autocast(device, enabled=False):
                lam = torch.sigmoid(nn.functional.linear(hidden_states.float(), self.lambda_proj.weight.float()))
                return out[:, :, 0::2].float() - lam[..., None] * out[:, :, 1::2].float()
        lam = torch.sigmoid(self.lambda_proj(hidden_states))  # (B, T, h)
        return out[:, :, 0::2] - lam[..., None].to(out.dtype) * out[:, :, 1::2]


DiffV2DecoderLayer, DiffV2PreTrainedModel, DiffV2Model, DiffV2ForCausalLM = declare_kind(
    __name__, "DiffV2", MODEL_TYPE, DiffV2Config, DiffV2Attention
)
