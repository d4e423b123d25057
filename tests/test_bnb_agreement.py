"""At 8 bits our LLM.int8 agrees with bitsandbytes' own CPU kernels.

Where the numbers can differ, and by how much:
- bitsandbytes casts activations and weights to float16 before quantizing; we quantize in float32. Inputs that
  are exactly representable in float16 give identical codes, row statistics and outlier columns (asserted
  bit for bit). For arbitrary float32 inputs a code can move by one step, so the product may differ by up to
  one activation step times Σ|w| per output (the bound used below).
- bitsandbytes dequantizes the int32 product with the constant 6.200124e-05, which is 1/127² = 6.2000124e-05
  with a digit slipped: 1.8e-5 relative. Plus float32 summation order: products agree to 1e-4 relative.
"""

import logging

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import pytest
import torch
from torch import nn

from quantdiff.quant.numerics import PerTensor, llm_int8_matmul, vectorwise_quantize
from quantdiff.quant.sites import LinearSite, LLMInt8Method, QuantConfig, quantized

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to float16" on every call

PRODUCT_RTOL = 1e-4  # of max |y|: bnb's 6.200124e-05 constant (1.8e-5) + float32 summation order


def fp16_exact(*shape: int, seed: int, scale: float = 2.5) -> torch.Tensor:
    """float32 values exactly representable in float16, with a few |x| ≥ 6 outliers at scale 2.5."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).half().float()


def eval_state() -> bnb.MatmulLtState:
    # threshold and is_training are class attributes, not dataclass fields: MatmulLtState(threshold=6.0) is a
    # TypeError. is_training must be False: on CPU the training path (MatMul8bitFp) skips activation quantization.
    state = bnb.MatmulLtState()
    state.threshold = 6.0
    state.is_training = False
    state.has_fp16_weights = False
    return state


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threshold", [0.0, 6.0], ids=["threshold=0", "threshold=6"])
def test_codes_row_stats_and_outlier_cols_equal_bnb(seed, threshold):
    a = fp16_exact(17, 24, seed=seed).half()
    codes, stats, cols = bnbF.int8_vectorwise_quant(a.clone(), threshold=threshold)
    ours = vectorwise_quantize(a, 8, threshold)
    assert torch.equal(ours.codes, codes)
    assert torch.equal(ours.row_absmax, stats)
    if threshold > 0:
        assert cols.numel() > 0, "the test input should hold outliers"
        assert torch.equal(ours.outlier_cols, cols)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [(9, 32), (2, 7, 32)], ids=["2d", "3d"])
def test_matmul_equals_bnb_matmul(seed, shape):
    a = fp16_exact(*shape, seed=seed)
    weight = fp16_exact(12, 32, seed=seed + 100, scale=0.2)
    state = eval_state()
    expect = bnb.matmul(a, weight, state=state)  # bnb's B is the weight (out, in): y = a @ weightᵀ
    ours = llm_int8_matmul(a, weight, bits=8, threshold=6.0)
    assert torch.equal(ours.weight.codes, state.CB) and torch.equal(ours.weight.row_absmax, state.SCB)
    assert torch.equal(ours.outlier_cols, state.idx) and state.idx.numel() > 0
    torch.testing.assert_close(ours.product, expect, rtol=0, atol=PRODUCT_RTOL * expect.abs().max().item())


def _bnb_linear(layer: nn.Linear) -> bnb.nn.Linear8bitLt:
    int8 = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=True, has_fp16_weights=False, threshold=6.0)
    int8.load_state_dict(layer.state_dict())
    return int8.to("cpu").eval()  # .to(device) quantizes the weight; eval: train mode skips activation quantization


def _fp16_exact_linear(seed: int) -> nn.Linear:
    """A 32 → 16 linear whose weights and bias float16 holds exactly (bitsandbytes computes in float16)."""
    torch.manual_seed(seed)
    layer = nn.Linear(32, 16)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.half().float())
        layer.bias.copy_(layer.bias.half().float())
    return layer


@pytest.mark.parametrize("seed", [0, 1])
def test_linear_site_equals_linear8bitlt_eval(seed):
    layer = _fp16_exact_linear(seed)
    x = fp16_exact(1, 10, 32, seed=seed)  # one sequence: our outlier columns are per sequence, bnb's per batch
    int8 = _bnb_linear(layer)
    with torch.no_grad():
        expect = int8(x)
        with quantized(nn.Sequential(layer), QuantConfig(LLMInt8Method(8, granularity=PerTensor()), LinearSite(filter=lambda m, fqn: True))):
            ours = layer(x)
    torch.testing.assert_close(ours, expect, rtol=0, atol=PRODUCT_RTOL * expect.abs().max().item())


@pytest.mark.parametrize("seed", [0, 1])
def test_causal_linear_site_equals_linear8bitlt_one_token_at_a_time(seed):
    """Granularity row (the default): each token's outliers its own, what bitsandbytes computes decoding token by token."""
    layer = _fp16_exact_linear(seed)
    x = fp16_exact(1, 10, 32, seed=seed)
    int8 = _bnb_linear(layer)
    with torch.no_grad():
        expect = torch.cat([int8(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        with quantized(nn.Sequential(layer), QuantConfig(LLMInt8Method(8), LinearSite(filter=lambda m, fqn: True))):
            ours = layer(x)
        whole = int8(x)
    torch.testing.assert_close(ours, expect, rtol=0, atol=PRODUCT_RTOL * expect.abs().max().item())
    assert (whole - expect).abs().max() > PRODUCT_RTOL * expect.abs().max()  # a prompt's columns are not a token's own


def test_linear_site_float32_inputs_within_one_code_step():
    torch.manual_seed(3)
    layer = nn.Linear(32, 16)
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(3)) * 2.5  # not float16-exact
    int8 = _bnb_linear(layer)
    with torch.no_grad():
        expect = int8(x)
        with quantized(nn.Sequential(layer), QuantConfig(LLMInt8Method(8, granularity=PerTensor()), LinearSite(filter=lambda m, fqn: True))):
            ours = layer(x)
    row_step = vectorwise_quantize(x[0], 8, 6.0).row_absmax / 127  # one activation code step per row
    w_deq = vectorwise_quantize(layer.weight.detach().half().float(), 8).dequant
    bound = row_step[:, None] * w_deq.abs().sum(dim=1)[None, :]  # (T, out): a code moved by one step everywhere
    assert ((ours[0] - expect[0]).abs() <= bound + PRODUCT_RTOL * expect.abs().max()).all()


def test_train_mode_bnb_does_not_quantize_activations():
    """Why the comparisons use eval mode: in train mode bnb's CPU path multiplies float activations."""
    torch.manual_seed(4)
    layer = nn.Linear(32, 16)
    x = fp16_exact(1, 10, 32, seed=4)
    int8 = _bnb_linear(layer).train()
    w_deq = vectorwise_quantize(layer.weight.detach().half().float(), 8).dequant
    with torch.no_grad():
        y_train = int8(x)
        with quantized(nn.Sequential(layer), QuantConfig(LLMInt8Method(8, granularity=PerTensor()), LinearSite(filter=lambda m, fqn: True))):
            ours = layer(x)
    assert (y_train - ours).abs().max() > 10 * PRODUCT_RTOL * ours.abs().max()
    torch.testing.assert_close(y_train, x @ w_deq.T + layer.bias.detach(), rtol=1e-3, atol=1e-3)
