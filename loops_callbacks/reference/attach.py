"""``attach_reference_logprobs``: the Loops SDK helper, scoring many datums at once.

Reached by its SDK import path, ``loops_callbacks.helpers.datum`` (the SDK's ``loops.helpers.datum``).

Example:
    >>> from loops_callbacks.types import Datum, ModelInput
    >>> class Reference:
    ...     def compute_logprobs(self, prompt):
    ...         return [None] + [-1.0] * (prompt.length - 1)
    >>> [datum] = attach_reference_logprobs([Datum(ModelInput.from_ints([1, 2, 3]))], Reference())
    >>> datum.loss_fn_inputs["ref_logprobs"].data
    [-1.0, -1.0, 0.0]
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from loops_callbacks import run_warnings
from loops_callbacks.conventions import (
    TinkerConventionWarning,
    describe_indices,
    tinker_convention_message,
    weighted_last_positions,
)
from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, model_input_length
from loops_callbacks.progress import ProgressBar
from loops_callbacks.types import TensorData

__all__ = ["attach_reference_logprobs", "attach_reference_values"]

D = TypeVar("D")
Progress = Callable[[int, int], None]


def attach_reference_logprobs(
    data: Sequence[D],
    reference: Any,
    *,
    batch_size: int | None = None,
    max_concurrency: int = 32,
    progress: bool | Progress = False,
) -> list[D]:
    """New datums with ``loss_fn_inputs["ref_logprobs"]``: ``reference``'s logprob of each target token.

    Same result as the Loops SDK: for each datum, ``lp = reference.compute_logprobs(model_input)``
    and ``ref_logprobs = [0.0 if v is None else float(v) for v in lp[1:]] + [0.0]`` as float32
    ``TensorData`` (position k holds the logprob of the token predicted at k; the last position
    predicts nothing). An existing ``ref_logprobs`` is replaced; ``data`` and its datums are not
    modified; other fields and attributes of a datum are kept. Datums may be ours, Tinker's,
    Loops', or mappings with ``model_input`` / ``loss_fn_inputs`` keys.

    Datums in Tinker's convention (``model_input = tokens[:-1]``, a weight on the last position)
    are scored the same way, so their last token's reference logprob is 0.0; one
    ``TinkerConventionWarning`` says how many and how to convert them
    (``loops_callbacks.data.from_tinker_convention``).

    How ``reference`` is called (the numbers are the same either way):
    - ``compute_logprobs_batch(model_inputs)`` when it has one (e.g. ``TorchSamplingClient``),
      ``batch_size`` datums per call (all at once by default);
    - else ``compute_logprobs_async``, up to ``max_concurrency`` calls in flight (from inside a
      running event loop this runs on a worker thread and blocks that loop until it is done);
      a deprecated ``compute_logprobs_async`` (Tinker's) is skipped for the next way;
    - else ``compute_logprobs`` in order; when it returns futures (Tinker), up to
      ``max_concurrency`` of them are in flight at once, resolved with ``.result()``.

    Args:
        data: the datums.
        reference: a ``SamplingClient`` (see ``loops_callbacks.reference.clients``).
        batch_size: datums per ``compute_logprobs_batch`` call (for progress); ``None`` = all.
        max_concurrency: concurrent requests on the async and futures ways.
        progress: ``True`` for a tqdm bar, or a callable ``progress(done, total)``.

    Raises:
        ValueError: bad ``batch_size`` / ``max_concurrency``; a datum with an empty or missing
            ``model_input``; a reference answer whose length differs from the datum's.

    Example:
        >>> from loops_callbacks.reference.clients import TorchSamplingClient
        >>> from loops_callbacks.types import Datum, ModelInput
        >>> import torch
        >>> reference = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(8, 8)))
        >>> data = [Datum(ModelInput.from_ints([1, 2, 3])), Datum(ModelInput.from_ints([4, 5]))]
        >>> [d.loss_fn_inputs["ref_logprobs"].shape for d in attach_reference_logprobs(data, reference)]
        [[3], [2]]
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int or None")
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency!r} must be a positive int")
    if not (progress is True or progress is False or callable(progress)):
        raise ValueError(f"progress={progress!r} must be a bool or a callable progress(done, total)")
    batch = getattr(reference, "compute_logprobs_batch", None)
    async_fn = getattr(reference, "compute_logprobs_async", None)
    sync_fn = getattr(reference, "compute_logprobs", None)
    if not any(callable(fn) for fn in (batch, async_fn, sync_fn)):
        raise TypeError(
            f"reference must have compute_logprobs (or compute_logprobs_async / compute_logprobs_batch), "
            f"got {type(reference).__name__}"
        )
    data = list(data)
    model_inputs, lengths = [], []
    for index, datum in enumerate(data):
        model_input = datum_model_input(datum)
        if model_input is None:
            raise ValueError(f"datum {index}: has no model_input ({type(datum).__name__})")
        datum_loss_fn_inputs(datum, index=index)  # fail before any scoring if it has none
        length = model_input_length(model_input)
        if length < 1:
            raise ValueError(f"datum {index}: model_input is empty; there is nothing to score")
        model_inputs.append(model_input)
        lengths.append(length)
    tinker = weighted_last_positions(data)
    if tinker:
        run_warnings.warn(tinker_convention_message(describe_indices(tinker, len(data))), TinkerConventionWarning)

    with ProgressBar(progress, len(data), desc="reference logprobs", unit="datum") as bar:
        report = bar.reach
        if callable(batch):
            logprobs = _score_batched(batch, model_inputs, batch_size, report)
        elif callable(async_fn) and getattr(async_fn, "__deprecated__", None) is None:
            logprobs = _run_coroutine(_score_async(async_fn, model_inputs, max_concurrency, report))
        elif callable(sync_fn):
            logprobs = _score_in_order(sync_fn, model_inputs, max_concurrency, report)
        else:  # only a deprecated async method
            logprobs = _run_coroutine(_score_async(async_fn, model_inputs, max_concurrency, report))

    return [
        _with_ref_logprobs(datum, index, _as_field(datum, _shift(lp, lengths[index], index)))
        for index, (datum, lp) in enumerate(zip(data, logprobs))
    ]


