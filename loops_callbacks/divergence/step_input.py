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
field of every datum's ``loss_fn_inputs``; ``group`` may also hold string labels (hashed into the
``max_groups`` buckets). With ``optimizer_step`` given, a datum's policy lag is
``optimizer_step - policy_version``: how many optimizer steps the weights that sampled it are
behind the weights being trained (0 on-policy). The trainer's step is the reference, not the
newest version in the step, because a whole batch that is equally stale (a sampler synced late)
would otherwise read lag 0, hiding the fault the lag is for; the cost is that versions must count
optimizer steps (a version ahead of the trainer cannot be: it is read as lag 0, with a warning).
Monitoring never stops training over these keys: a value the strata cannot use is a warning (once
per run and problem, naming the key, the value and the datum) and that family is off for the step.

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

import dataclasses
import math
import zlib

import torch

from loops_callbacks.divergence.action_tokens import (
    FlatBatch,
    flatten_datums,
    flatten_padded,
    trainer_logprobs_from_output,
)
from loops_callbacks.divergence.strata import DEFAULT_MAX_GROUPS
from loops_callbacks.fields import datum_loss_fn_inputs, field_length, field_to_tensor
from loops_callbacks.run_warnings import RunWarnings

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
    max_groups: int = DEFAULT_MAX_GROUPS,
    datum_advantages: bool = False,
    warnings: RunWarnings | None = None,
) -> FlatBatch:
    """The step's positions, in either contract form (module docstring).

    ``keys`` maps every name of ``DATA_KEYS`` to its key (``data_keys``); ``with_tokens`` keeps
    the token look-up for the worst-tokens table, ``with_token_ids`` the predicted ids the
    diagnosis groups by (datums only; padded tensors always carry theirs). With ``optimizer_step``
    (the caller keeps strata) the per-datum keys are read: policy versions become lags
    (``FlatBatch.lags``), groups ``FlatBatch.groups`` (``max_groups``: the index of ``group_other``,
    where negative ids go); lists and CPU tensors are checked on the host, int tensors on an
    accelerator are used where they are, without a host read. A per-datum value the strata cannot
    use is a warning through ``warnings`` (once per run and problem), never an error
    (``_per_datum_groups``, ``_per_datum_lags``). ``datum_advantages`` reads one advantage per datum
    (``FlatBatch.datum_advantages``, for a correction that needs them; ``_datum_advantages``).
    """
    say = warnings if warnings is not None else RunWarnings()
    step = _Step(outputs, batch, keys)
    flat, data = _read_positions(step, with_tokens, with_token_ids)
    if datum_advantages:
        flat = dataclasses.replace(flat, datum_advantages=_datum_advantages(step, data, flat, say))
    if optimizer_step is None:
        return flat
    groups = _per_datum_groups(step, data, flat.n_datums, max_groups, say)
    lags = _per_datum_lags(step, data, flat.n_datums, optimizer_step, say)
    if groups is None and lags is None:
        return flat
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


def _datum_advantages(
    step: _Step, data: Sequence[Any] | None, flat: FlatBatch, say: RunWarnings
) -> torch.Tensor:
    """Float64 ``[B]`` advantages, one per datum, on the batch's device; zeros and a warning when there are none.

    Read from ``[B]`` / ``[B, 1]`` advantages or a one-value field of each datum as they are; from
    per-token advantages (``[B, T]`` as verl keeps them, or a per-position field of each datum as
    Tinker datums carry them) as each row's value on its counted tokens (``_row_values``).
    """
    key = step.keys["advantages"]
    value = step.get("advantages")
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[1] != 1:
            if value.numel() != flat.counted.numel():
                problem = (
                    f"{key!r} has shape {tuple(value.shape)} but the step has {flat.n_datums} rows of "
                    f"{flat.counted.numel() // max(flat.n_datums, 1)} positions; give [B], [B, 1] or [B, T] advantages"
                )
                return _no_advantages(problem, flat, key, say)
            return _row_values(value.detach().reshape(-1), flat, key, say)
        value = value.reshape(-1)
    if value is None and data is not None:
        per_token = _per_token_datum_field(step, "advantages", data)
        if per_token is not None:
            return _row_values(per_token, flat, key, say)
    values = _per_datum_values(step, "advantages", data, flat.n_datums, value=value)
    if values is None:
        where = "in the batch, the step's output, or each datum's loss_fn_inputs"
        problem = f"no advantage per datum under {key!r} ({where})"
        return _no_advantages(problem, flat, key, say)
    return values.to(device=flat.device, dtype=torch.float64)


