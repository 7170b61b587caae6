"""``FlatBatch``: a batch's positions, datum after datum, on one device: the one form the statistics read.

``flatten_datums`` reads Loops / Tinker datums (sampler ``logprobs``, ``mask``, optional
``advantages`` and ``target_tokens`` in ``loss_fn_inputs``) and the trainer's logprobs (one row
per datum, or one right-padded ``[B, T]`` tensor); ``flatten_padded`` reads right-padded
``[B, T]`` tensors. Nothing is truncated: a datum whose fields differ in length is the alignment
bug these numbers exist to catch, so it is a ``ValueError`` naming the datum, the keys and the
lengths. Nothing here waits for the device.

The masks, named once (bool per position):

* ``masked_in``: mask > 0;
* ``counted``: masked in, with a non-zero advantage where advantages are given (NaN reads as 0);
* ``active``: counted, with both logprobs finite: the **action tokens** every number is over.

``counted & ~active`` are the tokens skipped for a missing or non-finite logprob
(``n_skipped_nonfinite``); ``advantage_nan`` marks the masked-in positions whose advantage is NaN.

A mask is 0/1 (or bools, or weights >= 0): a negative or NaN value would drop its token without a
word, so it is a ``ValueError`` naming the datum (or row), the position and how many there are. A
mask on the CPU is checked as it is read; one on an accelerator is not read here (that would wait for
the device): ``mask_refused`` marks its refused positions, counted with the step's statistics and
refused after the step's one host transfer (``report.step_report``).

Examples:
    >>> from loops_callbacks.types import Datum, ModelInput
    >>> datum = Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [None, -1.0, -2.0], "mask": [0.0, 1.0, 1.0]})
    >>> flat = flatten_datums([datum], [torch.tensor([0.0, -1.5, -2.0])])
    >>> flat.active.tolist(), flat.diff.tolist()
    ([False, True, True], [nan, -0.5, 0.0])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from loops_callbacks.fields import (
    datum_loss_fn_inputs,
    datum_model_input,
    field_length,
    field_to_tensor,
    model_input_length,
    model_input_tokens,
)
from loops_callbacks.validation import check_logprobs_dtype

LOGPROB_FLOOR = -1e4
"""A logprob below this (e.g. ``torch.finfo(torch.float32).min``) is a sentinel, not a probability."""
NO_TOKEN = -1
CONTEXT_BEFORE = 40
"""Ids shown before a worst token's ``model_input[k + 1]``, as the Loops SDK shows them."""
CONTEXT_AFTER = 1 + 20
"""``model_input[k + 1]`` (the context's centre), then the SDK's 20 ids after it."""
_PER_DATUM = ("row_lengths", "tokens", "lags", "groups", "servers", "datum_advantages", "sampler_prompts",
              "first_tokens", "prompt_starts")


