"""One logged step's inputs, read once into one representation: the batch flattened datum after datum (``FlatBatch``),
its per-datum fields, the prompts the sampler saw, and the engine's own account of itself (``SamplerFacts``).

``FlatBatch``: a batch's positions, datum after datum, on one device: the one form the statistics read.

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

The per-datum keys of a step: policy versions (as lags), groups, and one advantage per datum.

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

The prompt the sampler saw, against the prompt the trainer scored: ``sampler_prompt_ids``.

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

Each micro-batch keeps three states (``PROMPTS``): how many datums were compared and how many differ, sums;
and ``prompt_first``, a maximum: the first differing datum's index, the position of the difference counted
in the sampler's prompt (the last that differs, right-aligned: the prompts agree after it; where no id differs, the
last id a shorter trainer prompt lacks), both lengths and ``PROMPT_CONTEXT`` ids of each prompt around it, every entry stored as
``-datum * PROMPT_SCALE + value + 1`` so that the elementwise maximum is one record, the earliest datum's, once
micro-batches and ranks renumber their datums (``Layout.renumbered``). The host decodes it (``prompt_finding``).

Examples:
    >>> read_sampler_prompts([[1, 2, 3], [4]], 2, device=torch.device("cpu")).tolist()
    [[1, 2, 3], [-1, -1, 4]]

What the monitor can see for certain about the trainer, before any statistic: direct evidence.

``observe_training(trainer, pl_module)`` reads, once per logged step:

* dropout that is live in the LightningModule: every module in training mode that is a dropout
  layer (``torch.nn.Dropout`` and its siblings, or any class named ``*Dropout*`` with a float
  ``p``) with p > 0, and every module in training mode with a float dropout attribute > 0 that
  Hugging Face attention layers apply functionally (``attention_dropout`` of Llama, Mistral,
  Qwen2; ``dropout`` of BART-style layers). Counted by kind and p: "12 Dropout modules with
  p = 0.1". Dropout in the trainer's forward puts noise into its logprobs that no sampler has;
  TRL turns it off by default for RL for this reason.
* the trainer's precision (``trainer.precision``, e.g. ``"bf16-mixed"``).

A diagnosis ranks these observations above statistical guesses (``diagnosis``). They are what
the modules are at the end of the step: logprobs computed under ``model.eval()`` inside
``training_step`` would carry no dropout noise, which the facts say.

Examples:
    >>> import torch
    >>> module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.1))
    >>> print(observe_modules(module, precision="32-true").facts)
    2 Dropout modules with p = 0.1 are in training mode (the trainer's logprobs include dropout noise unless computed in eval mode); the trainer's precision is 32-true
    >>> observe_modules(module.eval(), precision=None).dropout_active
    False

``read_step``: one training step's batch and ``training_step`` output, read once into a ``FlatBatch``.

Each field is looked up under its key (``DATA_KEYS``, remappable with ``keys=``) in the step's
output first, then in the batch. Two contract forms: Loops / Tinker datums (the batch, or
``"data"``) with the trainer's ``training_logprobs`` or a ``forward_backward_output``; or padded
``[B, T]`` tensors. A broken contract is a ``ValueError`` naming the keys found in each place and
how to provide what is missing. The per-datum keys (``policy_version``, ``group``, one advantage
per datum) are read by ``batch``; what it cannot use is a warning, never an error.

Examples:
    >>> batch = {"logprobs": torch.tensor([[-1.0, -2.0]]), "mask": torch.ones(1, 2)}
    >>> flat = read_step({"training_logprobs": torch.tensor([[-1.5, -2.0]])}, batch)
    >>> flat.diff.tolist()
    [-0.5, 0.0]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from loops_callbacks.fields import (
    datum_loss_fn_inputs, datum_model_input, field_length, field_to_tensor, model_input_length, model_input_tokens,
)
from loops_callbacks.run_warnings import RunWarnings
from loops_callbacks.validation import check, check_bool, check_int, check_logprobs_dtype

LOGPROB_FLOOR = -1e4
"""A logprob below this (e.g. ``torch.finfo(torch.float32).min``) is a sentinel, not a probability."""
NO_TOKEN = -1
CONTEXT_BEFORE = 40
"""Ids shown before a worst token's ``model_input[k + 1]``, as the Loops SDK shows them."""
CONTEXT_AFTER = 1 + 20
"""``model_input[k + 1]`` (the context's centre), then the SDK's 20 ids after it."""
PER_DATUM = ("row_lengths", "tokens", "lags", "groups", "servers", "datum_advantages", "sampler_prompts",
              "first_tokens", "prompt_starts")