def _no_advantages(problem: str, flat: FlatBatch, key: str, say: RunWarnings) -> torch.Tensor:
    """Zero advantages for a step whose advantages cannot be read, with one warning per run: a shadow
    correction never stops training, and its numbers for such a step say so (nothing masked)."""
    say.warn(
        f"advantages:{key}",
        f"KLSampleTrainMonitor: a correction listed (off_policy_mask) needs one advantage per datum: {problem}; "
        "on such steps its shadow metrics count no sequence as masked (advantages read as 0)",
    )
    return torch.zeros(flat.n_datums, dtype=torch.float64, device=flat.device)


def _per_token_datum_field(step: _Step, name: str, data: Sequence[Any]) -> torch.Tensor | None:
    """The datums' field ``name`` over all positions (a one-value field spread over its datum's positions)
    when some datum has one value per position; ``None`` when every datum has one value (or none has it)."""
    key = step.keys[name]
    rows, lengths = [], []
    for i, datum in enumerate(data):
        inputs = datum_loss_fn_inputs(datum, index=i)
        if key not in inputs:
            return None  # _per_datum_values names the datum without it
        rows.append(field_to_tensor(_as_row(inputs[key]), where=f"datum {i}, key {key!r}").detach())
        lengths.append(field_length(inputs["logprobs"], where=f"datum {i}, key 'logprobs'"))
    if all(row.numel() == 1 for row in rows):
        return None
    wrong = [i for i, (row, n) in enumerate(zip(rows, lengths)) if row.numel() not in (1, n)]
    if wrong:
        i = wrong[0]
        raise ValueError(
            f"KLSampleTrainMonitor: datum {i}'s {key!r} has {rows[i].numel()} values for {lengths[i]} positions; "
            "give one value, or one per position"
        )
    device = rows[0].device
    return torch.cat([row.to(device, torch.float64).expand(n) for row, n in zip(rows, lengths)])


def _row_values(positions: torch.Tensor, flat: FlatBatch, key: str, say: RunWarnings) -> torch.Tensor:
    """Float64 ``[B]``: each row's value of the per-position ``positions`` on its counted tokens.

    The value where the row's counted tokens agree (per-token advantages repeat the sequence's
    advantage), else their mean, with one warning per run naming the first such datum; 0 for a row
    without counted tokens. The check is one host read, on the steps that log with per-token
    advantages and a correction that needs them.
    """
    device, counted = flat.device, flat.counted
    positions = positions.to(device=device, dtype=torch.float64)
    n_rows = flat.n_datums
    rows = torch.repeat_interleave(torch.arange(n_rows, device=device), flat.row_lengths, output_size=counted.numel())
    zeros = torch.zeros(n_rows, dtype=torch.float64, device=device)
    sums = zeros.index_add(0, rows, positions.masked_fill(~counted, 0.0))
    counts = zeros.index_add(0, rows, counted.to(torch.float64))
    mean = sums / counts.clamp(min=1.0)
    high = torch.full_like(mean, -math.inf).scatter_reduce(0, rows, positions.masked_fill(~counted, -math.inf), "amax")
    low = torch.full_like(mean, math.inf).scatter_reduce(0, rows, positions.masked_fill(~counted, math.inf), "amin")
    differ = torch.nonzero(high > low)
    if differ.numel():
        i = int(differ[0, 0])
        say.warn(
            "advantages_differ_in_a_row",
            f"KLSampleTrainMonitor: datum {i}'s per-token {key!r} differ on its counted tokens "
            f"({float(low[i]):.4g} to {float(high[i]):.4g}); the corrections read each row's mean "
            f"({float(mean[i]):.4g} here) as its advantage",
        )
    return mean


