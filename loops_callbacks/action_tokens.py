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
    >>> flat.active.tolist(), flat.trainer.tolist()
    ([False, True, True], [0.0, -1.5, -2.0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loops_callbacks.fields import (
    datum_loss_fn_inputs,
    datum_model_input,
    field_to_tensor,
    model_input_length,
    model_input_tokens,
)

__all__ = ["FlatBatch", "flatten_datums", "flatten_padded", "trainer_logprobs_from_output"]

NO_TOKEN = -1
"""Marks a position without a known token id (padding, or a datum without that field)."""


@dataclass(frozen=True)
class FlatBatch:
    """All positions of a batch, concatenated datum after datum, on one device.

    ``active`` marks the positions that count (mask > 0, advantage != 0 where advantages are
    given, both logprobs finite); ``counted`` the positions that pass the first two rules, so
    ``counted & ~active`` are the masked-in positions dropped for a missing or non-finite logprob.
    ``input_ids`` / ``target_tokens`` hold ``NO_TOKEN`` where unknown; they are ``None`` unless
    token ids were asked for (the worst-tokens table needs them, the scalars do not).
    """

    sampler: torch.Tensor  # float64 [L]
    trainer: torch.Tensor  # float64 [L]
    active: torch.Tensor  # bool [L]
    counted: torch.Tensor  # bool [L]
    datum: torch.Tensor  # int64 [L], the datum each position belongs to
    row_starts: torch.Tensor  # int64 [B], where each datum's positions begin
    row_lengths: torch.Tensor  # int64 [B]
    input_ids: torch.Tensor | None = None  # int64 [L], model_input token at each position
    target_tokens: torch.Tensor | None = None  # int64 [L]

    @property
    def n_datums(self) -> int:
        return int(self.row_lengths.numel())

    @property
    def device(self) -> torch.device:
        return self.trainer.device


def trainer_logprobs_from_output(forward_backward_output: Any) -> list[Any]:
    """The per-datum ``"logprobs"`` of a ``ForwardBackwardOutput`` (ours, Loops' or Tinker's).

    Example:
        >>> from loops_callbacks.types import ForwardBackwardOutput
        >>> trainer_logprobs_from_output(ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0]}]))
        [[0.0]]
    """
    outputs = getattr(forward_backward_output, "loss_fn_outputs", None)
    if outputs is None:
        raise ValueError(
            "forward_backward_output has no loss_fn_outputs; pass training_logprobs= instead, "
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


def flatten_datums(
    data: Sequence[Any],
    training_logprobs: Sequence[Any] | torch.Tensor,
    *,
    with_tokens: bool = False,
) -> FlatBatch:
    """Flatten Loops / Tinker datums and the trainer's per-datum logprobs.

    ``training_logprobs`` is one row per datum (tensors, arrays, lists or ``TensorData``), or one
    right-padded ``[B, T]`` tensor whose row i is read up to datum i's length.
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
    input_ids, targets = [], []
    any_advantages = False
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
        model_input = datum_model_input(datum, index=i)
        if model_input is not None and model_input_length(model_input) != length:
            raise ValueError(
                f"datum {i}: model_input has length {model_input_length(model_input)} but "
                f"loss_fn_inputs['logprobs'] has {length}; position k of every field belongs to "
                "the token predicted at k, so they must have the same length"
            )
        samplers.append(sampler)
        masks.append(mask)
        lengths.append(length)
        advantage = inputs.get("advantages")
        if advantage is not None:
            advantage = field_to_tensor(advantage, where=f"datum {i}, key 'advantages'")
            if advantage.shape[0] not in (1, length):
                raise ValueError(
                    f"datum {i}: loss_fn_inputs['advantages'] has length {advantage.shape[0]}, "
                    f"expected 1 (one value for the row) or {length} (one per position)"
                )
            any_advantages = True
        advantages.append(advantage)
        if with_tokens:
            input_ids.append(_token_row(model_input, length))
            target = inputs.get("target_tokens")
            targets.append(
                _token_row(None, length)
                if target is None
                else _checked_tokens(target, length, where=f"datum {i}, key 'target_tokens'")
            )

    device = _device_of(training_logprobs if padded_trainer else trainers, samplers)
    row_lengths = torch.tensor(lengths, dtype=torch.int64)
    if padded_trainer:
        trainer_flat = _unpad_rows(training_logprobs.detach(), row_lengths)
    else:
        trainer_flat = _cat(trainers, torch.float64)
    advantage_ok = None
    if any_advantages:
        advantage_ok = _cat([_advantage_ok(a, n) for a, n in zip(advantages, lengths)], torch.bool)
    return _build(
        sampler=_cat(samplers, torch.float64).to(device, torch.float64),
        trainer=trainer_flat.to(device, torch.float64),
        mask=_cat(masks, None).to(device),
        advantage_ok=None if advantage_ok is None else advantage_ok.to(device),
        row_lengths=row_lengths.to(device),
        input_ids=_cat(input_ids, torch.int64).to(device) if with_tokens else None,
        target_tokens=_cat(targets, torch.int64).to(device) if with_tokens else None,
    )


def flatten_padded(
    *,
    sampler_logprobs: torch.Tensor,
    training_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    target_tokens: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    with_tokens: bool = False,
) -> FlatBatch:
    """Flatten right-padded ``[B, T]`` tensors (padding must have ``mask == 0``).

    ``advantages`` is ``[B, T]`` or ``[B]`` (one value per row). Shapes must agree exactly.
    """
    fields = {"logprobs": sampler_logprobs, "training_logprobs": training_logprobs, "mask": mask}
    for name, tensor in fields.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} must be a [B, T] tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name!r} must be a [B, T] tensor, got shape {tuple(tensor.shape)}")
    shape = training_logprobs.shape
    for name, tensor in [*fields.items(), ("target_tokens", target_tokens), ("input_ids", input_ids)]:
        if tensor is not None and tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{name!r} has shape {tuple(tensor.shape)} but 'training_logprobs' has {tuple(shape)}; "
                "sampler and trainer fields must be aligned position by position"
            )
    batch, width = shape
    device = training_logprobs.device
    advantage_ok = None
    if advantages is not None:
        if advantages.dim() == 1 and advantages.shape[0] == batch:
            advantages = advantages[:, None].expand(batch, width)
        elif tuple(advantages.shape) != tuple(shape):
            raise ValueError(
                f"'advantages' has shape {tuple(advantages.shape)}; expected {tuple(shape)} or ({batch},)"
            )
        advantage_ok = _advantage_ok(advantages.reshape(-1), batch * width).to(device)

    def token_field(tokens: torch.Tensor | None) -> torch.Tensor | None:
        if not with_tokens:
            return None
        if tokens is None:
            return torch.full((batch * width,), NO_TOKEN, dtype=torch.int64, device=device)
        return tokens.detach().reshape(-1).to(device, torch.int64)

    return _build(
        sampler=sampler_logprobs.detach().reshape(-1).to(device, torch.float64),
        trainer=training_logprobs.detach().reshape(-1).to(torch.float64),
        mask=mask.detach().reshape(-1).to(device),
        advantage_ok=advantage_ok,
        row_lengths=torch.full((batch,), width, dtype=torch.int64, device=device),
        input_ids=token_field(input_ids),
        target_tokens=token_field(target_tokens),
    )


def _build(
    *,
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    mask: torch.Tensor,
    advantage_ok: torch.Tensor | None,
    row_lengths: torch.Tensor,
    input_ids: torch.Tensor | None,
    target_tokens: torch.Tensor | None,
) -> FlatBatch:
    counted = mask > 0
    if advantage_ok is not None:
        counted &= advantage_ok
    active = counted & torch.isfinite(sampler) & torch.isfinite(trainer)
    n_datums = row_lengths.numel()
    datum = torch.repeat_interleave(
        torch.arange(n_datums, device=row_lengths.device), row_lengths, output_size=trainer.shape[0]
    )
    row_starts = torch.cumsum(row_lengths, 0) - row_lengths
    return FlatBatch(
        sampler=sampler,
        trainer=trainer,
        active=active,
        counted=counted,
        datum=datum,
        row_starts=row_starts,
        row_lengths=row_lengths,
        input_ids=input_ids,
        target_tokens=target_tokens,
    )


def _unpad_rows(padded: torch.Tensor, row_lengths: torch.Tensor) -> torch.Tensor:
    """Rows of a right-padded ``[B, T]`` tensor, each cut to its length, concatenated.

    The index is built on the host from the (host) lengths, so the device never synchronizes.
    """
    batch, width = padded.shape
    row_starts = torch.cumsum(row_lengths, 0) - row_lengths
    total = int(row_lengths.sum())
    shift = torch.repeat_interleave(torch.arange(batch) * width - row_starts, row_lengths, output_size=total)
    index = torch.arange(total) + shift
    return padded.reshape(-1).index_select(0, index.to(padded.device))


def _advantage_ok(advantage: torch.Tensor | None, length: int) -> torch.Tensor:
    """Positions whose advantage is non-zero (``None``/NaN count as 0), broadcasting length 1."""
    if advantage is None:
        return torch.ones(length, dtype=torch.bool, device="cpu")
    ok = (advantage != 0) & ~torch.isnan(advantage.to(torch.float64))
    return ok.expand(length) if ok.shape[0] == 1 and length != 1 else ok


def _token_row(model_input: Any, length: int) -> torch.Tensor:
    if model_input is None:
        return torch.full((length,), NO_TOKEN, dtype=torch.int64)
    return torch.from_numpy(np.asarray(model_input_tokens(model_input), dtype=np.int64))


def _checked_tokens(value: Any, length: int, *, where: str) -> torch.Tensor:
    tokens = field_to_tensor(value, where=where)
    if tokens.shape[0] != length:
        raise ValueError(f"{where} has length {tokens.shape[0]}, but the datum's logprobs have {length}")
    if tokens.is_floating_point():
        tokens = torch.nan_to_num(tokens, nan=NO_TOKEN)
    return tokens.to(torch.int64)


def _cat(rows: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, dtype=dtype or torch.float64)
    device = rows[0].device
    if any(row.device != device for row in rows):
        rows = [row.cpu() for row in rows]
    flat = torch.cat(rows)
    return flat if dtype is None else flat.to(dtype)


def _device_of(trainer: torch.Tensor | list[torch.Tensor], samplers: list[torch.Tensor]) -> torch.device:
    """The trainer logprobs' device (where the model lives), else the sampler's, else CPU."""
    for candidate in ([trainer] if isinstance(trainer, torch.Tensor) else trainer) + samplers:
        if candidate.device.type != "cpu":
            return candidate.device
    return torch.device("cpu")
