"""Reading datums and per-position fields of any accepted kind into 1-D tensors.

A per-position field may be a torch tensor, a numpy array, a list (``None`` allowed in float
fields), this package's ``TensorData``, or a ``tinker`` / ``baseten-loops`` ``TensorData``.
A datum may be any object with ``.model_input`` and ``.loss_fn_inputs``, or a mapping with those
keys. Errors name the datum and the key, so a user can find the bad row.

Examples:
    >>> field_to_tensor([None, -0.25], where="datum 0, key 'logprobs'")
    tensor([    nan, -0.2500], dtype=torch.float64)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__: list[str] = []  # the package's field readers: nothing here is for users to import


def field_to_tensor(value: Any, *, where: str) -> torch.Tensor:
    """One 1-D tensor from any accepted field kind, keeping tensors on their device (not detached).

    Lists become float64 (``None`` becomes NaN; a caller reading token ids takes ``.long()``); numpy
    arrays and ``TensorData`` keep their dtype. Raises ``TypeError`` for other kinds and ``ValueError`` for
    anything that is not one-dimensional.
    """
    if isinstance(value, torch.Tensor):
        tensor = value
    elif isinstance(value, np.ndarray):
        tensor = _from_numpy(value, where)
    elif isinstance(value, (list, tuple)):
        tensor = _from_list(value, where)
    elif callable(getattr(value, "to_numpy", None)):  # tinker's TensorData (numpy-backed) and ours
        tensor = _from_numpy(np.asarray(value.to_numpy()), where)
    elif isinstance(getattr(value, "data", None), (list, tuple)):  # baseten-loops' TensorData (list-backed)
        tensor = _from_list(value.data, where)
        if getattr(value, "shape", None):
            tensor = tensor.reshape(list(value.shape))
    else:
        raise TypeError(f"{where}: expected a tensor, numpy array, list or TensorData, got {type(value).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{where}: expected a 1-D per-position field, got shape {tuple(tensor.shape)}; "
                         "pass one row per datum (padded [B, T] tensors only where the API says so)")
    return tensor


def field_length(value: Any, *, where: str) -> int:
    """Length of a 1-D field without converting it (tensors, arrays, lists, ``TensorData``)."""
    shape = getattr(value, "shape", None)
    if isinstance(value, (list, tuple)):
        return len(value)
    if shape is not None and len(shape) >= 1:
        if len(shape) != 1:
            raise ValueError(f"{where}: expected a 1-D per-position field, got shape {tuple(shape)}")
        return int(shape[0])
    return int(field_to_tensor(value, where=where).shape[0])


def _from_numpy(array: np.ndarray, where: str) -> torch.Tensor:
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{where}: expected numbers, got a numpy array of dtype {array.dtype}")
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _from_list(values: Sequence[Any], where: str) -> torch.Tensor:
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{where}: expected a list of numbers (or None), could not convert: {error}") from None
    return torch.from_numpy(array)


def datum_model_input(datum: Any) -> Any:
    """The datum's ``model_input`` (attribute or mapping key), or ``None`` when it has none."""
    if isinstance(datum, Mapping):
        return datum.get("model_input")
    return getattr(datum, "model_input", None)


def datum_loss_fn_inputs(datum: Any, *, index: int) -> Mapping[str, Any]:
    """The datum's ``loss_fn_inputs`` mapping; ``TypeError`` naming the datum when it has none."""
    inputs = datum.get("loss_fn_inputs") if isinstance(datum, Mapping) else getattr(datum, "loss_fn_inputs", None)
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"datum {index}: expected a Datum with a loss_fn_inputs mapping, got {type(datum).__name__}"
        )
    return inputs


def model_input_length(model_input: Any) -> int:
    """Token count of a ``ModelInput`` (any implementation), a list of ids or a 1-D tensor."""
    length = getattr(model_input, "length", None)
    if isinstance(length, int):
        return length
    if callable(length):
        return int(length())
    return len(model_input_tokens(model_input))


def model_input_tokens(model_input: Any) -> list[int]:
    """Token ids of a ``ModelInput`` (any implementation), a list of ids or a 1-D tensor."""
    to_ints = getattr(model_input, "to_ints", None)
    if callable(to_ints):
        return list(to_ints())
    if isinstance(model_input, (torch.Tensor, np.ndarray)) and model_input.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got a {type(model_input).__name__} of shape "
                         f"{tuple(model_input.shape)}")
    if not isinstance(model_input, (list, tuple, np.ndarray, torch.Tensor)):
        raise TypeError(f"expected a ModelInput or a list of token ids, got {type(model_input).__name__}")
    values = model_input.tolist() if isinstance(model_input, (torch.Tensor, np.ndarray)) else model_input
    # an int, never a float rounded or a bool read as 0/1 (numpy's integers are numbers.Integral too)
    bad = next(((k, t) for k, t in enumerate(values) if isinstance(t, bool) or not isinstance(t, numbers.Integral)),
               None)
    if bad is not None:
        raise TypeError(f"expected token ids (ints), got {bad[1]!r} (a {type(bad[1]).__name__}) at position {bad[0]}")
    return [int(t) for t in values]