def _per_datum_groups(
    step: _Step, data: Sequence[Any] | None, n_datums: int, max_groups: int, say: RunWarnings
) -> torch.Tensor | None:
    """Int64 ``[B]`` group ids of the per-datum key ``group``; ``None`` when absent or unusable.

    Ints >= 0 are ids (the strata pool those >= ``max_groups`` in ``group_other``); a negative id
    goes to ``group_other`` (index ``max_groups``); string labels go to the bucket
    ``zlib.crc32(label) % max_groups``, the same on every rank and in every run. Each is said
    once per run, naming the key, a value and its datum; anything else turns the group family off
    for the step, with a warning. Int ids in a tensor on an accelerator stay there, unread (the
    monitor says after the step's one host read that ``group_other`` has tokens).
    """
    key = step.keys["group"]
    raw = _per_datum_raw(step, "group", data, n_datums, say)
    if raw is None:
        return None
    if isinstance(raw, list):
        ids = torch.tensor([zlib.crc32(label.encode()) % max_groups for label in raw], dtype=torch.int64)
        seen = dict(zip(raw, ids.tolist()))
        shown = ", ".join(f"{label!r} -> group_{bucket}" for label, bucket in list(seen.items())[:8])
        say.warn(
            "group:labels",
            f"KLSampleTrainMonitor: {key!r} holds labels (datum 0: {raw[0]!r}); each label is counted in the "
            f"stratum group_<zlib.crc32(label) % max_groups> ({shown}), the same on every rank; labels that "
            "share a bucket are pooled (give int ids to keep each apart)",
        )
        return ids
    ids = _integers(raw, "group", key, say)
    if ids is None:
        return None
    if _on_accelerator(ids):
        return ids.masked_fill(ids < 0, max_groups)
    negative = torch.nonzero(ids < 0)
    if negative.numel():
        i = int(negative[0, 0])
        say.warn(
            "group:negative",
            f"KLSampleTrainMonitor: datum {i} has {key!r} = {int(ids[i])} (< 0); datums with a negative group id "
            "are counted in the stratum 'group_other'",
        )
        ids = ids.masked_fill(ids < 0, max_groups)
    return ids


def _per_datum_lags(
    step: _Step, data: Sequence[Any] | None, n_datums: int, optimizer_step: int, say: RunWarnings
) -> torch.Tensor | None:
    """Int64 ``[B]`` policy lags, ``optimizer_step - policy_version``; ``None`` when absent or unusable.

    A version ahead of the trainer's step cannot be (versions count optimizer steps): its lag is
    negative, which the strata count at lag 0 and in ``lag_ahead``; on the host the first is said
    once per run with its datum. A negative or non-integer version turns the lag family off for the
    step, with a warning. Int versions in a tensor on an accelerator stay there, unread: a version
    ahead is then said by the monitor after the step's one host read, and a negative version is
    not seen (it reads as a lag past the trainer's step).
    """
    key = step.keys["policy_version"]
    raw = _per_datum_raw(step, "policy_version", data, n_datums, say)
    if isinstance(raw, list):
        say.warn(
            "policy_version:labels",
            f"KLSampleTrainMonitor: {key!r} must count optimizer steps, got labels (datum 0: {raw[0]!r}); "
            "the strata by policy lag are off for such steps",
        )
        return None
    versions = None if raw is None else _integers(raw, "policy_version", key, say)
    if versions is None:
        return None
    if _on_accelerator(versions):
        return optimizer_step - versions
    negative = torch.nonzero(versions < 0)
    if negative.numel():
        i = int(negative[0, 0])
        say.warn(
            "policy_version:negative",
            f"KLSampleTrainMonitor: datum {i} has {key!r} = {int(versions[i])}; versions count the optimizer "
            "steps the sampler's weights had received (0 for the initial weights): the strata by policy lag "
            "are off for such steps",
        )
        return None
    lags = optimizer_step - versions
    ahead = torch.nonzero(lags < 0)
    if ahead.numel():
        i = int(ahead[0, 0])
        say.warn(
            "policy_version:ahead",
            f"KLSampleTrainMonitor: datum {i} has {key!r} = {int(versions[i])}, ahead of the trainer's optimizer "
            f"step {optimizer_step} ({ahead.shape[0]} of {n_datums} datums of the micro-batch); such datums are "
            "counted at lag 0 and in the stratum 'lag_ahead'. The policy version must count the optimizer steps "
            "the sampler's weights had received (0 for the initial weights)",
        )
    return lags


