"""The Python API's arguments, checked at the boundary with the CLI's own checks: every bad argument is one
`QuantdiffError` line naming the parameter, never a TypeError, IndexError or ValueError from deep inside torch
or transformers."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from quantdiff.core.errors import ConfigError, DataError
from quantdiff.core.integers import as_int
from quantdiff.core.typed import plain_numbers

F = TypeVar("F", bound=Callable[..., Any])

# dtype names the API takes besides torch dtypes (the names of torch's own floating types and the usual short ones).
DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def kind_of(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def model_name(model: Any, parameter: str = "model", what: str = "a model name or path") -> str | Path:
    """A model name or path (what the CLI takes as MODEL), or with `what` any path argument."""
    if isinstance(model, bool) or not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"{parameter} must be {what} (a str or Path), got {kind_of(model)}")
    if not str(model).strip():
        raise ConfigError(f"{parameter} must be {what}, got an empty string")
    return model


def dtype(value: Any) -> torch.dtype | None:
    """None, a floating torch.dtype, or its name ('bfloat16', 'bf16', 'float32', 'torch.float16', ...)."""
    if value is None:
        return None
    if isinstance(value, str):
        found = DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))
        if found is None:
            raise ConfigError(f"dtype must be a floating type ({', '.join(sorted(DTYPE_NAMES))} or a torch.dtype), got {value!r}")
        return found
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype or its name, got {value!r}")
    return value


def positive_int(value: Any, parameter: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    number = as_int(value)
    if number is None or number < 1:
        raise ConfigError(f"{parameter} must be a positive integer, got {value!r}")


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's, which place on real devices


def device_map(value: Any) -> None:
    """A device_map places the model only on devices `device` accepts (never meta): each device it names is
    checked as `device` is; accelerate's strategies and its "disk" offload are accepted as they are."""
    from quantdiff.core.device import resolve_device

    if value is None or (isinstance(value, str) and value in DEVICE_MAP_STRATEGIES):
        return
    if isinstance(value, dict) and not value:
        raise ConfigError("device_map is empty: it must place the model's modules")
    for place in value.values() if isinstance(value, dict) else [value]:
        if place != "disk":
            resolve_device(f"cuda:{as_int(place)}" if as_int(place) is not None else place, "device_map")


def flag(value: Any, parameter: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{parameter} must be True or False, got {value!r}")


def tile_size(value: Any) -> int | None:
    """None or 0: one tile (no tiling), as the CLI's --tile-size 0; else a positive integer."""
    if value is None or as_int(value) == 0:
        return None
    positive_int(value, "tile_size (None or 0 = one tile)")
    return as_int(value)


def arguments(function: F) -> F:
    """`function` with its call checked against its signature first: an unknown keyword, a missing or an extra
    argument is one ConfigError line naming the parameters, as `load` refuses an unknown keyword; then every
    number normalised once (`core.typed.plain_numbers`: numpy integers become ints, bools are refused)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"{function.__name__}(): {exc} (parameters: {', '.join(signature.parameters)})") from None
        plain_numbers(function, bound)
        return function(*bound.args, **bound.kwargs)

    return checked  # type: ignore[return-value]


def known_keywords(given: dict, known: Sequence[str], function: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"{function}() has no parameter {unknown[0]!r} (known: {', '.join(known)})")


def quantdiff_model(model: Any) -> nn.Module:
    """A model loaded by quantdiff.load (its attention taps are what every measurement observes)."""
    from quantdiff.attention.backend import taps

    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch model loaded with quantdiff.load, got {kind_of(model)}")
    if not taps(model):
        raise ConfigError("model has no quantdiff attention taps: load it with quantdiff.load (or prepare it with quantdiff.models.loading.prepare)")
    return model


def token_ids(data: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Integer ids of shape (T,) or (B, T), non-empty, with values (not on the meta device), inside the model's
    vocabulary and positions; (B, T) int64 out, so every comparison is made in int64 (the vocabulary size in
    int8 would wrap)."""
    if data.dtype == torch.bool or data.is_floating_point() or data.is_complex():
        raise DataError(f"data must hold integer token ids, got dtype {data.dtype}")
    if data.device.type == "meta":
        raise DataError("data is on the meta device, which holds shapes but no token ids: give ids on the CPU or the model's device")
    data = data.to(torch.int64)
    if data.dim() not in (1, 2):
        raise DataError(f"data must be token ids of shape (T,) or (B, T), got shape {tuple(data.shape)}")
    rows = data.reshape(1, -1) if data.dim() == 1 else data
    if rows.numel() == 0:
        raise DataError(f"data holds no tokens (shape {tuple(data.shape)})")
    from quantdiff.eval.bounds import check_positions

    config = model.config
    vocab = getattr(config, "vocab_size", None)
    check_positions(rows.shape[1], config, "data sequences")  # as `quantdiff stats` refuses a longer --seq-len
    outside = (rows < 0) | (rows >= vocab) if isinstance(vocab, int) else rows < 0
    if bool(outside.any()):
        raise DataError(f"data holds token id {int(rows[outside][0])} outside the model's vocabulary (size {vocab})")
    return rows


def batches(data: Any, model: nn.Module) -> list:
    """A non-empty sequence of Batch objects whose ids and lengths fit the model; returned with int64 ids."""
    from quantdiff.data.sources import Batch

    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
        raise DataError("data must be token ids (a tensor of shape (T,) or (B, T)) or a non-empty list of Batch objects")
    wrong = next((b for b in data if not isinstance(b, Batch)), None)
    if wrong is not None:
        raise DataError(f"data must be token ids (a tensor) or Batch objects, got a list holding {kind_of(wrong)}")
    checked = []
    for batch in data:
        if batch.input_ids.dim() != 2 or batch.input_ids.numel() == 0:
            raise DataError(f"a Batch's input_ids must be (B, T) and non-empty, got shape {tuple(batch.input_ids.shape)}")
        checked.append(Batch(token_ids(batch.input_ids, model), batch.attention_mask, batch.first_sequence))
    return checked
