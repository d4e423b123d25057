"""Load a local Hugging Face causal-LM directory onto the quantdiff attention backend.

Never reaches a hub (`local_files_only`: hub ids are resolved to cached directories by `names.resolve`),
runs remote code only when asked (`trust_remote_code=True`), never unpickles: only safetensors.
"""

from __future__ import annotations

import copy
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

import quantdiff.attention.backend as attention
from quantdiff.core.device import resolve_device
from quantdiff.core.errors import LoadError
from quantdiff.core.memory import available_memory
from quantdiff.models.config_check import check_heads, check_raw_sizes
from quantdiff.models.stored import FLOAT_DTYPES, check_float_dtypes, read_config_json, stored_bytes, stored_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
SHOWN = 3  # names listed in a mismatch message
# A checkpoint whose names transformers converts is compared by name only after loading: until then, never
# allocate more than this multiple of the values it stores (a few missing tensors pass, a wrong width does not).
ALLOCATION_SLACK = 1.5


def check_model_dir(path: str | Path) -> Path:
    """Validate a model directory before transformers sees it; raise LoadError with a one-line reason."""
    path = Path(path)
    if not path.exists():
        raise LoadError(f"model path does not exist: {path}")
    if not path.is_dir():
        raise LoadError(f"model path is not a directory: {path}")
    if not (path / "config.json").is_file():
        raise LoadError(f"no config.json in {path}: not a Hugging Face model directory")
    read_config_json(path)
    # A weight index may name shards in a subdirectory or elsewhere: then transformers' resolver (stored_tensors) decides.
    if not any(path.glob("*.safetensors")) and not (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise LoadError(
                f"{path} holds only pickled weights ({', '.join(pickled)}); quantdiff loads safetensors only "
                "(convert them with a tool you trust)"
            )
        raise LoadError(f"no .safetensors weights in {path}")
    stored_tensors(path)  # exactly the files that will load: present, whole, readable
    return path


def load_config(path: str | Path, trust_remote_code: bool = False):
    path = check_model_dir(path)
    raw = read_config_json(path)
    check_raw_sizes(raw, path / "config.json")
    _check_described_size(raw, path)
    try:
        with quiet_load_report(logging.CRITICAL):
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except StrictDataclassError as exc:  # transformers' own validation of the fields and their relations
        cause = exc.__cause__ or exc
        raise LoadError(f"invalid config.json in {path}: {' '.join(str(cause).split())}") from None
    except (ValueError, KeyError, OSError, TypeError, AttributeError) as exc:
        raise LoadError(f"cannot read config.json in {path}: {' '.join(str(exc).split())}") from None
    check_heads(config, raw, path / "config.json")
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    registered = type(config) in AutoModelForCausalLM._model_mapping  # quantdiff's own model types too (DIFF V2)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not registered and not remote:
        raise LoadError(f"unsupported architecture {config.model_type!r}: not a transformers causal LM")
    return config


def _check_described_size(raw: dict, path: Path) -> None:
    """Refuse, before transformers builds anything from it, a config describing far more than the checkpoint
    stores: every layer holds at least `hidden_size` values (its norm), and a config (or model skeleton) of
    10**9 layers would be built until memory runs out."""
    sizes = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers, width = sizes.get("num_hidden_layers"), sizes.get("hidden_size")
    if not (isinstance(layers, int) and isinstance(width, int)):
        return
    held = sum(t.numel for t in stored_tensors(path).values())
    if layers * width > ALLOCATION_SLACK * held:
        raise LoadError(
            f"{path}: config.json describes {layers:,} layers of width {width:,}, more than the {held:,} stored weight values "
            "can hold: the config does not match the stored tensors (refused before building the model)"
        )


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
    """A model from a local directory, in eval mode, on the quantdiff backend with taps attached.

    device: where to put it (default: CUDA if available, else CPU). device_map: passed to accelerate
    instead (e.g. "auto" for models larger than one device). trust_remote_code: run the model's own Python
    code (off unless asked for). The directory must hold exactly the model's tensors, as transformers' own
    loader maps them (checked from the headers before anything is allocated, then from its loading report).
    """
    path = Path(path)
    config = load_config(path, trust_remote_code)
    attention.register()
    _check_uses_registry(config)
    check_before_allocating(path, config, dtype, None if device_map is not None else available_memory(), trust_remote_code)
    # Mismatched shapes are reported by check_loading_report, in one line, instead of transformers' report.
    kwargs = dict(
        local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=True, attn_implementation=attention.BACKEND_NAME,
        ignore_mismatched_sizes=True,
    )
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    with quiet_load_report(), loading_reports() as reports:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=copy.deepcopy(config), **kwargs)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            if reports:  # transformers raises after its report when a conversion failed: the report says why
                check_loading_report(reports[-1], path, (getattr(config, "architectures", None) or [config.model_type])[0])
            raise LoadError(f"cannot load {path}: {str(exc).splitlines()[0]}") from None
    check_loading_report(reports[-1], path, type(model).__name__)
    if device_map is None:
        model.to(resolve_device(device))
    return prepare(model, tile_size)


