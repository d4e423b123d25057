"""Train a recipe's arms (by default the standard/differential pair): same initial seed, same batches in the same order.

All arms step in lockstep on each batch, so they see identical data and are checkpointed together.
Batches are a pure function of (seed, step): resuming needs no data-loader state, only the weights, the
optimizer moments and the step — saved as safetensors + JSON (nothing pickled). The learning rate is a pure
function of the step too, so an interrupted and resumed run ends with the same weights as an
uninterrupted one. On the CPU the run trains on one thread, and under `quantdiff train` with pinned kernels
(train.determinism): then a seed gives the same weights bit for bit on any x86-64 CPU with AVX2.

Each batch row is either a window of the training split or, with probability `retrieval_fraction`, a
needle document (quantdiff/data/needles.py) whose filler comes from the training split. The
curriculum, over the first half of training, raises the needles per document from 1 to
`retrieval_max_needles`, spreads them from the last 10% of the document (copy distance of a few
tokens, which a tiny model picks up first) to anywhere in it (copy across the whole context), and
shortens the values from `retrieval_value_words_start` words to the evaluated length. For the first
`copy_warmup_steps` steps the needle rows are random-token copy documents instead (`copy_document`).
With `[train] bos = true` every row starts with the BOS token (and so does every evaluated sequence).
With the `bigram-backcopy` source every row is a generated sequence instead (data.bigram_backcopy), and the
held-out sequences come from its held-out seed stream.

At every eval step all arms are scored on held-out text (the lm task) and measured on the same fixed
held-out sequences (`train.emergence`): the log's `outliers` series shows when outliers and sinks appear.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import quantdiff.data.bigram_backcopy as bigram_backcopy
import quantdiff.data.corpus as corpus
import quantdiff.data.tokenized as tokenized
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.core.progress import progress_bar
from quantdiff.data.bigram_backcopy import BigramBackcopy
from quantdiff.models.init import fold
from quantdiff.models.pairs import budget_matched, build_model, kind_configs, lambda_parameter_count, parameter_count
from quantdiff.train.recipe import ArmConfig, Recipe, TrainConfig, check_needles_fit, curriculum
from quantdiff.core.atomic import json_text
from quantdiff.core.manifest import file_sha256
from quantdiff.core.manifest import write_manifest
from quantdiff.core.savedir import atomic_dir
from quantdiff.data.needles import Filler, NeedleExample, make_needle_example, most_document_tokens, vocabulary_text
from quantdiff.data.sources import Batch
from quantdiff.eval.tasks.bb import BBTask
from quantdiff.eval.tasks.lm import LMTask, PreparedLM
from quantdiff.eval.tasks.retrieval import encode_example, exact_matches
from quantdiff.models.tokenizer import save_tokenizer
from quantdiff.train import determinism, emergence, guards, precision, provenance
from quantdiff.train.guards import CHECKPOINT  # inside --out; removed once the arms are saved
from quantdiff.train.resume_state import checked_state

# Measured on this project's CPUs: a 0.94M model learns to copy a 16-token random span repeated after 0–32 random tokens within ~500 steps.
COPY_SPAN, COPY_GAP = 16, 32
IGNORE = -100  # label of padding: no loss


@dataclass
class PairData:
    tokenizer: PreTrainedTokenizerBase
    train_ids: torch.Tensor | None  # (N,) int64, the training split as one stream (None: generated data)
    held_out_ids: torch.Tensor | None  # (M,) int64
    filler: Filler | None  # training-split sentences for the needle documents
    bos_id: int | None  # prepended to every row and evaluated sequence when the recipe asks for BOS
    generator: BigramBackcopy | None = None  # the synthetic source, when the recipe trains on it


def split_text(recipe: Recipe, split: str) -> str:
    return corpus.split_text(split, recipe.data.held_out_fraction, corpora=recipe.data.corpus_names)


def prepare_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase | None = None) -> PairData:
    """Tokenize both splits (training a BPE on the training split + the needle words unless one is given)."""
    if recipe.synthetic:
        generator = bigram_backcopy.load()
        return PairData(generator.tokenizer(), None, None, None, generator.bos_id, generator)
    train_text, held_out_text = split_text(recipe, "train"), split_text(recipe, corpus.HELD_OUT_SPLIT)
    tokenizer = tokenizer or tokenized.bpe(train_text + vocabulary_text(), recipe.model.vocab_size)
    encode = lambda text: torch.tensor(tokenized.ids(tokenizer, text), dtype=torch.long)  # noqa: E731
    bos_id = tokenizer.bos_token_id if recipe.train.bos else None
    return PairData(tokenizer, encode(train_text), encode(held_out_text), Filler.from_tokenizer(train_text, tokenizer), bos_id)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def needle_document(rng: random.Random, data: PairData, length: int, max_needles: int, spread: float, value_length: int) -> list[int]:
    """Token ids of one training needle document (every needle queried and answered), ≤ `length` tokens."""
    n = rng.randint(1, max_needles)
    depths = [1.0 - spread * rng.random() for _ in range(n)]
    example = make_needle_example(rng, data.filler, length, n, depths, n_queries=n, value_length=value_length)
    return data.tokenizer(example.text, add_special_tokens=False)["input_ids"]


def copy_document(rng: random.Random, tokenizer: PreTrainedTokenizerBase, length: int) -> list[int]:
    """`length` random non-special token ids: spans of COPY_SPAN tokens, each repeated after 0–COPY_GAP others.

    Only the repeats are predictable, so the loss on them can fall only by copying from the context."""
    vocab = range(max(tokenizer.all_special_ids) + 1, len(tokenizer))
    ids: list[int] = []
    while len(ids) < length:
        span = rng.choices(vocab, k=COPY_SPAN)
        ids += span + rng.choices(vocab, k=rng.randint(0, COPY_GAP)) + span
    return ids[:length]


def make_batch(step: int, data: PairData, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): the batch of `step`, a pure function of (seed, step)."""
    cfg = recipe.train
    B, T = cfg.batch_size, cfg.seq_len
    if data.generator is not None:
        rows = data.generator.train_rows(cfg.seed, step, B, T + 1)
        return rows[:, :-1], rows[:, 1:]
    first = int(data.bos_id is not None)  # row position where text starts
    body = T + 1 - first
    generator = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) % 2**64)  # any valid seed: within torch's range
    is_needle = torch.rand(B, generator=generator) < recipe.data.retrieval_fraction
    starts = torch.randint(0, len(data.train_ids) - body, (B,), generator=generator)  # drawn for every row: fixed RNG use
    rows = torch.full((B, T + 1), data.tokenizer.pad_token_id, dtype=torch.long)
    if first:
        rows[:, 0] = data.bos_id
    targets_valid = torch.ones(B, T + 1, dtype=torch.bool)
    for r in range(B):
        if is_needle[r]:
            rng = random.Random(f"{cfg.seed}/{step}/{r}")
            if step < recipe.data.copy_warmup_steps:
                ids = copy_document(rng, data.tokenizer, body)
            else:
                ids = needle_document(rng, data, body, *curriculum(step, recipe))
            rows[r, first : first + len(ids)] = torch.tensor(ids)
            targets_valid[r, first + len(ids) :] = False
        else:
            rows[r, first:] = data.train_ids[starts[r] : starts[r] + body]
    targets = rows[:, 1:].masked_fill(~targets_valid[:, 1:], IGNORE)
    return rows[:, :-1], targets


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