"""The ``FlatBatch`` fields that hold one value per datum (the others one per position)."""


@dataclass(frozen=True)
class FlatBatch:
    """All positions of a batch, concatenated datum after datum (module docstring for the masks).

    ``tokens`` looks up the worst tokens' ids (``PaddedTokens`` / ``DatumTokens``); ``token_ids`` is
    the id predicted at each position (< 0: unknown), for the diagnosis' per-token-id sums; ``entropy``
    and ``varentropy`` are the trainer's, for the check of what was sampled; ``lags``, ``groups`` and
    ``datum_advantages`` hold one value per datum (``batch``). ``None``: not given or not read.
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
    # the prompts' comparison (``batch``): the sampler's prompts, the trainer's id predicted at each position and
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

MAX_SERVERS = 8
"""Servers the divergence is kept for (``sampler_server``), in the order the run first named them; more share the
last slot."""


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


def read_servers(step: Any, flat: FlatBatch, registry: list[str]) -> torch.Tensor | None:
    """Int64 ``[B]`` slots of the server that sampled each datum (``sampler_server``: one URL per datum, a list of
    str), on the batch's device: a URL's index in ``registry``, the servers in the order the run first named them
    (appended to here; ``MAX_SERVERS`` and more share the last slot). ``None``: absent, or unusable (one
    warning per run).

    Examples:
        >>> registry = ["http://a:8000"]
        >>> class Step: get = staticmethod(lambda name: ["http://b:8000", "http://a:8000"]); label = repr
        >>> flat = FlatBatch(*[torch.zeros(2)] * 6, row_lengths=torch.ones(2, dtype=torch.int64))
        >>> read_servers(Step, flat, registry).tolist(), registry
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


def read_groups(step: Any, flat: FlatBatch, max_groups: int) -> torch.Tensor | None:
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


def read_lags(step: Any, flat: FlatBatch, optimizer_step: int) -> torch.Tensor | None:
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


def read_advantages(step: Any, flat: FlatBatch) -> torch.Tensor:
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
    width = flat.trainer.numel() // flat.n_datums if flat.n_datums else 0  # padded: T positions a row (no sync)
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


__all__ = ["SamplerFacts"]

FUNCTIONAL_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "hidden_dropout")
"""Float attributes that modules apply as ``F.dropout(..., p=value, training=self.training)``."""


@dataclass(frozen=True)
class DropoutSeen:
    """``count`` modules of one kind (``Dropout``, or ``LlamaAttention.attention_dropout``) with dropout ``p``."""

    kind: str
    p: float
    count: int

    @property
    def text(self) -> str:
        plural = "s" if self.count != 1 else ""
        owner, _, attribute = self.kind.partition(".")  # a functional dropout attribute, or a layer's p
        return f"{self.count} {owner} module{plural} with {attribute or 'p'} = {self.p:g}"


class SamplerFacts(NamedTuple):
    """What the sampling engine says about itself, handed to the monitor under the batch key ``sampler_facts``
    (``loops_callbacks.integrations.vllm`` fills it; any engine can): facts, not guesses. A named tuple, so
    that Lightning's batch transfer (``apply_to_collection``) carries it through unchanged.

    ``dtype`` the engine's weights (``"bfloat16"``); ``logprobs_mode`` what its logprobs are (vLLM's
    ``"raw_logprobs"``: the model's distribution at temperature 1, whatever was sampled from;
    ``"processed_logprobs"``: after temperature, top-k and top-p); ``temperature``, ``top_p``,
    ``top_k`` the sampling settings (``None``: not known; top-k 0 or -1: off); ``weight_version``
    the engine's weight version (the trainer's optimizer steps at its last sync); ``stale_prefix_cache``
    whether the engine's weights were reloaded after its prefix cache was last reset (KV computed
    with older weights can be served to prompts that share a prefix), ``None`` when not known;
    ``weights_unknown`` whether a weight push into the engine failed part way, so that it holds neither the old
    weights nor the new ones (the guard rail cannot trust a step sampled then).

    Examples:
        >>> facts = SamplerFacts(engine="vllm", dtype="bfloat16", logprobs_mode="raw_logprobs", temperature=0.7)
        >>> facts.samples_other_than_reported
        True
    """

    engine: str = ""
    dtype: str | None = None
    logprobs_mode: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    weight_version: int | None = None
    stale_prefix_cache: bool | None = None
    weights_unknown: bool = False

    @property
    def sampling_settings(self) -> list[str]:
        """The settings that move the sampled distribution off the model's at temperature 1, as text
        (``["temperature 0.7", "top-p 0.9"]``): a temperature other than 1, top-p below 1, top-k on."""
        settings = [f"temperature {self.temperature:g}" if self.temperature not in (None, 1.0) else "",
                    f"top-p {self.top_p:g}" if self.top_p is not None and self.top_p < 1.0 else "",
                    f"top-k {self.top_k}" if self.top_k is not None and self.top_k > 0 else ""]
        return [setting for setting in settings if setting]

    @property
    def samples_other_than_reported(self) -> bool:
        """Whether the tokens are drawn from another distribution than the reported logprobs describe: raw
        (temperature-1, untruncated) logprobs with any of the ``sampling_settings``."""
        return self.logprobs_mode in ("raw_logprobs", "raw_logits") and bool(self.sampling_settings)


