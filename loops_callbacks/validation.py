"""Argument checks shared by the callbacks, the DataModules and the scorers, with one wording.

A value of the wrong type is a ``TypeError``, a value out of range a ``ValueError``; both name
the argument and the value. ``bool`` is never accepted as an int.

Example:
    >>> check_int("top_n", 3, least=0)
    3
    >>> check_int("top_n", -1, least=0)
    Traceback (most recent call last):
    ...
    ValueError: top_n must be an int >= 0, got -1
    >>> check_dtype("scoring_dtype", "bfloat16")
    torch.bfloat16
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["FLOAT_DTYPES", "check_bool", "check_dtype", "check_int", "check_real", "check_type"]

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The floating-point dtypes a model may be scored or sampled in, by their YAML names (the one table)."""


def check_int(name: str, value: Any, *, least: int | None, what: str = "") -> int:
    """``value`` if it is an int (not a bool) ``>= least`` (any int when ``least`` is ``None``);
    ``TypeError`` / ``ValueError`` otherwise. ``what`` adds the value's meaning to the message.

    Example:
        >>> check_int("max_histogram_tokens", 1.5, least=None, what=" (<= 0: no cap)")
        Traceback (most recent call last):
        ...
        TypeError: max_histogram_tokens must be an int (<= 0: no cap), got 1.5
    """
    bound = "" if least is None else f" >= {least}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{bound}{what}, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be an int{bound}{what}, got {value!r}")
    return value


def check_real(name: str, value: Any, *, least: float, most: float = math.inf, what: str) -> float:
    """``value`` as a float if it is a real number (not a bool) in ``[least, most]``; ``TypeError`` /
    ``ValueError`` naming ``name`` otherwise (NaN is out of every range).

    Example:
        >>> check_real("max_kl", "0.05", least=0.0, what="a number >= 0 or None")
        Traceback (most recent call last):
        ...
        TypeError: max_kl must be a number >= 0 or None, got '0.05' (str)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    if not least <= value <= most:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; ``TypeError`` naming ``name`` otherwise (1 and "yes" are not bools).

    Example:
        >>> check_bool("log_histogram", 1)
        Traceback (most recent call last):
        ...
        TypeError: log_histogram must be a bool, got 1
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_dtype(name: str, value: Any, allowed: tuple[str, ...] = tuple(FLOAT_DTYPES)) -> torch.dtype:
    """The ``torch.dtype`` named by ``value`` (``"bfloat16"``, ``"torch.bfloat16"`` or the dtype itself),
    one of ``allowed``; ``ValueError`` naming the value and the choices otherwise."""
    key = value.removeprefix("torch.") if isinstance(value, str) else str(value).removeprefix("torch.")
    if (isinstance(value, (str, torch.dtype))) and key in allowed:
        return FLOAT_DTYPES[key]
    raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is an instance of ``types``; ``TypeError`` naming ``name``, ``what`` it must be and the value.

    Example:
        >>> check_type("cache_dir", 3, (str, type(None)), "a path or None")
        Traceback (most recent call last):
        ...
        TypeError: cache_dir must be a path or None, got 3
    """
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return value
