"""Rollout corrections as functions: per-token weights and a keep-mask for the policy-gradient loss.

``apply_correction`` takes right-padded ``[B, T]`` trainer and sampler logprobs, the action mask
(and the advantages, for ``off_policy_mask``) and returns a ``CorrectionResult``: ``weights`` to
multiply into the per-token loss (already 0 wherever a token is masked or is not an action
token), ``keep`` (the action tokens the correction keeps), ``clipped`` (the action tokens whose
weight a truncation changed) and the raw ``log_ratio``. ``correct_flat`` is the same on the
concatenated positions of a batch (``[L]`` with a row per position), which the monitor's shadow
statistics use: one implementation of every formula.

Each method computes what its framework computes (``spec`` names the code; the golden tests
compare against it), in float64 from the float64 log ratio ``trainer - sampler``:

* TRL (``token_*`` / ``sequence_*``, ``icepop``): ``exp`` of the token's (or the sequence's summed)
  log ratio, clamped into [clip_min, clip_max] (truncate) or set to 0 outside it (mask). A NaN
  log ratio (the sampler could not score the token) counts as 0, a ratio of 1, as TRL does.
* verl truncated IS (``token_tis``, ``sequence_tis``): the log ratio (summed per sequence)
  clamped to ±20, ``exp``, then capped at ``threshold``. verl lets a NaN log ratio make the
  weight NaN (and with it the loss); here it counts as 0, as TRL does.
* verl rejection (``token_k1`` ... ``seq_max_k3``, ``geo``): k1 = -log r, k2 = (log r)² / 2,
  k3 = r - 1 - log r of the clamped log ratio, per token or per sequence (sum, mean with verl's
  ``count + 1e-8`` denominator, max), kept within the bounds. A NaN log ratio fails every bound,
  as in verl: the token (or its whole sequence) is rejected.
* TRL's off-policy mask: the sequence's mean of sampler - trainer (NaN counted as 0, divided by
  max(count, 1)); a sequence with advantage < 0 and that mean > threshold is dropped.

Positions outside the mask are never read (their weight is 0, their keep False). An all-empty
mask gives all-zero weights (verl raises a ValueError there; nothing is wrong with such a batch).

Example:
    >>> import torch
    >>> trainer = torch.tensor([[-1.0, -2.0, 0.0]])
    >>> sampler = torch.tensor([[-1.5, -1.0, 0.0]])
    >>> mask = torch.tensor([[1.0, 1.0, 0.0]])
    >>> result = apply_correction("token_mask:1.5", trainer, sampler, mask)
    >>> result.keep.tolist(), [round(w, 4) for w in result.weights[0].tolist()]
    ([[False, True, False]], [0.0, 0.3679, 0.0])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loops_callbacks.correction.spec import Correction, parse_correction

__all__ = ["CorrectionResult", "FlatCorrection", "Segments", "apply_correction", "correct_flat"]

VERL_SAFETY_BOUND = 20.0
"""verl's ``SAFETY_BOUND``: log ratios are clamped to ±20 before ``exp`` (rollout_corr_helper.py)."""
VERL_MEAN_EPSILON = 1e-8
"""verl's ``masked_mean`` divides by ``count + 1e-8`` (verl/utils/torch_functional.py)."""


@dataclass(frozen=True)
class Segments:
    """Which row each of ``L`` concatenated positions belongs to, and sums / maxima per row.

    Example:
        >>> rows = Segments.of_lengths(torch.tensor([2, 1]), total=3)
        >>> rows.sum(torch.tensor([1.0, 2.0, 5.0])).tolist()
        [3.0, 5.0]
    """

    index: torch.Tensor  # int64 [L], the row of each position
    n_rows: int

    @classmethod
    def of_lengths(cls, row_lengths: torch.Tensor, *, total: int) -> Segments:
        """Rows of the given lengths (on their device), ``total`` = their sum, known on the host."""
        rows = torch.arange(row_lengths.numel(), device=row_lengths.device)
        return cls(torch.repeat_interleave(rows, row_lengths, output_size=total), int(row_lengths.numel()))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(self.n_rows).index_add_(0, self.index, values)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row maximum; -inf for a row without positions."""
        empty = values.new_full((self.n_rows,), -math.inf)
        return empty.scatter_reduce_(0, self.index, values, "amax", include_self=True)

    def spread(self, per_row: torch.Tensor) -> torch.Tensor:
        """Each row's value at each of its positions."""
        return per_row.index_select(0, self.index)


