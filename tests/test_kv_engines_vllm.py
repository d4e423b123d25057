"""vLLM's per-token-head KV caches (`quant.kv_engines`, layouts `vllm-int8-head`, `vllm-int4-head`, `vllm-fp8-head`)
against loop-by-loop transcriptions of vLLM's Triton kernels (github.com/vllm-project/vllm at 60e0ba0b,
vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, `_reshape_cache_per_token_head` and
`_reshape_cache_int4_packed`), in float32 as the kernel
computes, with e4m3 rounding taken from an enumeration of the format's values (not torch's cast); on rows with ties,
zeros and saturation and on SmolLM2's real keys and values; the cache stores those codes and the kv site reads them."""

import math

import numpy as np
import pytest
import torch

import quantdiff
from quantdiff.core.errors import ConfigError
from quantdiff.quant.kv_layout import LAYOUTS, fake_quantize, layout_named, quantize
from quantdiff.quant.sites import AbsmaxMethod, KVSite, QuantConfig, quantized
from tests.test_kv_engines import smollm2_keys_and_values

F32 = np.float32


def e4m3fn_values() -> list[float]:
    """Every finite float8_e4m3fn value from its bit fields (bias 7; exponent 0 subnormal; S.1111.111 is NaN)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue
            magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values.append((magnitude, mantissa))
    return values


E4M3 = e4m3fn_values()


def to_e4m3_rne(x: float) -> float:
    """Round to the nearest e4m3fn value, ties to the even mantissa (the store's conversion; inputs already clamped)."""
    best = min(E4M3, key=lambda vm: (abs(abs(x) - vm[0]), vm[1] % 2))
    return math.copysign(best[0], x)


def vllm_reshape_cache_per_token_head(row: np.ndarray, quant_max: float, quant_min: float, store) -> tuple[list[float], float]:
    """One (token, head) program of `_reshape_cache_per_token_head`: absmax, scale, clamp, store."""
    amax = F32(0.0)
    for v in row:
        amax = max(amax, F32(abs(v)))  # tl.max(tl.abs(k_h))
    scale = max(F32(amax / F32(quant_max)), F32(1e-6))  # tl.maximum(... / QUANT_MAX, 1e-6)
    inverse = F32(F32(1.0) / scale)
    codes = []
    for v in row:
        q = min(max(F32(v * inverse), F32(quant_min)), F32(quant_max))  # tl.clamp
        codes.append(store(float(q)))
    return codes, float(scale)


def vllm_reshape_cache_int4_packed(row: np.ndarray) -> tuple[list[float], float, float]:
    """One (token, head) program of `_reshape_cache_int4_packed`: (codes, zero-point, the scale read back). The sum
    Σx·r is taken in float64 and rounded once, as `quant.kv_engines` documents (Triton sums float32 in tree order)."""

    def rounded(v):  # tl.where(v >= 0, (v + 0.5).to(tl.int32), (v - 0.5).to(tl.int32))
        return int(F32(v + F32(0.5))) if v >= 0 else int(F32(v - F32(0.5)))

    def grid(inverse, zp):
        return [F32(min(max(rounded(F32(F32(v * inverse) + zp)), 0), 15)) for v in row]

    mn, mx = F32(np.inf), F32(-np.inf)
    for v in row:
        mn, mx = min(mn, v), max(mx, v)
    initial = max(F32((mx - mn) / F32(15.0)), F32(1e-6))
    zp = F32(min(max(rounded(F32(-mn / initial)), 0), 15))
    codes = grid(F32(F32(1.0) / initial), zp)
    xr = F32(sum(float(v) * float(q - zp) for v, q in zip(row, codes)))
    rr = F32(sum(float(q - zp) ** 2 for q in codes))
    scale = max(F32(xr / max(rr, F32(1e-6))), F32(1e-6))
    inverse = F32(F32(1.0) / scale)
    zp = F32(min(max(rounded(F32(-mn * inverse)), 0), 15))
    codes = grid(inverse, zp)
    packed = (np.array([scale], dtype=F32).view(np.int32) & -16) | int(zp)  # zero-point steganography
    read_back = (packed & -16).view(F32)[0]  # what attention uses: packed_bits & -16
    return [float(c) for c in codes], float(zp), float(read_back)


def check_int4_against_vllm(x: torch.Tensor) -> None:
    layout = layout_named("vllm-int4-head")
    rows = x.reshape(1, 1, -1, x.shape[-1])
    stored = quantize(rows, 4, layout, keys=False)
    dequant = fake_quantize(rows, 4, layout, keys=False).reshape(-1, x.shape[-1])
    for r, row in enumerate(x.float().numpy().astype(F32)):
        codes, zp, scale = vllm_reshape_cache_int4_packed(row)
        assert stored.codes[0, 0, r].float().tolist() == codes, r
        assert stored.scale[0, 0, r].item() == scale and stored.zero[0, 0, r].item() == -zp * scale
        assert dequant[r].tolist() == [float(F32(F32(c - zp) * F32(scale))) for c in codes], r  # (q − zp) · scale


STORES = {"vllm-int8-head": (127.0, -128.0, int), "vllm-fp8-head": (448.0, -448.0, to_e4m3_rne)}  # int(): fptosi truncates


def rows_with_edges() -> torch.Tensor:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    x[0] = 0.0  # an all-zero row: scale 1e-6, codes 0
    x[1, :8] = torch.tensor([127.0, 126.5, -126.5, 0.5, -0.5, 1.5, -1.5, 2.99])  # scale 1: truncation decides these
    x[2, 3] = 1e4  # one outlier: everything else lands near zero
    x[3] = torch.linspace(-448, 448, 64)  # fp8: scale 1, so every e4m3 tie is a real tie
    x[4] *= 1e-9  # below 1e-6 · QUANT_MAX: the scale floor
    return x


def check_against_vllm(x: torch.Tensor, mode: str) -> None:
    quant_max, quant_min, store = STORES[mode]
    layout = layout_named(mode)
    rows = x.reshape(1, 1, -1, x.shape[-1])
    stored = quantize(rows, 8, layout, keys=True)
    dequant = fake_quantize(rows, 8, layout, keys=True).reshape(-1, x.shape[-1])
    for r, row in enumerate(x.float().numpy().astype(F32)):
        codes, scale = vllm_reshape_cache_per_token_head(row, quant_max, quant_min, store)
        ours = stored.codes[0, 0, r].float() - stored.offset
        assert ours.tolist() == codes, (mode, r)
        assert stored.scale[0, 0, r].item() == scale
        assert dequant[r].tolist() == [float(F32(F32(c) * F32(scale))) for c in codes], (mode, r)  # q · scale


@pytest.mark.parametrize("mode", ["vllm-int8-head", "vllm-fp8-head"])
def test_vllm_modes_are_the_kernels_codes_on_edge_rows(mode):
    check_against_vllm(rows_with_edges(), mode)


def test_int4_per_token_head_is_the_kernels_codes_on_edge_rows():
    x = rows_with_edges()
    x[1, :4] = torch.tensor([-3.0, 5.0, 5.0, 5.0])  # lopsided: the zero-point sits off centre
    x[2, :] = 2.5  # a flat row: scale 1e-6
    check_int4_against_vllm(x)


def vllm_fp8_tensor_reference(x: np.ndarray, constant: float, scale: float | None = None) -> tuple[list[float], float]:
    """calc_kv_scales (amax(|x|) / K or V constant, once) then, element by element, `scaled_vec_conversion`:
    __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)."""
    if scale is None:
        amax = F32(0.0)
        for v in x.flat:
            amax = max(amax, F32(abs(v)))
        scale = F32(amax / F32(constant))
    codes = [to_e4m3_rne(min(max(float(F32(v / scale)), -448.0), 448.0)) for v in x.flat]  # SATFINITE
    return codes, float(scale)


def check_fp8_tensor_against_vllm(x: torch.Tensor, keys: bool) -> None:
    layout = layout_named("vllm-fp8-tensor")
    stored = quantize(x, 8, layout, keys=keys)
    dequant = fake_quantize(x, 8, layout, keys=keys)
    codes, scale = vllm_fp8_tensor_reference(x.float().numpy().astype(F32), 200.0 if keys else 100.0)
    assert stored.codes.float().flatten().tolist() == codes and stored.scale.item() == scale
    assert dequant.flatten().tolist() == [float(F32(F32(c) * F32(scale))) for c in codes]


@pytest.mark.parametrize("keys", [True, False])
def test_fp8_per_tensor_is_vllms_calculated_scale_and_conversion(keys):
    x = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(2))
    x[0, 1, 3, 5] = -40.0  # the tensor's amax
    check_fp8_tensor_against_vllm(x, keys)
    later = torch.full((1, 2, 1, 8), 1e3)  # a later token beyond 448 · the first forward's scale: saturated
    first = quantize(x, 8, layout_named("vllm-fp8-tensor"), keys=keys)
    codes, _ = vllm_fp8_tensor_reference(later.numpy(), 0.0, F32(first.scale.item()))
    assert quantize(later, 8, layout_named("vllm-fp8-tensor"), keys=keys, scale=first.scale).codes.float().flatten().tolist() == codes == [448.0] * 16
    assert not layout_named("vllm-fp8-tensor").causal


