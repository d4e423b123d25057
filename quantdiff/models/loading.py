"""Load a local Hugging Face causal-LM directory onto the quantdiff attention backend.

Never reaches a hub (`local_files_only`: hub ids are resolved to cached directories by `names.resolve`),
runs remote code only when asked (`trust_remote_code=True`), never unpickles: only safetensors.
"""

from __future__ import annotations

import copy
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import quantdiff.attention.backend as attention
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import LoadError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
SHOWN = 3  # names listed in a mismatch message


def check_model_dir(path: str | Path) -> Path:
    """Validate a model directory before transformers sees it; raise LoadError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise LoadError(f"model path does not exist: {path}")
    if not path.is_dir():
        raise LoadError(f"model path is not a directory: {path}")
    if not (path / "config.json").is_file():
        raise LoadError(f"no config.json in {path}: not a Hugging Face model directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise LoadError(
                f"{path} holds only pickled weights ({', '.join(pickled)}); quantdiff loads safetensors only "
                "(convert them with a tool you trust)"
            )
        raise LoadError(f"no .safetensors weights in {path}")
    for file in weights:
        _check_safetensors(file)
    return path


def _check_safetensors(file: Path) -> None:
    """Parse the header and check that every tensor's bytes are present: catches truncated or corrupt files."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > min(size - 8, MAX_HEADER_BYTES):  # read nothing absurd into memory
                raise LoadError(f"corrupt safetensors file {file}: its header claims {header_len:,} bytes of a {size:,}-byte file")
            header = json.loads(f.read(header_len))
        data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise LoadError(f"unreadable safetensors header in {file}: {type(exc).__name__}") from None
    if file.stat().st_size < 8 + header_len + data_end:
        raise LoadError(f"truncated safetensors file {file}: {file.stat().st_size} bytes, its header needs {8 + header_len + data_end}")
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise LoadError(f"unreadable safetensors file {file}: {str(exc).splitlines()[0]}") from None


def load_config(path: str | Path, trust_remote_code: bool = False):
    path = check_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, StrictDataclassError) as exc:  # strict configs validate their sizes
        lines = str(exc).splitlines()
        reason = lines[-1].strip() if isinstance(exc, StrictDataclassError) else lines[0]  # the cause, not the validator's name
        raise LoadError(f"cannot read config.json in {path}: {reason}") from None
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    registered = type(config) in AutoModelForCausalLM._model_mapping  # quantdiff's own model types too (DIFF V2)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not registered and not remote:
        raise LoadError(f"unsupported architecture {config.model_type!r}: not a transformers causal LM")
    return config


def _check_uses_registry(config, cls: type | None = None) -> None:
    """Refuse, by name, architectures whose attention bypasses transformers' attention registry: those that
    neither declare support for attention backends nor declare their attention modules for recording."""
    cls = cls or AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:
        return  # remote code: the coverage check of every run finds attention that bypasses the backend
    declared = (getattr(cls, "_can_record_outputs", None) or {}).get("attentions")
    if not (getattr(cls, "_supports_attention_backend", False) or declared):
        raise LoadError(f"unsupported architecture {config.model_type!r}: its attention does not use transformers' registry")


def load(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
    tile_size: int | None = attention.DEFAULT_TILE_SIZE,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A model from a local directory, in eval mode, on the quantdiff attention backend with taps attached.

    device: where to put it (default: CUDA if available, else CPU). device_map: passed to accelerate
    instead (e.g. "auto" for models larger than one device). trust_remote_code: run the model's own Python
    code (off unless asked for).
    """
    config = load_config(path, trust_remote_code)
    attention.register()
    _check_uses_registry(config)
    # Mismatched shapes are reported by check_checkpoint_tensors, in one line, instead of transformers' report.
    kwargs = dict(
        local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=True, attn_implementation=attention.BACKEND_NAME,
        ignore_mismatched_sizes=True,
    )
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        with quiet_load_report():
            model = AutoModelForCausalLM.from_pretrained(Path(path), config=copy.deepcopy(config), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise LoadError(f"cannot load {path}: {str(exc).splitlines()[0]}") from None
    check_checkpoint_tensors(model, Path(path))
    if device_map is None:
        model.to(resolve_device(device))
    return prepare(model, tile_size)


@contextmanager
def quiet_load_report() -> Iterator[None]:
    """transformers logs a multi-line table of missing/unexpected/mismatched keys; we report them in one line."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of every safetensors file in a model directory, read from the headers only."""
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _tied_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """{state_dict key: every key holding the same tensor}: a checkpoint stores tied weights once."""
    groups: dict[str, set[str]] = {}
    by_storage: dict[tuple, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta" and tensor.numel():
            by_storage.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), set()).add(name)
    for names in by_storage.values():
        for name in names:
            groups[name] = names
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied = groups.get(target, {target}) | groups.get(source, {source})
        for name in tied:
            groups[name] = tied
    return groups


def _computed_buffer(model: torch.nn.Module, key: str) -> bool:
    """A stored copy of a buffer the model computes itself (older checkpoints saved rotary inv_freq per layer,
    and position_ids), or a key the architecture declares ignorable: harmless to leave unread."""
    buffers = [name for name, _ in model.named_buffers()]
    if key in buffers or any(key.endswith(s) and any(b.endswith(s) for b in buffers) for s in ("rotary_emb.inv_freq", "position_ids")):
        return True
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(pattern, key) for pattern in patterns)


def check_tensors(model: torch.nn.Module, stored: dict[str, tuple[int, ...]], where: str | Path) -> None:
    """LoadError naming the first few tensors the model has but `stored` lacks, has but the model does not,
    or has with another shape. Tied weights need one stored copy; non-persistent buffers are not expected."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    groups = _tied_groups(model)
    missing = [k for k in expected if not any(name in stored for name in groups.get(k, {k}))]
    unexpected = [k for k in stored if k not in expected and not _computed_buffer(model, k)]
    wrong = [f"{k} {list(stored[k])} (model: {list(expected[k])})" for k in stored if k in expected and stored[k] != expected[k]]
    problems = [f"{what} {', '.join(names[:SHOWN])}" + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
                for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]
    if problems:
        raise LoadError(f"{where} does not hold exactly the tensors of {type(model).__name__}: {'; '.join(problems)}")


def check_checkpoint_tensors(model: torch.nn.Module, path: Path) -> None:
    """After from_pretrained: transformers initialises a missing tensor randomly and goes on; we refuse."""
    check_tensors(model, stored_shapes(path), path)


def prepare(model: PreTrainedModel, tile_size: int | None = attention.DEFAULT_TILE_SIZE) -> PreTrainedModel:
    """Switch an in-memory model to the quantdiff backend, attach taps, eval mode."""
    _check_uses_registry(model.config, type(model))
    attention.register()
    model.set_attn_implementation(attention.BACKEND_NAME)
    attention.attach_taps(model)  # LoadError when the model declares no attention modules
    attention.set_tile_size(model, tile_size)
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # whole sentences, on one line
        raise LoadError(f"no usable tokenizer in {path}: {reason}") from None
