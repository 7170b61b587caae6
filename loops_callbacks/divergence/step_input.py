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
Monitoring never stops training over these keys: a value the strata cannot use (None, empty, 2-D,
bools, a wrong count, a non-integer, a tensor on the meta device) is a warning (once per run and
problem, naming the key, what was given, the datum and the micro-batch's size) and that family is
off for the step. Advantages holding NaN are not read here: ``FlatBatch.advantage_nan`` marks them,
the statistics count them on the batch's device, and the monitor says so from the step's totals of
every rank.

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

import numpy as np
import torch

from loops_callbacks.divergence.action_tokens import (
    FlatBatch,
    flatten_datums,
    flatten_padded,
    trainer_logprobs_from_output,
)
from loops_callbacks.divergence.evidence import SamplerFacts
from loops_callbacks.divergence.strata import DEFAULT_MAX_GROUPS
from loops_callbacks.fields import datum_loss_fn_inputs, field_length, field_to_tensor
from loops_callbacks.run_warnings import RunWarnings

__all__ = ["DATA_KEYS", "data_keys", "key_label", "read_sampler_facts", "read_step"]

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
    "training_entropy",
    "training_varentropy",
    "sampler_facts",
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
    Advantages holding NaN where the mask counts are marked in ``FlatBatch.advantage_nan`` (counted
    with the statistics and said by the monitor from the reduced totals, so no host read here).
    """
    say = warnings if warnings is not None else RunWarnings()
    step = _Step(outputs, batch, keys)
    flat, data = _read_positions(step, with_tokens, with_token_ids)
    if datum_advantages:
        flat = dataclasses.replace(flat, datum_advantages=_datum_advantages(step, data, flat, say))
    if optimizer_step is None:
        return flat
    groups = _per_datum_groups(step, data, flat.n_datums, flat.device, max_groups, say)
    lags = _per_datum_lags(step, data, flat.n_datums, flat.device, optimizer_step, say)
    if groups is None and lags is None:
        return flat
    return dataclasses.replace(
        flat,
        lags=None if lags is None else lags.to(flat.device),
        groups=None if groups is None else groups.to(flat.device),
    )


def read_sampler_facts(outputs: Any, batch: Any, keys: Mapping[str, str], warnings: RunWarnings) -> SamplerFacts | None:
    """The sampling engine's ``SamplerFacts`` under ``keys["sampler_facts"]`` (the output first, then the
    batch); anything else there is one warning per run and ``None``: facts never stop training.

    Example:
        >>> facts = SamplerFacts(engine="vllm", logprobs_mode="processed_logprobs")
        >>> read_sampler_facts({"sampler_facts": facts}, {}, data_keys(None), RunWarnings()) is facts
        True
    """
    found = _Step(outputs, batch, keys).get("sampler_facts")
    if found is None or isinstance(found, SamplerFacts):
        return found
    key = keys["sampler_facts"]
    warnings.warn(
        f"sampler_facts:{key}",
        f"KLSampleTrainMonitor: {key!r} holds a {type(found).__name__}, not a "
        "loops_callbacks.divergence.evidence.SamplerFacts; it is not read",
    )
    return None


def _read_positions(step: _Step, with_tokens: bool, with_token_ids: bool) -> tuple[FlatBatch, Sequence[Any] | None]:
    """The ``FlatBatch`` of the step's positions, and its datums when the step is in the datum form."""
    outputs, batch, keys = step.outputs, step.batch, step.keys
    data = step.get("data")
    if data is None and _is_datum_list(batch):
        data = batch
    if data is not None:
        entropies = [keys[name] for name in ("training_entropy", "training_varentropy") if step.get(name) is not None]
        if entropies:
            raise ValueError(
                f"KLSampleTrainMonitor: {entropies} are read with padded [B, T] tensors, not with a list of Datum; "
                "return the batch's sampler 'logprobs' and 'mask' as [B, T] tensors to check what was sampled"
            )
        flat = flatten_datums(
            data, step.trainer_logprobs(datums=True), with_tokens=with_tokens, with_token_ids=with_token_ids,
            advantages_key=keys["advantages"],
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
        training_entropy=step.get("training_entropy"),
        training_varentropy=step.get("training_varentropy"),
    )
    return flat, None


