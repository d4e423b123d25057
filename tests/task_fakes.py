"""Fixed fake models and tokenizers whose scores can be computed by hand (shared by the task tests)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

VOCAB = 128  # character codes
# A unigram "language model": the next character never depends on the context.
UNIGRAM = {" ": 0.25, "a": 0.5, "b": 0.125}
OTHER = (1 - sum(UNIGRAM.values())) / (VOCAB - len(UNIGRAM))


def logp(char: str) -> float:
    return math.log(UNIGRAM.get(char, OTHER))


class CharTokenizer:
    """One token per character (its code point); no BOS, EOS = 0."""

    bos_token_id = None
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return VOCAB


class UnigramModel(nn.Module):
    """Logits = log UNIGRAM at every position, whatever the input."""

    def __init__(self) -> None:
        super().__init__()
        self.log_probs = nn.Parameter(torch.tensor([logp(chr(i)) for i in range(VOCAB)], dtype=torch.float64))

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.log_probs.expand(*input_ids.shape, VOCAB))


# Three items and what the unigram model gives them; every ending is scored as " " + ending.
ITEMS = [
    {"ctx": "x", "endings": ["a", "aa"], "label": 1},  # acc picks "a" (wrong), acc_norm "aa" (right)
    {"ctx": "y", "endings": ["b", "a", "bb"], "label": 1},  # both pick "a" (right)
    {"ctx": "z", "endings": ["aaaa", "b"], "label": 1},  # acc picks "b" (right), acc_norm "aaaa" (wrong)
]
EXPECTED_ACC = 2 / 3
EXPECTED_ACC_NORM = 2 / 3


def hand_loglik(ending: str) -> float:
    return sum(logp(c) for c in " " + ending)
