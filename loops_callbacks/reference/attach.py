"""``attach_reference_logprobs``: the Loops SDK helper, scoring many datums at once.

Reached by its SDK import path, ``loops_callbacks.helpers.datum`` (the SDK's ``loops.helpers.datum``).

Examples:
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
import itertools
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
from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_length, model_input_length
from loops_callbacks.progress import ProgressBar
from loops_callbacks.types import TensorData
from loops_callbacks.validation import check_int, check_reference_logprobs

__all__ = ["attach_reference_logprobs", "reference_field", "score_prompts", "with_ref_logprobs"]

D = TypeVar("D")
Progress = Callable[[int, int], None]


_PER_POSITION = frozenset({"target_tokens", "weights", "mask", "logprobs"})
"""The SDK's per-position ``loss_fn_inputs`` fields: each has one value per position of ``model_input``."""


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
        TypeError: ``data`` is not a sequence of datums (one datum, say); a reference answer that is
            not a list (a str, ``None``) or holds something other than numbers and ``None``.
        ValueError: bad ``batch_size`` / ``max_concurrency``; a datum with an empty, missing or
            not 1-D ``model_input``, or a 1-D per-position field (``target_tokens``, ``weights``, ``mask``,
            ``logprobs``) of neither one value nor model_input's length; a reference answer whose
            length differs from the datum's; a reference value that is not a logprob (NaN, infinite
            or above 0 beyond rounding: ``validation.check_reference_logprobs``), named by datum and
            position. Nothing is attached then.

    Examples:
        >>> from loops_callbacks.reference.clients import TorchSamplingClient
        >>> from loops_callbacks.types import Datum, ModelInput
        >>> import torch
        >>> reference = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(8, 8)))
        >>> data = [Datum(ModelInput.from_ints([1, 2, 3])), Datum(ModelInput.from_ints([4, 5]))]
        >>> [d.loss_fn_inputs["ref_logprobs"].shape for d in attach_reference_logprobs(data, reference)]
        [[3], [2]]
    """
    check_int("batch_size", batch_size, least=1, optional=True)
    check_int("max_concurrency", max_concurrency, least=1)
    if isinstance(data, (str, bytes, Mapping)) or datum_model_input(data) is not None:  # list() decides the rest
        raise TypeError(f"data must be a sequence of datums, got {type(data).__name__} (one datum: pass [datum])")
    data = list(data)
    model_inputs = []
    for index, datum in enumerate(data):
        model_input = datum_model_input(datum)
        if model_input is None:
            raise ValueError(f"datum {index}: has no model_input ({type(datum).__name__})")
        inputs = datum_loss_fn_inputs(datum, index=index)  # fail before any scoring if it has none
        length = _prompt_length(model_input, index)
        if length < 1:
            raise ValueError(f"datum {index}: model_input is empty; there is nothing to score")
        for key in _PER_POSITION.intersection(inputs):
            try:
                n = field_length(inputs[key], where=f"datum {index}, key {key!r}")
            except (TypeError, ValueError):  # None, a number, another dimension: left to the loss that reads it
                continue
            if n not in (1, length):  # one value (for the datum) or one per position
                raise ValueError(f"datum {index}: loss_fn_inputs[{key!r}] has {n} positions but model_input has "
                                 f"{length}; every per-position field has one value per position of model_input "
                                 "(ref_logprobs gets one too)")
        model_inputs.append(model_input)
    tinker = weighted_last_positions(data)
    if tinker:
        run_warnings.warn(tinker_convention_message(describe_indices(tinker, len(data))), TinkerConventionWarning)
    values = score_prompts(model_inputs, reference, batch_size=batch_size, max_concurrency=max_concurrency,
                           progress=progress)
    return [with_ref_logprobs(datum, index, _tensor_data_class(type(datum))(ref, "float32", [len(ref)]))
            for index, (datum, ref) in enumerate(zip(data, values))]


def score_prompts(model_inputs: Sequence[Any], reference: Any, *, batch_size: int | None = None,
                  max_concurrency: int = 32, progress: bool | Progress = False) -> list[list[float]]:
    """Each prompt's values in the SDK's ``ref_logprobs`` layout, scored the way ``attach_reference_logprobs`` says.

    Examples:
        >>> class Reference:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-1.0] * (len(prompt) - 1)
        >>> score_prompts([[1, 2, 3]], Reference())
        [[-1.0, -1.0, 0.0]]
    """
    if not (progress is True or progress is False or callable(progress)):
        raise TypeError(f"progress={progress!r} must be a bool or a callable progress(done, total)")
    batch = getattr(reference, "compute_logprobs_batch", None)
    async_fn = getattr(reference, "compute_logprobs_async", None)
    sync_fn = getattr(reference, "compute_logprobs", None)
    if not any(callable(fn) for fn in (batch, async_fn, sync_fn)):
        raise TypeError(f"reference must have compute_logprobs (or compute_logprobs_async / compute_logprobs_batch), "
                        f"got {type(reference).__name__}")
    model_inputs = list(model_inputs)
    lengths = [_prompt_length(prompt, index) for index, prompt in enumerate(model_inputs)]  # before any call
    with ProgressBar(progress, len(model_inputs), desc="reference logprobs", unit="datum") as bar:
        if callable(batch):
            logprobs = _score_batched(batch, model_inputs, batch_size, bar.reach)
        elif callable(sync_fn) and (not callable(async_fn) or getattr(async_fn, "__deprecated__", None) is not None):
            logprobs = _score_in_order(sync_fn, model_inputs, max_concurrency, bar.reach)
        else:  # an async method (a deprecated one only when there is nothing else)
            logprobs = _run_coroutine(_score_async(async_fn, model_inputs, max_concurrency, bar.reach))
    values = [_shift(lp, length, index) for index, (length, lp) in enumerate(zip(lengths, logprobs))]
    sizes = [len(v) for v in values]
    check_reference_logprobs(np.fromiter(itertools.chain.from_iterable(values), np.float64, count=sum(sizes)),
                             where="the reference's ref_logprobs (position k: the logprob of token k + 1)",
                             lengths=sizes)
    return values


def _prompt_length(model_input: Any, index: int) -> int:
    """``model_input_length``, its error naming the datum."""
    try:
        return model_input_length(model_input)
    except (TypeError, ValueError) as error:
        raise type(error)(f"datum {index}: model_input: {error}") from None


def _shift(logprobs: Any, length: int, index: int) -> list[float]:
    """The SDK's rule: drop element 0, ``None`` -> 0.0, append 0.0 for the last position."""
    if hasattr(logprobs, "tolist"):  # a tensor or numpy array
        logprobs = logprobs.tolist()
    if not isinstance(logprobs, (list, tuple)):  # a str, a mapping, None, a number: never read as its parts
        raise TypeError(f"datum {index}: the reference returned a {type(logprobs).__name__}, not a list of logprobs "
                        "(one per token, element 0 None)")
    if len(logprobs) != length:
        raise ValueError(
            f"datum {index}: the reference returned {len(logprobs)} logprobs for a model_input of "
            f"length {length}; expected one per token (element 0 None)"
        )
    try:
        return [0.0 if v is None else float(v) for v in logprobs[1:]] + [0.0]
    except (TypeError, ValueError):
        element = next(k for k, v in enumerate(logprobs) if k and v is not None and not _is_number(v))
        raise TypeError(f"datum {index}: element {element} of the reference's answer is {logprobs[element]!r} (a "
                        f"{type(logprobs[element]).__name__}), not a number or None") from None


