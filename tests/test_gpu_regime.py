"""The GPU regime recipes and bf16 training's float32 differential combine (issue 58), on CPU.

Training refuses bf16 on a CPU (guards.check_dtype: slow there), but CPU bf16 autocast exists, so the combine's
precision is checked here under it: what the combine reads and writes is float32, and one attention layer's bf16
output stays within 1e-2 (relative) of its float32 output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantdiff.models.pairs import budget_matched, build_model, kind_configs, parameter_count
from quantdiff.train.precision import keep_combine_float32
from quantdiff.train.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
BB = REPO / "recipes" / "gpu-regime-bb.toml"


def _models(recipe_path: Path) -> dict[str, torch.nn.Module]:
    recipe = load_recipe(str(recipe_path))
    configs = kind_configs(recipe.model, tuple(dict.fromkeys(arm.kind for arm in recipe.arms)))
    return {arm.name: build_model(budget_matched(configs[arm.kind], recipe.model) if arm.match_budget else configs[arm.kind],
                                  0, "sdpa", recipe.train.init) for arm in recipe.arms}


def test_regime_arms_have_the_authors_head_counts_and_diffv2_matches_the_standard_budget():
    models = _models(BB)
    assert models["standard"].config.num_attention_heads == 16
    assert models["diff"].config.num_attention_heads // 2 == 8  # DiffLlama pairs heads i and i + H/2
    assert models["diffv2-matched"].config.output_heads == 16  # DIFF V2 keeps the baseline's heads and W_O
    standard, matched = parameter_count(models["standard"]), parameter_count(models["diffv2-matched"])
    assert abs(matched / standard - 1) <= 0.005
    assert models["diffv2-matched"].config.intermediate_size < models["standard"].config.intermediate_size


def _small(kind: str) -> torch.nn.Module:
    recipe = load_recipe(str(BB))
    preset = type(recipe.model)(hidden_size=64, num_layers=1, num_heads=4, vocab_size=83, max_position_embeddings=32)
    return build_model(kind_configs(preset, (kind,))[kind], 0, "sdpa", "authors")


def _attention_io(model: torch.nn.Module, where: str, autocast: bool) -> tuple[torch.dtype, torch.Tensor]:
    """(the dtype the combine's module `where` of layer 0 reads, layer 0's attention output) on a fixed input."""
    attention = model.model.layers[0].self_attn
    seen: list[torch.dtype] = []
    handle = attention.get_submodule(where).register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    captured: list[torch.Tensor] = []
    out_handle = attention.register_forward_hook(lambda m, args, out: captured.append(out[0].float()))
    ids = torch.randint(0, 82, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids)
    finally:
        handle.remove()
        out_handle.remove()
    return seen[0], captured[0]


# Diff V1's combine is read by its per-head norm (after A1 - λ·A2), DIFF V2's by o_proj (after O_2i - λ·O_2i+1).
@pytest.mark.parametrize("kind, where", [("diff", "groupnorm"), ("diffv2", "o_proj")])
def test_the_differential_combine_stays_float32_under_bf16_autocast(kind, where):
    model = _small(kind)
    _, reference = _attention_io(model, where, autocast=False)
    if kind == "diff":
        assert _attention_io(model, where, autocast=True)[0] == torch.bfloat16  # transformers' own: the check can fail
        assert keep_combine_float32(model)
    dtype, output = _attention_io(model, where, autocast=True)
    assert dtype == torch.float32
    assert (output - reference).norm() / reference.norm() <= 1e-2


def test_the_float32_combine_leaves_float32_outputs_unchanged_and_other_kinds_alone():
    model = _small("diff")
    before = _attention_io(model, "groupnorm", autocast=False)[1]
    assert keep_combine_float32(model) and not keep_combine_float32(_small("standard"))
    assert torch.equal(_attention_io(model, "groupnorm", autocast=False)[1], before)


def test_the_bf16_combine_check_trains_every_kind_in_every_precision():
    """benchmarks/bf16_combine_check.py, the lead's comparison, at a size that takes a second."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bf16_combine_check", REPO / "benchmarks" / "bf16_combine_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    losses = check.main(["--device", "cpu", "--seeds", "0", "--steps", "2", "--hidden", "16", "--seq", "16", "--batch", "4", "--held-out", "4"])
    assert set(losses) == {("standard", "float32", 0), ("standard", "bf16", 0),
                           ("diff", "float32", 0), ("diff", "bf16", 0), ("diff", "bf16+float32-combine", 0)}
    assert all(0 < loss < 10 for loss in losses.values())  # finite, of a loss's size (uniform's is ln 83 = 4.42)
