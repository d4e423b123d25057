"""Multi-needle retrieval: exact-match accuracy, and the paper's attention to answer vs attention noise.

Documents come from `retrieval_data` (key → value needles in held-out filler, a final query for one key).
- `accuracy`: greedy decoding of as many tokens as the answer has gives exactly the answer's tokens. Each step
  recomputes the whole sequence (no KV cache), so dynamic quantization always sees every logit so far, as a
  fresh forward pass would.
- `attention_to_answer` / `attention_noise` (Table 3 of arXiv 2410.05258): teacher-forced on the true
  answer, for each query row that predicts an answer token, the attention mass on the needle's value tokens
  (answer span A) and on the rest of the prompt (noise N; earlier answer tokens count in neither), averaged
  over answer tokens, heads and layers, then over documents. For a differential head the map is
  (A1 − λ·A2) / (1 − λ), λ the layer's λ. The maps are the softmax of the logits *as the taps output them*,
  so a quantization applied to the logits shows in the scores; only the answer rows are kept, tile by tile.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
import torch
import torch.nn.functional as F
from torch import nn

import quantdiff.attention.backend as attention
from quantdiff.data.sources import text_or_held_out
from quantdiff.core.errors import DataError
from quantdiff.attention.observe import observe
from quantdiff.models import structure
from quantdiff.eval.tasks.choice import encode_pair
from quantdiff.data.needles import Filler, NeedleExample, make_needle_example
from quantdiff.eval.bounds import check_sequence_fits
from quantdiff.eval.scoring import Progress, batches_within_budget, left_pad, model_device, next_token_logits, note_scored


@dataclass(frozen=True)
class NeedleItem:
    prompt_ids: list[int]
    answer_ids: list[int]
    answer_positions: list[int]  # indices into prompt_ids of the tokens covering the answer span


@dataclass(frozen=True)
class PreparedRetrieval:
    items: list[NeedleItem]

    def __len__(self) -> int:  # progress units: documents (counted once per pass)
        return len(self.items)


def encode_example(tokenizer, example: NeedleExample, bos_id: int | None = None) -> NeedleItem:
    """Token ids of prompt (after `bos_id` when given) and answer, and which prompt tokens overlap the answer span
    (by char offsets)."""
    prompt_ids, answer_ids = encode_pair(tokenizer, example.prompt, example.answer, bos_id)
    first = int(bos_id is not None)  # where the prompt's text starts
    try:
        offsets = tokenizer(example.prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:  # slow (Python) tokenizers have no offsets
        raise DataError("the retrieval task needs a fast tokenizer (character offsets locate the answer span)") from None
    if len(offsets) != len(prompt_ids) - first:
        raise DataError("the tokenizer splits the prompt differently on its own: cannot locate the answer span")
    start, end = example.answer_span
    positions = [first + i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return NeedleItem(prompt_ids, answer_ids, positions)


@torch.no_grad()
def greedy_generate(model: nn.Module, prompts: list[list[int]], n_tokens: int) -> list[list[int]]:
    """`n_tokens` greedy tokens after each prompt, recomputing the full sequence at every step."""
    seqs = [list(p) for p in prompts]
    for _ in range(n_tokens):
        logits = next_token_logits(model, seqs)[:, -1]  # (B, V): left padding puts every last token at -1
        note_scored(logits)
        for seq, token in zip(seqs, logits.argmax(dim=-1).tolist()):
            seq.append(token)
    return [seq[len(p) :] for seq, p in zip(seqs, prompts)]


def exact_matches(model: nn.Module, items: list[NeedleItem], batch_size: int = 8, progress: Progress | None = None) -> list[bool]:
    out = []
    for part in batches_within_budget(model, [len(it.prompt_ids) + len(it.answer_ids) for it in items], batch_size):
        batch = items[part]
        generated = greedy_generate(model, [it.prompt_ids for it in batch], max(len(it.answer_ids) for it in batch))
        out.extend(gen[: len(it.answer_ids)] == it.answer_ids for gen, it in zip(generated, batch))
        if progress is not None:
            progress(len(batch))
    return out


@torch.no_grad()
def last_rows_attention(model: nn.Module, seqs: list[list[int]], rows: int) -> list[torch.Tensor]:
    """Per layer, the attention maps (B, heads, rows, S) of the last `rows` query rows of a left-padded batch.

    Tap hooks keep only those rows of every key tile, so memory grows with rows·S, not S². Differential
    layers yield their combined (A1 − λA2)/(1 − λ) maps (H/2 heads), with DIFF V2's λ of each query row.
    """
    modules = list(attention.iter_attention_modules(model))
    if not modules:
        raise DataError("attention scores need a model loaded with quantdiff (no attention taps found)")
    tiles: dict[int, list[tuple[int, torch.Tensor]]] = {}
    sinks: dict[int, torch.Tensor | None] = {}

    def keep_last_rows(tap: attention.Tap, args: tuple, logits: torch.Tensor) -> None:
        ctx = args[1]
        sinks[ctx.layer_idx] = ctx.sinks
        last = attention.softmax_input(logits.float(), ctx).masked_fill(~ctx.valid.expand_as(logits), float("-inf"))[:, :, -rows:]  # (B, H, ≤rows, cols)
        # A tile may start below some of the wanted rows (queries before its first key): those see none of it.
        last = F.pad(last, (0, 0, rows - last.shape[2], 0), value=float("-inf"))  # (B, H, rows, cols)
        tiles.setdefault(ctx.layer_idx, []).append((ctx.k_start, last))

    token_lambdas: dict[int, torch.Tensor] = {}  # DIFF V2: layer -> λ of the kept rows, (B, H/2, rows, 1)

    def keep_last_lambdas(layer: int, lam: torch.Tensor) -> None:
        token_lambdas[layer] = lam[:, -rows:].transpose(1, 2)[..., None]

    handles = [m.quantdiff_tap.register_forward_hook(keep_last_rows) for m in modules]
    try:
        ids, mask, positions = left_pad(seqs, model_device(model))
        with observe(model, on_lambda=keep_last_lambdas):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    maps = []
    for module in sorted(modules, key=lambda m: m.quantdiff_tap.layer_idx):
        logits = torch.cat([t for _, t in sorted(tiles[module.quantdiff_tap.layer_idx], key=lambda kt: kt[0])], dim=-1)  # (B, H, rows, S)
        probs = attention.attention_probs(logits, sinks[module.quantdiff_tap.layer_idx]).nan_to_num(0.0)  # padding rows attend to nothing
        tap = module.quantdiff_tap
        if tap.differential:
            lam = token_lambdas[tap.layer_idx] if tap.layer_idx in token_lambdas else structure.differential_lambda(module)
            probs = structure.differential_map(probs, lam, tap.pairing)  # (B, H/2, rows, S)
        maps.append(probs)
    return maps


@torch.no_grad()
def answer_attention(model: nn.Module, items: list[NeedleItem], batch_size: int = 8, progress: Progress | None = None) -> tuple[float, float]:
    """(mean attention to answer, mean attention noise) over documents; see the module docstring."""
    answer_scores, noise_scores = [], []
    for part in batches_within_budget(model, [len(it.prompt_ids) + len(it.answer_ids) for it in items], batch_size):
        batch = items[part]
        inputs = [it.prompt_ids + it.answer_ids[:-1] for it in batch]
        rows = max(len(it.answer_ids) for it in batch)
        maps = last_rows_attention(model, inputs, rows)
        width = max(len(seq) for seq in inputs)
        for b, (it, seq) in enumerate(zip(batch, inputs)):
            first = width - len(seq)  # column of the sequence's first token
            answer = torch.zeros(width, dtype=torch.bool)
            answer[[first + p for p in it.answer_positions]] = True
            noise = torch.zeros(width, dtype=torch.bool)
            noise[first : first + len(it.prompt_ids)] = True
            noise &= ~answer
            # (layers, heads, n_answer, S): the rows predicting this document's answer tokens
            a = torch.stack([m[b, :, rows - len(it.answer_ids) :] for m in maps]).cpu()
            answer_scores.append(a[..., answer].sum(-1).mean().item())
            noise_scores.append(a[..., noise].sum(-1).mean().item())
        if progress is not None:
            progress(len(batch))
    return sum(answer_scores) / len(answer_scores), sum(noise_scores) / len(noise_scores)


@dataclass
class RetrievalTask:
    """`depth`: where needles sit in the filler (0 = start, 1 = end); None = a random depth per needle.
    `filler_path`: a UTF-8 text file for the filler; None = the corpus' held-out split."""

    context_tokens: int = 256
    n_needles: int = 2
    depth: float | None = None
    examples: int = 50
    seed: int = 0
    filler_path: Path | None = None
    batch_size: int = 8
    name: str = "retrieval"
    metrics: tuple[str, ...] = ("accuracy", "attention_to_answer", "attention_noise")
    headline: ClassVar[str] = "accuracy"
    bos_by_construction: ClassVar[bool] = False

    def make_examples(self, tokenizer, limit: int | None = None, context_tokens: int | None = None) -> list[NeedleExample]:
        """Needle documents of `context_tokens` tokens (default the task's)."""
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise DataError(f"needle depth must be in [0, 1], got {self.depth}")
        filler = Filler.from_tokenizer(text_or_held_out(self.filler_path), tokenizer)
        rng = random.Random(self.seed)
        n = self.examples if limit is None else min(limit, self.examples)
        return [
            make_needle_example(rng, filler, context_tokens or self.context_tokens, self.n_needles, self._depths(rng)) for _ in range(n)
        ]

    def _depths(self, rng: random.Random) -> list[float]:
        if self.depth is None:
            return [rng.random() for _ in range(self.n_needles)]
        return [self.depth] * self.n_needles

    def prepare(self, tokenizer, limit: int | None = None, bos_id: int | None = None) -> PreparedRetrieval:
        """Documents of `context_tokens` tokens, BOS (`bos_id`) included when given."""
        examples = self.make_examples(tokenizer, limit, self.context_tokens - (bos_id is not None))
        return PreparedRetrieval([encode_example(tokenizer, ex, bos_id) for ex in examples])

    def damage_sequences(self, prepared: PreparedRetrieval) -> list[list[int]]:
        """Each document followed by its true answer: the teacher-forced sequence the attention scores run on."""
        return [item.prompt_ids + item.answer_ids for item in prepared.items]

    def evaluate(self, model: nn.Module, prepared: PreparedRetrieval, progress: Progress | None = None) -> dict[str, float]:
        longest = max((len(it.prompt_ids) + len(it.answer_ids) for it in prepared.items), default=0)
        check_sequence_fits(longest, model.config, self.batch_size, "a retrieval document", model_device(model))
        half = (lambda n: progress(n / 2)) if progress is not None else None  # two passes over the documents
        matches = exact_matches(model, prepared.items, self.batch_size, half)
        to_answer, noise = answer_attention(model, prepared.items, self.batch_size, half)
        return {
            "accuracy": sum(matches) / len(matches),
            "attention_to_answer": to_answer,
            "attention_noise": noise,
            "examples": len(matches),
        }