def attach_reference_values(data: Sequence[D], values: np.ndarray, offsets: np.ndarray) -> list[D]:
    """New datums whose ``ref_logprobs`` are float32 views of ``values`` (no copy, no Python floats).

    ``values`` holds every datum's ``ref_logprobs`` back to back (datum i's are
    ``values[offsets[i]:offsets[i + 1]]``, already in the SDK's layout: last value 0). Our datums
    and mapping datums get the numpy view itself, which ``DPOPairDataset`` and ``field_to_tensor``
    read without a copy; datums of a package with its own ``TensorData`` (Tinker, Loops) get that
    class, as ``attach_reference_logprobs`` gives them.

    Example:
        >>> import numpy as np
        >>> from loops_callbacks.types import Datum, ModelInput
        >>> data = [Datum(ModelInput.from_ints([1, 2, 3])), Datum(ModelInput.from_ints([4]))]
        >>> values = np.array([-1.0, -2.0, 0.0, 0.0], dtype=np.float32)
        >>> scored = attach_reference_values(data, values, np.array([0, 3, 4]))
        >>> scored[0].loss_fn_inputs["ref_logprobs"].tolist(), np.shares_memory(scored[0].loss_fn_inputs["ref_logprobs"], values)
        ([-1.0, -2.0, 0.0], True)
    """
    data = list(data)
    if len(offsets) != len(data) + 1:
        raise ValueError(f"attach_reference_values: {len(offsets) - 1} value ranges for {len(data)} datums")
    result = []
    for index, datum in enumerate(data):
        view = values[offsets[index] : offsets[index + 1]]
        model_input = datum_model_input(datum)
        length = model_input_length(model_input) if model_input is not None else -1
        if length != view.shape[0]:
            raise ValueError(f"datum {index}: {view.shape[0]} reference values for a model_input of length {length}")
        tensor_data = _tensor_data_class(type(datum))
        field: Any = view if tensor_data is TensorData else tensor_data(view.tolist(), "float32", [len(view)])
        result.append(_with_ref_logprobs(datum, index, field))
    return result


def _shift(logprobs: Any, length: int, index: int) -> list[float]:
    """The SDK's rule: drop element 0, ``None`` -> 0.0, append 0.0 for the last position."""
    if hasattr(logprobs, "tolist"):  # a tensor or numpy array
        logprobs = logprobs.tolist()
    values = list(logprobs)
    if len(values) != length:
        raise ValueError(
            f"datum {index}: the reference returned {len(values)} logprobs for a model_input of "
            f"length {length}; expected one per token (element 0 None)"
        )
    return [0.0 if v is None else float(v) for v in values[1:]] + [0.0]


