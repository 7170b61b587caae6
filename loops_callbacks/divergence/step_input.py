"""Read one training step's batch and ``training_step`` output into a ``FlatBatch``: the step's input.

Each field is looked up under its key (``DATA_KEYS``, remappable with ``keys=``) in the step's
output first, then in the batch. Two contract forms are accepted: Loops / Tinker datums (the
batch, or ``"data"``) with the trainer's ``training_logprobs`` or a ``forward_backward_output``;
or padded ``[B, T]`` tensors. A broken contract is a ``ValueError`` naming the keys found in each
place and how to provide what is missing.

Two optional per-datum keys: ``policy_version`` (the version of the sampler's weights that
generated each datum, counted in the trainer's optimizer steps: 0 for the initial weights, n for
the weights after n optimizer steps) and ``group`` (a task or environment id, an int >= 0). Each
is a ``[B]`` int tensor or list in the output or the batch, or in the datum form a one-value
field of every datum's ``loss_fn_inputs``. With ``optimizer_step`` given, a datum's policy lag is
``optimizer_step - policy_version``: how many optimizer steps the weights that sampled it are
behind the weights being trained (0 on-policy). The trainer's step is the reference, not the
newest version in the step, because a whole batch that is equally stale (a sampler synced late)
would otherwise read lag 0, hiding the fault the lag is for; the cost is that versions must count
optimizer steps (a version ahead of the trainer is a ``ValueError``: it cannot be).

Example:
    >>> import torch
    >>> batch = {"logprobs": torch.tensor([[-1.0, -2.0]]), "mask": torch.ones(1, 2)}
    >>> flat = read_step({"training_logprobs": torch.tensor([[-1.5, -2.0]])}, batch, data_keys(None))
    >>> flat.diff.tolist()
    [-0.5, 0.0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import dataclasses

from loops_callbacks.divergence.action_tokens import (
    FlatBatch,
    flatten_datums,
    flatten_padded,
    trainer_logprobs_from_output,
)
from loops_callbacks.fields import datum_loss_fn_inputs, field_to_tensor

__all__ = ["DATA_KEYS", "data_keys", "read_step"]

DATA_KEYS = (
    "data",
    "training_logprobs",
    "forward_backward_output",
    "logprobs",
    "mask",
    "advantages",
    "target_tokens",
    "input_ids",
    "policy_version",
    "group",
)
"""The names ``keys=`` may remap; by default each is read under its own name."""


def data_keys(keys: Mapping[str, str] | None) -> dict[str, str]:
    """``keys`` over the defaults; ``ValueError`` naming an unknown name or an empty key, ``TypeError``
    for a non-string key.

    Example:
        >>> data_keys({"logprobs": "sampler_lp"})["logprobs"]
        'sampler_lp'
    """
    given = dict(keys or {})
    unknown = sorted(set(given) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"keys has unknown names {unknown}; the names are {list(DATA_KEYS)}")
    not_str = {name: key for name, key in given.items() if not isinstance(key, str)}
    if not_str:
        raise TypeError(f"keys must map each name to a non-empty string, got {not_str}")
    empty = [name for name, key in given.items() if not key]
    if empty:
        raise ValueError(f"keys must map each name to a non-empty string, got an empty key for {empty}")
    return {name: given.get(name, name) for name in DATA_KEYS}


def read_step(
    outputs: Any,
    batch: Any,
    keys: Mapping[str, str],
    *,
    with_tokens: bool = False,
    with_token_ids: bool = True,
    optimizer_step: int | None = None,
    datum_advantages: bool = False,
) -> FlatBatch:
    """The step's positions, in either contract form (module docstring).

    ``keys`` maps every name of ``DATA_KEYS`` to its key (``data_keys``); ``with_tokens`` keeps
    the token look-up for the worst-tokens table, ``with_token_ids`` the predicted ids the
    diagnosis groups by (datums only; padded tensors always carry theirs). With ``optimizer_step``
    (the caller keeps strata) the per-datum keys are read: policy versions become lags
    (``FlatBatch.lags``), groups ``FlatBatch.groups``; they are read on the host (a transfer when
    they sit on an accelerator: keep them on the CPU). ``datum_advantages`` reads one advantage per
    datum (``FlatBatch.datum_advantages``, for a correction that needs them): ``[B]`` or ``[B, 1]``,
    or a one-value ``advantages`` field of each datum.
    """
    step = _Step(outputs, batch, keys)
    flat, data = _read_positions(step, with_tokens, with_token_ids)
    if datum_advantages:
        flat = dataclasses.replace(flat, datum_advantages=_datum_advantages(step, data, flat))
    if optimizer_step is None:
        return flat
    groups = _per_datum_ints(step, "group", data, flat.n_datums)
    versions = _per_datum_ints(step, "policy_version", data, flat.n_datums)
    if groups is None and versions is None:
        return flat
    lags = None
    if versions is not None:
        lags = optimizer_step - versions
        if bool((lags < 0).any()):
            datum = int(torch.nonzero(lags < 0)[0, 0])
            raise ValueError(
                f"KLSampleTrainMonitor: datum {datum} has {keys['policy_version']!r} = {int(versions[datum])}, "
                f"ahead of the trainer's optimizer step {optimizer_step}; the policy version must count the "
                "trainer's optimizer steps the sampler's weights had received (0 for the initial weights)"
            )
    return dataclasses.replace(
        flat,
        lags=None if lags is None else lags.to(flat.device),
        groups=None if groups is None else groups.to(flat.device),
    )


def _read_positions(step: _Step, with_tokens: bool, with_token_ids: bool) -> tuple[FlatBatch, Sequence[Any] | None]:
    """The ``FlatBatch`` of the step's positions, and its datums when the step is in the datum form."""
    outputs, batch, keys = step.outputs, step.batch, step.keys
    data = step.get("data")
    if data is None and _is_datum_list(batch):
        data = batch
    if data is not None:
        flat = flatten_datums(
            data, step.trainer_logprobs(datums=True), with_tokens=with_tokens, with_token_ids=with_token_ids
        )
        return flat, data
    missing = [keys[name] for name in ("logprobs", "mask") if step.get(name) is None]
    if missing:
        raise ValueError(
            f"KLSampleTrainMonitor: neither training_step's output (keys: {_keys(outputs)}) nor the batch "
            f"(keys: {_keys(batch)}) has {missing}. Provide the sampler's per-token logprobs "
            f"{keys['logprobs']!r} and the action-token mask {keys['mask']!r} as [B, T] tensors "
            "(in the batch or in the dict training_step returns), or a list of Datum as the batch "
            "(or under 'data'); other key names can be set with keys={'logprobs': ..., 'mask': ...}."
        )
    flat = flatten_padded(
        sampler_logprobs=step.get("logprobs"),
        training_logprobs=step.trainer_logprobs(datums=False),
        mask=step.get("mask"),
        advantages=step.get("advantages"),
        target_tokens=step.get("target_tokens"),
        input_ids=step.get("input_ids"),
        with_tokens=with_tokens,
    )
    return flat, None


