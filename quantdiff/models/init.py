"""How a freshly built model's weights start: the Differential Transformer authors' scheme ("authors"), or
transformers' `_init_weights` ("transformers"). Every arm of a run takes the same one — one framework, as the paper
compares its models.

"transformers": every nn.Linear and the token embedding N(0, initializer_range = 0.02), norms ones, and each kind's
extras as its class initialises them. This is what `build_model` always did, and what anyone who trains
transformers' DiffLlama from scratch gets.

"authors": what the authors train Diff in, YOCO (microsoft/unilm issue #1663), read in microsoft/unilm:
- `YOCO/yoco/models/decoder/model_parallel_init.py`: `init_method` = `nn.init.kaiming_uniform_(a=√5)`, used for
  every attention and MLP projection (`sliding_window_attention.py`, `cross_attention.py`,
  `feedforward_network.py`), and `vocab_init_method` = N(0, std = embedding dim^-0.5) for the token embedding.
  kaiming_uniform_(a=√5) is PyTorch's own nn.Linear default: U(±1/√fan_in), std 1/√(3·fan_in). (The same file's
  xavier `qkvg_init_method`/`out_init_method` serve YOCO's gated-retention layers only, which are not attention.)
- `YOCO/yoco/models/decoder/yoco.py`: `embed_scale = sqrt(dim)` multiplies the embedding output in the forward; the
  LM head `output_projection` is a plain `nn.Linear(dim, vocab, bias=False)`, so PyTorch's default, the same
  kaiming-uniform; RMSNorm weights start at ones (`rms_norm.py`).
- `Diff-Transformer/multihead_diffattn.py` and `multihead_flashdiff_{1,2}.py`: plain nn.Linear projections (the
  flashdiff files define the same `init_method`), λ vectors N(0, 0.1), and the per-head norm
  `subln = RMSNorm(2·head_dim, eps=1e-5, elementwise_affine=True)`: a learnable gain starting at ones (unilm pull
  request #1644, "diff elementwise_affine=true"). transformers' DiffLlama has it without a gain
  (`DiffLlamaAttention.groupnorm`, elementwise_affine=False).
So here, for every kind: every nn.Linear (projections, MLP, LM head, DIFF V2's W_λ, the gated kind's gate) reset
to PyTorch's default (kaiming-uniform a = √5, biases U(±1/√fan_in) if any); the token embedding N(0, 1/D) with a
√D multiplier in the forward; RMSNorm weights ones; DiffLlama's λ vectors N(0, 0.1) and the sink logits 0 as
their classes start them; Diff V1's per-head norm given its gain.

Where the other arms' authors initialise otherwise (kept to the one scheme above, as the paper compares):
- DIFF V2, `Diff-Transformer/Diff-Transformer-V2/multihead_flashdiffv2.py`: plain nn.Linear, W_λ included, and no
  init code of its own: PyTorch's default, the same as here.
- Qiu et al.'s gated attention, qiuzh20/gated_attention `modeling_qwen3.py` (`Qwen3PreTrainedModel._init_weights`,
  `initializer_range` = 0.02 in `configuration_qwen3.py`): every Linear — the gate rows of q_proj included — and
  the embedding N(0, 0.02), no embedding multiplier: transformers' scheme. Here the gate is a Linear like every
  other, kaiming-uniform.
- GPT-OSS, transformers' `models/gpt_oss/modeling_gpt_oss.py` (`GptOssPreTrainedModel._init_weights`): sinks and
  Linears N(0, initializer_range). Here the sinks start at 0 under both schemes (models/sink.py: the model starts
  as softmax-off-by-one).

Every model stays a plain transformers class: the √D multiplier and Diff V1's gain are training-time
reparametrisations (`torch.nn.utils.parametrize`), so every hook, quantizer and attention backend sees an ordinary
model. The embedding's weight is `original · √D`; o_proj's weight is `original · gain` over its input columns —
DiffLlama's o_proj reads pair p's normed 2·head_dim outputs at columns p·2d + j, so gain[j] scales column p·2d + j
of every pair, which is exactly a norm gain since o_proj is linear. `fold` writes both into the weights before a
model is saved. Tied input and output embeddings are refused under "authors": folding √D into a shared matrix would
scale the LM head too.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers import PreTrainedModel
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

from quantdiff.core.errors import ConfigError

INITS = ("authors", "transformers")
DEFAULT_INIT = "authors"  # recipes and `quantdiff pair`
LEGACY_INIT = "transformers"  # build_model's default: throwaway models (tests, benchmarks) as they always were


def check_init(init: str, what: str = "init", tied: bool = False) -> None:
    """ConfigError unless `init` is a known scheme (and, under "authors", the embeddings are untied)."""
    if init not in INITS:
        raise ConfigError(f"{what} must be one of {', '.join(INITS)}, got {init!r}")
    if init == "authors" and tied:
        raise ConfigError(f"{what} = authors cannot tie the input and output embeddings: its √D embedding multiplier "
                          "would scale the LM head too (untie them, or use init = transformers)")


class Scale(nn.Module):
    """A parametrisation: the tensor times a fixed factor (the embedding's √D)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.factor


class ColumnGain(nn.Module):
    """A parametrisation: a learnable gain (ones at start, 1-D so it is not weight-decayed) scaling the weight's
    input columns, tiled over the groups of `gain.numel()` columns (Diff V1's per-head norm gain on o_proj)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.gain.repeat(weight.shape[1] // self.gain.numel())


@torch.no_grad()
def _authors_weights(model: PreTrainedModel) -> None:
    """Every nn.Linear to PyTorch's default (kaiming-uniform, a = √5), the token embedding N(0, 1/D)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    embedding = model.get_input_embeddings()
    embedding.weight.normal_(0.0, embedding.embedding_dim ** -0.5)
    if embedding.padding_idx is not None:  # as transformers and nn.Embedding leave it
        embedding.weight[embedding.padding_idx].zero_()


def apply_authors_init(model: PreTrainedModel) -> PreTrainedModel:
    """Re-initialise `model` (built by transformers' init) with the authors' scheme, in its training form: the √D
    multiplier and Diff V1's gain as parametrisations (`fold` removes them). Returns `model`."""
    output = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    check_init("authors", "init", tied=output is not None and output.weight is embedding.weight)
    _authors_weights(model)
    parametrize.register_parametrization(embedding, "weight", Scale(math.sqrt(embedding.embedding_dim)))
    for module in model.modules():
        if isinstance(module, DiffLlamaAttention):
            parametrize.register_parametrization(module.o_proj, "weight", ColumnGain(2 * module.head_dim))
    return model


def initialise(model: PreTrainedModel, init: str) -> PreTrainedModel:
    """`model`, freshly built with transformers' init, under scheme `init` (training form: see `fold`)."""
    check_init(init)
    return apply_authors_init(model) if init == "authors" else model


def fold(model: nn.Module) -> nn.Module:
    """Every parametrisation written into its weight (`leave_parametrized`): a plain model whose state dict has the
    keys transformers' loader expects, computing the same function. In place; returns `model`."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    return model
