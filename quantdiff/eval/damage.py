"""Quantization damage against the same model in full precision, token by token, as llama.cpp's
`perplexity --kl-divergence` measures it (ggml-org/llama.cpp PR #6936, "perplexity: more statistics", and
examples/perplexity/perplexity.cpp):

- KL(p_full ‖ p_quant) = Σ_v p_full(v) (ln p_full(v) − ln p_quant(v)) over the vocabulary, per predicted token;
  its mean, median, 99th percentile and max over tokens;
- Δp = p_quant(correct) − p_full(correct) of the correct next token: its mean and RMS (√ mean Δp²);
- same top-1: the share of tokens whose most probable next token is the same in both models ("same top p");
- Δ loss = mean NLL_quant − mean NLL_full (the difference of ln perplexity).

Differences from llama.cpp, on purpose: every position after the first is scored (llama.cpp scores the second
half of each context window); the reference is the float32 logits themselves (llama.cpp stores the base model's
log-probabilities as 16-bit codes); softmax and KL are taken in float64 from float32 logits. Percentiles are
exact: the per-token values (five numbers per token) are all kept, and the quantile interpolates linearly between
the two nearest order statistics (numpy's default), where llama.cpp rounds to one of them.

The full-precision forward runs once per batch and every config is compared with it before the next batch, so only
one batch's logits are ever held: the per-token values are what is reduced, on the fly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from quantdiff.attention.observe import observe
from quantdiff.data.sources import Batch
from quantdiff.quant import sites
from quantdiff.stats.collect import StatsCollector
from quantdiff.stats.model_stats import ModelStats

PER_TOKEN = ("kld", "delta_p", "same_top1", "nll_full", "nll_quant")
SOURCE = "llama.cpp perplexity --kl-divergence (ggml-org/llama.cpp PR #6936)"


def _logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits


def per_token(full: torch.Tensor, quant: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
    """The per-token values (float64, on the CPU) of one batch: logits (B, T, V) of both models, position t
    predicting token t + 1; padded targets are left out. One row at a time: float64 (T, V) is the peak."""
    values: dict[str, list[torch.Tensor]] = {name: [] for name in PER_TOKEN}
    for row in range(batch.input_ids.shape[0]):
        target = batch.input_ids[row, 1:].to(full.device)
        keep = slice(None) if batch.attention_mask is None else batch.attention_mask[row, 1:].bool().to(full.device)
        log_full = torch.log_softmax(full[row, :-1].float().double(), dim=-1)[keep]
        log_quant = torch.log_softmax(quant[row, :-1].float().double(), dim=-1)[keep]
        target = target[keep].view(-1, 1)
        nll_full, nll_quant = -log_full.gather(1, target).view(-1), -log_quant.gather(1, target).view(-1)
        values["kld"].append((log_full.exp() * (log_full - log_quant)).sum(dim=-1))
        values["delta_p"].append(torch.exp(-nll_quant) - torch.exp(-nll_full))
        values["same_top1"].append((log_full.argmax(dim=-1) == log_quant.argmax(dim=-1)).double())
        values["nll_full"].append(nll_full)
        values["nll_quant"].append(nll_quant)
    return {name: torch.cat(parts).cpu() for name, parts in values.items()}


def summarize(values: dict[str, torch.Tensor]) -> dict:
    """The damage fields of one config from its per-token values (see the module docstring)."""
    kld = values["kld"].numpy()
    delta_p = values["delta_p"]
    return {
        "tokens": int(kld.size),
        "kld_mean": float(kld.mean()),
        "kld_median": float(np.quantile(kld, 0.5)),
        "kld_p99": float(np.quantile(kld, 0.99)),
        "kld_max": float(kld.max()),
        "delta_p_mean": float(delta_p.mean()),
        "delta_p_rms": float(delta_p.square().mean().sqrt()),
        "same_top1": float(values["same_top1"].mean()),
        "delta_loss": float(values["nll_quant"].mean() - values["nll_full"].mean()),
        "loss_full": float(values["nll_full"].mean()),
    }


def damages(
    model: nn.Module,
    batches: Sequence[Batch],
    configs: Sequence[sites.QuantConfig],
    stats_k: int | None = None,
    progress: Callable[[int], None] | None = None,
    allow_partial: bool = False,
) -> tuple[list[dict], ModelStats | None]:
    """The damage of each config against `model` unquantized, on `batches`; with `stats_k`, also the outlier
    statistics (`collect_stats`'s, Top-k of `stats_k`) from the hooks of the very full-precision forwards the
    damage is measured against. progress(1) after each forward; allow_partial as `sites.quantized`'s."""
    collector = None if stats_k is None else StatsCollector(model, stats_k)
    gathered: list[dict[str, list[torch.Tensor]]] = [{name: [] for name in PER_TOKEN} for _ in configs]
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch in batches:
            batch = batch.to(device)
            if collector is None:
                full = _logits(model, batch)
            else:
                with observe(model, collector.on_logits, collector.on_hidden, collector.on_linear_input, on_lambda=collector.sinks.on_lambda):
                    full = collector.run(model, batch, lm_head=True)
            if progress is not None:
                progress(1)
            for config, into in zip(configs, gathered):
                with sites.quantized(model, config, allow_partial):
                    quant = _logits(model, batch)
                for name, value in per_token(full, quant, batch).items():
                    into[name].append(value)
                if progress is not None:
                    progress(1)
    if collector is not None:
        collector.stats.sinks = collector.sinks
    results = [summarize({name: torch.cat(parts) for name, parts in into.items()}) for into in gathered]
    return results, None if collector is None else collector.stats