def _datum_advantages(step: _Step, data: Sequence[Any] | None, flat: FlatBatch) -> torch.Tensor:
    """Float64 ``[B]`` advantages, one per datum, on the batch's device; ``ValueError`` when there are none."""
    key = step.keys["advantages"]
    value = step.get("advantages")
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[1] != 1:
            raise ValueError(
                f"KLSampleTrainMonitor: a correction listed needs one advantage per datum, but {key!r} has shape "
                f"{tuple(value.shape)}; give [B] or [B, 1] advantages"
            )
        value = value.reshape(-1)
    values = _per_datum_values(step, "advantages", data, flat.n_datums, value=value)
    if values is None:
        raise ValueError(
            f"KLSampleTrainMonitor: a correction listed needs one advantage per datum under {key!r} "
            "(in the batch, the step's output, or each datum's loss_fn_inputs); none was found"
        )
    return values.to(device=flat.device, dtype=torch.float64)


def _per_datum_ints(step: _Step, name: str, data: Sequence[Any] | None, n_datums: int) -> torch.Tensor | None:
    """Int64 ``[B]`` CPU tensor of the per-datum key ``name`` (module docstring); ``None`` when absent.

    ``ValueError`` naming the key and the lengths for a wrong count, a non-integer or a negative
    value, or a key only some datums have; ``TypeError`` for a value that is not numbers.
    """
    values = _per_datum_values(step, name, data, n_datums)
    if values is None:
        return None
    where = f"KLSampleTrainMonitor: {step.keys[name]!r}"
    if values.is_floating_point():
        if not bool(torch.isfinite(values).all()) or not bool((values == values.round()).all()):
            raise ValueError(f"{where} must hold integers, got {values.tolist()}")
    elif values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{where} must hold integers, got dtype {values.dtype}")
    values = values.to(torch.int64)
    if bool((values < 0).any()):
        raise ValueError(f"{where} must be >= 0, got {values.tolist()}")
    return values


