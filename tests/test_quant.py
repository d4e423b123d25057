"""Pure quantizers against their defining equations and naive loop implementations."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantdiff.core.errors import ConfigError
from quantdiff.quant.numerics import (
    PerColumn,
    PerRow,
    PerTensor,
    absmax,
    absmax_quantize,
    fake_quantize_with_absmax,
    groupwise_absmax_quantize,
    llm_int8_matmul,
    outlier_features,
    qmax,
    quantize_with_absmax,
    vectorwise_quantize,
)

GRANULARITIES = [PerTensor(), PerRow(), PerColumn()]
FLOATS = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw, max_side: int = 9) -> torch.Tensor:
    rows, cols = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    values = draw(st.lists(FLOATS, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).view(rows, cols)


def naive_scale(x: torch.Tensor, granularity, bits: int) -> torch.Tensor:
    """The scale each entry of a 2-d x gets, from loops: max|x| / (2^(b-1) - 1) over its group."""
    rows, cols = x.shape
    scale = torch.empty_like(x)
    for i in range(rows):
        for j in range(cols):
            if isinstance(granularity, PerTensor):
                group = x
            elif isinstance(granularity, PerRow):
                group = x[i]
            else:
                group = x[:, j]
            scale[i, j] = group.abs().max() / (2 ** (bits - 1) - 1)
    return scale


@settings(max_examples=60, deadline=None)
@given(x=matrices(), bits=st.integers(2, 16), g=st.sampled_from(GRANULARITIES))
def test_absmax_error_bound_code_range_and_scale(x, bits, g):
    r = absmax_quantize(x, bits, g)
    scale = naive_scale(x, g, bits)
    torch.testing.assert_close(r.scale.expand_as(x), scale, rtol=1e-6, atol=0)
    err = (r.dequant - x).abs()
    bound = scale / 2 + 1e-6 * x.abs() + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    assert r.codes.dtype == (torch.int8 if bits <= 8 else torch.int16)
    assert r.codes.abs().max() <= qmax(bits)
    torch.testing.assert_close(r.dequant, r.codes.float() * r.scale, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(x=matrices(), bits=st.integers(2, 16), g=st.sampled_from(GRANULARITIES))
def test_absmax_idempotent(x, bits, g):
    once = absmax_quantize(x, bits, g)
    twice = absmax_quantize(once.dequant, bits, g)
    assert torch.equal(twice.codes, once.codes)
    torch.testing.assert_close(twice.dequant, once.dequant, rtol=5e-7, atol=0)  # the rescale may move an ulp or two


@settings(max_examples=40, deadline=None)
@given(x=matrices(), bits=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_mask_entries_pass_through_and_do_not_set_scale(x, bits, seed):
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
    poisoned = x.masked_fill(~mask, 1e30)  # must neither set the scale nor be quantized
    r = absmax_quantize(poisoned, bits, PerTensor(), mask=mask)
    expect_scale = x[mask].abs().max() / qmax(bits) if mask.any() else torch.tensor(0.0)
    torch.testing.assert_close(r.scale.view(()), expect_scale, rtol=1e-6, atol=0)
    assert torch.equal(r.dequant[~mask], poisoned[~mask])
    assert (r.codes[~mask] == 0).all()


@settings(max_examples=40, deadline=None)
@given(x=matrices(), bits=st.integers(2, 16), seed=st.integers(0, 2**16), half=st.booleans())
def test_fake_quantize_equals_dequant_of_full_quantize(x, bits, seed, half):
    x = x.half() if half else x
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.7
    amax = absmax(x, PerRow(), mask)
    expect = quantize_with_absmax(x, amax, bits, mask).dequant
    assert torch.equal(fake_quantize_with_absmax(x, amax, bits, mask), expect)
    assert torch.equal(fake_quantize_with_absmax(x, amax, bits), quantize_with_absmax(x, amax, bits).dequant)


def test_masked_fake_quantize_runs_with_autograd():
    """A forward outside no_grad (the README's first call) takes an allocating path with the same values."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 5
    mask = torch.rand(4, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    amax = absmax(x, PerRow(), mask)
    expect = fake_quantize_with_absmax(x, amax, 4, mask)
    got = fake_quantize_with_absmax(x.clone().requires_grad_(), amax, 4, mask)
    assert torch.equal(got.detach(), expect), (got.detach() - expect).abs().max()


@pytest.mark.parametrize("g", GRANULARITIES, ids=lambda g: type(g).__name__)
def test_zero_tensor_gives_zero_codes_without_nan(g):
    r = absmax_quantize(torch.zeros(3, 4), 8, g)
    assert torch.equal(r.dequant, torch.zeros(3, 4)) and not r.codes.any() and not r.scale.any()


@pytest.mark.parametrize("tiny", [1.4e-45, 1e-40, 1e-37], ids=["subnormal-min", "subnormal", "below-127/max"])
def test_tiny_absmax_flushes_to_zero_without_nan(tiny):
    r = absmax_quantize(torch.tensor([[0.0, tiny, -tiny]]), 8)  # 127 / absmax overflows float32
    assert torch.equal(r.dequant, torch.zeros(1, 3)) and not r.codes.any()


def test_zero_row_next_to_nonzero_rows():
    x = torch.tensor([[0.0, 0.0], [7.0, -3.0]])
    r = absmax_quantize(x, 4, PerRow())  # row 1: scale 7 / 7 = 1
    assert torch.equal(r.dequant[0], torch.zeros(2)) and torch.equal(r.dequant[1], x[1])  # ±absmax is on the grid


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["dtype=fp16", "dtype=bf16"])
def test_half_inputs_are_computed_in_float32(dtype):
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)).to(dtype)
    r = absmax_quantize(x, 6, PerRow())
    ref = absmax_quantize(x.float(), 6, PerRow())
    assert r.dequant.dtype == dtype
    assert torch.equal(r.codes, ref.codes)
    assert torch.equal(r.dequant, ref.dequant.to(dtype))


