"""llama.cpp's KV-cache types (`quant.kv_engines`, layouts `q8_0` and `q4_0`) against loop-by-loop transcriptions
of ggml's reference functions (ggml/src/ggml-quants.c: `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`,
`dequantize_row_q8_0`, `dequantize_row_q4_0`), in float32 as ggml computes, on random rows with ties and zero
blocks and on SmolLM2's real keys and values; the cache stores those codes and the kv site reads them."""

import math

import numpy as np
import pytest
import torch

import quantdiff
from quantdiff.core.errors import ConfigError
from quantdiff.quant.kv_layout import LAYOUTS, KVLayout, fake_quantize, layout_named, quantize

F32 = np.float32


def ggml_quantize_row_q8_0_ref(x: np.ndarray) -> tuple[list[int], list[float]]:
    codes, scales = [], []
    for i in range(len(x) // 32):
        block = x[i * 32 : (i + 1) * 32]
        amax = F32(0.0)
        for v in block:
            amax = max(amax, F32(abs(v)))
        d = F32(amax / F32(127))
        id_ = F32(F32(1.0) / d) if d else F32(0.0)
        scales.append(float(np.float16(d)))  # GGML_FP32_TO_FP16
        for v in block:
            x0 = F32(v * id_)
            codes.append(int(math.copysign(math.floor(abs(float(x0)) + 0.5), float(x0))))  # roundf
    return codes, scales


def ggml_quantize_row_q4_0_ref(x: np.ndarray) -> tuple[list[int], list[float]]:
    codes, scales = [], []
    for i in range(len(x) // 32):
        block = x[i * 32 : (i + 1) * 32]
        amax, max_ = F32(0.0), F32(0.0)
        for v in block:
            if amax < abs(v):
                amax, max_ = F32(abs(v)), v
        d = F32(max_ / F32(-8))
        id_ = F32(F32(1.0) / d) if d else F32(0.0)
        scales.append(float(np.float16(d)))
        for v in block:
            x0 = F32(F32(v * id_) + F32(8.5))
            codes.append(min(15, int(x0)))  # (int8_t) truncates toward zero
    return codes, scales


def ggml_dequantize(codes: list[int], scales: list[float], offset: int) -> list[float]:
    """dequantize_row_q8_0 / _q4_0: (code [− 8]) · fp16 d, in float32."""
    return [float(F32(F32(c - offset) * F32(scales[j // 32]))) for j, c in enumerate(codes)]


REFERENCES = {"q8_0": (ggml_quantize_row_q8_0_ref, 0), "q4_0": (ggml_quantize_row_q4_0_ref, 8)}


def rows_with_edges() -> torch.Tensor:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[0, :32] = 0.0  # a zero block
    x[1, 5], x[1, 9] = 3.0, -3.0  # equal magnitudes: q4_0 takes the first
    x[2, 32:] = torch.linspace(-1, 1, 32)
    x[3, 32:] *= 1000
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, -6.5] * 4)  # ties: roundf and q4_0's + 8.5 decide them
    x[2, :32] = halves
    x[2, 0] = 127.0  # q8_0: d = 1, so the ties stay ties
    x[3, :32] = halves
    x[3, 1] = -8.0  # q4_0: d = −8 / −8 = 1
    return x


def check_against_ggml(x: torch.Tensor, mode: str) -> None:
    reference, offset = REFERENCES[mode]
    layout = layout_named(mode)
    bits = 8 if mode == "q8_0" else 4
    stored = quantize(x.view(1, 1, -1, x.shape[-1]), bits, layout, keys=True)
    dequant = fake_quantize(x.view(1, 1, -1, x.shape[-1]), bits, layout, keys=True).view(-1, x.shape[-1])
    for r, row in enumerate(x.numpy().astype(F32)):
        codes, scales = reference(row)
        ours = stored.codes[0, 0, r].int() - (stored.offset - offset)  # the stored codes, on ggml's offset
        assert ours.tolist() == codes, (mode, r)
        assert stored.scale[0, 0, r, :, 0].float().tolist() == scales
        assert dequant[r].tolist() == ggml_dequantize([c for c in codes], scales, offset), (mode, r)


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_engine_modes_are_ggmls_codes_on_edge_rows(mode):
    check_against_ggml(rows_with_edges(), mode)


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_engine_modes_are_ggmls_codes_on_smollm2s_keys_and_values(smollm2_dir, mode):
    for tensor, _ in smollm2_keys_and_values(smollm2_dir):
        check_against_ggml(tensor.reshape(-1, tensor.shape[-1]), mode)


def smollm2_keys_and_values(smollm2_dir) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, is_keys) of SmolLM2's first and last layers' cache after a 24-token forward: real K/V to check
    engine codes on."""
    from transformers import DynamicCache

    model = quantdiff.load(smollm2_dir, device="cpu")
    ids = torch.randint(1, 1000, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, use_cache=True, cache=cache)
    return [(t, t is cache.layers[layer].keys) for layer in (0, len(cache.layers) - 1) for t in (cache.layers[layer].keys, cache.layers[layer].values)]


def test_the_cache_stores_engine_codes_and_refuses_other_widths(tiny_pair):
    from quantdiff.models import loading

    model = loading.prepare(tiny_pair["standard"], tile_size=None)  # head width 16: refused, not a block of 32
    with pytest.raises(ConfigError, match="does not divide the head width 16"):
        quantdiff.kv_cache(model, bits=8, layout="q8_0")
    with pytest.raises(ConfigError, match="stores 4-bit codes, not 8"):
        layout_named("q4_0").check_bits(8)
    with pytest.raises(ConfigError, match="blocks of 32 channels and its lack of a residual are fixed"):
        layout_named("q8_0", group_size=16)
    with pytest.raises(ConfigError, match="per token in blocks of 32 channels"):
        KVLayout(engine="q4_0")
    assert LAYOUTS["q4_0"].name == "llama.cpp q4_0: per token, blocks of 32 channels, fp16 scales, ggml's rounding"
