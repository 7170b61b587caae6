"""Read one training step's batch and ``training_step`` output into a ``FlatBatch``: the step's input.

Each field is looked up under its key (``DATA_KEYS``, remappable with ``keys=``) in the step's
output first, then in the batch. Two contract forms are accepted: Loops / Tinker datums (the
batch, or ``"data"``) with the trainer's ``training_logprobs`` or a ``forward_backward_output``;
or padded ``[B, T]`` tensors. A broken contract is a ``ValueError`` naming the keys found in each
place and how to provide what is missing.

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

from loops_callbacks.divergence.action_tokens import (
    FlatBatch,
    flatten_datums,
    flatten_padded,
    trainer_logprobs_from_output,
)

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
) -> FlatBatch:
    """The step's positions, in either contract form (module docstring).

    ``keys`` maps every name of ``DATA_KEYS`` to its key (``data_keys``); ``with_tokens`` keeps
    the token look-up for the worst-tokens table, ``with_token_ids`` the predicted ids the
    diagnosis groups by (datums only; padded tensors always carry theirs).
    """
    step = _Step(outputs, batch, keys)
    data = step.get("data")
    if data is None and _is_datum_list(batch):
        data = batch
    if data is not None:
        return flatten_datums(
            data, step.trainer_logprobs(datums=True), with_tokens=with_tokens, with_token_ids=with_token_ids
        )
    missing = [keys[name] for name in ("logprobs", "mask") if step.get(name) is None]
    if missing:
        raise ValueError(
            f"KLSampleTrainMonitor: neither training_step's output (keys: {_keys(outputs)}) nor the batch "
            f"(keys: {_keys(batch)}) has {missing}. Provide the sampler's per-token logprobs "
            f"{keys['logprobs']!r} and the action-token mask {keys['mask']!r} as [B, T] tensors "
            "(in the batch or in the dict training_step returns), or a list of Datum as the batch "
            "(or under 'data'); other key names can be set with keys={'logprobs': ..., 'mask': ...}."
        )
    return flatten_padded(
        sampler_logprobs=step.get("logprobs"),
        training_logprobs=step.trainer_logprobs(datums=False),
        mask=step.get("mask"),
        advantages=step.get("advantages"),
        target_tokens=step.get("target_tokens"),
        input_ids=step.get("input_ids"),
        with_tokens=with_tokens,
    )


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