@dataclass(frozen=True)
class FlatBatch:
    """All positions of a batch, concatenated datum after datum (module docstring for the masks).

    ``tokens`` looks up the worst tokens' ids (``PaddedTokens`` / ``DatumTokens``); ``token_ids`` is
    the id predicted at each position (< 0: unknown), for the diagnosis' per-token-id sums; ``entropy``
    and ``varentropy`` are the trainer's, for the check of what was sampled; ``lags``, ``groups`` and
    ``datum_advantages`` hold one value per datum (``per_datum``). ``None``: not given or not read.
    """

    sampler: torch.Tensor  # [L], the caller's dtype
    trainer: torch.Tensor  # [L], the caller's dtype
    diff: torch.Tensor  # float64 [L], trainer - sampler (non-finite where a logprob is missing)
    masked_in: torch.Tensor
    counted: torch.Tensor
    active: torch.Tensor
    row_lengths: torch.Tensor  # int64 [B]
    advantage_nan: torch.Tensor | None = None
    tokens: PaddedTokens | DatumTokens | None = None
    token_ids: torch.Tensor | None = None  # int64 [L]
    entropy: torch.Tensor | None = None  # [L]
    varentropy: torch.Tensor | None = None  # [L]
    lags: torch.Tensor | None = None  # int64 [B]: the trainer's optimizer step minus the datum's policy version
    groups: torch.Tensor | None = None  # int64 [B], >= 0 (max_groups: group_other)
    servers: torch.Tensor | None = None  # int64 [B]: the slot of the server that sampled the datum (< 0: unknown)
    datum_advantages: torch.Tensor | None = None  # float64 [B]; NaN: unusable
    mask_refused: torch.Tensor | None = None  # bool [L]: mask < 0 or NaN, where it was not read (an accelerator)
    # the prompts' comparison (``prompts``): the sampler's prompts, the trainer's id predicted at each position and
    # at each datum's position 0 (< 0: unknown), and where each datum's prompt starts (0 for a list of Datum, the
    # first position of ``attention_mask``; ``None``: a padded row's left padding is not marked)
    sampler_prompts: torch.Tensor | None = None  # int64 [B, P], left-padded with -1
    prompt_tokens: torch.Tensor | None = None  # int64 [L]
    first_tokens: torch.Tensor | None = None  # int64 [B]
    prompt_starts: torch.Tensor | None = None  # int64 [B]

    @property
    def n_datums(self) -> int:
        return int(self.row_lengths.numel())

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def datum_chunks(self, positions: int) -> Iterator[FlatBatch]:
        """Consecutive whole-datum slices (views) of about ``positions`` positions each; the batch itself when small.

        A chunk ends with the first datum that reaches a multiple of ``positions``, so a datum is
        never split. Reads the row lengths on the host: for the CPU, where that is free.

        Examples:
            >>> flat = flatten_padded(sampler_logprobs=torch.zeros(3, 4), training_logprobs=torch.zeros(3, 4),
            ...                       mask=torch.ones(3, 4))
            >>> [chunk.n_datums for chunk in flat.datum_chunks(5)]
            [2, 1]
        """
        ends = torch.cumsum(self.row_lengths, 0)
        total = int(ends[-1]) if ends.numel() else 0
        if total <= positions:
            yield self
            return
        cuts = torch.searchsorted(ends, torch.arange(positions, total, positions), right=False) + 1
        first = start = 0
        for end in torch.unique_consecutive(torch.cat([cuts, torch.tensor([self.n_datums])])).tolist():
            stop = int(ends[end - 1])
            yield FlatBatch(**{
                field.name: _cut(getattr(self, field.name), (first, end) if field.name in _PER_DATUM else (start, stop))
                for field in dataclasses.fields(self)
            })
            first, start = end, stop


def _cut(value: Any, bounds: tuple[int, int]) -> Any:
    if value is None or isinstance(value, bool):
        return value
    return value.rows(*bounds) if isinstance(value, (PaddedTokens, DatumTokens)) else value[bounds[0] : bounds[1]]


