"""A naive LLaMA forward in float64, from the equations, for checking quantdiff's own model kinds against.

It shares nothing with `quantdiff.models`: RMSNorm, rotate-half RoPE, causal softmax attention head by head (with an
optional sink logit per head in every row's denominator), the SwiGLU MLP, written out from their definitions and
read from the model's state dict. What a kind does with its heads' outputs before W_O is the caller's `combine`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# combine(layer prefix, attention input a (T, D), per-head outputs [(T, d)]) -> the input of o_proj (T, width)
Combine = Callable[[str, torch.Tensor, list[torch.Tensor]], torch.Tensor]


def concat(_prefix: str, _a: torch.Tensor, heads: list[torch.Tensor]) -> torch.Tensor:
    """Standard attention: the heads' outputs side by side."""
    return torch.cat(heads, dim=-1)


def forward(model: torch.nn.Module, ids: torch.Tensor, combine: Combine = concat, sinks: Callable[[str], torch.Tensor | None] = lambda _p: None) -> dict:
    """Logits (B, T, V), and per layer the attention probabilities (B, H, T, T) and pre-softmax logits QKᵀ/√d.

    `sinks(prefix)`: the layer's sink logit per head (H,), added to every row's softmax denominator with no value,
    or None (plain softmax)."""
    cfg = model.config
    w = {name: t.detach().double() for name, t in model.state_dict().items()}
    n_q, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = ids.shape[1]
    theta = cfg.rope_parameters["rope_theta"]
    angles = torch.arange(T, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x):  # (T, d), LLaMA's rotate-half layout
        x1, x2 = x[:, : d // 2], x[:, d // 2 :]
        return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    layers = range(cfg.num_hidden_layers)
    out = {"logits": [], "probs": [[] for _ in layers], "scores": [[] for _ in layers]}
    for b in range(ids.shape[0]):
        x = w["model.embed_tokens.weight"][ids[b]]
        for layer in layers:
            p = f"model.layers.{layer}."
            a = rms(x, w[p + "input_layernorm.weight"])
            q = (a @ w[p + "self_attn.q_proj.weight"].T).view(T, n_q, d)
            k = (a @ w[p + "self_attn.k_proj.weight"].T).view(T, n_kv, d)
            v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, n_kv, d)
            sink = sinks(p)
            heads, probs, scores = [], [], []
            for j in range(n_q):
                g = j // (n_q // n_kv)  # the KV head serving query head j
                s = rope(q[:, j]) @ rope(k[:, g]).T / math.sqrt(d)
                e = torch.exp(s.masked_fill(~causal, -math.inf))
                denominator = e.sum(-1, keepdim=True) + (0.0 if sink is None else math.exp(sink[j]))
                prob = e / denominator
                heads.append(prob @ v[:, g])
                probs.append(prob)
                scores.append(s)
            x = x + combine(p, a, heads) @ w[p + "self_attn.o_proj.weight"].T
            m = rms(x, w[p + "post_attention_layernorm.weight"])
            gate_act = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate_act * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            out["probs"][layer].append(torch.stack(probs))
            out["scores"][layer].append(torch.stack(scores))
        out["logits"].append(rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T)
    return {
        "logits": torch.stack(out["logits"]),
        "probs": [torch.stack(rows) for rows in out["probs"]],
        "scores": [torch.stack(rows) for rows in out["scores"]],
    }