def _on_accelerator(values: torch.Tensor) -> bool:
    """Whether ``values`` sit on an accelerator, where reading them would synchronize the host."""
    return values.device.type != "cpu"


def _per_datum_raw(
    step: _Step, name: str, data: Sequence[Any] | None, n_datums: int, say: RunWarnings
) -> torch.Tensor | list[str] | None:
    """The per-datum key ``name`` as given: a ``[B]`` tensor of numbers (on an accelerator only when it
    holds ints), or a list of string labels.

    ``None`` when absent, or, with a warning naming the key, when it cannot be one value per datum
    (a wrong count, a key only some datums have, a kind that is not numbers or strings).
    """
    key = step.keys[name]
    where = f"KLSampleTrainMonitor: {key!r}"
    off = f"; the strata by {'group' if name == 'group' else 'policy lag'} are off for such steps"
    value = step.get(name)
    if value is None and data is not None:
        inputs = [datum_loss_fn_inputs(datum, index=i) for i, datum in enumerate(data)]
        has = [key in fields for fields in inputs]
        if not any(has):
            return None
        if not all(has):
            say.warn(
                f"{name}:some_datums",
                f"{where}: datum {has.index(True)} has it in loss_fn_inputs but datum {has.index(False)} does not"
                + off,
            )
            return None
        try:
            value = [_one_value(fields[key]) for fields in inputs]
        except (TypeError, ValueError) as error:
            say.warn(f"{name}:unreadable", f"{where}: {error}" + off)
            return None
        longer = [i for i, item in enumerate(value) if item is None]
        if longer:
            say.warn(f"{name}:count", f"{where}: datum {longer[0]}'s field holds more than one value" + off)
            return None
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and any(isinstance(item, str) for item in value):
        if all(isinstance(item, str) for item in value) and len(value) == n_datums:
            return list(value)
        got = list(value)[:8]
        say.warn(f"{name}:mixed", f"{where} must be one int (or one string label) per datum, got {got}" + off)
        return None
    try:
        values = field_to_tensor(_as_row(value), where=where).detach()
    except (TypeError, ValueError) as error:
        say.warn(f"{name}:unreadable", f"{error}" + off)
        return None
    if values.numel() != n_datums:
        say.warn(f"{name}:count", f"{where} has {values.numel()} values for {n_datums} datums" + off)
        return None
    if _on_accelerator(values) and (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool):
        values = values.cpu()  # only int ids are used unread on the device; others are checked on the host
    return values


def _one_value(field: Any) -> Any:
    """A datum's one-value field as a scalar (a string label as it is); ``None`` for any other length."""
    if isinstance(field, str):
        return field
    if isinstance(field, (list, tuple)) and len(field) == 1 and isinstance(field[0], str):
        return field[0]
    row = field_to_tensor(_as_row(field), where="per-datum field")
    return row.reshape(()).item() if row.numel() == 1 else None


def _integers(values: torch.Tensor, name: str, key: str, say: RunWarnings) -> torch.Tensor | None:
    """``values`` as int64 when each is an integer; ``None`` with a warning naming a datum otherwise."""
    off = f"; the strata by {'group' if name == 'group' else 'policy lag'} are off for such steps"
    if values.dtype == torch.bool or values.is_complex():
        say.warn(f"{name}:dtype", f"KLSampleTrainMonitor: {key!r} must hold integers, got dtype {values.dtype}" + off)
        return None
    if values.is_floating_point():
        bad = torch.nonzero(~torch.isfinite(values) | (values != values.round()))
        if bad.numel():
            i = int(bad[0, 0])
            say.warn(
                f"{name}:not_integer",
                f"KLSampleTrainMonitor: {key!r} must hold integers, got {float(values[i])} at datum {i}" + off,
            )
            return None
    return values.to(torch.int64)


def _per_datum_values(
    step: _Step, name: str, data: Sequence[Any] | None, n_datums: int, *, value: Any = None
) -> torch.Tensor | None:
    """``[B]`` tensor of the per-datum key ``name`` (``value`` when the caller read it), on the device it
    was given on; ``None`` when absent.

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
        value = torch.cat([row.reshape(1).detach().to(rows[0].device, torch.float64) for row in rows])
    if value is None:
        return None
    values = field_to_tensor(_as_row(value), where=where).detach()
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