@torch.no_grad()
def flatten_datums(
    data: Sequence[Any],
    training_logprobs: Sequence[Any] | torch.Tensor,
    *,
    with_tokens: bool = False,
    diagnose: bool = True,
    advantages_key: str = "advantages",
) -> FlatBatch:
    """Flatten Loops / Tinker datums and the trainer's per-datum logprobs (module docstring).

    ``training_logprobs``: one row per datum (tensors, arrays, lists or ``TensorData``), or one
    right-padded ``[B, T]`` tensor; ``diagnose`` reads what the diagnosis needs (the predicted ids, ``FlatBatch.token_ids``);
    ``advantages_key`` names the ``loss_fn_inputs`` field of the advantages.
    """
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a list of Datum, got {type(data).__name__}")
    padded = isinstance(training_logprobs, torch.Tensor)
    if padded and training_logprobs.dim() != 2:
        raise ValueError(
            f"training_logprobs as one tensor must be padded [B, T], got shape {tuple(training_logprobs.shape)}; "
            "or pass a list with one 1-D row per datum"
        )
    check_logprobs_dtype("training_logprobs", training_logprobs if padded else None)
    n_rows = training_logprobs.shape[0] if padded else len(training_logprobs)
    if len(data) != n_rows:
        raise ValueError(
            f"len(data) = {len(data)} but training_logprobs has {n_rows} rows; "
            "pass one row of trainer logprobs per datum, in the same order"
        )
    samplers, masks, trainers, advantages, lengths, token_rows = [], [], [], [], [], []
    for i, datum in enumerate(data):
        inputs = datum_loss_fn_inputs(datum, index=i)
        for key, fix in (("logprobs", "attach the sampler's per-position logprobs when building the datum"),
                         ("mask", "add a per-position mask with 1.0 on action tokens")):
            if key not in inputs:
                raise ValueError(f"datum {i}: loss_fn_inputs has no {key!r} (keys: {sorted(inputs)}); {fix}")
        sampler = check_logprobs_dtype(f"datum {i}: loss_fn_inputs['logprobs']",
                                       field_to_tensor(inputs["logprobs"], where=f"datum {i}, key 'logprobs'"))
        mask = field_to_tensor(inputs["mask"], where=f"datum {i}, key 'mask'")
        length = sampler.shape[0]
        if not padded:
            trainer = field_to_tensor(training_logprobs[i], where=f"datum {i}, training logprobs")
            trainers.append(check_logprobs_dtype(f"training_logprobs[{i}]", trainer))
        model_input, target = datum_model_input(datum), inputs.get("target_tokens")
        trainer_length = min(length, training_logprobs.shape[1]) if padded else trainers[-1].shape[0]
        input_length = length if model_input is None else model_input_length(model_input)
        target_length = length if target is None else field_length(target, where=f"datum {i}, key 'target_tokens'")
        if not length == mask.shape[0] == trainer_length == input_length == target_length:
            given = {"loss_fn_inputs['mask']": mask.shape[0], f"training_logprobs[{i}]": trainer_length,
                     "model_input": None if model_input is None else input_length,
                     "loss_fn_inputs['target_tokens']": None if target is None else target_length}
            raise ValueError(
                f"datum {i}: lengths differ: loss_fn_inputs['logprobs'] has {length}, "
                + ", ".join(f"{name} has {n}" for name, n in given.items() if n is not None)
                + "; every per-position field must have the datum's length (position k of each belongs to the token "
                "predicted at k; nothing is truncated: a mismatch means sampler and trainer positions are misaligned)"
            )
        advantage = inputs.get(advantages_key)
        if advantage is not None:
            advantage = field_to_tensor(advantage, where=f"datum {i}, key {advantages_key!r}")
            if advantage.shape[0] not in (1, length):
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{advantages_key!r}] has length {advantage.shape[0]}, "
                    f"expected 1 (one value for the row) or {length} (one per position)"
                )
            advantage = advantage.expand(length)
        if diagnose:
            token_rows.append(_predicted_ids(target, model_input, length, where=f"datum {i}"))
        samplers.append(sampler)
        masks.append(mask)
        advantages.append(advantage)
        lengths.append(length)
    device = next((t.device for t in ([training_logprobs] if padded else trainers[:1]) + samplers[:1]
                   if t.device.type != "cpu"), torch.device("cpu"))
    row_lengths = torch.tensor(lengths, dtype=torch.int64)
    trainer = _unpad_rows(training_logprobs.detach(), row_lengths) if padded else _cat(trainers)
    advantage = None
    if any(a is not None for a in advantages):  # a datum without advantages counts all its masked-in tokens
        advantage = _cat([torch.ones(n) if a is None else a for a, n in zip(advantages, lengths)]).to(device)
    return _build(
        _cat(samplers).to(device), trainer.to(device), _cat(masks), advantage, row_lengths.to(device),
        rows="datum", device=device, tokens=DatumTokens(data) if with_tokens else None,
        token_ids=_cat(token_rows).to(device, torch.int64) if diagnose else None,
    )


@torch.no_grad()
def flatten_padded(
    *,
    sampler_logprobs: torch.Tensor,
    training_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    target_tokens: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    with_tokens: bool = False,
    training_entropy: torch.Tensor | None = None,
    training_varentropy: torch.Tensor | None = None,
) -> FlatBatch:
    """Flatten right-padded ``[B, T]`` tensors (padding must have ``mask == 0``); shapes must agree exactly.

    ``advantages`` is ``[B, T]`` or ``[B]``; ``training_entropy`` and ``training_varentropy`` come together.
    """
    if (training_entropy is None) != (training_varentropy is None):
        given, missing = ("training_entropy", "training_varentropy")[:: 1 if training_varentropy is None else -1]
        raise ValueError(f"{given!r} is given without {missing!r}: the check of what was sampled needs both")
    fields = {"logprobs": sampler_logprobs, "training_logprobs": training_logprobs, "mask": mask,
              "target_tokens": target_tokens, "input_ids": input_ids, "training_entropy": training_entropy,
              "training_varentropy": training_varentropy}
    for i, (name, tensor) in enumerate(fields.items()):
        if (tensor is not None or i < 3) and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} must be a [B, T] tensor, got {type(tensor).__name__}")
        if i < 3 and tensor.dim() != 2:  # the three fields every batch has
            raise ValueError(f"{name!r} must be a [B, T] tensor, got shape {tuple(tensor.shape)}")
    shape = training_logprobs.shape
    for name in ("logprobs", "training_logprobs", "training_entropy", "training_varentropy"):
        check_logprobs_dtype(repr(name), fields[name])
    for name, tensor in fields.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(
                f"{name!r} has shape {tuple(tensor.shape)} but 'training_logprobs' has {tuple(shape)}; "
                "sampler and trainer fields must be aligned position by position"
            )
    (batch, width), device = shape, training_logprobs.device
    if advantages is not None:
        if not isinstance(advantages, torch.Tensor):
            raise TypeError(f"'advantages' must be a tensor, got {type(advantages).__name__}")
        if advantages.dim() == 1 and advantages.shape[0] == batch:
            advantages = advantages[:, None]
        elif advantages.shape != shape:
            raise ValueError(f"'advantages' has shape {tuple(advantages.shape)}; expected {tuple(shape)} or ({batch},)")
        advantages = advantages.detach().to(device).expand(batch, width).reshape(-1)
    token_ids = None
    if target_tokens is not None:
        token_ids = target_tokens.detach().reshape(-1).to(device, torch.int64)
    elif input_ids is not None:
        ids = input_ids.detach().to(device, torch.int64)
        token_ids = torch.cat([ids[:, 1:], ids.new_full((batch, min(width, 1)), NO_TOKEN)], dim=1).reshape(-1)
    entropy, varentropy = (None if x is None else x.detach().reshape(-1).to(device)
                           for x in (training_entropy, training_varentropy))
    return _build(
        sampler_logprobs.detach().reshape(-1).to(device), training_logprobs.detach().reshape(-1),
        mask.detach().reshape(-1), advantages, torch.full((batch,), width, dtype=torch.int64, device=device),
        rows="row", device=device, tokens=PaddedTokens(input_ids, target_tokens, device) if with_tokens else None,
        token_ids=token_ids, entropy=entropy, varentropy=varentropy,
    )


