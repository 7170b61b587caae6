"""The per-datum keys of a step: policy versions (as lags), groups, and one advantage per datum.

``policy_version`` is the version of the sampler's weights that generated each datum, counted in
the trainer's optimizer steps (0 for the initial weights); a datum's policy lag is the trainer's
optimizer step minus it (0 on-policy). The trainer's step is the reference, not the newest version
in the step: a whole batch equally stale (a sampler synced late) would otherwise read lag 0. A
version ahead of the trainer cannot be: it is read as lag 0 (stratum ``lag_ahead`` too), with a
warning. ``group`` is a task or environment id, an int >= 0, or a string label (hashed into the
``max_groups`` buckets). Each is a ``[B]`` int tensor or list in the output or the batch, or a
one-value field of every datum's ``loss_fn_inputs``.

Monitoring never stops training over these keys: a value that cannot be used (None, empty, 2-D,
bools, a wrong count, a non-integer, a tensor on the meta device) is one warning per run and
problem, naming the key, what was given, the datum and the micro-batch's size, and that family is
off for the step. Int tensors on an accelerator are used where they are, never read on the host.

Examples:
    >>> message = _unusable_message("'group' is None in the batch", "group", 2)
    >>> message.split(": the ")[0]
    "KLSampleTrainMonitor: 'group' is None in the batch; the strata by group are off for such steps"
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import torch

from loops_callbacks.divergence.flat_batch import FlatBatch
from loops_callbacks.divergence.states import MAX_SERVERS
from loops_callbacks.fields import datum_loss_fn_inputs, field_length, field_to_tensor
from loops_callbacks.run_warnings import RunWarnings

DEFAULT_MAX_GROUPS = 8
_FAMILIES = {"policy_version": ("policy lag", "per-lag"), "group": ("group", "per-group")}
_EXPECTED = {"policy_version": "one int >= 0 per datum", "group": "one int id (or one string label) per datum"}
_BOOLS = (bool, np.bool_)


class _Unusable(Exception):
    """A per-datum value that cannot be used: ``kind`` (said once per run each), ``text``, ``given``."""

    def __init__(self, kind: str, text: str, given: str = "") -> None:
        super().__init__(text)
        self.kind, self.text, self.given = kind, text, given


def _unusable_message(text: str, name: str, n_datums: int, *, given: str = "") -> str:
    """The warning for a per-datum key that cannot be used: what was given, and what the monitor does."""
    family, numbers = _FAMILIES[name]
    return (
        f"KLSampleTrainMonitor: {text}; the strata by {family} are off for such steps: the {numbers} numbers are "
        f"not computed ({f'it was {given}; ' if given else ''}for a micro-batch of {n_datums} datums, give "
        f"{_EXPECTED[name]}: a [{n_datums}] tensor or list, or a one-value field of each datum's loss_fn_inputs)"
    )


def servers(step: Any, flat: FlatBatch, registry: list[str]) -> torch.Tensor | None:
    """Int64 ``[B]`` slots of the server that sampled each datum (``sampler_server``: one URL per datum, a list of
    str), on the batch's device: a URL's index in ``registry``, the servers in the order the run first named them
    (appended to here; ``states.MAX_SERVERS`` and more share the last slot). ``None``: absent, or unusable (one
    warning per run).

    Examples:
        >>> registry = ["http://a:8000"]
        >>> class Step: get = staticmethod(lambda name: ["http://b:8000", "http://a:8000"]); label = repr
        >>> flat = FlatBatch(*[torch.zeros(2)] * 6, row_lengths=torch.ones(2, dtype=torch.int64))
        >>> servers(Step, flat, registry).tolist(), registry
        ([1, 0], ['http://a:8000', 'http://b:8000'])
    """
    urls = step.get("sampler_server")
    if urls is None:
        return None
    if not isinstance(urls, (list, tuple)) or len(urls) != flat.n_datums or not all(isinstance(u, str) for u in urls):
        shown = f"a {type(urls).__name__}" + (f" of {len(urls)}" if isinstance(urls, (list, tuple)) else "")
        step.say.warn("sampler_server:unusable", f"KLSampleTrainMonitor: {step.label('sampler_server')} is {shown}, "
                      f"not one server URL (str) per datum for a micro-batch of {flat.n_datums} datums; the "
                      "divergence by server is off for such steps")
        return None
    for url in dict.fromkeys(urls):
        if url not in registry:
            registry.append(url)
    slots = [min(registry.index(url), MAX_SERVERS - 1) for url in urls]
    return torch.tensor(slots, dtype=torch.int64).to(flat.device)


def groups(step: Any, flat: FlatBatch, max_groups: int) -> torch.Tensor | None:
    """Int64 ``[B]`` group ids on the batch's device (``max_groups``: ``group_other``, where negative ids go;
    a string label: ``zlib.crc32(label) % max_groups``, the same on every rank and run); ``None``: absent
    or unusable (module docstring)."""
    key, say = step.label("group"), step.say
    ids = _read(step, "group", flat)
    if isinstance(ids, list):
        labels, ids = ids, torch.tensor([zlib.crc32(label.encode()) % max_groups for label in ids], dtype=torch.int64)
        buckets = list(dict(zip(labels, ids.tolist())).items())[:8]
        shown = ", ".join(f"{label!r} -> group_{bucket}" for label, bucket in buckets)
        say.warn("group:labels", f"KLSampleTrainMonitor: {key} holds labels (datum 0: {labels[0]!r}); each label is "
                 f"counted in the stratum group_<zlib.crc32(label) % max_groups> ({shown}), the same on every rank; "
                 "labels that share a bucket are pooled (give int ids to keep each apart)")
        return ids.to(flat.device)
    if ids is None:
        return None
    if not _on_accelerator(ids) and (ids < 0).any():  # on an accelerator the monitor says it from the strata
        i = int(torch.nonzero(ids < 0)[0, 0])
        say.warn("group:negative", f"KLSampleTrainMonitor: datum {i} has {key} = {int(ids[i])} (< 0); datums with a "
                 "negative group id are counted in the stratum 'group_other'")
    return ids.masked_fill(ids < 0, max_groups).to(flat.device)


def lags(step: Any, flat: FlatBatch, optimizer_step: int) -> torch.Tensor | None:
    """Int64 ``[B]`` policy lags, ``optimizer_step - policy_version``, on the batch's device; ``None``:
    absent or unusable (module docstring). A negative or non-integer version turns the family off."""
    key, n, say = step.label("policy_version"), flat.n_datums, step.say
    versions = _read(step, "policy_version", flat, labels_refused="must count optimizer steps")
    if versions is None or _on_accelerator(versions):  # on an accelerator: unread (ahead: said from the strata)
        return None if versions is None else optimizer_step - versions
    if (versions < 0).any():
        i = int(torch.nonzero(versions < 0)[0, 0])
        text = (f"datum {i} has {key} = {int(versions[i])}, but versions count the optimizer steps the sampler's "
                "weights had received (0 for the initial weights)")
        say.warn("policy_version:negative", _unusable_message(text, "policy_version", n))
        return None
    ahead = torch.nonzero(versions > optimizer_step)
    if ahead.numel():
        i = int(ahead[0, 0])
        say.warn("policy_version:ahead", f"KLSampleTrainMonitor: datum {i} has {key} = {int(versions[i])}, ahead of "
                 f"the trainer's optimizer step {optimizer_step} ({ahead.shape[0]} of {n} datums of the micro-batch); "
                 "such datums are counted at lag 0 and in the stratum 'lag_ahead'. The policy version must count the "
                 "optimizer steps the sampler's weights had received (0 for the initial weights)")
    return (optimizer_step - versions).to(flat.device)


def advantages(step: Any, flat: FlatBatch) -> torch.Tensor:
    """Float64 ``[B]``: one advantage per datum, for a correction that needs them (``off_policy_mask``).

    From ``[B]`` / ``[B, 1]`` advantages or a one-value field of each datum as they are (NaN, which
    counts as 0 for the action tokens, as 0); from per-token ones (``[B, T]``, as verl keeps them, or
    a per-position field, as Tinker datums carry them) each row's value on its counted tokens (their
    mean, with one warning, where they differ: one host read). Where none can be read (none, bools, a
    shape that fits no datum): NaN, and one warning: such sequences are counted as masked.
    """
    key, label, data = step.keys["advantages"], step.label("advantages"), step.data
    value, per_position = step.get("advantages"), False
    try:
        if value is None:
            inputs = [datum_loss_fn_inputs(datum, index=i) for i, datum in enumerate(data or ())]
            fields = [fields.get(key) for fields in inputs]
            if data is None or any(field is None for field in fields):
                raise _Unusable("", f"no advantage per datum under {key!r} (in the batch, the step's output, or each "
                                "datum's loss_fn_inputs)")
            rows = []  # flatten_datums read these fields: each is 1-D, with 1 value or one per position
            for i, field in enumerate(fields):
                _no_bools(field, f"datum {i}'s {label}")
                rows.append(field_to_tensor(field, where=f"datum {i}, key {key!r}").detach())
            per_position = any(row.numel() != 1 for row in rows)
            lengths = [field_length(fields["logprobs"], where=f"datum {i}") for i, fields in enumerate(inputs)]
            value = torch.cat([row.to(rows[0].device, torch.float64).expand(n if per_position else 1)
                               for row, n in zip(rows, lengths)])
        _no_bools(value, label)
        row = value.reshape(-1) if isinstance(value, (torch.Tensor, np.ndarray)) else _as_row(value)
        values = _row(row, label, _described(value), 0).to(flat.device, torch.float64)  # counts: checked below
        if per_position or values.numel() != flat.n_datums:
            if values.numel() != flat.counted.numel():
                raise _Unusable("", f"{label} has shape {tuple(getattr(value, 'shape', (values.numel(),)))} "
                                f"({values.numel()} values) but the step's {flat.n_datums} datums have "
                                f"{flat.counted.numel()} positions in all; give [B], [B, 1] or [B, T] advantages")
            return _row_values(values, flat, key, step.say)
        return values.masked_fill(values.isnan(), 0.0)  # a new tensor: the caller's is never written
    except _Unusable as problem:
        step.say.warn(f"advantages:{key}", f"KLSampleTrainMonitor: a correction listed (off_policy_mask) needs one "
                 f"advantage per datum: {problem.text}; on such steps its shadow metrics count the sequences as "
                 "masked (they cannot be judged)")
        return torch.full((flat.n_datums,), math.nan, dtype=torch.float64, device=flat.device)


def _on_accelerator(values: torch.Tensor) -> bool:
    """Whether ``values`` sit on an accelerator, where reading them would synchronize the host."""
    return values.device.type != "cpu"


def _no_bools(value: Any, label: str) -> None:
    """``_Unusable`` when ``value`` holds bools (a bool, a bool tensor or array, a list with one)."""
    dtype = getattr(value, "dtype", None)
    if isinstance(value, _BOOLS) or dtype in (torch.bool, np.bool_):
        raise _Unusable("", f"{label} holds bools ({f'dtype {dtype}' if dtype is not None else repr(value)}), "
                        "not numbers")
    found = [item for item in value if isinstance(item, _BOOLS)] if isinstance(value, (list, tuple)) else []
    if found:
        raise _Unusable("", f"{label} holds bools ({found[0]!r} at index {list(value).index(found[0])}), not numbers")


def _row_values(positions: torch.Tensor, flat: FlatBatch, key: str, say: RunWarnings) -> torch.Tensor:
    """Each row's value of the per-position ``positions`` on its counted tokens (0 without any): their mean,
    with one warning per run naming the first datum where they differ (one host read)."""
    counted, n = flat.counted, flat.n_datums
    rows = torch.repeat_interleave(torch.arange(n, device=flat.device), flat.row_lengths, output_size=counted.numel())
    zeros = torch.zeros(n, dtype=torch.float64, device=flat.device)
    mean = zeros.index_add(0, rows, positions.masked_fill(~counted, 0.0)) / zeros.index_add(
        0, rows, counted.to(torch.float64)).clamp(min=1.0)
    high = torch.full_like(mean, -math.inf).scatter_reduce(0, rows, positions.masked_fill(~counted, -math.inf), "amax")
    low = torch.full_like(mean, math.inf).scatter_reduce(0, rows, positions.masked_fill(~counted, math.inf), "amin")
    differ = torch.nonzero(high > low)
    if differ.numel():
        i = int(differ[0, 0])
        say.warn("advantages_differ_in_a_row", f"KLSampleTrainMonitor: datum {i}'s per-token {key!r} differ on its "
                 f"counted tokens ({float(low[i]):.4g} to {float(high[i]):.4g}); the corrections read each row's mean "
                 f"({float(mean[i]):.4g} here) as its advantage")
    return mean


def _read(step: Any, name: str, flat: FlatBatch, *, labels_refused: str | None = None
          ) -> torch.Tensor | list[str] | None:
    """The per-datum key ``name`` as given: an int64 ``[B]`` tensor or a list of string labels (unless
    ``labels_refused`` says why labels cannot be); ``None`` when absent, or (one warning per run and problem)
    when it cannot be one integer per datum."""
    n = flat.n_datums
    try:
        value = _given(step, name, n, flat.device)
        if isinstance(value, list) and labels_refused is not None:
            raise _Unusable("labels", f"{step.label(name)} {labels_refused}, got labels (datum 0: {value[0]!r})")
        return value if value is None or isinstance(value, list) else _integers(value, step.label(name))
    except _Unusable as problem:
        step.say.warn(f"{name}:{problem.kind}", _unusable_message(problem.text, name, n, given=problem.given))
        return None


def _given(step: Any, name: str, n: int, device: torch.device) -> torch.Tensor | list[str] | None:
    label, value, data = step.label(name), step.get(name), step.data
    given = _described(value)
    if value is None and data is not None:
        fields = [datum_loss_fn_inputs(datum, index=i) for i, datum in enumerate(data)]
        has = [step.keys[name] in inputs for inputs in fields]
        if any(has) and not all(has):
            raise _Unusable("some_datums", f"{label}: datum {has.index(True)} has it in loss_fn_inputs but datum "
                            f"{has.index(False)} does not")
        if any(has):
            value = [_one_value(inputs[step.keys[name]], f"datum {i}'s {label}") for i, inputs in enumerate(fields)]
            given = f"a one-value field of each of the {len(data)} datums"
    if value is None:
        place = step.given_as_none(name)
        if place is not None:
            raise _Unusable("none", f"{label} is None in {place}")
        return None
    value = _as_row(value)
    if isinstance(value, (list, tuple)):
        nones = [i for i, item in enumerate(value) if item is None]
        if nones:
            raise _Unusable("none", f"{label} is None at datum {nones[0]} ({len(nones)} of the {len(value)} values)",
                            given)
        bools = [i for i, item in enumerate(value) if isinstance(item, _BOOLS)]
        if bools:
            raise _Unusable("dtype", f"{label} must hold integers, got bools (datum {bools[0]}: {value[bools[0]]!r})",
                            given)
        labels = [isinstance(item, str) for item in value]
        if any(labels) and not all(labels):
            raise _Unusable("mixed", f"{label} must be one int (or one string label) per datum, got {list(value)[:8]}")
        if any(labels):
            if len(value) != n:
                raise _Unusable("count", f"{label} has {len(value)} labels for {n} datums", given)
            return list(value)
    values = _row(value, label, given, n)
    if values.dtype == torch.bool:
        raise _Unusable("dtype", f"{label} must hold integers, got bools (dtype torch.bool)", given)
    if values.numel() != n:
        raise _Unusable("count", f"{label} has {values.numel()} values for {n} datums", given)
    if _on_accelerator(values):  # int ids stay where the batch is, unread; other values are checked on the host
        try:
            values = values.to(device if not (values.is_floating_point() or values.is_complex()) else "cpu")
        except (RuntimeError, NotImplementedError) as error:  # the meta device: no values to copy
            raise _Unusable("device", f"{label} cannot be read from the {values.device} device ({error})", given)
    return values


def _one_value(field: Any, where: str) -> Any:
    """A datum's one-value field as a scalar (a string label or a bool as it is); ``_Unusable`` otherwise."""
    if field is None:
        raise _Unusable("none", f"{where} is None")
    if isinstance(field, (list, tuple)) and len(field) == 1:
        if field[0] is None:
            raise _Unusable("none", f"{where} is [None]")
        field = field[0] if isinstance(field[0], (str, *_BOOLS)) else field
    if isinstance(field, (str, *_BOOLS)):
        return field
    shape, given = _shape_of(_as_row(field)), _described(field)
    if shape is not None and len(shape) == 1 and shape[0] > 1:  # said as a count before labels fail to convert
        raise _Unusable("count", f"{where} holds {shape[0]} values ({given})")
    row = _row(_as_row(field), where, given, 1)
    if row.numel() != 1:  # a kind without a shape
        raise _Unusable("count", f"{where} holds {row.numel()} values ({given})")
    return row.reshape(()).item()