def _per_datum_values(
    step: _Step, name: str, data: Sequence[Any] | None, n_datums: int, *, value: Any = None
) -> torch.Tensor | None:
    """``[B]`` CPU tensor of the per-datum key ``name`` (``value`` when the caller read it); ``None`` when absent.

    ``ValueError`` for a wrong count or a key only some datums have.
    """
    key = step.keys[name]
    if value is None:
        value = step.get(name)
    where = f"KLSampleTrainMonitor: {key!r}"
    if value is None and data is not None:
        has = [key in datum_loss_fn_inputs(datum, index=i) for i, datum in enumerate(data)]
        if not any(has):
            return None
        if not all(has):
            raise ValueError(
                f"{where}: datum {has.index(True)} has it in loss_fn_inputs but datum {has.index(False)} "
                "does not; give it to every datum of the step, or to none"
            )
        rows = [field_to_tensor(_as_row(datum_loss_fn_inputs(d, index=i)[key]), where=f"datum {i}, key {key!r}")
                for i, d in enumerate(data)]
        lengths = sorted({row.numel() for row in rows})
        if lengths != [1]:
            raise ValueError(f"{where}: each datum's field must hold one value, got lengths {lengths}")
        value = torch.cat([row.reshape(1).detach().cpu().to(torch.float64) for row in rows])
    if value is None:
        return None
    values = field_to_tensor(_as_row(value), where=where).detach().cpu()
    if values.numel() != n_datums:
        raise ValueError(f"{where} has {values.numel()} values for {n_datums} datums; give one per datum")
    return values


def _as_row(value: Any) -> Any:
    """A scalar (an int, a 0-d tensor) as a one-value row; anything else as it is."""
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.reshape(1)
    return value


class _Step:
    """One step's output and batch, looked up by name: the output first, then the batch."""

    def __init__(self, outputs: Any, batch: Any, keys: Mapping[str, str]) -> None:
        self.outputs, self.batch, self.keys = outputs, batch, keys

    def get(self, name: str) -> Any:
        key = self.keys[name]
        for source in (self.outputs, self.batch):
            if isinstance(source, Mapping) and source.get(key) is not None:
                return source[key]
        return None

    def trainer_logprobs(self, *, datums: bool) -> Any:
        logprobs = self.get("training_logprobs")
        if logprobs is not None:
            return logprobs
        output = self.get("forward_backward_output") if datums else None
        if output is not None:
            return trainer_logprobs_from_output(output)
        also = f" or {self.keys['forward_backward_output']!r}" if datums else ""
        raise ValueError(
            f"KLSampleTrainMonitor: training_step's output has no {self.keys['training_logprobs']!r}{also} "
            f"(keys: {_keys(self.outputs)}). Return the trainer's per-token logprobs of the target tokens, e.g. "
            f"`return {{'loss': loss, {self.keys['training_logprobs']!r}: logprobs}}` with logprobs [B, T] "
            "(position k = the token predicted at k), or set keys={'training_logprobs': <your key>}."
        )


def _is_datum_list(batch: Any) -> bool:
    return (
        isinstance(batch, Sequence)
        and not isinstance(batch, (str, bytes, torch.Tensor))
        and len(batch) > 0
        and (hasattr(batch[0], "loss_fn_inputs") or (isinstance(batch[0], Mapping) and "loss_fn_inputs" in batch[0]))
    )


def _keys(value: Any) -> list[str] | str:
    return sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
