"""The prompt the sampler saw, against the prompt the trainer scored: ``sampler_prompt_ids``.

A step may carry the sampler's prompt token ids under ``sampler_prompt_ids`` (the output first, then the batch):
a list of one 1-D sequence of ids per datum (lists, tuples, tensors), or an int ``[B, P]`` tensor padded on the
LEFT with negative values (-1); a list of Datum may instead carry each prompt in its ``loss_fn_inputs``. A wrong kind is a ``TypeError``; a count that is not the micro-batch's datums, a
negative, fractional or non-finite id, or (on the CPU) padding after an id is a ``ValueError`` naming the datum (or
row), the position and the lengths. An int tensor on an accelerator is used where it is, unread: a negative id
inside its rows reads as an id no trainer token has.

The trainer's prompt of a datum is what it scored before its first masked-in position k0 (the completion's first
token is the one predicted at k0): the input ids at positions 0 to k0. Ids 1 to k0 are the tokens predicted at
positions 0 to k0 - 1 (``input_ids[1:]``, else ``target_tokens``, for a list of Datum ``model_input[1:]``, else
``target_tokens``); the id at position 0 is known only from ``input_ids`` or ``model_input`` (without them it is
not compared). The two prompts are compared right-aligned (both end right before the completion), over the
positions both know (an id < 0, such as -100 in labels, is unknown); a datum differs where an id differs or, as
far as the lengths are knowable, where the lengths do: the trainer's prompt shorter than the sampler's (a BOS the
trainer lacks, a missing system prompt) always; longer (the sampler's BOS dropped, a second BOS in the trainer's)
where each prompt's start is known: a list of Datum, whose rows hold no padding, or padded ``[B, T]`` rows with an
``attention_mask`` (``[B, T]`` or ``[B, T + 1]``, nonzero on real tokens: the prompt starts at its first). Without
it a padded row may begin with left padding nothing marks, so tokens the trainer has before the sampler's prompt
are not seen. Datums without masked-in positions, or whose sampler prompt is empty, are not compared.

Each micro-batch keeps three states (``states.PROMPTS``): how many datums were compared and how many differ, sums;
and ``prompt_first``, a maximum: the first differing datum's index, the position of the difference counted
in the sampler's prompt (the last that differs, right-aligned: the prompts agree after it; where no id differs, the
last id a shorter trainer prompt lacks), both lengths and ``PROMPT_CONTEXT`` ids of each prompt around it, every entry stored as
``-datum * PROMPT_SCALE + value + 1`` so that the elementwise maximum is one record, the earliest datum's, once
micro-batches and ranks renumber their datums (``Layout.renumbered``). The host decodes it (``prompt_finding``).

Examples:
    >>> read_sampler_prompts([[1, 2, 3], [4]], 2, device=torch.device("cpu")).tolist()
    [[1, 2, 3], [-1, -1, 4]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from loops_callbacks.divergence.flat_batch import NO_TOKEN, FlatBatch, flatten_padded
from loops_callbacks.fields import (
    datum_loss_fn_inputs, datum_model_input, field_length, field_to_tensor, model_input_tokens,
)

PROMPT_CONTEXT = 8
"""Ids of each prompt kept around the difference: ``PROMPT_CONTEXT // 2`` before it, the rest from it (a rank's
header carries the record: 8 bytes an entry per rank)."""
PROMPT_SCALE = float(2**24)
"""A record entry is ``-datum * PROMPT_SCALE + value + 1``: values (ids, positions, lengths) below 2**24 - 1, datums
below 2**29 stay exact in float64; a larger id is shown as unknown (the comparison itself reads every id)."""
RECORD = ("datum", "position", "sampler_length", "trainer_length")
PROMPT_RECORD = len(RECORD) + 2 * PROMPT_CONTEXT
"""The entries of ``prompt_first``: ``RECORD``, then the sampler's context ids, then the trainer's."""
_NONE = 2**62  # "no position": larger than any position


def read_sampler_prompts(value: Any, n_datums: int, *, device: torch.device, key: str = "'sampler_prompt_ids'"
                         ) -> torch.Tensor:
    """Int64 ``[B, P]`` sampler prompts, left-padded with -1, on ``device`` (module docstring for the forms)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{key} is a {value.dtype} tensor; expected token ids: an int [B, P] tensor padded on the "
                            "left with -1, or one list of ids per datum")
        if value.dim() != 2 or value.shape[0] != n_datums:
            raise ValueError(f"{key} has shape {tuple(value.shape)}; expected [{n_datums}, P] (one left-padded row "
                             f"per datum of the micro-batch's {n_datums}), or one list of ids per datum")
        ids = value.detach().to(torch.int64)
        if ids.device.type == "cpu":
            _check_left_padded(ids, key)
        return ids.to(device)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{key} is a {type(value).__name__}; expected one list of ids per datum (or an int [B, P] "
                        "tensor padded on the left with -1)")
    if len(value) != n_datums:
        raise ValueError(f"{key} holds {len(value)} prompts for a micro-batch of {n_datums} datums; expected one per "
                         "datum, in the batch's order")
    rows = [_prompt_row(row, f"{key}, datum {i}") for i, row in enumerate(value)]
    if not rows:
        return torch.zeros(0, 0, dtype=torch.int64, device=device)
    flipped = pad_sequence([row.flip(0) for row in rows], batch_first=True, padding_value=NO_TOKEN)
    return flipped.flip(1).to(device)