def _datum_advantages(
    step: _Step, data: Sequence[Any] | None, flat: FlatBatch, say: RunWarnings
) -> torch.Tensor:
    """Float64 ``[B]`` advantages, one per datum, on the batch's device; NaN and a warning when there are none.

    Read from ``[B]`` / ``[B, 1]`` advantages or a one-value field of each datum as they are (NaN,
    which counts as 0 for the action tokens, as 0); from per-token advantages (``[B, T]`` as verl
    keeps them, or a per-position field of each datum as Tinker datums carry them) as each row's
    value on its counted tokens (``_row_values``). Bools are no advantages: zeros and a warning.
    """
    key = step.keys["advantages"]
    value = step.get("advantages")
    bools = _bool_advantages(value, data, key, _label(step, "advantages"))
    if bools is not None:
        return _no_advantages(bools, flat, key, say)
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[1] != 1:
            if value.numel() != flat.counted.numel():
                problem = (
                    f"{_label(step, 'advantages')} has shape {tuple(value.shape)} ({value.numel()} values) but the "
                    f"step's {flat.n_datums} datums have {flat.counted.numel()} positions in all; give [B], [B, 1] "
                    "or [B, T] advantages"
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
    values = values.to(device=flat.device, dtype=torch.float64)
    return values.masked_fill(values.isnan(), 0.0)  # a new tensor: the caller's is never written


def _bool_advantages(value: Any, data: Sequence[Any] | None, key: str, label: str) -> str | None:
    """What to say when the advantages hold bools (a correction needs numbers); ``None`` when they do not."""
    if value is None and data is not None:
        for i, datum in enumerate(data):
            detail = _bools_in(datum_loss_fn_inputs(datum, index=i).get(key))
            if detail is not None:
                return f"datum {i}'s {label} holds bools ({detail}), not numbers"
        return None
    detail = _bools_in(value)
    return None if detail is None else f"{label} holds bools ({detail}), not numbers"


def _bools_in(value: Any) -> str | None:
    """Where ``value`` holds bools (a bool, a bool tensor or array, a list with a bool), said; ``None`` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return repr(value)
    dtype = getattr(value, "dtype", None)
    if dtype in (torch.bool, np.bool_):
        return f"dtype {dtype}"
    if isinstance(value, (list, tuple)):
        found = [i for i, item in enumerate(value) if isinstance(item, (bool, np.bool_))]
        if found:
            return f"{value[found[0]]!r} at index {found[0]}"
    return None


def _no_advantages(problem: str, flat: FlatBatch, key: str, say: RunWarnings) -> torch.Tensor:
    """NaN advantages (none usable) for a step whose advantages cannot be read, with one warning per run on
    rank 0: a shadow correction never stops training, and it counts such sequences as masked, with their
    rank, so that rank 0 says any rank's (``shadow.no_advantage_message``)."""
    say.warn(
        f"advantages:{key}",
        f"KLSampleTrainMonitor: a correction listed (off_policy_mask) needs one advantage per datum: {problem}; "
        "on such steps its shadow metrics count the sequences as masked (they cannot be judged)",
    )
    return torch.full((flat.n_datums,), math.nan, dtype=torch.float64, device=flat.device)


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
    step: _Step, data: Sequence[Any] | None, n_datums: int, device: torch.device, max_groups: int, say: RunWarnings
) -> torch.Tensor | None:
    """Int64 ``[B]`` group ids of the per-datum key ``group``; ``None`` when absent or unusable.

    Ints >= 0 are ids (the strata pool those >= ``max_groups`` in ``group_other``); a negative id
    goes to ``group_other`` (index ``max_groups``); string labels go to the bucket
    ``zlib.crc32(label) % max_groups``, the same on every rank and in every run. Each is said
    once per run, naming the key, a value and its datum; anything else turns the group family off
    for the step, with a warning. Int ids in a tensor on an accelerator stay there, unread (the
    monitor says after the step's one host read that ``group_other`` has tokens).
    """
    key = _label(step, "group")
    raw = _per_datum_raw(step, "group", data, n_datums, device, say)
    if raw is None:
        return None
    if isinstance(raw, list):
        ids = torch.tensor([zlib.crc32(label.encode()) % max_groups for label in raw], dtype=torch.int64)
        seen = dict(zip(raw, ids.tolist()))
        shown = ", ".join(f"{label!r} -> group_{bucket}" for label, bucket in list(seen.items())[:8])
        say.warn(
            "group:labels",
            f"KLSampleTrainMonitor: {key} holds labels (datum 0: {raw[0]!r}); each label is counted in the "
            f"stratum group_<zlib.crc32(label) % max_groups> ({shown}), the same on every rank; labels that "
            "share a bucket are pooled (give int ids to keep each apart)",
        )
        return ids
    ids = _integers(raw, "group", key, n_datums, say)
    if ids is None:
        return None
    if _on_accelerator(ids):
        return ids.masked_fill(ids < 0, max_groups)
    negative = torch.nonzero(ids < 0)
    if negative.numel():
        i = int(negative[0, 0])
        say.warn(
            "group:negative",
            f"KLSampleTrainMonitor: datum {i} has {key} = {int(ids[i])} (< 0); datums with a negative group id "
            "are counted in the stratum 'group_other'",
        )
        ids = ids.masked_fill(ids < 0, max_groups)
    return ids