@dataclass(frozen=True)
class DirectEvidence:
    """What the trainer is, seen directly: live dropout (``dropout``) and its precision (``precision``)."""

    dropout: tuple[DropoutSeen, ...] = ()
    precision: str | None = None

    @property
    def dropout_active(self) -> bool:
        """Whether any dropout with p > 0 is live in the LightningModule."""
        return bool(self.dropout)

    @property
    def dropout_modules(self) -> int:
        """How many modules apply dropout (layers and functional attributes together)."""
        return sum(seen.count for seen in self.dropout)

    @property
    def max_dropout_p(self) -> float:
        """The largest live dropout probability; 0.0 when none is live."""
        return max((seen.p for seen in self.dropout), default=0.0)

    @property
    def reduced_precision(self) -> bool:
        """Whether the trainer computes in 16-bit (``16``/``bf16`` in its precision): its logprobs carry rounding."""
        return self.precision is not None and "16" in self.precision

    @property
    def facts(self) -> str:
        """The observations as one clause list, for the diagnosis' message (empty when nothing was seen)."""
        parts = []
        if self.dropout:
            parts.append(
                ", ".join(seen.text for seen in self.dropout)
                + (" is" if self.dropout_modules == 1 else " are")
                + " in training mode (the trainer's logprobs include dropout noise unless computed in eval mode)"
            )
        if self.precision is not None:
            parts.append(f"the trainer's precision is {self.precision}")
        return "; ".join(parts)


def observe_modules(module: torch.nn.Module, *, precision: str | None) -> DirectEvidence:
    """The direct evidence of ``module`` (walked once) and a known ``precision``."""
    counts: collections.Counter[tuple[str, float]] = collections.Counter()
    for child in module.modules():
        if not child.training:
            continue
        layer = isinstance(child, torch.nn.modules.dropout._DropoutNd) or "Dropout" in type(child).__name__
        p = getattr(child, "p", None) if layer else None  # a dropout layer's probability
        if isinstance(p, (float, int)) and not isinstance(p, bool) and 0.0 < float(p) <= 1.0:
            counts[type(child).__name__, float(p)] += 1
            continue
        for attribute in FUNCTIONAL_DROPOUT_ATTRIBUTES:
            value = getattr(child, attribute, None)
            if isinstance(value, float) and 0.0 < value <= 1.0:
                counts[f"{type(child).__name__}.{attribute}", value] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))  # most modules first
    seen = tuple(DropoutSeen(kind, p, count) for (kind, p), count in ranked)
    return DirectEvidence(dropout=seen, precision=precision)


def observe_training(trainer: Any, pl_module: torch.nn.Module) -> DirectEvidence:
    """The direct evidence of a Lightning run: the LightningModule's live dropout and ``trainer.precision``.

    Never raises: monitoring never breaks training (an unreadable precision is ``None``).
    """
    try:
        precision = str(trainer.precision)
    except Exception:  # a trainer double without the attribute, or a strategy that cannot say
        precision = None
    return observe_modules(pl_module, precision=precision)


DATA_KEYS = (
    "data", "training_logprobs", "forward_backward_output", "logprobs", "mask", "advantages", "target_tokens",
    "input_ids", "policy_version", "group", "training_entropy", "training_varentropy", "sampler_facts",
    "sampler_prompt_ids", "sampler_server", "attention_mask",
)
"""The names ``keys=`` may remap; by default each is read under its own name."""


