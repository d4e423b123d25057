"""Load a local Hugging Face causal-LM directory onto the quantdiff attention backend.

Never reaches a hub (`local_files_only`: hub ids are resolved to cached directories by `names.resolve`),
runs remote code only when asked (`trust_remote_code=True`), never unpickles: only safetensors.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import quantdiff.attention.backend as attention
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import LoadError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


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
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
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
    except (ValueError, KeyError, OSError) as exc:
        raise LoadError(f"cannot read config.json in {path}: {str(exc).splitlines()[0]}") from None
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
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
    kwargs = dict(
        local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=True, attn_implementation=attention.BACKEND_NAME
    )
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(Path(path), config=copy.deepcopy(config), **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise LoadError(f"cannot load {path}: {str(exc).splitlines()[0]}") from None
    if device_map is None:
        model.to(resolve_device(device))
    return prepare(model, tile_size)


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
        raise LoadError(f"no usable tokenizer in {path}: {str(exc).splitlines()[0]}") from None
