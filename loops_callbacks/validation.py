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

from typing import Any

import torch

__all__ = ["FLOAT_DTYPES", "check_dtype", "check_int"]

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The floating-point dtypes a model may be scored or sampled in, by their YAML names (the one table)."""


def check_int(name: str, value: Any, *, least: int) -> int:
    """``value`` if it is an int (not a bool) ``>= least``; ``TypeError`` / ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def check_dtype(name: str, value: Any, allowed: tuple[str, ...] = tuple(FLOAT_DTYPES)) -> torch.dtype:
    """The ``torch.dtype`` named by ``value`` (``"bfloat16"``, ``"torch.bfloat16"`` or the dtype itself),
    one of ``allowed``; ``ValueError`` naming the value and the choices otherwise."""
    key = value.removeprefix("torch.") if isinstance(value, str) else str(value).removeprefix("torch.")
    if (isinstance(value, (str, torch.dtype))) and key in allowed:
        return FLOAT_DTYPES[key]
    raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