def datum_prompts(data: Sequence[Any], key: str) -> list[Any] | None:
    """Each datum's ``loss_fn_inputs[key]`` when the datums carry their prompts there (``None``: none does); a
    ``ValueError`` naming the datums without one when only some do."""
    fields = [datum_loss_fn_inputs(datum, index=i).get(key) for i, datum in enumerate(data)]
    given = [i for i, field in enumerate(fields) if field is not None]
    if not given:
        return None
    if len(given) < len(fields):
        missing = [i for i, field in enumerate(fields) if field is None]
        shown = ", ".join(map(str, given[:8])) + (", ..." if len(given) > 8 else "")
        raise ValueError(
            f"datum {missing[0]} has no loss_fn_inputs[{key!r}] (datums {shown} have one; {len(missing)} of "
            f"{len(fields)} have none): give every datum its sampler prompt, or none")
    return fields


def _prompt_row(row: Any, where: str) -> torch.Tensor:
    """One datum's ids as int64, or the error naming the datum and position."""
    if isinstance(row, (str, bytes)) or (isinstance(row, torch.Tensor) and row.dim() != 1):
        raise TypeError(f"{where}: expected a 1-D sequence of token ids, got "
                        f"{type(row).__name__ if not isinstance(row, torch.Tensor) else f'shape {tuple(row.shape)}'}")
    tensor = field_to_tensor(row, where=where)
    if tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise TypeError(f"{where}: holds {tensor.dtype} values, not token ids")
    if isinstance(row, torch.Tensor) and tensor.dtype.is_floating_point:
        raise TypeError(f"{where}: is a {tensor.dtype} tensor; token ids are ints")
    values = tensor.detach().cpu()
    if values.dtype.is_floating_point:
        bad = ~torch.isfinite(values) | (values != values.round()) | (values < 0)
    else:
        bad = values < 0
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where}: position {position} of {values.numel()} is {values[position].item()!r}, not a "
                         "token id (an int >= 0); give each prompt's ids without padding")
    return values.to(torch.int64)


def _check_left_padded(ids: torch.Tensor, key: str) -> None:
    """A ``ValueError`` naming the row and position of a negative id after the row's first id."""
    known = ids >= 0
    started = torch.cumsum(known.to(torch.int64), 1) > 0
    after = started & ~known
    if bool(after.any()):
        row, position = (int(i) for i in after.nonzero()[0])
        first = int(known[row].to(torch.int64).argmax())
        raise ValueError(
            f"{key}: row {row}, position {position} is {int(ids[row, position])} after the prompt's first id at "
            f"position {first} (row of {ids.shape[1]}); pad the rows on the left with -1 (the prompts end at the "
            "right edge, where the completion starts)")


