"""Flatten a batch once into the positions the divergence statistics read.

Two input forms reach the same ``FlatBatch``:

* ``flatten_datums``: Loops / Tinker datums (sampler ``logprobs``, ``mask``, optional
  ``advantages`` and ``target_tokens`` in ``loss_fn_inputs``) plus the trainer's logprobs (one
  row per datum, or one right-padded ``[B, T]`` tensor);
* ``flatten_padded``: right-padded ``[B, T]`` tensors, the form a Lightning ``training_step``
  naturally has.

Every datum's positions are concatenated in datum order on the trainer logprobs' device. Nothing
is truncated: a length mismatch between a datum's fields is the alignment bug these metrics exist
to catch, so it is a ``ValueError`` naming the datum, the keys and the lengths. No step here
synchronizes with the device.

Example:
    >>> import torch
    >>> from loops_callbacks.types import Datum, ModelInput
    >>> datum = Datum(ModelInput.from_ints([1, 2, 3]),
    ...               {"logprobs": [None, -1.0, -2.0], "mask": [0.0, 1.0, 1.0]})
    >>> flat = flatten_datums([datum], [torch.tensor([0.0, -1.5, -2.0])])
    >>> flat.active.tolist(), flat.diff.tolist()
    ([False, True, True], [nan, -0.5, 0.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loops_callbacks.divergence.token_context import DatumTokens, PaddedTokens, TokenLookup
from loops_callbacks.fields import (
    datum_loss_fn_inputs,
    datum_model_input,
    field_length,
    field_to_tensor,
    model_input_length,
    model_input_tokens,
)

__all__ = ["FlatBatch", "flatten_datums", "flatten_padded", "trainer_logprobs_from_output"]


@dataclass(frozen=True)
class FlatBatch:
    """All positions of a batch, concatenated datum after datum, on one device.

    ``active`` marks the positions that count (mask > 0, advantage != 0 where advantages are
    given, both logprobs finite); ``counted`` the positions that pass the first two rules, so
    ``counted & ~active`` are the masked-in positions dropped for a missing or non-finite
    logprob. ``masked_in`` marks the positions with mask > 0 whatever their advantage, and
    ``advantage_nan`` those of them whose advantage is NaN (read as 0, so not counted); both are
    ``None`` when the batch has no advantages (``masked_in`` is then ``counted``), and both stay on
    the batch's device: the statistics count them, and the count reaches the host with the rest.
    ``tokens`` looks up token ids for the worst-tokens table; ``None`` when not asked for.
    ``entropy`` and ``varentropy`` are the trainer's entropy and varentropy at each position
    (``token_logprobs(with_entropy=True)``), for the check of what was sampled; ``None`` when not given.
    ``token_ids`` is the id of the token predicted at each position (``target_tokens``, else the
    next ``model_input`` / ``input_ids`` id; negative where unknown), for the per-token-id sums of
    the diagnosis; ``None`` when the batch has no token ids.
    """

    sampler: torch.Tensor  # [L], the caller's dtype
    trainer: torch.Tensor  # [L], the caller's dtype
    diff: torch.Tensor  # float64 [L], trainer - sampler (non-finite where a logprob is missing)
    active: torch.Tensor  # bool [L]
    counted: torch.Tensor  # bool [L]
    row_lengths: torch.Tensor  # int64 [B]
    tokens: TokenLookup | None = None
    token_ids: torch.Tensor | None = None  # int64 [L], the token predicted at each position; < 0 unknown
    lags: torch.Tensor | None = None  # int64 [B], each datum's policy lag (``step_input``); None: no versions
    groups: torch.Tensor | None = None  # int64 [B], each datum's group id (>= 0); None: no groups
    datum_advantages: torch.Tensor | None = None  # float64 [B], one advantage per datum; None: not read
    masked_in: torch.Tensor | None = None  # bool [L], mask > 0; None: no advantages (then ``counted``)
    advantage_nan: torch.Tensor | None = None  # bool [L], masked in with a NaN advantage; None: no advantages
    entropy: torch.Tensor | None = None  # [L], the trainer's entropy at each position; None: not given
    varentropy: torch.Tensor | None = None  # [L], the trainer's varentropy (Var log p) at each position

    @property
    def n_datums(self) -> int:
        return int(self.row_lengths.numel())

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def datum_chunks(self, positions: int) -> Iterator[FlatBatch]:
        """Consecutive whole-datum slices (views) of about ``positions`` positions each; the batch itself when small.

        A chunk ends with the first datum that reaches a multiple of ``positions``, so a datum is
        never split (one longer than ``positions`` is a chunk of its own). Reads the row lengths on
        the host: for the CPU, where that is free.

        Example:
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
        first_datum = first_position = 0
        for cut in torch.unique_consecutive(torch.cat([cuts, torch.tensor([self.n_datums])])).tolist():
            last_position = int(ends[cut - 1])
            yield self._datums(first_datum, cut, first_position, last_position)
            first_datum, first_position = cut, last_position

    def _datums(self, first: int, end: int, start: int, stop: int) -> FlatBatch:
        """Datums ``first`` to ``end - 1``, at positions ``start`` to ``stop - 1``: views, nothing copied."""
        return FlatBatch(
            self.sampler[start:stop],
            self.trainer[start:stop],
            self.diff[start:stop],
            self.active[start:stop],
            self.counted[start:stop],
            self.row_lengths[first:end],
            None if self.tokens is None else _ShiftedTokens(self.tokens, first),
            None if self.token_ids is None else self.token_ids[start:stop],
            None if self.lags is None else self.lags[first:end],
            None if self.groups is None else self.groups[first:end],
            None if self.datum_advantages is None else self.datum_advantages[first:end],
            None if self.masked_in is None else self.masked_in[start:stop],
            None if self.advantage_nan is None else self.advantage_nan[start:stop],
            None if self.entropy is None else self.entropy[start:stop],
            None if self.varentropy is None else self.varentropy[start:stop],
        )


