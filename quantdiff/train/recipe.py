"""Recipes: one TOML file says how a matched set of models (the arms) is trained and analysed.

`[[arms]]` tables list the models trained side by side on identical batches: each names its directory
(`name`), its architecture (`kind`: standard, diff, diffv2, gated, sink — models.pairs.ALL_KINDS) and its optimizer
(`adamw`, the default, or `sgd` with `momentum`: the sink papers' negative control), with an optional `lr` and
`weight_decay` of its own (the schedule's shape stays the recipe's). Without `[[arms]]` a recipe trains the standard/Diff pair.

Each section becomes one frozen dataclass; an unknown key is a ConfigError naming it, so a typo can never
silently fall back to a default. `load_recipe("tiny")` finds a recipe by name in the repository's
`recipes/` directory, or — on an installed package, which has no `recipes/` — the copy saved beside the
shipped pair (`quantdiff/assets/<name>/standard/recipe.toml`): the recipe that trained a pair travels with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import tomllib

import torch

from quantdiff.across_seeds.metrics import MODEL_METRICS, change_key, sweep_key
from quantdiff.core.atomic import check_name_length
from quantdiff.core.errors import ConfigError
from quantdiff.core.memory import check_fits
from quantdiff.eval.bounds import forward_bytes
from quantdiff.data.needles import VALUE_LENGTH, min_document_tokens
from quantdiff.data.corpus import CORPORA
from quantdiff.models.init import DEFAULT_INIT, check_init
from quantdiff.models.names import ASSETS
from quantdiff.data import bigram_backcopy
from quantdiff.models.pairs import ALL_KINDS, KINDS, SizePreset, check_seed, preset_from_dict
from quantdiff.quant.numerics import check_bits
from quantdiff.quant.registry import granularity, method_name, site_name
from quantdiff.report.markdown import reference_name
from quantdiff.train.recipe_types import check_types

SOURCES = (*CORPORA, bigram_backcopy.NAME)  # the Debian text corpora and the synthetic task
REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DTYPES = ("float32", "bf16")
MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_position_embeddings")  # no defaults
OPTIMIZERS = ("adamw", "sgd")
RETRIEVAL_BATCH = 8  # documents per forward pass of the retrieval task (eval.tasks.retrieval)
ARM_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")  # a directory name, the same on every filesystem


TEXT_TASKS = ("lm", "choice", "retrieval")  # what a text recipe's run sweeps (a bigram-backcopy recipe: "bb")

@dataclass(frozen=True)
class DataConfig:
    corpus: str = "janeaustenr"  # see quantdiff/data/corpus.py; or "bigram-backcopy" (quantdiff/data/bigram_backcopy.py)
    # Several corpora mixed (each split by document, concatenated in this order); empty = [corpus].
    corpora: list[str] = field(default_factory=list)
    held_out_fraction: float = 0.1  # share of chapters (chosen by hash) never trained on
    retrieval_fraction: float = 0.25  # share of each batch's rows that are needle documents
    retrieval_max_needles: int = 4  # needles per document grow from 1 to this over the first half of training
    # Words per needle value at step 0, shrinking to the evaluated 3 by mid-training: long values give many
    # copyable tokens per document, the signal a tiny model needs before any induction head forms.
    retrieval_value_words_start: int = 3
    # Steps during which the needle rows are random-token copy documents instead (train.copy_document): a pure
    # induction signal with no corpus to fall back on, so a tiny model forms copy heads before the needles.
    copy_warmup_steps: int = 0

    @property
    def corpus_names(self) -> tuple[str, ...]:
        return tuple(self.corpora) or (self.corpus,)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3  # peak; tiny models tolerate a high rate
    min_lr: float = 3e-4  # cosine decay floor
    warmup_steps: int = 100
    weight_decay: float = 0.1  # AdamW, matrices only; weight decay encourages attention sinks
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95  # the large-LM choice (1B runs of the sink studies); PyTorch's default is 0.999
    # A BOS token opens every corpus window and needle document: a fixed first token that attention can
    # learn to park on (an attention sink). False = windows start mid-text, as the shipped pair was trained.
    bos: bool = False
    grad_clip: float = 1.0  # max gradient norm; 0 = no clipping (as Guo et al. train Bigram-Backcopy)
    seed: int = 0  # initialisation, batch order and needle documents: same for both kinds
    # Several seeds: each trains every arm (OUT/seed-<s>/<arm>); `seed`, if also given, must be one of them and
    # names the seed whose models stand for the run where one set is used (a shipped built-in). Empty: `seed` only.
    seeds: list[int] = field(default_factory=list)
    dtype: str = "float32"  # "bf16" = bfloat16 autocast, CUDA only (weights and optimizer stay float32)
    device: str = "auto"  # "auto" = CUDA when present
    compile: bool = False  # torch.compile the training step's model
    fused_adamw: bool = False  # AdamW's fused kernel (one launch for every parameter); off: PyTorch's default
    checkpoint_every: int = 100  # steps; resume restarts from the last one
    log_every: int = 10
    eval_every: int = 250  # held-out loss on eval_batches batches, for the log's curve
    eval_batches: int = 4
    # Held-out sequences on which both models' outliers and sinks are measured at every eval step (0 = off).
    outlier_sequences: int = 4
    # Initial weights of every arm (quantdiff/models/init.py): "authors" = the Diff Transformer authors' (kaiming-
    # uniform Linears, embedding N(0, 1/D) times √D in the forward, a gain on Diff V1's per-head norm);
    # "transformers" = transformers' default, N(0, 0.02) for every Linear and the embedding.
    init: str = DEFAULT_INIT

    @property
    def tokens(self) -> int:
        """Token budget per model."""
        return self.steps * self.batch_size * self.seq_len


@dataclass(frozen=True)
class TasksConfig:
    lm_tokens: int = 65536  # held-out tokens for loss / next-token accuracy
    choice_items: int = 200  # cloze multiple-choice items cut from held-out text
    retrieval_contexts: list[int] = field(default_factory=lambda: [256])  # unset: 256, or the model's positions if fewer
    retrieval_needles: list[int] = field(default_factory=lambda: [1, 2, 4])
    retrieval_examples: int = 50  # per (context, needles) setting
    bb_sequences: int = 64  # held-out bigram-backcopy sequences of the bb task (bigram-backcopy recipes)


@dataclass(frozen=True)
class AnalysisConfig:
    stats_tokens: int = 16384
    seq_len: int = 256
    bits: list[int] = field(default_factory=lambda: [16, 8, 6, 4])
    methods: list[str] = field(default_factory=lambda: ["absmax", "llm_int8"])
    sites: list[str] = field(default_factory=lambda: ["logits", "qk", "linear"])
    # The sweep's scales (`quant.registry`): "row", causal, by default; the shipped recipes name "tensor", the
    # former per-sequence (non-causal) scales their published results were computed with.
    granularity: str = "row"
    # The primary comparisons, named before the run: each of primary_arms against the reference arm on each of
    # primary_metrics (seeds.json keys), Holm-corrected as one family in the report; all else is exploratory.
    primary_metrics: list[str] = field(default_factory=list)
    primary_arms: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ArmConfig:
    """One trained model: its directory name, architecture and optimizer (None = the [train] value)."""

    name: str
    kind: str = "standard"
    optimizer: str = "adamw"
    lr: float | None = None  # peak; the [train] schedule scaled to it (min_lr in the same proportion)
    weight_decay: float | None = None
    momentum: float = 0.9  # SGD only
    # DIFF V2 only: narrow the MLP so the arm has the standard arm's parameter count (models.pairs.budget_matched),
    # the comparison the V2 authors ask for; False keeps every size of the baseline, their reference module's way
    match_budget: bool = False

    def peak_lr(self, train: TrainConfig) -> float:
        return train.lr if self.lr is None else self.lr

    def decay(self, train: TrainConfig) -> float:
        return train.weight_decay if self.weight_decay is None else self.weight_decay


DEFAULT_ARMS = tuple(ArmConfig(kind, kind) for kind in KINDS)


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str  # the TOML text itself, saved beside the trained models
    data: DataConfig
    model: SizePreset
    train: TrainConfig
    tasks: TasksConfig
    analysis: AnalysisConfig
    arms: tuple[ArmConfig, ...] = DEFAULT_ARMS

    @property
    def arm_names(self) -> tuple[str, ...]:
        return tuple(arm.name for arm in self.arms)

    @property
    def synthetic(self) -> bool:
        """True when the data is the bigram-backcopy generator rather than text corpora."""
        return self.data.corpus_names == (bigram_backcopy.NAME,)


PLAN_PREFIX = "confirm-"  # recipes/confirm-*.toml: confirmatory plans, committed before any training of their run


def plan_file(recipe: Recipe) -> str | None:
    """`recipes/<name>.toml` when the recipe is, byte for byte, one of the repository's confirmatory plans
    (recipes/confirm-*.toml; its primary family is then the plan's, fixed before the run), else None: a copy
    changed by a single byte, or by a `--set`, is no longer the plan, and its family is exploratory."""
    for path in sorted(REPO_RECIPES.glob(PLAN_PREFIX + "*.toml")):
        if path.read_text(encoding="utf-8") == recipe.source:
            return f"{REPO_RECIPES.name}/{path.name}"
    return None


SECTIONS = {"data": DataConfig, "train": TrainConfig, "tasks": TasksConfig, "analysis": AnalysisConfig}


def _section(cls: type, name: str, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    defaults = cls()
    for key in table:
        if not hasattr(defaults, key):
            raise ConfigError(f"unknown key {key!r} in [{name}] (known: {', '.join(f.name for f in fields(cls))})")
    check_types(cls, name, table)  # list items too
    return cls(**table)


def parse_recipe(source: str, name: str) -> Recipe:
    """Parse and validate recipe text; ConfigError names the first problem."""
    try:
        doc = tomllib.loads(source)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {name}: invalid TOML: {exc}") from None
    unknown = sorted(set(doc) - set(SECTIONS) - {"model", "arms"})
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}] in recipe {name} (known: data, model, train, tasks, analysis, arms)")
    model_table = doc.get("model", {})
    if not isinstance(model_table, dict):
        raise ConfigError(f"recipe {name}: [model] must be a table")
    missing = [key for key in MODEL_KEYS if key not in model_table]
    if missing:  # defaults would silently pick the size of the models the whole run is about
        raise ConfigError(f"recipe {name}: [model] must set {', '.join(missing)}")
    model = preset_from_dict(model_table)  # rejects unknown keys
    check_types(SizePreset, "model", model_table)
    model.validate()
    # Training holds weights, gradients and AdamW's two moments of both models.
    model.check_memory(4, f"[model] training a pair of {model.parameter_estimate():,}-parameter models")
    sections = {key: _section(cls, key, doc.get(key, {})) for key, cls in SECTIONS.items()}
    _check_corpus_keys(doc.get("data", {}))
    if "retrieval_contexts" not in doc.get("tasks", {}):  # the default document length, within the model's positions
        default = min(TasksConfig().retrieval_contexts[0], model.max_position_embeddings)
        sections["tasks"] = dataclasses.replace(sections["tasks"], retrieval_contexts=[default])
    arms = _arms(doc["arms"]) if "arms" in doc else DEFAULT_ARMS
    recipe = Recipe(name=name, source=source, model=model, arms=arms, **sections)
    _check(recipe)
    _check_primary(recipe)
    _check_emergence_options(recipe)
    _check_seeds(recipe.train, doc.get("train", {}))
    return recipe


def _arms(tables: Any) -> tuple[ArmConfig, ...]:
    """[[arms]] tables → ArmConfigs; ConfigError names the first bad key or value."""
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError("[[arms]] must be one or more tables, each with a name")
    known = {f.name: f for f in fields(ArmConfig)}
    arms = []
    for table in tables:
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r} in [[arms]] (known: {', '.join(known)})")
        name = table.get("name")
        if not isinstance(name, str) or not ARM_NAME.match(name):
            raise ConfigError(f"[[arms]] name must be lower-case letters, digits, - or _, got {name!r}")
        check_name_length(name, "[[arms]] name")  # it names OUT/<arm> and the temporaries written beside it
        for key in ("kind", "optimizer"):
            if not isinstance(table.get(key, ""), str):
                raise ConfigError(f"[[arms]] {name}: {key} must be a string")
        for key in ("lr", "weight_decay", "momentum"):
            value = table.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"[[arms]] {name}: {key} must be a finite number >= 0, got {value!r}")
        if not isinstance(table.get("match_budget", False), bool):
            raise ConfigError(f"[[arms]] {name}: match_budget must be true or false")
        arm = ArmConfig(**table)
        if arm.kind not in ALL_KINDS:
            raise ConfigError(f"[[arms]] {name}: unknown kind {arm.kind!r} (known: {', '.join(ALL_KINDS)})")
        if arm.match_budget and arm.kind != "diffv2":
            raise ConfigError(f"[[arms]] {name}: match_budget narrows DIFF V2's MLP; kind {arm.kind!r} already has the standard model's sizes")
        if arm.optimizer not in OPTIMIZERS:
            raise ConfigError(f"[[arms]] {name}: unknown optimizer {arm.optimizer!r} (known: {', '.join(OPTIMIZERS)})")
        if arm.lr == 0:
            raise ConfigError(f"[[arms]] {name}: lr must be positive")
        arms.append(arm)
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ConfigError("[[arms]] lists a name twice")
    return tuple(arms)


def _check(recipe: Recipe) -> None:
    data, train = recipe.data, recipe.train
    if bigram_backcopy.NAME in data.corpus_names and len(data.corpus_names) > 1:
        raise ConfigError(f"[data] {bigram_backcopy.NAME} cannot be mixed with text corpora")
    if data.corpus not in SOURCES:
        raise ConfigError(f"unknown corpus {data.corpus!r} (known: {', '.join(SOURCES)})")
    if data.copy_warmup_steps < 0:
        raise ConfigError("[data] copy_warmup_steps must be at least 0")
    if data.retrieval_value_words_start < 1 or data.retrieval_max_needles < 1:
        raise ConfigError("[data] retrieval_value_words_start and retrieval_max_needles must be at least 1")
    if not 0 < data.held_out_fraction < 1 or not 0 <= data.retrieval_fraction <= 1:
        raise ConfigError("held_out_fraction must be in (0, 1) and retrieval_fraction in [0, 1]")
    check_seed(train.seed, "[train] seed")
    check_init(train.init, "[train] init", tied=recipe.model.tie_word_embeddings)
    if train.dtype not in DTYPES:
        raise ConfigError(f"[train] dtype must be one of {', '.join(DTYPES)}, got {train.dtype!r}")
    if min(train.steps, train.batch_size, train.seq_len, train.checkpoint_every, train.log_every, train.eval_every) <= 0:
        raise ConfigError("[train] steps, batch_size, seq_len and the *_every intervals must be positive")
    if train.seq_len > recipe.model.max_position_embeddings:
        raise ConfigError(f"[train] seq_len={train.seq_len} exceeds max_position_embeddings={recipe.model.max_position_embeddings}")
    if recipe.synthetic:
        _check_synthetic(recipe)
    elif recipe.model.vocab_size < 259:
        raise ConfigError("vocab_size must be at least 259 (256 bytes + 3 special tokens)")
    if not math.isfinite(train.lr) or train.lr <= 0:
        raise ConfigError(f"[train] lr must be a positive finite number, got {train.lr}")
    if not math.isfinite(train.min_lr) or not 0 <= train.min_lr <= train.lr:
        raise ConfigError(f"[train] min_lr must be in [0, lr={train.lr}], got {train.min_lr}")
    if train.warmup_steps < 0 or train.eval_batches < 1:
        raise ConfigError("[train] warmup_steps must be at least 0 and eval_batches at least 1")
    for key in ("weight_decay", "grad_clip"):
        value = getattr(train, key)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"[train] {key} must be a finite number >= 0, got {value}")
    if train.device not in ("auto", ""):
        try:
            torch.device(train.device)  # the name only: whether this machine has that device is checked at training
        except (RuntimeError, ValueError):
            raise ConfigError(f"[train] device must be auto, cpu, cuda or cuda:N, got {train.device!r}") from None
    _check_sizes(recipe)
    if not recipe.synthetic:
        check_needles_fit(recipe)
    analysis = recipe.analysis
    try:  # the names and bit widths `quantdiff sweep` takes, checked by the same registry
        for method in analysis.methods:
            method_name(method)
        for site in analysis.sites:
            site_name(site)
        for bits in analysis.bits:
            check_bits(bits)
        granularity(analysis.granularity)
    except ConfigError as exc:
        raise ConfigError(f"[analysis] {exc}") from None


def _check_primary(recipe: Recipe) -> None:
    """[analysis] primary_metrics × primary_arms: set together, without repeats, each arm one the reference arm
    is compared with, each metric a model metric of across_seeds.metrics or a sweep cell this recipe's run makes."""
    analysis = recipe.analysis
    metrics, arms = analysis.primary_metrics, analysis.primary_arms
    if bool(metrics) != bool(arms):
        raise ConfigError("[analysis] primary_metrics and primary_arms name the primary comparisons together: set both or neither")
    for key, items in (("primary_metrics", metrics), ("primary_arms", arms)):
        if len(set(items)) != len(items):
            raise ConfigError(f"[analysis] {key} lists a name twice: {items}")
    reference = reference_name({arm.name: arm.kind for arm in recipe.arms})
    compared = [name for name in recipe.arm_names if name != reference]
    for arm in arms:
        if arm not in compared:
            raise ConfigError(f"[analysis] primary_arms: {arm!r} is not an arm compared with the reference arm {reference!r} (those are: {', '.join(compared) or 'none'})")
    tasks = ("bb",) if recipe.synthetic else TEXT_TASKS
    cells = {sweep_key(task, site, method_name(method), bits) for task in tasks for site in analysis.sites for method in analysis.methods for bits in analysis.bits}
    cells |= {change_key(task, site, method_name(method), bits) for task in tasks for site in analysis.sites for method in analysis.methods
              for bits in analysis.bits}
    model_keys = [m.key for m in MODEL_METRICS]
    for metric in metrics:
        if metric not in model_keys and metric not in cells:
            raise ConfigError(f"[analysis] primary_metrics: unknown metric {metric!r} (known: {', '.join(model_keys)}, or sweep/ or change/<task>/<site>/<method>/<bits> "
                              f"with task {' or '.join(tasks)} and this recipe's sites, methods and bits, e.g. {sweep_key(tasks[0], analysis.sites[-1], method_name(analysis.methods[0]), analysis.bits[-1])})")


def _check_sizes(recipe: Recipe) -> None:
    tasks, analysis = recipe.tasks, recipe.analysis
    sizes = {"[tasks] lm_tokens": tasks.lm_tokens, "[tasks] choice_items": tasks.choice_items,
             "[tasks] retrieval_examples": tasks.retrieval_examples, "[tasks] bb_sequences": tasks.bb_sequences, "[analysis] stats_tokens": analysis.stats_tokens,
             "[analysis] seq_len": analysis.seq_len}
    for name, value in sizes.items():
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    lists = {"[tasks] retrieval_contexts": tasks.retrieval_contexts, "[tasks] retrieval_needles": tasks.retrieval_needles,
             "[analysis] bits": analysis.bits, "[analysis] methods": analysis.methods, "[analysis] sites": analysis.sites}
    for name, items in lists.items():
        if not items or len(set(items)) != len(items):
            raise ConfigError(f"{name} must be a non-empty list without repeats, got {items}")
    if min(tasks.retrieval_contexts + tasks.retrieval_needles) <= 0:
        raise ConfigError("[tasks] retrieval_contexts and retrieval_needles must be positive")
    model = recipe.model
    for context in tasks.retrieval_contexts:  # the trained models' positions, and this machine's memory
        if context > model.max_position_embeddings:
            raise ConfigError(f"[tasks] retrieval_contexts {context} exceeds max_position_embeddings={model.max_position_embeddings}")
        check_fits(forward_bytes(RETRIEVAL_BATCH, context, model.vocab_size, model.num_heads), f"[tasks] retrieval_contexts {context:,}")


def _check_corpus_keys(table: dict) -> None:
    """`corpus` names one source and `corpora` a mix: with both set, one of them would be ignored."""
    if "corpus" not in table or not table.get("corpora"):
        return
    if table["corpus"] == bigram_backcopy.NAME:
        raise ConfigError(f"[data] {bigram_backcopy.NAME} cannot be mixed with text corpora")
    raise ConfigError("[data] sets both corpus and corpora: name one source with corpus, or list every corpus of the mix in corpora")


def curriculum(step: int, recipe: Recipe) -> tuple[int, float, int]:
    """(most needles per document, share of the document they spread over, words per value) at `step`.

    Each moves linearly from its easy end to its final value over the first half of training."""
    progress = min(1.0, step / max(1, recipe.train.steps // 2))
    start = recipe.data.retrieval_value_words_start
    return (
        1 + int((recipe.data.retrieval_max_needles - 1) * progress),
        0.1 + 0.9 * progress,
        round(start + (VALUE_LENGTH - start) * progress),
    )


def curriculum_stages(recipe: Recipe) -> list[tuple[int, int]]:
    """Every (most needles, words per value) pair of the steps that make needle documents (after the copy
    warm-up). Both move monotonically, so the steps where the needle count changes, the ones just before, and
    the ends are all the stages there are."""
    first, last = recipe.data.copy_warmup_steps, recipe.train.steps - 1
    if first > last:
        return []
    last = min(max(first, recipe.train.steps // 2), last)  # from mid-training on nothing changes
    needles = lambda step: curriculum(step, recipe)[0]  # noqa: E731
    points = {first, last}
    for n in range(needles(first) + 1, needles(last) + 1):
        change = first + bisect_left(range(first, last + 1), n, key=needles)
        points |= {change, change - 1}
    return sorted({(needles(step), curriculum(step, recipe)[2]) for step in points})


def needle_documents(recipe: Recipe) -> list[tuple[int, int, int, int, str]]:
    """Every kind of needle document a run makes: (tokens available, needles, queries, words per value, what).

    Training rows hold seq_len + 1 tokens (inputs and targets), less the BOS the recipe may put first; the
    curriculum's (needles, words) pairs are all listed, since words per value may shrink as needles grow."""
    data, train, tasks = recipe.data, recipe.train, recipe.tasks
    bos = int(train.bos)
    documents = []
    if data.retrieval_fraction > 0:
        documents += [(train.seq_len + 1 - bos, n, n, words, f"[train] seq_len + 1{' - BOS' * bos} (training needle documents)")
                      for n, words in curriculum_stages(recipe)]
    documents += [(train.seq_len - bos, n, 1, VALUE_LENGTH, f"[train] seq_len{' - BOS' * bos} (retrieval evaluation after training)") for n in tasks.retrieval_needles]
    documents += [(c, n, 1, VALUE_LENGTH, f"[tasks] retrieval_contexts {c}") for c in tasks.retrieval_contexts for n in tasks.retrieval_needles]
    return documents


def check_needles_fit(recipe: Recipe, need: Callable[[int, int, int], int] = min_document_tokens, unit: str = "tokens") -> None:
    """Needle documents must fit their lengths, or training or evaluation would fail after hours of work.

    `need(needles, queries, words)`: tokens a document needs; by default a bound for any tokenizer (a token per
    word), which the recipe can be checked against before a tokenizer exists; training checks again with its own."""
    for length, needles, queries, words, what in needle_documents(recipe):
        needed = need(needles, queries, words)
        if length < needed:
            raise ConfigError(f"{what} = {length} tokens cannot hold {needles} needle(s) of {words}-word values (at least {needed} {unit})")


def _check_synthetic(recipe: Recipe) -> None:
    """bigram-backcopy is a whole data set with its own character vocabulary: no text, needles or BPE."""
    vocab = bigram_backcopy.load().vocab_size
    if recipe.model.vocab_size != vocab:
        raise ConfigError(f"[model] vocab_size must be {vocab} for {bigram_backcopy.NAME} (its characters, BOS and padding)")
    if recipe.data.retrieval_fraction or recipe.data.copy_warmup_steps:
        raise ConfigError(f"[data] {bigram_backcopy.NAME} has no needle or copy rows: set retrieval_fraction = 0")
    if not recipe.train.bos:
        raise ConfigError(f"[train] bos must be true for {bigram_backcopy.NAME}: every sequence starts with BOS")


def _check_seeds(train: TrainConfig, table: dict) -> None:
    """`seeds`: a non-empty list of distinct whole numbers in torch's seed range, holding `seed` if both are given."""
    if "seeds" not in table:
        return
    seeds = train.seeds
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"[train] seeds must be a non-empty list of whole numbers, got {seeds!r}")
    for seed in seeds:
        check_seed(seed, "[train] seeds: each seed")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"[train] seeds lists a seed twice: {seeds}")
    if "seed" in table and train.seed not in seeds:
        raise ConfigError(f"[train] seed {train.seed} is not one of seeds {seeds} (it names the seed that stands for the run)")


def _check_emergence_options(recipe: Recipe) -> None:
    data, train = recipe.data, recipe.train
    unknown = [name for name in data.corpora if name not in SOURCES]
    if unknown:
        raise ConfigError(f"[data] corpora: unknown corpus {unknown[0]!r} (known: {', '.join(SOURCES)})")

    if len(set(data.corpora)) != len(data.corpora):
        raise ConfigError("[data] corpora lists a corpus twice")
    if not (0 <= train.adam_beta1 < 1 and 0 <= train.adam_beta2 < 1):
        raise ConfigError("[train] adam_beta1 and adam_beta2 must be in [0, 1)")
    if train.outlier_sequences < 0:
        raise ConfigError("[train] outlier_sequences must be at least 0")


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file by path, or by name from the repository's recipes/ or a shipped pair's saved copy."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (REPO_RECIPES / f"{name_or_path}.toml", ASSETS / str(name_or_path) / "standard" / "recipe.toml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"no recipe {str(name_or_path)!r}: not a file, and not a name in {REPO_RECIPES} or {ASSETS}")


def load_recipe(name_or_path: str | Path) -> Recipe:
    path = recipe_path(name_or_path)
    name = path.parent.parent.name if path.name == "recipe.toml" else path.stem
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"recipe {path} is not UTF-8 text (a TOML file)") from None
    return parse_recipe(text, name)