def _per_datum_lags(
    step: _Step, data: Sequence[Any] | None, n_datums: int, device: torch.device, optimizer_step: int, say: RunWarnings
) -> torch.Tensor | None:
    """Int64 ``[B]`` policy lags, ``optimizer_step - policy_version``; ``None`` when absent or unusable.

    A version ahead of the trainer's step cannot be (versions count optimizer steps): its lag is
    negative, which the strata count at lag 0 and in ``lag_ahead``; on the host the first is said
    once per run with its datum. A negative or non-integer version turns the lag family off for the
    step, with a warning. Int versions in a tensor on an accelerator stay there, unread: a version
    ahead is then said by the monitor after the step's one host read, and a negative version is
    not seen (it reads as a lag past the trainer's step).
    """
    key = _label(step, "policy_version")
    raw = _per_datum_raw(step, "policy_version", data, n_datums, device, say)
    if isinstance(raw, list):
        text = f"{key} must count optimizer steps, got labels (datum 0: {raw[0]!r})"
        say.warn("policy_version:labels", _unusable_message(text, "policy_version", n_datums))
        return None
    versions = None if raw is None else _integers(raw, "policy_version", key, n_datums, say)
    if versions is None:
        return None
    if _on_accelerator(versions):
        return optimizer_step - versions
    negative = torch.nonzero(versions < 0)
    if negative.numel():
        i = int(negative[0, 0])
        text = (
            f"datum {i} has {key} = {int(versions[i])}, but versions count the optimizer steps the sampler's "
            "weights had received (0 for the initial weights)"
        )
        say.warn("policy_version:negative", _unusable_message(text, "policy_version", n_datums))
        return None
    lags = optimizer_step - versions
    ahead = torch.nonzero(lags < 0)
    if ahead.numel():
        i = int(ahead[0, 0])
        say.warn(
            "policy_version:ahead",
            f"KLSampleTrainMonitor: datum {i} has {key} = {int(versions[i])}, ahead of the trainer's optimizer "
            f"step {optimizer_step} ({ahead.shape[0]} of {n_datums} datums of the micro-batch); such datums are "
            "counted at lag 0 and in the stratum 'lag_ahead'. The policy version must count the optimizer steps "
            "the sampler's weights had received (0 for the initial weights)",
        )
    return lags


def _on_accelerator(values: torch.Tensor) -> bool:
    """Whether ``values`` sit on an accelerator, where reading them would synchronize the host."""
    return values.device.type != "cpu"


def _per_datum_raw(
    step: _Step, name: str, data: Sequence[Any] | None, n_datums: int, device: torch.device, say: RunWarnings
) -> torch.Tensor | list[str] | None:
    """The per-datum key ``name`` as given: a ``[B]`` tensor of numbers (on an accelerator, the batch's
    ``device``, only when it holds ints), or a list of string labels.

    ``None`` when absent, or, with one warning per run and problem (``_Unusable``: the key, what was
    given, the micro-batch's size), when it cannot be one value per datum: None, empty, 2-D, bools,
    a wrong count, a key only some datums have, a kind that is not numbers or strings, a tensor that
    cannot be read (the meta device holds no values).
    """
    try:
        return _per_datum_given(step, name, data, n_datums, device)
    except _Unusable as problem:
        say.warn(f"{name}:{problem.kind}", _unusable_message(problem.text, name, n_datums, given=problem.given))
        return None


class _Unusable(Exception):
    """A per-datum key's value the strata cannot use: ``kind`` names the problem (said once per run
    each), ``text`` what is wrong, ``given`` what was given where ``text`` does not say it."""

    def __init__(self, kind: str, text: str, given: str = "") -> None:
        super().__init__(text)
        self.kind, self.text, self.given = kind, text, given


_FAMILIES = {"policy_version": ("policy lag", "per-lag"), "group": ("group", "per-group")}
_EXPECTED = {"policy_version": "one int >= 0 per datum", "group": "one int id (or one string label) per datum"}


