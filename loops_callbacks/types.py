"""The Loops / Tinker wire types: ``TensorData``, ``ModelInput``, ``Datum``, ``ForwardBackwardOutput``.

They have the shapes and methods of the Baseten Loops SDK (and Tinker) types, so code written
against either reads the same here. Every function of this package also accepts the real
``tinker`` / ``baseten-loops`` objects unchanged (duck typing), and plain tensors, numpy arrays
and lists wherever a per-position field is expected.

Examples:
    >>> from loops_callbacks.types import Datum, ModelInput, TensorData
    >>> datum = Datum(
    ...     model_input=ModelInput.from_ints([5, 6, 7]),
    ...     loss_fn_inputs={"logprobs": TensorData([None, -0.5, -1.0], "float32", [3])},
    ... )
    >>> datum.model_input.length, datum.loss_fn_inputs["logprobs"].to_torch().isnan().tolist()
    (3, [True, False, False])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from loops_callbacks.validation import FLOAT_DTYPES, check_choice

__all__ = ["TensorData", "EncodedTextChunk", "ModelInput", "Datum", "ForwardBackwardOutput"]

_TORCH_DTYPES = {**FLOAT_DTYPES, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


@dataclass
class TensorData:
    """A flat list of numbers with a dtype and shape; float lists may hold ``None`` (no NaN in JSON).

    Examples:
        >>> TensorData.from_torch(torch.tensor([0.5, float("nan")])).data
        [0.5, None]
    """

    data: list[Any]
    dtype: str = "float32"
    shape: list[int] | None = None

    def __post_init__(self) -> None:
        check_choice("TensorData dtype", self.dtype, sorted(_TORCH_DTYPES))
        if self.shape is None:
            self.shape = [len(self.data)]

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        """Copy a tensor to a list; NaN becomes ``None`` so the result stays JSON-safe."""
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise TypeError(f"TensorData has no dtype name for {tensor.dtype}; use one of {sorted(_TORCH_DTYPES)}")
        values = tensor.detach().cpu()
        if values.is_floating_point():
            values = values.double()
        data = [None if isinstance(v, float) and math.isnan(v) else v for v in values.flatten().tolist()]
        return cls(data=data, dtype=name, shape=list(tensor.shape))

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        return cls.from_torch(torch.from_numpy(np.ascontiguousarray(array)))

    def to_numpy(self) -> np.ndarray:
        """The data as an array of ``shape``; ``None`` becomes NaN for float dtypes."""
        dtype = np.float64 if _TORCH_DTYPES[self.dtype].is_floating_point else None
        array = np.array(self.data, dtype=dtype)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        """The data as a tensor of ``dtype`` and ``shape``; ``None`` becomes NaN."""
        return torch.from_numpy(self.to_numpy()).to(_TORCH_DTYPES[self.dtype])

    def tolist(self) -> list[Any]:
        return list(self.data)


@dataclass
class EncodedTextChunk:
    """A run of token ids inside a ``ModelInput``."""

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ModelInput:
    """The token sequence a datum feeds to the model.

    Examples:
        >>> ModelInput.from_ints([1, 2]).append_int(3).to_ints()
        [1, 2, 3]
    """

    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        """A new ``ModelInput`` with ``chunk`` added at the end (this one is unchanged)."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        """A new ``ModelInput`` with one more token (this one is unchanged)."""
        if self.chunks and isinstance(self.chunks[-1], EncodedTextChunk):
            last = EncodedTextChunk(tokens=[*self.chunks[-1].tokens, int(token)])
            return ModelInput(chunks=[*self.chunks[:-1], last])
        return self.append(EncodedTextChunk(tokens=[int(token)]))


@dataclass
class Datum:
    """One training sequence: its tokens and its per-position loss inputs.

    ``loss_fn_inputs`` values may be ``TensorData``, tensors, numpy arrays or lists.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ForwardBackwardOutput:
    """What a trainer's forward/backward returns; ``loss_fn_outputs[i]["logprobs"]`` is datum i's."""

    loss: float | None = None
    loss_fn_output_type: str = ""
    loss_fn_outputs: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