def make_optimizer(model: PreTrainedModel, cfg: TrainConfig, arm: ArmConfig) -> tuple[torch.optim.Optimizer, list[str]]:
    """The arm's optimizer (AdamW, or SGD with momentum) with weight decay on matrices only (not norms, not λ);
    also the parameter names in state order."""
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    other = [(n, p) for n, p in named if p.ndim < 2]
    groups = [
        {"params": [p for _, p in decay], "weight_decay": arm.decay(cfg)},
        {"params": [p for _, p in other], "weight_decay": 0.0},
    ]
    names = [n for n, _ in decay + other]
    if arm.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=arm.peak_lr(cfg), momentum=arm.momentum), names
    return torch.optim.AdamW(groups, lr=arm.peak_lr(cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-8,
                             fused=cfg.fused_adamw or None), names  # None: PyTorch picks (foreach on CUDA)


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    return {
        f"optim.{names[index]}.{key}": value.detach().cpu().contiguous()
        for index, state in optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
    state_dict = optimizer.state_dict()
    for index, name in enumerate(names):
        prefix = f"optim.{name}."
        state = {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}
        if state:
            state_dict["state"][index] = state
    optimizer.load_state_dict(state_dict)


def held_out_windows(data: PairData, seq_len: int, max_tokens: int) -> list[list[int]]:
    """Consecutive held-out windows of `seq_len` tokens (BOS first when training puts one there), ≈ `max_tokens` in all;
    generated data: its first held-out sequences."""
    if data.generator is not None:
        return data.generator.held_out_rows(max(1, max_tokens // seq_len), seq_len).tolist()
    prefix = [] if data.bos_id is None else [data.bos_id]
    body = seq_len - len(prefix)
    count = min((len(data.held_out_ids) - 1) // body, max(1, max_tokens // seq_len))
    return [prefix + data.held_out_ids[w * body : (w + 1) * body].tolist() for w in range(count)]


def held_out_loss(model: PreTrainedModel, windows: list[list[int]]) -> float:
    """Mean next-token loss (nats) of the lm task over `windows`, token-weighted."""
    return LMTask(context=max(map(len, windows))).evaluate(model, PreparedLM(windows))["loss"]


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy (nats) of the unigram distribution of `ids`: the loss of the best context-free predictor."""
    counts = torch.tensor(list(Counter(ids.tolist()).values()), dtype=torch.float64)
    p = counts / counts.sum()
    return float(-(p * p.log()).sum())


def retrieval_examples(data_text: str, tokenizer: PreTrainedTokenizerBase, context: int, n_needles: int, count: int, seed: int) -> list[NeedleExample]:
    """Held-out needle documents (filler from held-out text), needles at uniform random depths."""
    filler = Filler.from_tokenizer(data_text, tokenizer)
    rng = random.Random(f"retrieval/{seed}/{context}/{n_needles}")
    return [make_needle_example(rng, filler, context, n_needles, [rng.random() for _ in range(n_needles)]) for _ in range(count)]


def retrieval_exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[NeedleExample], bos_id: int | None = None) -> float:
    """Share of examples whose greedy continuation reproduces the queried value exactly (the retrieval task's check)."""
    items = [encode_example(tokenizer, example) for example in examples]
    if bos_id is not None:
        items = [
            dataclasses.replace(it, prompt_ids=[bos_id] + it.prompt_ids, answer_positions=[p + 1 for p in it.answer_positions])
            for it in items
        ]
    matches = exact_matches(model, items)
    return sum(matches) / len(matches)


HASHES = "sha256.json"  # in a checkpoint: {"<arm>.safetensors": sha256}, checked before a resume loads them


class Checkpoint:
    """OUT/.checkpoint/: tokenizer/, <arm>.safetensors (weights + optimizer moments), sha256.json (their
    digests), state.json (step, curves)."""

    def __init__(self, out: Path):
        self.dir = out / CHECKPOINT

    def exists(self) -> bool:
        return (self.dir / "state.json").is_file()

    def save(self, tokenizer, models, optimizers, state: dict) -> None:
        with atomic_dir(self.dir, force=True, kind="checkpoint") as tmp:
            save_tokenizer(tokenizer, tmp / "tokenizer")
            for kind, model in models.items():
                # cloned: tied embeddings share one tensor under two names, which safetensors refuses to save
                weights = {f"model.{k}": v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}
                save_file(weights | optimizer_tensors(*optimizers[kind]), tmp / f"{kind}.safetensors")
            # a resume refuses a tensor file whose bytes changed since this save (a flipped byte loads silently)
            digests = {f"{kind}.safetensors": file_sha256(tmp / f"{kind}.safetensors") for kind in models}
            (tmp / HASHES).write_text(json_text(digests, indent=1))
            (tmp / "state.json").write_text(json_text(state, indent=None))

    def load_state(self, recipe: Recipe) -> dict:
        """state.json, every field checked against `recipe` (resume_state)."""
        try:
            state = json.loads((self.dir / "state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LoadError(f"corrupt training checkpoint {self.dir}: state.json is unreadable ({type(exc).__name__}); remove it or pass --force") from None
        return checked_state(state, recipe, self.dir)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        try:
            return AutoTokenizer.from_pretrained(str(self.dir / "tokenizer"), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as exc:  # a missing or damaged tokenizer/ directory
            reason = " ".join(str(exc).split())[:200]
            raise LoadError(f"corrupt training checkpoint {self.dir}: its tokenizer does not load ({type(exc).__name__}: {reason}); remove it or pass --force") from None

    def recorded_hashes(self) -> dict[str, str] | None:
        """{file: sha256} as save() recorded it; None for a checkpoint written before hashes were recorded."""
        path = self.dir / HASHES
        if not path.exists():
            return None
        try:
            digests = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise LoadError(f"corrupt training checkpoint {path}: unreadable ({type(exc).__name__}); remove it or pass --force") from None
        if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
            raise LoadError(f"corrupt training checkpoint {path}: not a map of file names to sha256; remove it or pass --force")
        return digests

    def restore(self, models, optimizers) -> str | None:
        """Load every arm's weights and optimizer moments; returns a warning for a checkpoint without hashes."""
        digests = self.recorded_hashes()
        for kind in models:
            path = self.dir / f"{kind}.safetensors"
            if digests is not None and (path.name not in digests or not path.is_file() or file_sha256(path) != digests[path.name]):
                raise LoadError(f"corrupt training checkpoint {path}: its sha256 differs from the one recorded when it was saved; remove it or pass --force")
        for kind, model in models.items():
            try:
                tensors = load_file(self.dir / f"{kind}.safetensors")
                bad = next((name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
                if bad is not None:  # save() never writes one (guards.check_weights): the file was damaged since
                    raise ValueError(f"tensor {bad} holds NaN or Inf")
                model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
                load_optimizer_tensors(*optimizers[kind], {k: v for k, v in tensors.items() if k.startswith("optim.")})
            except (SafetensorError, OSError, RuntimeError, KeyError, ValueError) as exc:
                reason = " ".join(str(exc).split())[:200]
                raise LoadError(f"corrupt training checkpoint {self.dir / f'{kind}.safetensors'}: {reason}; remove it or pass --force") from None
        if digests is None:
            return f"warning: the checkpoint in {self.dir} records no sha256 of its tensor files (written before quantdiff recorded them): resuming unverified"
        return None

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class TrainingProgress:
    """A rich progress bar showing tokens/s (all arms together) and each arm's latest loss."""

    def __init__(self, console, total: int, completed: int):
        from rich.progress import TextColumn

        losses = TextColumn("{task.fields[speed]:,.0f} tok/s  loss {task.fields[losses]}")
        self.progress = progress_bar(losses, console=console, remaining=True)
        self.task = self.progress.add_task("train", total=total, completed=completed, speed=0.0, losses="")
        self.tokens, self.started = 0, time.perf_counter()

    def __enter__(self) -> TrainingProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def advance(self, tokens: int, losses: dict[str, float]) -> None:
        self.tokens += tokens
        speed = self.tokens / (time.perf_counter() - self.started)
        shown = "  ".join(f"{name} {loss:.3f}" for name, loss in losses.items())
        self.progress.update(self.task, advance=1, speed=speed, losses=shown)


def arms_exist(out: Path, recipe: Recipe) -> bool:
    """True when every arm of `recipe` has its trained model in OUT/<arm>."""
    return all((out / name / "config.json").is_file() for name in recipe.arm_names)


@dataclass
class Run:
    """One training run: what it trains on, the arms' models with their optimizers, and the logged state."""

    recipe: Recipe
    out: Path
    device: torch.device
    data: PairData
    models: dict[str, PreTrainedModel]
    optimizers: dict[str, tuple[torch.optim.Optimizer, list[str]]]
    state: dict  # step, elapsed_s, loss, held_out and outliers curves: saved in every checkpoint
    eval_windows: list[list[int]]  # held-out lm windows scored at every eval step
    outlier_batches: list[Batch]  # held-out sequences measured at every eval step (same for every arm)


def new_state(recipe: Recipe) -> dict:
    empty = lambda: {name: [] for name in recipe.arm_names}  # noqa: E731
    return {"recipe": recipe.source, "seed": recipe.train.seed, "step": 0, "elapsed_s": 0.0, "loss": empty(), "held_out": empty(), "outliers": empty(),
            "history": []}


def _against_standard(models: dict, recipe: Recipe, name: str) -> str:
    """' (+7.2% against standard)' for an arm whose count differs from the first standard arm's."""
    standard = next((arm.name for arm in recipe.arms if arm.kind == "standard"), None)
    if standard is None or name == standard:
        return ""
    ratio = parameter_count(models[name]) / parameter_count(models[standard]) - 1
    return f" ({ratio:+.2%} against {standard})"


def start_run(recipe: Recipe, out: Path, checkpoint: Checkpoint, force: bool, console) -> Run:
    """Check the target, read the data, build (or restore) every arm's model and optimizer."""
    cfg = recipe.train
    guards.check_out(out, recipe.arm_names)  # everything a failing run would otherwise meet after printing
    if arms_exist(out, recipe) and not checkpoint.exists() and not force:
        raise ConfigError(f"trained models already exist in {out} (use --force to retrain)")
    device = resolve_device(cfg.device, "[train] device")
    guards.check_dtype(cfg.dtype, device)
    if not recipe.synthetic:
        corpus.require(recipe.data.corpus_names)  # DataError with install instructions before any work
    state = checkpoint.load_state(recipe) if checkpoint.exists() and not force else None
    data = prepare_data(recipe, checkpoint.load_tokenizer() if state else None)
    if not recipe.synthetic:
        # The recipe was checked at one token per word; the trained tokenizer may need more for the rarest words.
        check_needles_fit(recipe, partial(most_document_tokens, data.filler.count_tokens), "tokens of the trained tokenizer")
    configs = kind_configs(recipe.model, tuple(dict.fromkeys(arm.kind for arm in recipe.arms)))
    arm_configs = {arm.name: budget_matched(configs[arm.kind], recipe.model) if arm.match_budget else configs[arm.kind] for arm in recipe.arms}
    # In training form: the init's parametrisations (models.init) stay until finish() folds them; checkpoints hold them
    models = {arm.name: build_model(arm_configs[arm.name], cfg.seed, "sdpa", cfg.init, reparametrised=True).to(device).train() for arm in recipe.arms}
    optimizers = {arm.name: make_optimizer(models[arm.name], cfg, arm) for arm in recipe.arms}
    if state and (unverified := checkpoint.restore(models, optimizers)):
        console.print(unverified)
    console.print("parameters: " + "  ".join(
        f"{arm.name} ({arm.kind}, {arm.optimizer}) {parameter_count(models[arm.name]):,}"
        + (f" incl. λ {lambda_parameter_count(models[arm.name]):,}" if lambda_parameter_count(models[arm.name]) else "")
        + _against_standard(models, recipe, arm.name)
        for arm in recipe.arms))
    if state:
        console.print(f"resuming from step {state['step']} ({checkpoint.dir})")
    console.print(determinism.describe(determinism.settings()))
    console.print(f"training {cfg.steps} steps × {cfg.batch_size} × {cfg.seq_len} = {cfg.tokens:,} tokens per model on {device}")
    eval_windows = held_out_windows(data, cfg.seq_len, cfg.eval_batches * cfg.batch_size * cfg.seq_len)
    outliers = emergence.windows_as_batches(held_out_windows(data, cfg.seq_len, cfg.outlier_sequences * cfg.seq_len), data.tokenizer.pad_token_id)
    state = state or new_state(recipe)
    # every start and resume, with its code (train/provenance.py); a checkpoint from before this field has none
    state.setdefault("history", []).append(provenance.start_entry(state["step"]))
    return Run(recipe, out, device, data, models, optimizers, state, eval_windows, outliers if cfg.outlier_sequences else [])


def train_step(run: Run, step_models: dict, autocast, step: int) -> None:
    """Every arm takes one optimizer step on the batch of `step`."""
    cfg = run.recipe.train
    inputs, targets = (t.to(run.device) for t in make_batch(step, run.data, run.recipe))
    for arm in run.recipe.arms:
        name, model = arm.name, step_models[arm.name]
        optimizer, _ = run.optimizers[name]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg) * arm.peak_lr(cfg) / cfg.lr  # the recipe's schedule, scaled to the arm's peak
        with autocast:
            loss = lm_loss(model, inputs, targets)
        guards.check_loss(loss.item(), name, step, run.out / CHECKPOINT)  # before the update reaches the weights
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(run.models[name].parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.state["loss"][name].append(round(loss.item(), 5))
    run.state["step"] = step + 1


def evaluate_step(run: Run) -> None:
    """Held-out loss of every arm, and their outliers on the same held-out sequences."""
    cfg, step = run.recipe.train, run.state["step"]
    for name, model in run.models.items():
        model.eval()
        run.state["held_out"][name].append([step, held_out_loss(model, run.eval_windows)])
        if run.outlier_batches:
            run.state["outliers"][name].append(emergence.measure(model, run.outlier_batches, step, step * cfg.batch_size * cfg.seq_len))
        model.train()


@determinism.pinned_threads()  # the whole run, final evaluation included: its log reproduces too
def train_pair(recipe: Recipe, out: str | Path, *, force: bool = False, stop_after: int | None = None, console=None) -> dict[str, Path] | None:
    """Train (or resume) the recipe's arms into OUT/<arm> (by default OUT/standard and OUT/diff); returns their paths.

    `stop_after=k` stops after step k with the checkpoint saved, as an interruption would (returns None).
    """
    from quantdiff.report.console import line_console

    console = console or line_console(stderr=True)
    out, cfg = Path(out), recipe.train
    checkpoint = Checkpoint(out)
    run = start_run(recipe, out, checkpoint, force, console)
    state = run.state
    if cfg.dtype == "bf16":  # before compiling: the float32 combine is part of what is compiled
        for model in run.models.values():
            precision.keep_combine_float32(model)
    step_models = {kind: torch.compile(model) if cfg.compile else model for kind, model in run.models.items()}
    autocast = torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    started = time.perf_counter() - state["elapsed_s"]
    with TrainingProgress(console, cfg.steps, state["step"]) as progress:
        for step in range(state["step"], cfg.steps):
            train_step(run, step_models, autocast, step)
            if state["step"] % cfg.eval_every == 0:
                evaluate_step(run)
            state["elapsed_s"] = time.perf_counter() - started
            progress.advance(cfg.batch_size * cfg.seq_len * len(run.models), {k: v[-1] for k, v in state["loss"].items()})
            stopping = stop_after is not None and state["step"] >= stop_after and state["step"] < cfg.steps
            if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps or stopping:
                guards.check_weights(run.models, state["step"], checkpoint.dir)  # never a checkpoint with NaN or Inf
                checkpoint.save(run.data.tokenizer, run.models, run.optimizers, state)
            if stopping:
                return None

    paths = finish(run, console)
    checkpoint.remove()
    return paths


def final_checks(run: Run) -> Callable[[PreTrainedModel], dict]:
    """What each trained model is checked on besides held-out loss: greedy needle retrieval (text corpora) or the
    bb task (bigram-backcopy: backcopy accuracy and bigram KL on held-out sequences)."""
    recipe, data, cfg, tasks = run.recipe, run.data, run.recipe.train, run.recipe.tasks
    if data.generator is not None:
        task = BBTask(sequences=max(1, tasks.lm_tokens // cfg.seq_len), context=cfg.seq_len)
        prepared = task.prepare(data.tokenizer)
        return lambda model: {"bb": task.evaluate(model, prepared)}
    held_out_text = split_text(recipe, corpus.HELD_OUT_SPLIT)
    examples = {
        n: retrieval_examples(held_out_text, data.tokenizer, cfg.seq_len - (data.bos_id is not None), n, tasks.retrieval_examples, cfg.seed)
        for n in tasks.retrieval_needles
    }
    return lambda model: {
        "retrieval_exact_match": {str(n): retrieval_exact_match(model, data.tokenizer, ex, data.bos_id) for n, ex in examples.items()},
        "retrieval_examples": tasks.retrieval_examples,  # by needles per document, context = seq_len
    }


def _check_line(checks: dict) -> str:
    if "bb" in checks:
        return f"backcopy accuracy {checks['bb']['accuracy']:.1%}, bigram KL {checks['bb']['bigram_kl']:.3f} nats"
    return "retrieval exact match " + ", ".join(f"{n} needles {acc:.0%}" for n, acc in checks["retrieval_exact_match"].items())


def finish(run: Run, console) -> dict[str, Path]:
    """Each arm folded into a plain transformers model (models.init.fold: the same function), evaluated on held-out
    data, and saved as a complete HF directory with its log."""
    recipe, data, state = run.recipe, run.data, run.state
    cfg, tasks = recipe.train, recipe.tasks
    windows = held_out_windows(data, cfg.seq_len, tasks.lm_tokens)
    baseline = unigram_entropy(torch.tensor([t for w in windows for t in w[1:]]))
    checks = final_checks(run)
    paths = {}
    for arm in recipe.arms:
        name, model = arm.name, fold(run.models[arm.name])
        model.eval()
        loss = held_out_loss(model, windows)
        log = {
            "kind": arm.kind,
            "arm": dataclasses.asdict(arm) | {"lr": arm.peak_lr(cfg), "weight_decay": arm.decay(cfg)},
            "recipe": recipe.name,
            "seed": cfg.seed,  # initialisation and batches (a multi-seed run: this directory's seed)
            "init": cfg.init,  # the initialisation scheme (models.init)
            "determinism": determinism.settings(),  # of the process that finished the run; "pinned": reproducible elsewhere
            "corpora": list(recipe.data.corpus_names),
            "steps": cfg.steps,
            "tokens": cfg.tokens,
            "parameters": parameter_count(model),
            "lambda_parameters": lambda_parameter_count(model),
            **provenance.code_version(),  # of the process that finished the run; each start's is in "history"
            "started_at": state["history"][0]["at"] if state["history"][0]["from_step"] == 0 else None,  # None: resumed from a checkpoint older than this record
            "finished_at": provenance.utc_now(),
            "history": state["history"],  # [{at, from_step, git_commit, git_dirty}]: the start, then every resume
            "wall_time_s": round(state["elapsed_s"], 1),  # all arms together
            "train_loss_curve": state["loss"][name],  # one value per step
            "final_train_loss": sum(state["loss"][name][-50:]) / len(state["loss"][name][-50:]),
            "held_out_curve": state["held_out"][name],  # [step, loss]
            "held_out_loss": loss,
            "held_out_tokens": sum(len(w) - 1 for w in windows),
            "unigram_entropy": baseline,
            **checks(model),
            "outliers": state["outliers"][name],  # emergence series: one entry per eval step
        }
        console.print(
            f"{name:12s} held-out loss {loss:.3f} nats (unigram baseline {baseline:.3f}); "
            f"train loss {log['final_train_loss']:.3f}; {_check_line(log)}"
        )
        paths[name] = run.out / name
        with atomic_dir(paths[name], force=True, kind="model") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            save_tokenizer(data.tokenizer, tmp)
            (tmp / "recipe.toml").write_text(recipe.source)
            (tmp / "train_log.json").write_text(json_text(log, indent=1))
            write_manifest(tmp)  # a finished seed is verified against it before a re-run skips it (train.seeds)
    return paths