def _unusable_message(text: str, name: str, n_datums: int, *, given: str = "") -> str:
    """The warning for a per-datum key the strata cannot use: what was given, and what the monitor does.

    Example:
        >>> message = _unusable_message("'group' is None in the batch", "group", 2)
        >>> message.split(": the ")[0]
        "KLSampleTrainMonitor: 'group' is None in the batch; the strata by group are off for such steps"
        >>> "the per-group numbers are not computed" in message and "for a micro-batch of 2 datums" in message
        True
    """
    family, numbers = _FAMILIES[name]
    return (
        f"KLSampleTrainMonitor: {text}; the strata by {family} are off for such steps: the {numbers} numbers are "
        f"not computed ({f'it was {given}; ' if given else ''}for a micro-batch of {n_datums} datums, give "
        f"{_EXPECTED[name]}: a [{n_datums}] tensor or list, or a one-value field of each datum's loss_fn_inputs)"
    )


def key_label(keys: Mapping[str, str], name: str) -> str:
    """The key of ``name`` as the user gave it, and which name it stands for when ``keys=`` renamed it.

    Example:
        >>> key_label(data_keys({"advantages": "adv"}), "advantages"), key_label(data_keys(None), "mask")
        ("'adv' (the advantages key)", "'mask'")
    """
    key = keys[name]
    return f"{key!r}" if key == name else f"{key!r} (the {name} key)"


def _label(step: _Step, name: str) -> str:
    return key_label(step.keys, name)


def _per_datum_given(
    step: _Step, name: str, data: Sequence[Any] | None, n_datums: int, device: torch.device
) -> torch.Tensor | list[str] | None:
    """``_per_datum_raw`` without the warning: ``_Unusable`` for a value the strata cannot use."""
    label = _label(step, name)
    value = step.get(name)
    given = _described(value)
    if value is None and data is not None:
        value = _datum_fields(data, step.keys[name], label)
        given = f"a one-value field of each of the {len(data)} datums"
    if value is None:
        place = step.given_as_none(name)
        if place is not None:
            raise _Unusable("none", f"{label} is None in {place}")
        return None
    value = _as_row(value)
    if isinstance(value, (list, tuple)):
        _check_items(value, label, n_datums, given)
        if value and all(isinstance(item, str) for item in value):
            return list(value)
    shape = _shape_of(value)
    if shape is not None and len(shape) != 1:
        raise _Unusable("shape", f"{label} is {given}")
    if shape is not None and shape[0] == 0 != n_datums:
        raise _Unusable("empty", f"{label} is empty ({given})")
    try:
        values = field_to_tensor(value, where=label).detach()
    except (TypeError, ValueError) as error:
        raise _Unusable("unreadable", str(error)) from None
    if values.dtype == torch.bool:
        raise _Unusable("dtype", f"{label} must hold integers, got bools (dtype torch.bool)", given)
    if values.numel() != n_datums:
        raise _Unusable("count", f"{label} has {values.numel()} values for {n_datums} datums", given)
    if _on_accelerator(values):  # int ids go where the batch is, unread; other values are checked on the host
        where = device if not (values.is_floating_point() or values.is_complex()) else torch.device("cpu")
        try:
            values = values.to(where)
        except (RuntimeError, NotImplementedError) as error:  # the meta device: no values to copy
            raise _Unusable("device", f"{label} cannot be read from the {values.device} device ({error})", given)
    return values


def _check_items(values: Sequence[Any], label: str, n_datums: int, given: str) -> None:
    """``_Unusable`` for a list (``given``) the strata cannot use item by item: a None, a bool, labels
    mixed with numbers or of the wrong count."""
    nones = [i for i, item in enumerate(values) if item is None]
    if nones:
        raise _Unusable(
            "none", f"{label} is None at datum {nones[0]} ({len(nones)} of the {len(values)} values)", given
        )
    bools = [i for i, item in enumerate(values) if isinstance(item, (bool, np.bool_))]
    if bools:
        i = bools[0]
        raise _Unusable("dtype", f"{label} must hold integers, got bools (datum {i}: {values[i]!r})", given)
    labels = [isinstance(item, str) for item in values]
    if any(labels) and not all(labels):
        raise _Unusable("mixed", f"{label} must be one int (or one string label) per datum, got {list(values)[:8]}")
    if any(labels) and len(values) != n_datums:
        raise _Unusable("count", f"{label} has {len(values)} labels for {n_datums} datums", given)