class _ShiftedTokens:
    """A ``TokenLookup`` of a chunk: datum i of the chunk is datum ``first + i`` of the batch."""

    def __init__(self, tokens: TokenLookup, first: int) -> None:
        self.tokens, self.first = tokens, first

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens.lookup(datum + self.first, position)


def trainer_logprobs_from_output(forward_backward_output: Any) -> list[Any]:
    """The per-datum ``"logprobs"`` of a ``ForwardBackwardOutput`` (ours, Loops' or Tinker's).

    Example:
        >>> from loops_callbacks.types import ForwardBackwardOutput
        >>> trainer_logprobs_from_output(ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0]}]))
        [[0.0]]
    """
    outputs = getattr(forward_backward_output, "loss_fn_outputs", None)
    if outputs is None:
        raise TypeError(
            f"forward_backward_output has no loss_fn_outputs (got {type(forward_backward_output).__name__}); pass training_logprobs= instead, "
            "or the output of a forward_backward call whose loss returns per-datum logprobs"
        )
    missing = [i for i, item in enumerate(outputs) if not isinstance(item, Mapping) or "logprobs" not in item]
    if missing:
        raise ValueError(
            f"forward_backward_output.loss_fn_outputs items {missing[:10]}{'...' if len(missing) > 10 else ''} "
            f"have no 'logprobs' (of {len(outputs)} items); the loss function must return per-datum "
            "logprobs, or pass training_logprobs= directly"
        )
    return [item["logprobs"] for item in outputs]