def _score_batched(batch: Callable[..., Any], model_inputs: list[Any], batch_size: int | None, report: Progress) -> list[Any]:
    step = batch_size or max(len(model_inputs), 1)
    results: list[Any] = []
    for start in range(0, len(model_inputs), step):
        chunk = model_inputs[start : start + step]
        answer = list(batch(chunk))
        if len(answer) != len(chunk):
            raise ValueError(
                f"compute_logprobs_batch returned {len(answer)} results for {len(chunk)} prompts "
                f"(datums {start}..{start + len(chunk) - 1})"
            )
        results.extend(answer)
        report(len(results))
    return results


async def _score_async(
    async_fn: Callable[..., Any], model_inputs: list[Any], max_concurrency: int, report: Progress
) -> list[Any]:
    semaphore = asyncio.Semaphore(max_concurrency)
    done = 0

    async def one(model_input: Any) -> Any:
        nonlocal done
        async with semaphore:
            result = await async_fn(model_input)
        done += 1
        report(done)
        return result

    return list(await asyncio.gather(*(one(m) for m in model_inputs)))


def _run_coroutine(coroutine: Any) -> Any:
    """``asyncio.run``; inside a running event loop, on a worker thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _score_in_order(sync_fn: Callable[..., Any], model_inputs: list[Any], max_concurrency: int, report: Progress) -> list[Any]:
    """Call in order; futures (objects with ``.result()``) stay at most ``max_concurrency`` in flight."""
    results: list[Any] = []
    pending: collections.deque[Any] = collections.deque()

    def resolve_oldest() -> None:
        answer = pending.popleft()
        results.append(answer.result() if callable(getattr(answer, "result", None)) else answer)
        report(len(results))

    for model_input in model_inputs:
        if len(pending) >= max_concurrency:
            resolve_oldest()
        pending.append(sync_fn(model_input))
        if not callable(getattr(pending[-1], "result", None)):
            while pending:
                resolve_oldest()
    while pending:
        resolve_oldest()
    return results


def _as_field(datum: Any, ref: list[float]) -> Any:
    """The SDK's field: ``TensorData(ref, "float32", [n])`` of the datum's own package."""
    return _tensor_data_class(type(datum))(ref, "float32", [len(ref)])


def _with_ref_logprobs(datum: Any, index: int, field: Any) -> Any:
    """A copy of ``datum`` whose ``loss_fn_inputs`` also holds ``ref_logprobs``; the datum is not modified."""
    inputs = {**datum_loss_fn_inputs(datum, index=index), "ref_logprobs": field}
    if isinstance(datum, Mapping):
        return {**datum, "loss_fn_inputs": inputs}
    if dataclasses.is_dataclass(datum):
        new = dataclasses.replace(datum, loss_fn_inputs=inputs)  # runs the class's own checks
        names = {f.name for f in dataclasses.fields(datum)}
        for key, value in getattr(datum, "__dict__", {}).items():  # attributes set outside the fields
            if key not in names:
                object.__setattr__(new, key, value)
        return new
    if callable(getattr(datum, "model_copy", None)):  # pydantic v2
        return datum.model_copy(update={"loss_fn_inputs": inputs})
    new = copy.copy(datum)
    try:
        new.loss_fn_inputs = inputs
    except (AttributeError, TypeError) as error:
        raise TypeError(f"datum {index}: cannot set loss_fn_inputs on a copy of {type(datum).__name__}: {error}") from None
    return new


@functools.lru_cache(maxsize=None)
def _tensor_data_class(datum_class: type) -> type:
    """The ``TensorData`` of the datum's own package (Tinker's ``Datum`` rejects any other), else ours."""
    for cls in datum_class.__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("builtins", "loops_callbacks"):
            continue
        package = sys.modules.get(root)
        for holder in (_attribute(package, "types"), package):
            candidate = _attribute(holder, "TensorData")
            if isinstance(candidate, type):
                return candidate
    return TensorData


def _attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, also where a package's lazy ``__getattr__`` fails otherwise."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a lazy import of an unrelated package must not break scoring
        return None