def _build(
    sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor | None,
    row_lengths: torch.Tensor, *, rows: str, device: torch.device, **optional: Any,
) -> FlatBatch:
    # d = trainer - sampler in float64 (each value widened exactly). A float64 difference of two
    # logprobs is finite exactly when both are (float32 inputs cannot overflow it).
    diff = trainer.to(torch.float64, copy=True).sub_(sampler.to(torch.float64))  # same-dtype sub_ is vectorized
    refused = _refused_mask(mask, row_lengths, rows)  # None: none, or checked already (the CPU)
    mask = mask.to(device)
    masked_in = mask > 0
    counted, nan = masked_in, None
    if advantage is not None:
        nan = torch.isnan(advantage)
        counted = masked_in & (advantage != 0) & ~nan
        nan &= masked_in
    active = counted & (diff.abs() < float("inf"))  # isfinite, in fewer passes
    return FlatBatch(sampler, trainer, diff, masked_in, counted, active, row_lengths, nan,
                     mask_refused=None if refused is None else refused.to(device), **optional)


def _refused_mask(mask: torch.Tensor, row_lengths: torch.Tensor, rows: str) -> torch.Tensor | None:
    """The positions whose mask is negative or NaN: on the CPU a ``ValueError`` naming the first (its ``rows``,
    "datum" or "row", and position) and how many there are; elsewhere, where reading them would wait for the
    device, a bool tensor of them for the step's statistics to count. ``None``: nothing to refuse (bools, or
    checked)."""
    if mask.dtype == torch.bool:
        return None
    refused = ~(mask >= 0) if mask.is_floating_point() or mask.is_complex() else mask < 0
    if mask.device.type != "cpu":
        return refused
    if not bool(refused.any()):
        return None
    first, count = int(refused.nonzero()[0, 0]), int(refused.sum())
    ends = torch.cumsum(row_lengths.cpu(), 0)
    row = int(torch.searchsorted(ends, first, right=True))
    position = first - (int(ends[row - 1]) if row else 0)
    where = f"datum {row}, key 'mask': position" if rows == "datum" else f"'mask': row {row}, position"
    value = mask[first].item()
    shown = f"{value:g}" + (" (None in a list reads as NaN)" if rows == "datum" and math.isnan(value) else "")
    raise ValueError(
        f"{where} {position} is {shown}, not a mask value; {count} such value{'s' * (count != 1)} in all. "
        "A mask is 1.0 on the action tokens and 0.0 elsewhere (or bools, or weights >= 0): a negative or NaN value "
        "would drop its token without a word"
    )


def _predicted_ids(target: Any, model_input: Any, length: int, *, where: str) -> torch.Tensor:
    """Int64 ``[length]``: ``target_tokens``, else ``model_input[k + 1]``, else ``NO_TOKEN``."""
    if target is not None:
        return field_to_tensor(target, where=f"{where}, key 'target_tokens'").to(torch.int64)
    ids = torch.full((length,), NO_TOKEN, dtype=torch.int64)
    if model_input is not None and length > 1:
        given = model_input if isinstance(model_input, torch.Tensor) else torch.tensor(model_input_tokens(model_input))
        ids[: length - 1] = given[1:length].to(torch.int64)
    return ids


