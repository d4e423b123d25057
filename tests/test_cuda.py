"""GPU paths of the backend and loading; skipped where no CUDA device is present (CI has none)."""

from __future__ import annotations

import pytest
import torch

import quantdiff.attention.backend as attention
from quantdiff.models.loading import load, prepare

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["standard", "diff"])
def test_tiled_backend_matches_sdpa_on_cuda(tiny_pair, kind, dtype, tol):
    model = tiny_pair[kind].to("cuda", dtype)
    ids = torch.randint(0, 97, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask).logits.float()
        prepare(model, tile_size=16)
        handles = [t.register_forward_hook(lambda *a: None) for t in attention.taps(model)]
        out = model(ids, attention_mask=mask).logits.float()
        for h in handles:
            h.remove()
    diff = (out - ref)[mask.bool()].abs().max().item()
    assert diff <= tol, f"{kind} {dtype}: max abs diff {diff:.2e}"


def test_load_defaults_to_cuda(tiny_pair, tmp_path):
    tiny_pair["diff"].save_pretrained(tmp_path)
    model = load(tmp_path)
    assert next(model.parameters()).device.type == "cuda"