def data_keys(keys: Mapping[str, str] | None) -> dict[str, str]:
    """``keys`` over the defaults; ``ValueError`` naming an unknown name or an empty key, ``TypeError``
    for a non-string key (``validation.check``).

    Examples:
        >>> data_keys({"logprobs": "sampler_lp"})["logprobs"]
        'sampler_lp'
    """
    given = dict(keys or {})
    unknown = sorted(set(given) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"keys has unknown names {unknown}; the names are {list(DATA_KEYS)}")
    for name, key in given.items():
        check(f"keys[{name!r}]", key, str, "a non-empty string", bool)
    return {name: given.get(name, name) for name in DATA_KEYS}


def key_label(keys: Mapping[str, str], name: str) -> str:
    """The key of ``name`` as the user gave it, and which name it stands for when ``keys=`` renamed it.

    Examples:
        >>> key_label(data_keys({"advantages": "adv"}), "advantages"), key_label(data_keys(None), "mask")
        ("'adv' (the advantages key)", "'mask'")
    """
    key = keys[name]
    return f"{key!r}" if key == name else f"{key!r} (the {name} key)"


@dataclass(frozen=True)
class ReadOptions:
    """What ``read_step`` reads, checked once when made: ``keys`` (over the defaults: ``data_keys``) say where
    each datum is; ``with_tokens`` keeps the worst tokens' look-up, ``diagnose`` what the diagnosis needs (the
    predicted ids it groups by, the sampler's prompts); ``max_groups`` is the index of ``group_other`` in the
    strata; ``datum_advantages`` reads one advantage per datum (for a correction that needs them).

    >>> ReadOptions(keys={"logprobs": "sampler_lp"}).keys["mask"]
    'mask'
    """

    keys: Mapping[str, str] = field(default_factory=dict)
    with_tokens: bool = False
    diagnose: bool = True
    max_groups: int = DEFAULT_MAX_GROUPS
    datum_advantages: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", data_keys(self.keys))
        for name in ("with_tokens", "diagnose", "datum_advantages"):
            check_bool(name, getattr(self, name))
        check_int("max_groups", self.max_groups, least=1)


def read_step(
    outputs: Any,
    batch: Any,
    options: ReadOptions = ReadOptions(),  # noqa: B008 - frozen
    *,
    optimizer_step: int | None = None,
    warnings: RunWarnings | None = None,
    servers: list[str] | None = None,
) -> FlatBatch:
    """The step's positions, in either contract form (module docstring), read as ``options`` say.

    With ``optimizer_step`` (the caller keeps strata) the policy versions become lags and the groups ids;
    ``servers`` are the run's sampling servers, in the order first named, to which each datum's
    ``sampler_server`` is looked up (and appended; ``read_servers``). What these per-datum keys hold that cannot
    be used is a warning through ``warnings`` (once per run and problem).
    """
    keys, with_tokens, diagnose = options.keys, options.with_tokens, options.diagnose
    step = _Step(outputs, batch, keys, warnings)
    data = step.data
    if data is None and _is_empty_list(batch) and (step.get("logprobs") is None or step.get("mask") is None):
        raise ValueError(
            f"KLSampleTrainMonitor: the batch is an empty {type(batch).__name__}: it holds no datums, and "
            f"training_step's output (keys: {_keys(outputs)}) has no {keys['logprobs']!r} and {keys['mask']!r} "
            "either. Give a list of Datum (with the sampler's 'logprobs' and a 'mask' in each loss_fn_inputs) as the "
            "batch or under 'data', or [B, T] tensors of logprobs and mask"
        )
    if data is not None:
        entropies = [keys[name] for name in ("training_entropy", "training_varentropy") if step.get(name) is not None]
        if entropies:
            raise ValueError(
                f"KLSampleTrainMonitor: {entropies} are read with padded [B, T] tensors, not with a list of Datum; "
                "return the batch's sampler 'logprobs' and 'mask' as [B, T] tensors to check what was sampled"
            )
        flat = flatten_datums(data, step.trainer_logprobs(datums=True), with_tokens=with_tokens, diagnose=diagnose,
                              advantages_key=keys["advantages"])
    else:
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
            sampler_logprobs=step.get("logprobs"), training_logprobs=step.trainer_logprobs(datums=False),
            mask=step.get("mask"), advantages=step.get("advantages"), target_tokens=step.get("target_tokens"),
            input_ids=step.get("input_ids"), with_tokens=with_tokens, training_entropy=step.get("training_entropy"),
            training_varentropy=step.get("training_varentropy"),
        )
    found: dict[str, Any] = {}
    prompts = step.get("sampler_prompt_ids") if diagnose else None
    if prompts is None and diagnose and data is not None:
        prompts = datum_prompts(data, keys["sampler_prompt_ids"])
    if prompts is not None:  # the prompt the sampler saw, against the trainer's (``batch``)
        found["sampler_prompts"] = read_sampler_prompts(prompts, flat.n_datums, device=flat.device,
                                                        key=step.label("sampler_prompt_ids"))
        found["prompt_tokens"], found["first_tokens"] = trainer_tokens(
            data, None if data is not None else step.get("input_ids"),
            None if data is not None else step.get("target_tokens"), flat)
        found["prompt_starts"] = (torch.zeros(flat.n_datums, dtype=torch.int64, device=flat.device) if data is not None
                                  else prompt_starts(step.get("attention_mask"), flat, step.label("attention_mask")))
        if found["prompt_tokens"] is None and warnings is not None:
            warnings.warn("sampler_prompt_ids:no_tokens", f"KLSampleTrainMonitor: {step.label('sampler_prompt_ids')} "
                          "is given, but the batch has neither 'input_ids' nor 'target_tokens': the prompts are not "
                          "compared")
    if options.datum_advantages:
        found["datum_advantages"] = read_advantages(step, flat)
    if diagnose and servers is not None:
        found["servers"] = read_servers(step, flat, servers)
    if optimizer_step is not None:
        found["groups"] = read_groups(step, flat, options.max_groups)
        found["lags"] = read_lags(step, flat, optimizer_step)
    return dataclasses.replace(flat, **found) if found else flat