def prompt_starts(attention_mask: Any, flat: FlatBatch, key: str = "'attention_mask'") -> torch.Tensor | None:
    """Int64 ``[B]``: where each padded row's prompt starts, its first position with ``attention_mask`` nonzero
    (``T``: a row without any); ``None`` without a mask. A mask that is not a ``[B, T]`` or ``[B, T + 1]`` tensor
    is a ``TypeError`` / ``ValueError`` naming ``key`` and the shapes.

    Examples:
        >>> flat = flatten_padded(sampler_logprobs=torch.zeros(2, 4), training_logprobs=torch.zeros(2, 4),
        ...                       mask=torch.ones(2, 4))
        >>> prompt_starts(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), flat).tolist()
        [2, 0]
    """
    if attention_mask is None:
        return None
    width = int(flat.row_lengths[0]) if flat.n_datums else 0  # a padded batch: every row has T positions
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{key} is a {type(attention_mask).__name__}; expected a [B, T] tensor, nonzero on real tokens")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != flat.n_datums or attention_mask.shape[1] not in (
            width, width + 1):
        raise ValueError(f"{key} has shape {tuple(attention_mask.shape)}; expected [{flat.n_datums}, {width}] (the "
                         f"logprobs' [B, T]) or [{flat.n_datums}, {width + 1}] (the whole sequences), nonzero on real "
                         "tokens")
    real = attention_mask.detach().to(flat.device) != 0
    return torch.where(real.any(1), real.to(torch.int8).argmax(1), width).to(torch.int64)