def _unpad_rows(padded: torch.Tensor, row_lengths: torch.Tensor) -> torch.Tensor:
    """Each row of a right-padded ``[B, T]`` tensor cut to its (host) length, concatenated; no device sync."""
    batch, width = padded.shape
    total = int(row_lengths.sum())
    shift = torch.repeat_interleave(torch.arange(batch) * width - (torch.cumsum(row_lengths, 0) - row_lengths),
                                    row_lengths, output_size=total)
    return padded.reshape(-1).index_select(0, (torch.arange(total) + shift).to(padded.device))


def _cat(rows: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of the rows (type promotion as ``torch.cat``); mixed devices meet on the CPU."""
    if not rows:
        return torch.zeros(0, dtype=torch.float64)
    if any(row.device != rows[0].device for row in rows):
        rows = [row.cpu() for row in rows]
    return torch.cat(rows)


class PaddedTokens:
    """The worst tokens' ids from right-padded ``[B, T]`` ``input_ids`` / ``target_tokens`` (either may be
    ``None``), gathered on their device.

    For position k of a datum the token is ``target_tokens[k]``, else ``model_input[k + 1]``, else
    ``NO_TOKEN``; the context is ``model_input`` alone, as in the Loops SDK: ``CONTEXT_BEFORE`` ids
    before index k + 1, then ``CONTEXT_AFTER`` from it (``NO_TOKEN`` past the datum's end).

    Examples:
        >>> lookup = PaddedTokens(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[7, 7, 7, 7]]), torch.device("cpu"))
        >>> token, before, after = lookup.lookup(torch.tensor([0, 0]), torch.tensor([1, 3]))
        >>> token.tolist(), before[:, -2:].tolist(), after[:, :2].tolist()
        ([7, 7], [[1, 2], [3, 4]], [[3, 4], [-1, -1]])
    """

    def __init__(self, input_ids: torch.Tensor | None, target_tokens: torch.Tensor | None, device: torch.device):
        self.input_ids, self.target_tokens = (None if x is None else x.detach().to(device) for x in (input_ids,
                                                                                                    target_tokens))

    def rows(self, first: int, end: int) -> PaddedTokens:
        cut = [None if x is None else x[first:end] for x in (self.input_ids, self.target_tokens)]
        return PaddedTokens(*cut, self.input_ids.device if self.input_ids is not None else torch.device("cpu"))

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token [r]``, ``before [r, CONTEXT_BEFORE]``, ``after [r, CONTEXT_AFTER]`` (int64, ``NO_TOKEN``: none)."""
        columns = position[:, None] + 1 + torch.arange(-CONTEXT_BEFORE, CONTEXT_AFTER, device=position.device)
        window = torch.full_like(columns, NO_TOKEN) if self.input_ids is None else _take(self.input_ids, datum, columns)
        token = window[:, CONTEXT_BEFORE] if self.target_tokens is None else _take(self.target_tokens, datum, position)
        return token, window[:, :CONTEXT_BEFORE], window[:, CONTEXT_BEFORE:]


class DatumTokens:
    """The worst tokens' ids read from the chosen datums' ``model_input`` and ``target_tokens`` (on the host: a
    few rows), padded with ``NO_TOKEN`` and looked up as ``PaddedTokens`` looks them up."""

    def __init__(self, data: Sequence[Any]) -> None:
        self.data = data

    def rows(self, first: int, end: int) -> DatumTokens:
        return DatumTokens(self.data[first:end])

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, predicted = [], []
        for i in datum.tolist():  # one per table row
            model_input = datum_model_input(self.data[i])
            ids = torch.tensor(model_input_tokens(model_input) if model_input is not None else [], dtype=torch.int64)
            target = datum_loss_fn_inputs(self.data[i], index=i).get("target_tokens")
            inputs.append(ids)
            predicted.append(_predicted_ids(target, ids, ids.shape[0], where=f"datum {i}"))
        padded = [pad_sequence(rows, batch_first=True, padding_value=NO_TOKEN) for rows in (inputs, predicted)]
        chosen = torch.arange(len(inputs), device=datum.device)  # row r of the padded ids is datum[r]
        return PaddedTokens(*padded, datum.device).lookup(chosen, position)


def _take(tokens: torch.Tensor, row: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``tokens[row, column]`` as int64, ``NO_TOKEN`` where the column is outside the row."""
    if row.dim() < column.dim():
        row = row[:, None]
    inside = (column >= 0) & (column < tokens.shape[1])
    values = tokens[row, column.clamp(0, max(tokens.shape[1] - 1, 0))] if tokens.shape[1] else torch.zeros_like(column)
    return torch.where(inside, values.to(torch.int64), NO_TOKEN)
