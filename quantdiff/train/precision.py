"""bf16 autocast training with Diff V1's differential combine kept in float32 (issue 58).

Under autocast, transformers' DiffLlama attention computes λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init in the query's
dtype, then A1 − λ·A2, the per-head RMSNorm and the (1 − λ_init) scale in the attention outputs' dtype: all bf16,
as in the authors' code, which runs the module in the training dtype. A one-off H200 check (results/gpu/README.md)
saw Diff V1 fall behind in bf16 autocast without compile. Here two changes keep that combine in float32 without
copying transformers' forward: the query projection's output is cast to float32 (λ is cast to the query's dtype;
the attention matmuls are autocast back to bf16, so only RoPE and λ gain precision), and the attention function
returns float32 outputs (SDPA's own, upcast), so the subtraction, the norm and the scale run in float32 and o_proj
reads them under autocast as before. DIFF V2 does the same in its own combine (models/diffv2.py). In float32
training both are no-ops: nothing is cast, and the attention is SDPA's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

FLOAT32_OUT = "quantdiff_sdpa_float32_out"  # SDPA whose outputs come back float32


def _sdpa_float32_out(module: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    out, weights = sdpa_attention_forward(module, *args, **kwargs)
    return out.float(), weights


def _to_float32(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def keep_combine_float32(model: nn.Module) -> bool:
    """Make a DiffLlama model's differential combine run in float32 under autocast (see the module docstring);
    returns whether `model` has DiffLlama attention (other kinds are left unchanged)."""
    attentions = [m for m in model.modules() if isinstance(m, DiffLlamaAttention)]
    if not attentions:
        return False
    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"the float32 combine wraps SDPA; this model trains on {model.config._attn_implementation!r}")
    AttentionInterface.register(FLOAT32_OUT, _sdpa_float32_out)
    AttentionMaskInterface.register(FLOAT32_OUT, sdpa_mask)  # without a mask function the mask arrives as None
    for attention in attentions:
        attention.q_proj.register_forward_hook(_to_float32)
    model.set_attn_implementation(FLOAT32_OUT)
    return True