def skeleton(config, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model `config` describes, on the meta device: its parameter names and shapes, no memory."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError, RuntimeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise LoadError(f"config.json does not describe a {config.model_type} model transformers can build: {reason}") from None


def check_before_allocating(path: Path, config, dtype: torch.dtype | None, budget: int | None, trust_remote_code: bool = False) -> None:
    """From the headers of exactly the files that will load, before any weight is allocated: refuse integer
    weights, tensors that do not match the model `config` describes (a wrong hidden_size would otherwise
    allocate the larger model first), and a model larger than `budget` bytes of memory."""
    tensors = stored_tensors(path)
    declared = getattr(config, "quantization_config", None)
    if declared is not None:
        if all(t.dtype in FLOAT_DTYPES for t in tensors.values()):  # no codes at all: nothing was quantized
            method = declared.get("quant_method", "a") if isinstance(declared, dict) else getattr(declared, "quant_method", "a")
            raise LoadError(
                f"{path}: config.json declares {method} quantization, but the checkpoint stores plain float weights "
                "(transformers would quantize them while loading): remove quantization_config, or load the quantized checkpoint"
            )
        return  # quantized storage: its packing decides dtypes and sizes (transformers' quantizer checks them)
    model = skeleton(config, trust_remote_code)
    computed = _computed_buffers(model)
    check_float_dtypes(tensors, path, tolerated={n for n in tensors if computed(n)})
    names = set(model.state_dict(keep_vars=True))
    if all(n in names or computed(n) for n in tensors):  # stored under the in-memory names
        check_tensors(model, {n: t.shape for n, t in tensors.items()}, path)
    # Otherwise transformers converts the names (e.g. per-expert tensors fused) and its loading report names any
    # problem after loading; here a config describing far more values than are stored is refused unallocated.
    needed = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()  # tied weights once
    expected, held = sum(t.numel() for t in needed), sum(t.numel for t in tensors.values())
    if expected > ALLOCATION_SLACK * held:
        raise LoadError(
            f"{path}: config.json describes {expected:,} weight values but the checkpoint stores {held:,}: "
            "the config does not match the stored tensors (refused before allocating)"
        )
    size = expected * dtype.itemsize if dtype is not None else stored_bytes(tensors)
    if budget is not None and size > budget:
        raise LoadError(f"{path} needs {size / 1e9:.1f} GB of memory, {budget / 1e9:.1f} GB are available")


@contextmanager
def loading_reports() -> Iterator[list]:
    """Collect transformers' own loading report (missing, unexpected and mismatched keys after its key
    conversion, and conversion errors) of each from_pretrained call in the block, also when it then raises."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.log_state_dict_report
    reports: list = []

    def capture(*args, loading_info, **kwargs):
        reports.append(loading_info)
        return original(*args, loading_info=loading_info, **kwargs)

    modeling_utils.log_state_dict_report = capture
    try:
        yield reports
    finally:
        modeling_utils.log_state_dict_report = original


def check_loading_report(info, where: str | Path, model_name: str) -> None:
    """LoadError naming the first few tensors transformers found missing, unexpected, of the wrong shape or not
    convertible: transformers would initialise them randomly (or drop them) and go on; we refuse."""
    missing = sorted(info.missing_keys)
    unexpected = sorted(info.unexpected_keys)
    wrong = [f"{k} {list(stored)} (model: {list(model)})" for k, stored, model in sorted(info.mismatched_keys, key=str)]
    unconverted = [f"{k} ({_conversion_reason(str(v))})" for k, v in sorted(info.conversion_errors.items())]
    _refuse(where, model_name, missing=missing, unexpected=unexpected, wrong=wrong, unconverted=unconverted + list(info.error_msgs))


def _conversion_reason(text: str) -> str:
    """The exception line of a conversion error (transformers stores a whole traceback)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return (raised or lines or [""])[-1]


def _refuse(where: str | Path, model_name: str, **problems: list[str]) -> None:
    labels = {"missing": "missing", "unexpected": "unexpected", "wrong": "wrong shape", "unconverted": "not convertible"}
    parts = [f"{labels[what]} {', '.join(names[:SHOWN])}" + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
             for what, names in problems.items() if names]
    if parts:
        raise LoadError(f"{where} does not hold exactly the tensors of {model_name}: {'; '.join(parts)}")


@contextmanager
def quiet_load_report(level: int = logging.ERROR) -> Iterator[None]:
    """transformers logs a multi-line table of missing/unexpected/mismatched keys (and, for a config it cannot
    set, the whole config as an error): we report them in one line. Its "Loading weights" bar is off too: a
    library call prints nothing, and the CLI draws its own progress."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity(level)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


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


def _computed_buffers(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a key is a stored copy of a buffer the model computes itself (older checkpoints saved rotary
    inv_freq per layer, and position_ids), or a key the architecture declares ignorable: harmless to leave
    unread. The model's buffers are listed once, not once per key (a module walk per stored tensor)."""
    buffers = {name for name, _ in model.named_buffers()}
    suffixes = [s for s in ("rotary_emb.inv_freq", "position_ids") if any(b.endswith(s) for b in buffers)]
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return lambda key: key in buffers or any(key.endswith(s) for s in suffixes) or any(re.search(pattern, key) for pattern in patterns)


def check_tensors(model: torch.nn.Module, stored: dict[str, tuple[int, ...]], where: str | Path) -> None:
    """For tensors stored under the in-memory state_dict names (quantdiff's exports, and every checkpoint whose
    names transformers does not convert): LoadError naming the first few tensors the model has but `stored`
    lacks, has but the model does not, or has with another shape. Tied weights need one stored copy;
    non-persistent buffers are not expected."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    groups = _tied_groups(model)
    missing = [k for k in expected if not any(name in stored for name in groups.get(k, {k}))]
    computed = _computed_buffers(model)
    unexpected = [k for k in stored if k not in expected and not computed(k)]
    wrong = [f"{k} {list(stored[k])} (model: {list(expected[k])})" for k in stored if k in expected and stored[k] != expected[k]]
    _refuse(where, type(model).__name__, missing=missing, unexpected=unexpected, wrong=wrong)


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