@torch.no_grad()
def flatten_datums(
    data: Sequence[Any],
    training_logprobs: Sequence[Any] | torch.Tensor,
    *,
    with_tokens: bool = False,
    with_token_ids: bool = True,
    advantages_key: str = "advantages",
) -> FlatBatch:
    """Flatten Loops / Tinker datums and the trainer's per-datum logprobs.

    ``training_logprobs`` is one row per datum (tensors, arrays, lists or ``TensorData``), or one
    right-padded ``[B, T]`` tensor whose row i is read up to datum i's length. ``with_token_ids``
    reads the predicted token ids the diagnosis groups by (``FlatBatch.token_ids``).
    ``advantages_key`` names the ``loss_fn_inputs`` field holding the advantages (the monitor's
    ``keys["advantages"]``).
    """
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a list of Datum, got {type(data).__name__}")
    padded_trainer = isinstance(training_logprobs, torch.Tensor)
    if padded_trainer and training_logprobs.dim() != 2:
        raise ValueError(
            f"training_logprobs as one tensor must be padded [B, T], got shape {tuple(training_logprobs.shape)}; "
            "or pass a list with one 1-D row per datum"
        )
    n_rows = training_logprobs.shape[0] if padded_trainer else len(training_logprobs)
    if len(data) != n_rows:
        raise ValueError(
            f"len(data) = {len(data)} but training_logprobs has {n_rows} rows; "
            "pass one row of trainer logprobs per datum, in the same order"
        )

    samplers, masks, trainers, advantages, lengths = [], [], [], [], []
    token_rows: list[torch.Tensor] | None = [] if with_token_ids else None
    for i, datum in enumerate(data):
        inputs = datum_loss_fn_inputs(datum, index=i)
        for key in ("logprobs", "mask"):
            if key not in inputs:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs has no {key!r} (keys: {sorted(inputs)}); "
                    + (
                        "attach the sampler's per-position logprobs when building the datum"
                        if key == "logprobs"
                        else "add a per-position mask with 1.0 on action tokens"
                    )
                )
        sampler = field_to_tensor(inputs["logprobs"], where=f"datum {i}, key 'logprobs'")
        mask = field_to_tensor(inputs["mask"], where=f"datum {i}, key 'mask'")
        length = sampler.shape[0]
        if padded_trainer:
            width = training_logprobs.shape[1]
            if length > width:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs['logprobs'] has length {length} but the padded "
                    f"training_logprobs are only {width} wide"
                )
            trainer_length = length
        else:
            trainer = field_to_tensor(training_logprobs[i], where=f"datum {i}, training logprobs")
            trainer_length = trainer.shape[0]
            trainers.append(trainer)
        if not (length == mask.shape[0] == trainer_length):
            raise ValueError(
                f"datum {i}: lengths differ: loss_fn_inputs['logprobs'] has {length}, "
                f"loss_fn_inputs['mask'] has {mask.shape[0]}, training logprobs have {trainer_length}; "
                "every per-position field must have the datum's length (nothing is truncated: a "
                "mismatch means sampler and trainer positions are misaligned)"
            )
        model_input = datum_model_input(datum)
        if model_input is not None and model_input_length(model_input) != length:
            raise ValueError(
                f"datum {i}: model_input has length {model_input_length(model_input)} but "
                f"loss_fn_inputs['logprobs'] has {length}; position k of every field belongs to "
                "the token predicted at k, so they must have the same length"
            )
        advantage = inputs.get(advantages_key)
        if advantage is not None:
            advantage = field_to_tensor(advantage, where=f"datum {i}, key {advantages_key!r}")
            if advantage.shape[0] not in (1, length):
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{advantages_key!r}] has length {advantage.shape[0]}, "
                    f"expected 1 (one value for the row) or {length} (one per position)"
                )
        target = inputs.get("target_tokens")
        if target is not None:
            target_length = field_length(target, where=f"datum {i}, key 'target_tokens'")
            if target_length != length:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs['target_tokens'] has length {target_length}, "
                    f"but loss_fn_inputs['logprobs'] has {length}"
                )
        if token_rows is not None:
            token_rows.append(_predicted_ids(target, model_input, length, where=f"datum {i}"))
        samplers.append(sampler)
        masks.append(mask)
        advantages.append(advantage)
        lengths.append(length)

    device = _device_of(training_logprobs if padded_trainer else trainers, samplers)
    row_lengths = torch.tensor(lengths, dtype=torch.int64)
    trainer_flat = _unpad_rows(training_logprobs.detach(), row_lengths) if padded_trainer else _cat(trainers)
    return _build(
        sampler=_cat(samplers).to(device),
        trainer=trainer_flat.to(device),
        mask=_cat(masks).to(device),
        advantage=_advantage_rows(advantages, row_lengths, device),
        row_lengths=row_lengths.to(device),
        tokens=DatumTokens(data) if with_tokens else None,
        token_ids=None if token_rows is None else _cat(token_rows).to(device=device, dtype=torch.int64),
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
    """Flatten right-padded ``[B, T]`` tensors (padding must have ``mask == 0``).

    ``advantages`` is ``[B, T]`` or ``[B]`` (one value per row); ``training_entropy`` and
    ``training_varentropy`` (given together) the trainer's at each position. Shapes must agree exactly.
    """
    if (training_entropy is None) != (training_varentropy is None):
        given, missing = ("training_entropy", "training_varentropy")[:: 1 if training_varentropy is None else -1]
        raise ValueError(f"{given!r} is given without {missing!r}: the check of what was sampled needs both")
    fields = {"logprobs": sampler_logprobs, "training_logprobs": training_logprobs, "mask": mask}
    for name, tensor in fields.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} must be a [B, T] tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name!r} must be a [B, T] tensor, got shape {tuple(tensor.shape)}")
    shape = training_logprobs.shape
    optional = [("target_tokens", target_tokens), ("input_ids", input_ids), ("training_entropy", training_entropy),
                ("training_varentropy", training_varentropy)]
    for name, tensor in optional:
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} must be a [B, T] tensor, got {type(tensor).__name__}")
    for name, tensor in [*fields.items(), *optional]:
        if tensor is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{name!r} has shape {tuple(tensor.shape)} but 'training_logprobs' has {tuple(shape)}; "
                "sampler and trainer fields must be aligned position by position"
            )
    batch, width = shape
    device = training_logprobs.device
    advantage = None
    if advantages is not None:
        if not isinstance(advantages, torch.Tensor):
            raise TypeError(f"'advantages' must be a tensor, got {type(advantages).__name__}")
        if advantages.dim() == 1 and advantages.shape[0] == batch:
            advantages = advantages[:, None]
        elif tuple(advantages.shape) != tuple(shape):
            raise ValueError(
                f"'advantages' has shape {tuple(advantages.shape)}; expected {tuple(shape)} or ({batch},)"
            )
        flags = _advantage_flags(advantages.detach().to(device))
        advantage = (flags[0].expand(batch, width).reshape(-1), flags[1].expand(batch, width).reshape(-1))
    token_ids = None
    if target_tokens is not None:
        token_ids = target_tokens.detach().reshape(-1).to(device=device, dtype=torch.int64)
    elif input_ids is not None:
        ids = input_ids.detach().to(device=device, dtype=torch.int64)
        token_ids = torch.cat([ids[:, 1:], ids.new_full((batch, min(width, 1)), -1)], dim=1).reshape(-1)
    tokens = None
    if with_tokens:
        tokens = PaddedTokens(
            None if input_ids is None else input_ids.detach().to(device),
            None if target_tokens is None else target_tokens.detach().to(device),
        )
    flat = _build(
        sampler=sampler_logprobs.detach().reshape(-1).to(device),
        trainer=training_logprobs.detach().reshape(-1),
        mask=mask.detach().reshape(-1).to(device),
        advantage=advantage,
        row_lengths=torch.full((batch,), width, dtype=torch.int64, device=device),
        tokens=tokens,
        token_ids=token_ids,
    )
    if training_entropy is None or training_varentropy is None:
        return flat
    return dataclasses.replace(
        flat,
        entropy=training_entropy.detach().reshape(-1).to(device),
        varentropy=training_varentropy.detach().reshape(-1).to(device),
    )