def test_batch_dims_give_one_scale_per_sequence():
    x = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(1))
    x[1] *= 100  # a loud sequence must not coarsen the other one's grid
    batched = absmax_quantize(x, 4, PerTensor(), batch_dims=1)
    alone = absmax_quantize(x[0], 4, PerTensor())
    assert torch.equal(batched.dequant[0], alone.dequant)


@pytest.mark.parametrize("bits", [1, 17, 0, 8.0, True, "8"], ids=lambda b: f"bits={b!r}")
def test_bad_bits_raise_config_error(bits):
    with pytest.raises(ConfigError, match="bits"):
        absmax_quantize(torch.ones(2, 2), bits)


# ---- LLM.int8 -----------------------------------------------------------------------------------------------


def _at_tie(scaled: float) -> bool:
    """Whether x · q / absmax lies so near a rounding midpoint that float32 arithmetic (bitsandbytes', ours) may
    round it to the other neighbour than the exact value does: within a few float32 ulps of the value (2⁻²⁴
    relative each: the quotient, the product and the reciprocal torch takes for q / absmax)."""
    return abs(abs(scaled) % 1.0 - 0.5) < 1e-6 + 4 * 2.0**-24 * abs(scaled)


def naive_llm_int8(a: torch.Tensor, w: torch.Tensor, bits: int, threshold: float):
    """LLM.int8 written out from the paper + bitsandbytes, with loops, in float64: (outlier cols, product, slack).
    `slack` (n, m) is what codes at a rounding tie may move the product by (one code step each), the only place
    the float32 implementation may differ by more than float error."""
    q = 2 ** (bits - 1) - 1
    n, k = a.shape
    cols = [j for j in range(k) if any(abs(float(a[i, j])) >= threshold for i in range(n))]
    y = torch.zeros(n, w.shape[0], dtype=torch.float64)
    slack = torch.zeros(n, w.shape[0], dtype=torch.float64)
    w_absmax = w.abs().amax(dim=1).double()
    w_scaled = w.double() * q / w_absmax[:, None]
    w_codes = torch.round(w_scaled)
    w_ties = torch.tensor([[_at_tie(float(v)) for v in row] for row in w_scaled], dtype=torch.float64)
    for i in range(n):
        small = [abs(float(v)) for v in a[i] if abs(float(v)) < threshold]
        a_absmax = max(small, default=0.0)
        for j in range(k):
            weight = w_codes[:, j] * w_absmax / q
            slack[i] += abs(float(a[i, j])) * w_ties[:, j] * w_absmax / q
            if j in cols:  # outlier feature: exact activation times dequantized weight column
                y[i] += float(a[i, j]) * weight
            elif a_absmax > 0:
                scaled = float(a[i, j]) * q / a_absmax
                y[i] += round(scaled) * (a_absmax / q) * weight
                slack[i] += (a_absmax / q) * weight.abs() * _at_tie(scaled)
    return cols, y, slack


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), bits=st.integers(2, 16), n=st.integers(1, 6), k=st.integers(1, 8))
def test_llm_int8_matches_naive_loops(seed, bits, n, k):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k, generator=g) * 4  # |a| ≥ 6 occurs in a few percent of entries
    w = torch.randn(3, k, generator=g)
    r = llm_int8_matmul(a, w, bits=bits, threshold=6.0)
    cols, y, slack = naive_llm_int8(a, w, bits, 6.0)
    assert r.outlier_cols.tolist() == cols
    assert torch.equal(r.a.dequant[:, cols], a[:, cols])  # outlier features are exact
    assert not r.a.codes[:, cols].any()
    gap = (r.product.double() - y).abs()
    assert (gap <= 1e-5 + 1e-5 * y.abs() + slack).all(), (gap, slack)