def read_sampler_facts(outputs: Any, batch: Any, keys: Mapping[str, str], warnings: RunWarnings) -> SamplerFacts | None:
    """The sampling engine's ``SamplerFacts`` under ``keys["sampler_facts"]`` (the output first, then the
    batch); anything else there is one warning per run and ``None``: facts never stop training.

    Examples:
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
        "loops_callbacks.divergence.batch.SamplerFacts; it is not read",
    )
    return None


def trainer_logprobs_from_output(forward_backward_output: Any) -> list[Any]:
    """The per-datum ``"logprobs"`` of a ``ForwardBackwardOutput`` (ours, Loops' or Tinker's).

    Examples:
        >>> from loops_callbacks.types import ForwardBackwardOutput
        >>> trainer_logprobs_from_output(ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0]}]))
        [[0.0]]
    """
    outputs = getattr(forward_backward_output, "loss_fn_outputs", None)
    if outputs is None:
        raise TypeError(
            f"forward_backward_output has no loss_fn_outputs (got {type(forward_backward_output).__name__}); "
            "pass training_logprobs= instead, or the output of a forward_backward call whose loss returns "
            "per-datum logprobs"
        )
    missing = [i for i, item in enumerate(outputs) if not isinstance(item, Mapping) or "logprobs" not in item]
    if missing:
        raise ValueError(
            f"forward_backward_output.loss_fn_outputs items {missing[:10]}{'...' if len(missing) > 10 else ''} "
            f"have no 'logprobs' (of {len(outputs)} items); the loss function must return per-datum "
            "logprobs, or pass training_logprobs= directly"
        )
    return [item["logprobs"] for item in outputs]


class _Step:
    """One step's output and batch, looked up by name: the output first, then the batch; its datums (``None``:
    padded tensors), and where its warnings go (``batch`` reads the per-datum keys from it)."""

    def __init__(self, outputs: Any, batch: Any, keys: Mapping[str, str], warnings: RunWarnings | None = None) -> None:
        self.outputs, self.batch, self.keys = outputs, batch, keys
        self.say = warnings if warnings is not None else RunWarnings()
        data = self.get("data")
        self.data = batch if data is None and _is_datum_list(batch) else data

    def get(self, name: str) -> Any:
        key = self.keys[name]
        for source in (self.outputs, self.batch):
            if isinstance(source, Mapping) and source.get(key) is not None:
                return source[key]
        return None

    def label(self, name: str) -> str:
        return key_label(self.keys, name)

    def given_as_none(self, name: str) -> str | None:
        """Where ``name``'s key holds None ("training_step's output", "the batch") when no place has a value."""
        key = self.keys[name]
        places = [place for place, source in (("training_step's output", self.outputs), ("the batch", self.batch))
                  if isinstance(source, Mapping) and key in source and source[key] is None]
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
        isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, torch.Tensor)) and len(batch) > 0
        and (hasattr(batch[0], "loss_fn_inputs") or (isinstance(batch[0], Mapping) and "loss_fn_inputs" in batch[0]))
    )


def _is_empty_list(batch: Any) -> bool:
    return isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, torch.Tensor)) and len(batch) == 0


def _keys(value: Any) -> list[str] | str:
    return sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