@dataclass(frozen=True)
class FlatCorrection:
    """A correction on concatenated positions: float64 ``weights``, bool ``keep`` and ``clipped``, all ``[L]``."""

    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor


@dataclass(frozen=True)
class CorrectionResult:
    """``apply_correction``'s answer, ``[B, T]`` on the inputs' device (module docstring).

    ``weights`` has the trainer logprobs' dtype; ``log_ratio`` is float64 ``trainer - sampler``
    as given (NaN where a logprob is missing, whatever off the mask).
    """

    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor
    log_ratio: torch.Tensor


@torch.no_grad()
def correct_flat(
    correction: Correction,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    rows: Segments,
    advantages: torch.Tensor | None = None,
) -> FlatCorrection:
    """``correction`` on float64 ``log_ratio`` [L] (trainer - sampler), bool ``mask`` [L], per-row ``advantages`` [B].

    Example:
        >>> rows = Segments.of_lengths(torch.tensor([2]), total=2)
        >>> out = correct_flat(parse_correction("sequence_truncate:2.0"), torch.tensor([0.5, 0.5], dtype=torch.float64),
        ...                    torch.tensor([True, True]), rows)
        >>> out.weights.tolist(), out.clipped.tolist()
        ([2.0, 2.0], [True, True])
    """
    spec = correction.spec
    known = mask & ~torch.isnan(log_ratio)
    d = torch.where(known, log_ratio, 0.0)  # off the mask and NaN: 0 (TRL's nan_to_num((t - s) * mask))
    clipped = torch.zeros_like(mask)
    if spec.family == "trl":
        ratio = torch.exp(d if spec.level == "token" else rows.spread(rows.sum(d)))
        low, high = correction.params["clip_min"], correction.params["clip_max"]
        outside = _outside(ratio, low, high)
        if spec.formula.endswith("truncate"):
            weights = ratio if low is None and high is None else ratio.clamp(min=low, max=high)
            keep, clipped = mask, mask & outside
        else:
            weights = ratio.masked_fill(outside, 0.0)
            keep = mask & ~outside
    elif spec.family == "verl_is":
        summed = d if spec.level == "token" else rows.spread(rows.sum(d))
        ratio = torch.exp(summed.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
        threshold = correction.params["threshold"]
        weights, keep, clipped = ratio.clamp(max=threshold), mask, mask & (ratio > threshold)
    elif spec.family == "verl_rs":
        keep = mask & _verl_rejection_keep(correction, torch.where(mask, log_ratio, 0.0), mask, rows)
        weights = keep.to(torch.float64)
    else:  # off_policy
        if advantages is None:
            raise ValueError(
                f"correction {correction.name!r} needs the advantages (one per sequence); pass advantages="
            )
        count = rows.sum(mask.to(torch.float64)).clamp(min=1.0)
        mean_kl = rows.sum(-d) / count  # the sampler's minus the trainer's logprob, as TRL's kl_div
        keep = mask & rows.spread((advantages >= 0) | (mean_kl <= correction.params["threshold"]))
        weights = keep.to(torch.float64)
    return FlatCorrection(torch.where(mask, weights, 0.0), keep, clipped)


def _outside(ratio: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if low is not None:
        outside |= ratio < low
    if high is not None:
        outside |= ratio > high
    return outside


def _verl_rejection_keep(
    correction: Correction, log_ratio: torch.Tensor, mask: torch.Tensor, rows: Segments
) -> torch.Tensor:
    """verl's per-option keep (``compute_rollout_rejection_mask``) at every position; NaN log ratios fail."""
    option = correction.spec.formula
    safe = log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    kind = option[-2:]
    if kind == "k1":
        stat = -safe
    elif kind == "k2":
        stat = 0.5 * safe**2
    else:
        stat = torch.exp(safe) - 1.0 - safe
    if option.startswith("seq_sum") or option.startswith("seq_mean"):
        total = rows.sum(torch.where(mask, stat, 0.0))
        if option.startswith("seq_mean"):
            total = total / (rows.sum(mask.to(torch.float64)) + VERL_MEAN_EPSILON)
        stat = rows.spread(total)
    elif option.startswith("seq_max"):
        peak = rows.max(torch.where(mask, stat, -math.inf))
        # a NaN token makes its sequence's max NaN in verl (torch.max propagates NaN); amax does too
        stat = rows.spread(torch.where(peak == -math.inf, 0.0, peak))
    upper = correction.params["upper"]
    if kind == "k1":
        return (stat >= math.log(correction.params["lower"])) & (stat <= math.log(upper))
    return stat <= upper


def apply_correction(
    correction: str | Correction,
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
) -> CorrectionResult:
    """Weights and keep-mask of ``correction`` for right-padded ``[B, T]`` logprobs (module docstring).

    ``mask`` > 0 marks action tokens; ``advantages`` is ``[B]`` or ``[B, 1]``, needed only by
    ``off_policy_mask``. The inputs are not modified; everything is computed without gradient on
    the trainer logprobs' device.

    Example:
        >>> t, s = torch.zeros(2, 3), torch.full((2, 3), -0.5)
        >>> apply_correction("sequence_mask", t, s, torch.ones(2, 3)).keep.any().item()  # e^1.5 = 4.5 > 3
        False
    """
    correction = parse_correction(correction)
    for key, tensor in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs), ("mask", mask)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{key!r} must be a [B, T] tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{key!r} must be a [B, T] tensor, got shape {tuple(tensor.shape)}")
        if tensor.shape != trainer_logprobs.shape:
            raise ValueError(
                f"{key!r} has shape {tuple(tensor.shape)} but 'trainer_logprobs' has {tuple(trainer_logprobs.shape)}; "
                "the fields must be aligned position by position"
            )
    for key, tensor in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs)):
        if not tensor.is_floating_point():
            raise TypeError(f"{key!r} must hold floating-point logprobs, got dtype {tensor.dtype}")
    batch, width = trainer_logprobs.shape
    device = trainer_logprobs.device
    per_row = None
    if advantages is not None:
        if not isinstance(advantages, torch.Tensor):
            raise TypeError(
                f"'advantages' must be a tensor of shape ({batch},) or ({batch}, 1), got {type(advantages).__name__}"
            )
        if tuple(advantages.shape) not in ((batch,), (batch, 1)):
            raise ValueError(
                f"'advantages' has shape {tuple(advantages.shape)}; expected ({batch},) or ({batch}, 1), "
                "one per sequence"
            )
        per_row = advantages.detach().reshape(batch).to(device=device, dtype=torch.float64)
    elif correction.spec.needs_advantages:
        raise ValueError(f"correction {correction.name!r} needs 'advantages' of shape ({batch},) or ({batch}, 1)")
    trainer = trainer_logprobs.detach()
    log_ratio = trainer.to(torch.float64) - sampler_logprobs.detach().to(device=device, dtype=torch.float64)
    active = mask.detach().to(device) > 0
    rows = Segments.of_lengths(torch.full((batch,), width, dtype=torch.int64, device=device), total=batch * width)
    flat = correct_flat(correction, log_ratio.reshape(-1), active.reshape(-1), rows, per_row)
    return CorrectionResult(
        weights=flat.weights.reshape(batch, width).to(trainer.dtype),
        keep=flat.keep.reshape(batch, width),
        clipped=flat.clipped.reshape(batch, width),
        log_ratio=log_ratio,
    )