def test_int8_per_token_head_truncates_where_rounding_would_not():
    """The issue's finding, kept true: truncation is not rounding (a rounding quantizer would fail the test above)."""
    x = torch.tensor([[127.0, 0.6, -0.6, 1.7]])
    codes = quantize(x.view(1, 1, 1, 4), 8, layout_named("vllm-int8-head"), keys=False).codes.float() - 128
    assert codes.flatten().tolist() == [127.0, 0.0, 0.0, 1.0]


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("mode", ["vllm-int8-head", "vllm-int4-head", "vllm-fp8-head", "vllm-fp8-tensor"])
def test_vllm_modes_are_the_kernels_codes_on_smollm2s_keys_and_values(smollm2_dir, mode):
    for tensor, keys in smollm2_keys_and_values(smollm2_dir):
        rows = tensor.reshape(-1, tensor.shape[-1])[:48]  # a slice: the transcriptions are Python loops
        if mode == "vllm-fp8-tensor":
            check_fp8_tensor_against_vllm(tensor[:, :, :16], keys=keys)
        elif mode == "vllm-int4-head":
            check_int4_against_vllm(rows)
        else:
            check_against_vllm(rows, mode)


@pytest.mark.parametrize("mode", ["vllm-int8-head", "vllm-int4-head", "vllm-fp8-head", "vllm-fp8-tensor"])
def test_the_cache_and_the_kv_site_hold_the_same_vllm_codes(tiny_pair, mode):
    """A prompt through the cache stores the mode's codes of the keys and values the model wrote (int4 two a byte),
    and its logits are the kv site's in a full forward (same shapes; across shapes float noise can move a code)."""
    from transformers import DynamicCache

    from quantdiff.models import loading
    from quantdiff.quant.kv_cache import _pack
    from quantdiff.quant.kv_engines import ENGINE_BITS

    model = loading.prepare(tiny_pair["standard"], tile_size=None)
    bits = ENGINE_BITS[mode]
    ids = torch.randint(1, 30, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, plain = quantdiff.kv_cache(model, bits=bits, layout=mode), DynamicCache()
        through_cache = model(ids, use_cache=True, cache=cache).logits
        unquantized = model(ids, use_cache=True, cache=plain).logits
        with quantized(model, QuantConfig(AbsmaxMethod(bits), KVSite(layout=LAYOUTS[mode]))):
            site = model(ids).logits
    layer, written = cache.layers[0], plain.layers[0]  # later layers' inputs already differ: layer 0 read quantized K/V
    for store, tensor, keys in ((layer._keys, written.keys, True), (layer._values, written.values, False)):
        expected = quantize(tensor, bits, LAYOUTS[mode], keys=keys)
        codes = _pack(expected.codes, 4) if bits == 4 else expected.codes
        assert torch.equal(store.codes[bits].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(store.scales[bits], expected.scale)
        assert (bits not in store.zeros) if expected.zero is None else torch.equal(store.zeros[bits], expected.zero)
    assert torch.equal(through_cache, site)
    if mode == "vllm-fp8-tensor":  # a decode step keeps the first forward's scale, as vLLM's calculated scales do
        keys_before = layer._keys.scales[bits].clone()
        with torch.no_grad():
            model(ids[:, :1] * 0 + 3, use_cache=True, cache=cache)
        assert torch.equal(layer._keys.scales[bits], keys_before) and layer._keys.codes[bits].shape[2] == ids.shape[1] + 1
    assert (through_cache - unquantized).abs().max() > 1e-5  # the cache quantized something
    assert repr(cache).endswith(LAYOUTS[mode].name + ")")


def test_vllm_modes_refuse_other_widths_and_groups():
    with pytest.raises(ConfigError, match="stores 8-bit codes, not 4"):
        layout_named("vllm-int8-head").check_bits(4)
    with pytest.raises(ConfigError, match="one scale per token and KV head and its lack of a residual are fixed"):
        layout_named("vllm-fp8-head", group_size=16)
    assert LAYOUTS["vllm-int8-head"].name == "vLLM int8_per_token_head: per token and KV head, float32 scales, codes truncated"
