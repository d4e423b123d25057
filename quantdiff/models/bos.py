"""Whether a model's sequences start with its BOS token: as the model was trained, unless the user says otherwise.

A model trained with BOS at every sequence start parks attention and grows its massive activation on that token;
measured without it, its sinks and outliers are not the ones it has in use (Gemma 3 270M: sink score 0.58 with
BOS, 0.00 without). What a model expects, in this order:
1. a model quantdiff trained: its recipe's `[train] bos` (recipe.toml beside the weights);
2. a model converted from a GGUF file: the file's `tokenizer.ggml.add_bos_token` (transformers' tokenizer built
   from the file does not carry it);
3. otherwise its tokenizer: whether encoding with special tokens puts BOS first (`add_bos_token`, or a
   post-processor such as Llama 3's).
`--bos always|never` overrides the decision; the decision and its reason go into every JSON output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.models.source import model_source

BOS_MODES = ("auto", "always", "never")
RECIPE_FILE = "recipe.toml"


@dataclass(frozen=True)
class BosChoice:
    """`token_id`: put first in every sequence (None: nothing is); `reason`: why, in a phrase."""

    token_id: int | None
    token: str | None
    mode: str
    reason: str

    @property
    def prefix(self) -> list[int]:
        return [] if self.token_id is None else [self.token_id]

    def to_dict(self) -> dict:
        return {"added": self.token_id is not None, "token_id": self.token_id, "token": self.token, "mode": self.mode, "reason": self.reason}


def check_mode(mode: str) -> str:
    if mode not in BOS_MODES:
        raise ConfigError(f"--bos must be one of {', '.join(BOS_MODES)}, got {mode!r}")
    return mode


def expects_bos(model_dir: Path, tokenizer) -> tuple[bool, str]:
    """(whether the model was trained with BOS first, the evidence), by the rules of the module docstring."""
    trained = _recipe_bos(model_dir)
    if trained is not None:
        return trained, f"trained by quantdiff with [train] bos = {str(trained).lower()}"
    record = model_source(model_dir) or {}
    if record.get("format") == "gguf" and record.get("add_bos_token") is not None:
        return record["add_bos_token"], f"the GGUF file's tokenizer.ggml.add_bos_token = {str(record['add_bos_token']).lower()}"
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        return False, "its tokenizer has no BOS token"
    adds = tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos_id]
    return adds, "its tokenizer adds BOS" if adds else "its tokenizer adds no BOS"


def decide_bos(model_dir: str | Path, tokenizer, mode: str = "auto") -> BosChoice:
    """What goes first in `model_dir`'s sequences under `--bos mode`."""
    check_mode(mode)
    model_dir = Path(model_dir)
    if mode == "never":
        return BosChoice(None, None, mode, "--bos never")
    first, reason = (True, "--bos always") if mode == "always" else expects_bos(model_dir, tokenizer)
    if not first:
        return BosChoice(None, None, mode, reason)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None:
        raise LoadError(f"{model_dir}: BOS first ({reason}), but its tokenizer has no BOS token")
    return BosChoice(int(bos_id), tokenizer.bos_token, mode, reason)


def _recipe_bos(model_dir: Path) -> bool | None:
    """A quantdiff-trained model's `[train] bos` (absent: false, the recipe default); None without a recipe."""
    import tomllib

    path = model_dir / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        bos = tomllib.loads(path.read_text(encoding="utf-8")).get("train", {}).get("bos", False)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError) as exc:
        raise LoadError(f"unreadable {path}: {exc}") from None
    if not isinstance(bos, bool):
        raise LoadError(f"{path}: [train] bos must be true or false, got {bos!r}")
    return bos


def describe_bos(name: str, record: dict) -> str:
    """One line for a table's notes: what opened `name`'s sequences, and why."""
    if record["added"]:
        return f"{name}: every sequence starts with BOS {record['token']} (id {record['token_id']}): {record['reason']}"
    return f"{name}: no BOS put first: {record['reason']}"
