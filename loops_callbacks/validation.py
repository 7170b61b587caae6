"""The one rule for arguments: a value of the wrong type is a ``TypeError``, a value of the right type
out of range a ``ValueError``, both saying ``"<name> must be <what>, got <value>"``.

``check`` is the rule; ``check_int``, ``check_real``, ``check_bool``, ``check_choice``, ``check_dtype`` and
``check_logprobs_dtype`` are its common cases. ``bool`` is never accepted as a number.

Examples:
    >>> check_int("top_n", 3, least=0)
    3
    >>> check_int("top_n", -1, least=0)
    Traceback (most recent call last):
    ...
    ValueError: top_n must be an int >= 0, got -1
    >>> check_choice("on_exceed", "halt", ("warn", "stop", "raise"))
    Traceback (most recent call last):
    ...
    ValueError: on_exceed must be one of ['warn', 'stop', 'raise'], got 'halt'
    >>> check_dtype("scoring_dtype", "bfloat16")
    torch.bfloat16
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

__all__: list[str] = []  # the package's own checks: nothing here is for users to import

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The floating-point dtypes a model may be scored or sampled in, by their YAML names (the one table)."""

_SHOWN = reprlib.Repr()  # a refused value as it is, a huge one abridged (a list of a million token ids)
_SHOWN.maxstring = _SHOWN.maxother = 300


def check(
    name: str, value: Any, kind: type | tuple[type, ...], what: str, valid: Callable[[Any], bool] | None = None,
    *, optional: bool = False,
) -> Any:
    """``value`` if it is a ``kind`` (a bool only where ``kind`` is ``bool``) and ``valid(value)`` holds, or ``None``
    when ``optional``; else a ``TypeError`` (not a ``kind``) or a ``ValueError`` (not valid) saying what ``name``
    must be.

    Examples:
        >>> check("max_kl", "0.05", numbers.Real, "a number >= 0", optional=True)
        Traceback (most recent call last):
        ...
        TypeError: max_kl must be a number >= 0 or None, got '0.05' (str)
        >>> check("prompt", list(range(10**6)), str, "text")
        Traceback (most recent call last):
        ...
        TypeError: prompt must be text, got [0, 1, 2, 3, 4, 5, ...] (list)
    """
    if optional and value is None:
        return None
    what += " or None" if optional else ""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{name} must be {what}, got {_SHOWN.repr(value)} ({type(value).__name__})")
    if valid is not None and not valid(value):
        raise ValueError(f"{name} must be {what}, got {_SHOWN.repr(value)}")
    return value


def check_int(name: str, value: Any, *, least: int | None, what: str = "", optional: bool = False) -> int | None:
    """``value`` if it is an int ``>= least`` (any int when ``least`` is ``None``), or ``None`` when ``optional``;
    ``what`` adds its meaning.

    Examples:
        >>> check_int("max_histogram_tokens", 1.5, least=None, what=" (<= 0: no cap)")
        Traceback (most recent call last):
        ...
        TypeError: max_histogram_tokens must be an int (<= 0: no cap), got 1.5 (float)
    """
    bound = "" if least is None else f" >= {least}"
    return check(name, value, int, f"an int{bound}{what}", lambda v: least is None or v >= least, optional=optional)


def check_real(
    name: str, value: Any, *, least: float, most: float = math.inf, what: str, optional: bool = False
) -> float | None:
    """``value`` as a float if it is a real number in ``[least, most]`` (NaN is in no range), or ``None`` when
    ``optional``."""
    checked = check(name, value, numbers.Real, what, lambda v: least <= v <= most, optional=optional)
    return None if checked is None else float(checked)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (1 and "yes" are not)."""
    return check(name, value, bool, "a bool")


def check_choice(name: str, value: Any, choices: Collection[str]) -> str:
    """``value`` if it is one of the strings ``choices``."""
    return check(name, value, str, f"one of {list(choices)}", lambda v: v in choices)


def check_dtype(name: str, value: Any, allowed: tuple[str, ...] = tuple(FLOAT_DTYPES)) -> torch.dtype:
    """The ``torch.dtype`` named by ``value`` (``"bfloat16"``, ``"torch.bfloat16"`` or the dtype itself), one of
    ``allowed``; a ``ValueError`` naming the value and the choices otherwise.

    Examples:
        >>> check_dtype("scoring_dtype", 16)
        Traceback (most recent call last):
        ...
        TypeError: scoring_dtype must be a dtype name, one of ['float32', 'float64', 'bfloat16', 'float16'], got 16 (int)
    """
    key = str(check(name, value, (str, torch.dtype), f"a dtype name, one of {list(allowed)}")).removeprefix("torch.")
    if key not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
    return FLOAT_DTYPES[key]


def check_logprobs_dtype(name: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` (or ``None``), a ``TypeError`` unless it holds floats: logprobs in an integer dtype never were.

    Examples:
        >>> check_logprobs_dtype("'logprobs'", torch.zeros(2, dtype=torch.long))
        Traceback (most recent call last):
        ...
        TypeError: 'logprobs' must hold floating-point logprobs (float32, bfloat16, ...), got dtype torch.int64
    """
    if tensor is not None and not tensor.is_floating_point():
        raise TypeError(f"{name} must hold floating-point logprobs (float32, bfloat16, ...), got dtype {tensor.dtype}")
    return tensor


LOGPROB_ROUNDING = 1e-3
"""How far above 0 a logprob may read and still be rounding (bf16 ``log_softmax`` of a near-certain token)."""


def check_reference_logprobs(values: Any, *, where: str, lengths: Any = None) -> None:
    """A ``ValueError`` unless every value is a finite logprob, ``<= LOGPROB_ROUNDING``: a reference logprob
    (or a token's logprob an engine reports) is never NaN, infinite or a probability above 1.

    ``values`` is a tensor, array or list; ``lengths`` (one per datum, summing to ``values``' length) makes the
    message name the datum and its position, else the position alone. One vectorized pass, on the values' device.

    Examples:
        >>> check_reference_logprobs([-0.5, -1.0], where="the reference's answer")
        >>> check_reference_logprobs([-0.5, 0.0, -1.0, 0.3], where="reference logprobs", lengths=[2, 2])
        Traceback (most recent call last):
        ...
        ValueError: reference logprobs: datum 1, position 1 is 0.3, not a logprob (finite and <= 0); 1 such value in all
    """
    flat = torch.as_tensor(values if not isinstance(values, list) else [float("nan") if v is None else v
                                                                         for v in values]).reshape(-1)
    if not flat.is_floating_point():
        flat = flat.double()
    bad = ~(torch.isfinite(flat) & (flat <= LOGPROB_ROUNDING))
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    place = f"position {first}"
    if lengths is not None:
        ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
        datum = int(np.searchsorted(ends, first, side="right"))
        place = f"datum {datum}, position {first - (int(ends[datum - 1]) if datum else 0)}"
    count = int(bad.sum())
    raise ValueError(f"{where}: {place} is {flat[first].item():g}, not a logprob (finite and <= 0); "
                     f"{count} such value{'s' if count != 1 else ''} in all")