def _build(
    *,
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    mask: torch.Tensor,
    advantage: tuple[torch.Tensor, torch.Tensor] | None,
    row_lengths: torch.Tensor,
    tokens: TokenLookup | None,
    token_ids: torch.Tensor | None = None,
) -> FlatBatch:
    """The ``FlatBatch``; ``advantage``: (non-zero, NaN) per position (``_advantage_flags``), ``None`` without any."""
    # d = trainer - sampler in float64 (each value widened exactly). A float64 difference of two
    # logprobs is finite exactly when both are (float32 inputs cannot overflow it), so one
    # finiteness test covers both.
    diff = trainer.to(torch.float64, copy=True).sub_(sampler.to(torch.float64))  # same-dtype sub_ is vectorized
    masked_in = mask > 0
    counted, advantage_nan = masked_in, None
    if advantage is not None:
        nonzero, nan = advantage
        counted = masked_in & nonzero
        advantage_nan = masked_in & nan
    active = counted & (diff.abs() < float("inf"))  # isfinite, in fewer passes
    return FlatBatch(
        sampler, trainer, diff, active, counted, row_lengths, tokens, token_ids,
        masked_in=None if advantage is None else masked_in,
        advantage_nan=advantage_nan,
    )


def _predicted_ids(target: Any, model_input: Any, length: int, *, where: str) -> torch.Tensor:
    """Int64 ``[length]``: ``target_tokens``, else ``model_input[k + 1]``, else -1 (unknown)."""
    if target is not None:
        return field_to_tensor(target, where=f"{where}, key 'target_tokens'").to(torch.int64)
    ids = torch.full((length,), -1, dtype=torch.int64)
    if model_input is not None and length > 1:
        given = model_input if isinstance(model_input, torch.Tensor) else torch.tensor(model_input_tokens(model_input))
        ids[: length - 1] = given[1:length].to(torch.int64)
    return ids