def _datum_fields(data: Sequence[Any], key: str, label: str) -> list[Any] | None:
    """Each datum's one-value field ``key`` as a scalar (a label as a string, a bool as a bool); ``None``
    when no datum has it; ``_Unusable`` naming the datum when some datum lacks it or holds no one value."""
    inputs = [datum_loss_fn_inputs(datum, index=i) for i, datum in enumerate(data)]
    has = [key in fields for fields in inputs]
    if not any(has):
        return None
    if not all(has):
        first, lacking = has.index(True), has.index(False)
        raise _Unusable("some_datums", f"{label}: datum {first} has it in loss_fn_inputs but datum {lacking} does not")
    return [_one_value(fields[key], f"datum {i}'s {label}") for i, fields in enumerate(inputs)]


def _one_value(field: Any, where: str) -> Any:
    """A datum's one-value field as a scalar (a string label as it is, a bool as a bool); ``_Unusable``
    saying what it holds otherwise."""
    if field is None:
        raise _Unusable("none", f"{where} is None")
    if isinstance(field, (str, bool, np.bool_)):
        return field
    if isinstance(field, (list, tuple)) and len(field) == 1 and isinstance(field[0], (str, bool, np.bool_)):
        return field[0]
    if isinstance(field, (list, tuple)) and len(field) == 1 and field[0] is None:
        raise _Unusable("none", f"{where} is [None]")
    shape = _shape_of(_as_row(field))
    if shape is not None and len(shape) > 1:
        raise _Unusable("shape", f"{where} is {_described(field)}")
    if shape is not None and shape[0] != 1:
        problem = "is empty" if shape[0] == 0 else f"holds {shape[0]} values"
        raise _Unusable("empty" if shape[0] == 0 else "count", f"{where} {problem} ({_described(field)})")
    try:
        row = field_to_tensor(_as_row(field), where=where)
    except (TypeError, ValueError) as error:
        raise _Unusable("unreadable", str(error)) from None
    if row.numel() != 1:  # a kind without a shape
        raise _Unusable("count", f"{where} holds {row.numel()} values ({_described(field)})")
    return row.reshape(()).item()


def _integers(values: torch.Tensor, name: str, key: str, n_datums: int, say: RunWarnings) -> torch.Tensor | None:
    """``values`` as int64 when each is an integer (a float with an integer value, within int64's
    range, included); ``None`` with a warning naming a datum otherwise. ``key`` is the key as said."""
    if values.is_complex():
        text = f"{key} must hold integers, got dtype {values.dtype}"
        say.warn(f"{name}:dtype", _unusable_message(text, name, n_datums))
        return None
    if values.is_floating_point():
        bad = torch.nonzero(~torch.isfinite(values) | (values != values.round()) | (values.abs() >= 2.0**63))
        if bad.numel():
            i = int(bad[0, 0])
            text = f"{key} must hold integers, got {float(values[i])} at datum {i}"
            say.warn(f"{name}:not_integer", _unusable_message(text, name, n_datums))
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


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor, array, ``TensorData`` or (rectangular) list; ``None`` when it has none."""
    shape = getattr(value, "shape", None)
    if shape is not None and not callable(shape):
        return tuple(int(n) for n in shape)
    if isinstance(value, (list, tuple)):
        try:
            return tuple(np.shape(np.asarray(value, dtype=object)))
        except ValueError:  # ragged
            return None
    return None


def _described(value: Any) -> str:
    """What ``value`` is, for a message: its kind and shape (and dtype where it has one).

    Example:
        >>> _described(torch.zeros(3, 1))
        'a tensor of shape (3, 1) and dtype torch.float32'
    """
    if value is None:
        return "None"
    if isinstance(value, (bool, np.bool_)):
        return f"a bool ({value!r})"
    kind = {torch.Tensor: "tensor", np.ndarray: "numpy array"}.get(type(value), type(value).__name__)
    shape = _shape_of(value)
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (list, tuple)):
        return f"a {kind} of length {len(value)}" if shape is None or len(shape) == 1 else f"a {kind} of shape {shape}"
    if shape is None:
        return f"a {kind}"
    return f"a {kind} of shape {shape}" + (f" and dtype {dtype}" if dtype is not None else "")


def _as_row(value: Any) -> Any:
    """A scalar (an int, a bool, a numpy scalar, a 0-d tensor or array) as a one-value row; anything else as it is."""
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, np.generic):
        return [value.item()]
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
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

    def given_as_none(self, name: str) -> str | None:
        """Where ``name``'s key is present with the value None ("training_step's output", "the batch"),
        when no place has a value for it; ``None`` otherwise."""
        key = self.keys[name]
        places = [
            place
            for place, source in (("training_step's output", self.outputs), ("the batch", self.batch))
            if isinstance(source, Mapping) and key in source and source[key] is None
        ]
        return " and ".join(places) if places and self.get(name) is None else None

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