def _is_number(value: Any) -> bool:
    """Whether ``float(value)`` works."""
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _score_batched(batch: Callable[..., Any], model_inputs: list[Any], batch_size: int | None, report: Progress) -> list[Any]:
    step = batch_size or max(len(model_inputs), 1)
    results: list[Any] = []
    for start in range(0, len(model_inputs), step):
        chunk = model_inputs[start : start + step]
        answer = batch(chunk)
        if isinstance(answer, (str, bytes, Mapping)) or not hasattr(answer, "__len__"):
            raise TypeError(f"compute_logprobs_batch returned a {type(answer).__name__} for datums {start}.."
                            f"{start + len(chunk) - 1}, not a list with one answer per prompt")
        answer = list(answer)
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


def with_ref_logprobs(datum: Any, index: int, field: Any) -> Any:
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


def reference_field(datum: Any, values: np.ndarray) -> Any:
    """``ref_logprobs`` for ``datum`` from float32 ``values`` without a copy: the numpy array itself for our datums and
    mappings (``field_to_tensor`` reads it as it is), the datum's own package's ``TensorData`` for Tinker's / Loops'."""
    tensor_data = _tensor_data_class(type(datum))
    return values if tensor_data is TensorData else tensor_data(values.tolist(), "float32", [len(values)])


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