def test_llm_int8_row_absmax_ignores_outlier_entries_only():
    # bitsandbytes' rule: the outlier entry is zeroed before the row absmax, its column's other entries still count.
    a = torch.tensor([[10.0, 1.0, 2.0], [5.0, 1.0, 0.5]])
    r = vectorwise_quantize(a, 8, threshold=6.0)
    assert r.outliers.tolist() == [[True, False, False]]
    assert r.row_absmax.tolist() == [2.0, 5.0]


def test_llm_int8_all_outliers_is_exact():
    a = torch.full((3, 4), 7.0) * torch.tensor([1.0, -1.0, 2.0, 1.5])
    w = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    r = llm_int8_matmul(a, w)
    assert r.a.outliers.all() and not r.a.codes.any()
    torch.testing.assert_close(r.product, a @ r.weight.dequant.T, rtol=0, atol=0)


def test_llm_int8_keeps_batch_shape_and_dtype():
    a = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    r = llm_int8_matmul(a, w, bits=4)
    assert r.product.shape == (2, 3, 4) and r.product.dtype == torch.bfloat16
    flat = llm_int8_matmul(a.reshape(6, 8), w, bits=4)  # outlier columns are found over all rows, as bnb does
    assert torch.equal(r.product.reshape(6, 4), flat.product)


def test_outlier_features_per_leading_index():
    x = torch.zeros(2, 3, 4)
    x[1, 2, 3] = 6.0
    assert outlier_features(x, 6.0).squeeze(1).tolist() == [[False] * 4, [False, False, False, True]]
    assert not outlier_features(x, 0.0).any()


def test_weight_shape_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match="does not fit"):
        llm_int8_matmul(torch.ones(2, 3), torch.ones(4, 5))


@settings(max_examples=60, deadline=None)
@given(x=matrices(max_side=13), bits=st.integers(2, 8), group_size=st.integers(1, 6))
def test_groupwise_absmax_equals_naive_per_group_loops(x, bits, group_size):
    """Groups of G consecutive inputs per row, the last one shorter when G does not divide the width."""
    q = 2 ** (bits - 1) - 1
    expect = torch.empty_like(x)
    for i in range(x.shape[0]):
        for start in range(0, x.shape[1], group_size):
            group = x[i, start : start + group_size]
            amax = group.abs().max()
            inv = q / amax
            inv = inv if torch.isfinite(inv) else torch.tensor(0.0)  # zero or denormal group: codes 0, no NaN
            expect[i, start : start + group_size] = (group * inv).round().clamp(-q, q) * (amax / q)
    result = groupwise_absmax_quantize(x, bits, group_size)
    assert torch.equal(result.dequant, expect)
    assert result.scale.shape == (x.shape[0], -(-x.shape[1] // group_size))
    assert result.codes.shape == x.shape and int(result.codes.abs().max()) <= q


@pytest.mark.parametrize("group_size", [0, -4, 2.5, True])
def test_bad_group_size_raises_config_error(group_size):
    with pytest.raises(ConfigError, match="group size"):
        groupwise_absmax_quantize(torch.ones(2, 8), 4, group_size)
