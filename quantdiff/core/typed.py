"""Public config classes checked where they are built: `checked_class` makes a dataclass's constructor refuse a
call that does not fit its signature (`HadamardRotation(5)`) and an argument whose type is not its field's
annotation (`KVSite(plan="x")`), each as one ConfigError line naming the class and the field, instead of a
TypeError or an AttributeError when the value is first used. Integers follow `core.integers` (a numpy integer
is stored as an int); floats take any real number but a bool, stored as a float."""

from __future__ import annotations

import collections.abc
import functools
import inspect
import re
import types
import typing
from numbers import Real
from typing import Any, Callable, TypeVar

from quantdiff.core.errors import ConfigError
from quantdiff.core.integers import as_int

C = TypeVar("C", bound=type)


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of the annotated type (containers and callables by their outer type only)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, member) for member in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return as_int(value) is not None
    if hint is float:
        return isinstance(value, Real) and not isinstance(value, bool)
    if origin is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        return isinstance(value, origin) if isinstance(origin, type) else True
    return isinstance(value, hint) if isinstance(hint, type) else True


def _members(hint: Any) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _plain(value: Any, hint: Any) -> Any:
    """A numpy number as the Python int or float its field holds (so configs compare and serialise as usual)."""
    members = _members(hint)
    if int in members and as_int(value) is not None:
        return as_int(value)
    if float in members and isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    return value


def _shown(hint: Any) -> str:
    """'KVPlan | None' for quantdiff.quant.kv_plan.KVPlan | None (module paths dropped)."""
    return re.sub(r"[\w.]+\.(\w+)", r"\1", re.sub(r"<class '([\w.]+)'>", r"\1", str(hint)))


def checked_class(cls: C) -> C:
    """`cls` (a dataclass) with its constructor's arguments checked first (see the module docstring)."""
    init = cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            names = ", ".join(list(signature.parameters)[1:])
            raise ConfigError(f"{cls.__name__}(): {exc} (parameters: {names or 'none'})") from None
        hints = typing.get_type_hints(cls)
        for name, value in list(bound.arguments.items())[1:]:
            hint = hints.get(name)
            if hint is None:
                continue
            if not _fits(value, hint):
                raise ConfigError(f"{cls.__name__}: {name} must be {_shown(hint)}, got {value!r:.60}")
            bound.arguments[name] = _plain(value, hint)
        init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def plain_numbers(function: Callable[..., Any], bound: inspect.BoundArguments) -> None:
    """The public functions' one boundary for numbers (`api_checks.arguments`): every argument of `function`
    annotated as an int or a float (alone or in a union: `int | None`, `int | str`) is stored as a Python int or
    float (a numpy integer converted, so none reaches torch or a file writer), and a bool there is refused as one
    ConfigError line naming the parameter. Other values are left to the function's own checks, whose messages
    say what the value must be."""
    hints = typing.get_type_hints(function)
    for name, value in bound.arguments.items():
        members = _members(hints.get(name))
        if bool in members or not {int, float} & set(members):
            continue
        if isinstance(value, bool):
            raise ConfigError(f"{function.__name__}(): {name} must be {_shown(hints[name])}, got {value!r}")
        bound.arguments[name] = _plain(value, hints[name])