def _row(value: Any, label: str, given: str, n: int) -> torch.Tensor:
    """``value`` as a detached 1-D tensor; ``_Unusable`` when it is not 1-D, is empty where ``n`` > 0 values are due,
    or cannot be read (``given``: what it is, for the message)."""
    shape = _shape_of(value)
    if shape is not None and len(shape) != 1:
        raise _Unusable("shape", f"{label} is {given}")
    if shape is not None and shape[0] == 0 != n:
        raise _Unusable("empty", f"{label} is empty ({given})")
    try:
        return field_to_tensor(value, where=label).detach()
    except (TypeError, ValueError) as error:
        raise _Unusable("unreadable", str(error)) from None


def _integers(values: torch.Tensor, key: str) -> torch.Tensor:
    """``values`` as int64 when each is an integer (a float with an integer value, within int64's range);
    ``_Unusable`` naming a datum otherwise. ``key`` is the key as said."""
    if values.is_complex():
        raise _Unusable("dtype", f"{key} must hold integers, got dtype {values.dtype}")
    if values.is_floating_point():
        bad = torch.nonzero(~torch.isfinite(values) | (values != values.round()) | (values.abs() >= 2.0**63))
        if bad.numel():
            i = int(bad[0, 0])
            raise _Unusable("not_integer", f"{key} must hold integers, got {float(values[i])} at datum {i}")
    return values.to(torch.int64)


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

    Examples:
        >>> _described(torch.zeros(3, 1))
        'a tensor of shape (3, 1) and dtype torch.float32'
    """
    if value is None:
        return "None"
    if isinstance(value, _BOOLS):
        return f"a bool ({value!r})"
    kind = {torch.Tensor: "tensor", np.ndarray: "numpy array"}.get(type(value), type(value).__name__)
    shape, dtype = _shape_of(value), getattr(value, "dtype", None)
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