def _unpad_rows(padded: torch.Tensor, row_lengths: torch.Tensor) -> torch.Tensor:
    """Rows of a right-padded ``[B, T]`` tensor, each cut to its length, concatenated.

    The index is built on the host from the (host) lengths, so the device never synchronizes.
    Positions past a row's length (padding) are never read.
    """
    batch, width = padded.shape
    row_starts = torch.cumsum(row_lengths, 0) - row_lengths
    total = int(row_lengths.sum())
    shift = torch.repeat_interleave(torch.arange(batch) * width - row_starts, row_lengths, output_size=total)
    index = torch.arange(total) + shift
    return padded.reshape(-1).index_select(0, index.to(padded.device))


def _advantage_flags(advantage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(non-zero, NaN) of each advantage: a NaN advantage (``None`` is read as NaN) counts as 0.

    Example:
        >>> [flags.tolist() for flags in _advantage_flags(torch.tensor([1.0, 0.0, float("nan")]))]
        [[True, False, False], [False, False, True]]
    """
    nan = torch.isnan(advantage)
    return (advantage != 0) & ~nan, nan


def _advantage_rows(
    advantages: list[torch.Tensor | None], row_lengths: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per position, ``_advantage_flags`` of its datum's advantage (non-zero for a datum without
    advantages); ``None`` when no datum has advantages."""
    if all(a is None for a in advantages):
        return None
    lengths = row_lengths.tolist()
    if all(a is not None and a.shape[0] == 1 for a in advantages):  # one value per row: the common RL case
        repeats = row_lengths.to(device)
        return tuple(  # type: ignore[return-value]
            torch.repeat_interleave(flags, repeats, output_size=sum(lengths))
            for flags in _advantage_flags(_cat(advantages).to(device))
        )
    ones = torch.ones(1)
    rows = [
        (ones if a is None else a).expand(n) if (a is None or a.shape[0] == 1) else a
        for a, n in zip(advantages, lengths)
    ]
    return _advantage_flags(_cat(rows).to(device))


def _cat(rows: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of the rows (type promotion as ``torch.cat``); mixed devices meet on the CPU."""
    if not rows:
        return torch.zeros(0, dtype=torch.float64)
    device = rows[0].device
    if any(row.device != device for row in rows):
        rows = [row.cpu() for row in rows]
    return torch.cat(rows)


def _device_of(trainer: torch.Tensor | list[torch.Tensor], samplers: list[torch.Tensor]) -> torch.device:
    """The trainer logprobs' device (where the model lives), else the sampler's, else CPU.

    The first row of each stands for all (rows on several devices meet on the CPU in ``_cat``
    and then move here).
    """
    for candidate in ([trainer] if isinstance(trainer, torch.Tensor) else trainer[:1]) + samplers[:1]:
        if candidate.device.type != "cpu":
            return candidate.device
    return torch.device("cpu")