def trainer_tokens(data: Sequence[Any] | None, input_ids: torch.Tensor | None, target_tokens: torch.Tensor | None,
                   flat: FlatBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The trainer's ids for the comparison: int64 ``[L]``, the id predicted at each position (< 0: unknown), and
    int64 ``[B]``, each datum's id at position 0 (-1: unknown); ``(None, None)`` where neither is known. Datums are
    read on the host (their ids are host lists; their lengths were checked by ``flatten_datums``)."""
    device, batch = flat.device, flat.n_datums
    if data is not None:
        predicted, first = [], []
        for i, datum in enumerate(data):  # one per datum: their ids are host lists
            model_input, inputs = datum_model_input(datum), datum_loss_fn_inputs(datum, index=i)
            ids = torch.tensor(model_input_tokens(model_input) if model_input is not None else [], dtype=torch.int64)
            length = field_length(inputs["logprobs"], where=f"datum {i}, key 'logprobs'")  # checked: the row's
            row = torch.full((length,), NO_TOKEN, dtype=torch.int64)
            if ids.numel():
                row[: max(min(ids.numel(), length + 1) - 1, 0)] = ids[1 : length + 1]
                first.append(int(ids[0]))
            else:
                target = inputs.get("target_tokens")
                if target is not None:
                    row = field_to_tensor(target, where=f"datum {i}, key 'target_tokens'").to(torch.int64)
                first.append(NO_TOKEN)
            predicted.append(row)
        tokens = torch.cat(predicted) if predicted else torch.zeros(0, dtype=torch.int64)
        return tokens.to(device), torch.tensor(first, dtype=torch.int64).to(device)
    if input_ids is not None:
        ids = input_ids.detach().to(device, torch.int64)
        tail = ids.new_full((batch, min(ids.shape[1], 1)), NO_TOKEN)
        return torch.cat([ids[:, 1:], tail], dim=1).reshape(-1), (ids[:, 0] if ids.shape[1] else tail[:, 0])
    if target_tokens is not None:
        return target_tokens.detach().reshape(-1).to(device, torch.int64), torch.full(
            (batch,), NO_TOKEN, dtype=torch.int64, device=device)
    return None, None


def prompt_values(flat: FlatBatch) -> dict[str, torch.Tensor]:
    """``n_prompt_datums_compared``, ``n_prompt_datums_differ`` and the ``prompt_first`` record of one chunk (module
    docstring), on the batch's device; zeros and -inf without sampler prompts."""
    device = flat.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    empty = torch.full((PROMPT_RECORD,), -math.inf, dtype=torch.float64, device=device)
    prompts, tokens = flat.sampler_prompts, flat.prompt_tokens
    if prompts is None or tokens is None or flat.n_datums == 0:
        return {"n_prompt_datums_compared": zero, "n_prompt_datums_differ": zero, "prompt_first": empty}
    batch, width = prompts.shape
    lengths = flat.row_lengths.to(device)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    positions = torch.arange(tokens.shape[0], device=device)
    row = torch.searchsorted(ends, positions, right=True).clamp(max=batch - 1)
    in_row = positions - starts.index_select(0, row)
    k0 = torch.full((batch,), _NONE, dtype=torch.int64, device=device).scatter_reduce(
        0, row, torch.where(flat.masked_in, in_row, _NONE), "amin")
    has_completion = k0 < _NONE
    k0 = torch.where(has_completion, k0, 0)
    exact = flat.prompt_starts is not None
    start = flat.prompt_starts.to(device) if exact else torch.zeros_like(k0)
    trainer_length = k0 + 1 - start
    sampler_known = prompts >= 0
    sampler_length = sampler_known.sum(1)

    def trainer_at(columns: torch.Tensor) -> torch.Tensor:
        """The trainer's id at right-aligned ``columns`` [B, K] of the sampler's rows (-1: unknown, -2: none)."""
        index = trainer_length[:, None] - width + columns  # in the trainer's prompt
        at = start[:, None] + index  # in the row
        flat_at = (starts[:, None] + at - 1).clamp(0, max(tokens.shape[0] - 1, 0))
        ids = tokens.index_select(0, flat_at.reshape(-1)).reshape(flat_at.shape) if tokens.numel() else torch.full_like(
            flat_at, NO_TOKEN)
        ids = torch.where(at == 0, flat.first_tokens.to(device)[:, None].expand_as(ids), ids)
        ids = torch.where(ids < 0, NO_TOKEN, ids)
        return torch.where((index < 0) | (index >= trainer_length[:, None]), -2, ids)

    columns = torch.arange(width, device=device).expand(batch, width)
    trainer = trainer_at(columns)
    both = sampler_known & (trainer >= 0)
    mismatch = both & (prompts != trainer)
    sampler_index = columns - (width - sampler_length)[:, None]
    # the last id that differs: the prompts agree from after it to the completion (right-aligned, where a prompt's
    # start may be left padding, this is the one position that does not depend on where each prompt starts)
    last_mismatch = torch.where(mismatch, sampler_index, -1).amax(1) if width else torch.full_like(k0, -1)
    length_differs = trainer_length != sampler_length if exact else trainer_length < sampler_length
    compared = has_completion & (trainer_length > 0) & (sampler_length > 0) & (both.any(1) | length_differs)
    differ = compared & (length_differs | (last_mismatch >= 0))
    # without a differing id: the sampler's last id the trainer's shorter prompt lacks (0 for a dropped BOS), or 0
    missing = (sampler_length - trainer_length - 1).clamp(min=0)
    position = torch.where(last_mismatch >= 0, last_mismatch, missing)
    # the context: PROMPT_CONTEXT // 2 columns before the difference, the rest from it
    centre = position + (width - sampler_length)
    around = centre[:, None] + torch.arange(-(PROMPT_CONTEXT // 2), PROMPT_CONTEXT - PROMPT_CONTEXT // 2,
                                            device=device)
    inside = (around >= 0) & (around < width)
    sampler_context = torch.where(
        inside, prompts.gather(1, around.clamp(0, max(width - 1, 0))) if width else torch.full_like(around, NO_TOKEN),
        NO_TOKEN)
    trainer_context = trainer_at(around).clamp(min=NO_TOKEN)
    values = torch.cat([
        torch.stack([torch.zeros_like(k0), position, sampler_length, trainer_length], 1),
        sampler_context.clamp(min=NO_TOKEN), trainer_context,
    ], 1)
    values = torch.where(values + 1 < PROMPT_SCALE, values, NO_TOKEN).to(torch.float64)  # too large: shown unknown
    datum = torch.arange(batch, device=device, dtype=torch.float64)[:, None]
    record = (values + 1.0 - datum * PROMPT_SCALE).masked_fill(~differ[:, None], -math.inf).amax(0)
    return {"n_prompt_datums_compared": torch.count_nonzero(compared).to(torch.float64),
            "n_prompt_datums_differ": torch.count_nonzero(differ).to(torch.float64), "prompt_first": record}


def renumber(record: torch.Tensor, datum_offset: torch.Tensor | float) -> torch.Tensor:
    """A ``prompt_first`` record (or ``[..., PROMPT_RECORD]`` records) whose datums come ``datum_offset`` later."""
    if not isinstance(datum_offset, torch.Tensor):
        datum_offset = torch.tensor(float(datum_offset), dtype=torch.float64, device=record.device)
    return record - datum_offset.to(record.dtype).reshape(*datum_offset.shape, *([1] * (record.dim()
                                                                                         - datum_offset.dim()))) * PROMPT_SCALE


def decode_record(record: np.ndarray) -> dict[str, Any] | None:
    """The first differing datum's index, position, lengths and context ids from a host ``prompt_first``
    (``None``: no datum differs).

    Examples:
        >>> values = np.array([0, 2, 4, 3] + [-1, -1, 5, 6, 7, 8, 9, -1] + [-1, -1, 5, 6, 8, -1, -1, -1], dtype=float)
        >>> found = decode_record(values + 1 - 3 * PROMPT_SCALE)
        >>> found["datum"], found["position"], found["sampler_before"], found["sampler"], found["trainer"]
        (3, 2, [5, 6], [7, 8, 9], [8])
    """
    record = np.asarray(record, dtype=np.float64)
    if record.size != PROMPT_RECORD or not np.isfinite(record[0]):
        return None
    datum = int(-math.floor(record[0] / PROMPT_SCALE))
    values = (record + datum * PROMPT_SCALE - 1).round().astype(np.int64)
    half = PROMPT_CONTEXT // 2
    sampler, trainer = (values[len(RECORD) + i * PROMPT_CONTEXT: len(RECORD) + (i + 1) * PROMPT_CONTEXT]
                        for i in range(2))
    return {"datum": datum, "position": int(values[1]), "sampler_length": int(values[2]),
            "trainer_length": int(values[3]), "sampler": [int(v) for v in sampler[half:] if v >= 0],
            "sampler_before": [int(v) for v in sampler[:half] if v >= 0],
            "trainer": [int(v) for v in trainer[half:] if v >= 0],
            "trainer_before": [int(v) for v in trainer[:half] if v >= 0]}


def prompt_finding(totals: Mapping[str, float], arrays: Mapping[str, np.ndarray],
                   decode: Callable[[list[int]], str] = lambda ids: " ".join(map(str, ids))
                   ) -> tuple[str, dict[str, float]] | None:
    """What the run says of its prompts when some datum's differ: the sentence (ids shown by ``decode``) and its
    numbers; ``None`` when none differs or none was compared.

    Examples:
        >>> values = np.array([0, 1, 2, 2] + [-1, -1, -1, 5, 6, -1, -1, -1] + [-1, -1, -1, 5, 7, -1, -1, -1], dtype=float)
        >>> print(prompt_finding({"n_prompt_datums_differ": 1.0, "n_prompt_datums_compared": 2.0},
        ...                      {"prompt_first": values + 1})[0])
        in 1 of 2 compared datums; datum 0 at prompt token 1 (the prompts agree after it): sampler '…5⟦6…' vs trainer '…5⟦7…'
    """
    differ = totals.get("n_prompt_datums_differ", 0.0)
    record = arrays.get("prompt_first")
    found = decode_record(record) if differ and record is not None else None
    if found is None:
        return None
    compared = totals.get("n_prompt_datums_compared", 0.0)

    def text(before: list[int], after: list[int]) -> str:
        return f"'…{decode(before) if before else ''}⟦{decode(after) if after else '<end>'}…'"

    lengths = ""
    if found["sampler_length"] != found["trainer_length"]:
        lengths = (f" (the sampler's prompt has {found['sampler_length']} tokens, the trainer's "
                   f"{found['trainer_length']})")
    where = f"at prompt token {found['position']} (the prompts agree after it)"
    if found["trainer_length"] > found["sampler_length"] and found["sampler"][:1] == found["trainer"][:1]:
        where = (f"before the sampler's first prompt token (the prompts agree from it on: the trainer's has "
                 f"{found['trainer_length'] - found['sampler_length']} more before it)")
    said = (f"in {differ:.0f} of {compared:.0f} compared datums; datum {found['datum']} {where}{lengths}: sampler {text(found['sampler_before'], found['sampler'])} vs trainer "
            f"{text(found['trainer_before'], found['trainer'])}")
    numbers = {"prompt_datums_differ": float(differ), "prompt_datums_compared": float(compared),
               "prompt_datum": float(found["datum"]), "prompt_position": float(found["position"])}
    return said, numbers
