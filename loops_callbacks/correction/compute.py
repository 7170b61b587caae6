"""Rollout corrections as functions: per-token weights and a keep-mask for the policy-gradient loss.

``apply_correction`` takes right-padded ``[B, T]`` trainer and sampler logprobs, the action mask
(and the advantages, for ``off_policy_mask``) and returns a ``CorrectionResult``: ``weights`` to
multiply into the per-token loss (already 0 wherever a token is masked or is not an action
token), ``keep`` (the action tokens the correction keeps), ``clipped`` (the action tokens whose
weight a truncation changed) and the raw ``log_ratio``. ``correct_flat`` is the same on the
concatenated positions of a batch (a ``CorrectionInput``: ``[L]`` positions in rows of any
lengths), and ``correct_rows`` a sequence-level correction per row, which the monitor's shadow
statistics use: one implementation of every formula.

Each method computes what its framework computes (``spec`` names the code; the golden tests
compare against it), in float64 from the float64 log ratio ``trainer - sampler``. A token whose
log ratio is not finite (a logprob None, NaN or ±inf: the tokens the main metrics skip,
``n_skipped_nonfinite``) is missing: it is in no sequence's sum or count, and

* TRL (``token_*`` / ``sequence_*``, ``icepop``): ``exp`` of the token's (or the sequence's summed)
  log ratio, clamped into [clip_min, clip_max] (truncate) or set to 0 outside it (mask). A missing
  token has ratio 1, as TRL gives a NaN one (TRL reads ±inf as ±3.4e38, whose sums depend on the
  order of the additions).
* verl truncated IS (``token_tis``, ``sequence_tis``): the log ratio (summed per sequence)
  clamped to ±20, ``exp``, then capped at ``threshold``. verl lets a NaN log ratio make the
  weight NaN (and with it the loss); here a missing token has ratio 1, as in TRL.
* verl rejection (``token_k1`` ... ``seq_max_k3``, ``geo``): k1 = -log r, k2 = (log r)² / 2,
  k3 = r - 1 - log r of the clamped log ratio, per token or per sequence (sum, mean with verl's
  ``count + 1e-8`` denominator, max), kept within the bounds. A missing token fails every bound,
  as a NaN does in verl: the token (or its whole sequence) is rejected.
* TRL's off-policy mask: the sequence's mean of sampler - trainer over its finite tokens
  (divided by max(count, 1)); a sequence with advantage < 0 and that mean > threshold is dropped,
  and so is one whose advantage is NaN (it cannot be judged).

Positions outside the mask are never read (their weight is 0, their keep False). An all-empty
mask gives all-zero weights (verl raises a ValueError there; nothing is wrong with such a batch).

Examples:
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
from functools import cached_property
from typing import NamedTuple

import torch

from loops_callbacks.correction.spec import Correction, parse_correction
from loops_callbacks.validation import check, check_logprobs_dtype


VERL_SAFETY_BOUND = 20.0
"""verl's ``SAFETY_BOUND``: log ratios are clamped to ±20 before ``exp`` (rollout_corr_helper.py)."""
VERL_MEAN_EPSILON = 1e-8
"""verl's ``masked_mean`` divides by ``count + 1e-8`` (verl/utils/torch_functional.py)."""


@dataclass(frozen=True)
class Segments:
    """Rows of given lengths over ``L`` concatenated positions: sums, maxima and spreading per row. The lengths
    are the caller's promise (``FlatBatch.row_lengths``, or full rows): reading them back would synchronize.

    Examples:
        >>> rows = Segments(torch.tensor([2, 1]), total=3)
        >>> rows.sum(torch.tensor([1.0, 2.0, 5.0])).tolist()
        [3.0, 5.0]
    """

    lengths: torch.Tensor  # int64 [B], on the positions' device, each >= 0
    total: int  # L = lengths.sum(), known on the host

    @cached_property
    def index(self) -> torch.Tensor:
        """Int64 [L]: the row of each position."""
        rows = torch.arange(self.lengths.numel(), device=self.lengths.device)
        return torch.repeat_interleave(rows, self.lengths, output_size=self.total)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row sum (0 for an empty row)."""
        return self._reduce(values, "sum", 0.0)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row maximum; -inf for an empty row, NaN for a row with a NaN."""
        return self._reduce(values, "max", -math.inf)

    def _reduce(self, values: torch.Tensor, how: str, initial: float) -> torch.Tensor:
        if not self.lengths.numel():  # segment_reduce needs a row
            return values.new_zeros(0)
        # unsafe: the lengths sum to ``total`` by construction, and its checks would read them on the host
        return torch.segment_reduce(values, how, lengths=self.lengths, unsafe=True, initial=initial)

    def spread(self, per_row: torch.Tensor) -> torch.Tensor:
        """Each row's value at each of its positions."""
        return per_row.index_select(0, self.index)


class CorrectionInput:
    """The positions corrections read, and what they share, computed once on first use.

    ``log_ratio`` is float64 [L] ``trainer - sampler`` (NaN or ±inf where a logprob is missing), ``mask``
    bool [L] the action tokens, ``rows`` the rows the positions form, ``advantages`` float64 [B]
    (only ``off_policy_mask`` reads it). Several corrections of one batch read one input.
    """

    def __init__(
        self, log_ratio: torch.Tensor, mask: torch.Tensor, rows: Segments, advantages: torch.Tensor | None = None
    ) -> None:
        self.log_ratio, self.mask, self.rows, self.advantages = log_ratio, mask, rows, advantages

    @cached_property
    def finite(self) -> torch.Tensor:
        """Bool [L]: the action tokens with a finite log ratio, those the main metrics count; the others are missing."""
        return self.mask & torch.isfinite(self.log_ratio)

    @cached_property
    def zeroed(self) -> torch.Tensor:
        """The log ratio on ``finite`` tokens, 0 elsewhere (TRL: ``nan_to_num((t - s) * mask, nan=0.0)`` for NaN)."""
        return torch.where(self.finite, self.log_ratio, 0.0)

    @cached_property
    def row_count(self) -> torch.Tensor:
        """Float64 [B]: ``finite`` tokens per row."""
        return self.rows.sum(self.finite.to(torch.float64))

    @cached_property
    def row_log_ratio(self) -> torch.Tensor:
        """Float64 [B]: each row's summed ``zeroed``: the log of its sequence ratio."""
        return self.rows.sum(self.zeroed)


class Weights(NamedTuple):
    """A correction's float64 ``weights``, bool ``keep`` and ``clipped``: per row (``correct_rows``: every action
    token of a row has its row's weight and fate) or per position (``correct_flat``)."""

    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor


@dataclass(frozen=True)
class CorrectionResult:
    """``apply_correction``'s answer, ``[B, T]`` on the inputs' device (module docstring).

    ``weights`` is float32, or float64 for float64 trainer logprobs (a bound never overflows a 16-bit
    dtype); ``log_ratio`` is float64 ``trainer - sampler``
    as given (NaN where a logprob is missing, whatever off the mask).
    """

    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor
    log_ratio: torch.Tensor


@torch.no_grad()
def correct_rows(correction: Correction, x: CorrectionInput) -> Weights:
    """A sequence-level ``correction`` (``correction.spec.level == "sequence"``) per row of ``x``.

    Examples:
        >>> x = CorrectionInput(torch.tensor([0.5, 0.5, 0.1], dtype=torch.float64), torch.tensor([True, True, True]),
        ...                     Segments(torch.tensor([2, 1]), total=3))
        >>> rows = correct_rows(parse_correction("sequence_truncate:2.0"), x)
        >>> [round(w, 4) for w in rows.weights.tolist()], rows.clipped.tolist()
        ([2.0, 1.1052], [True, False])
    """
    if correction.spec.level != "sequence":
        raise ValueError(f"correction {correction.name!r} is token-level; use correct_flat")
    if correction.spec.family != "off_policy":
        return _weights(correction, x, x.row_log_ratio, torch.ones_like(x.row_count, dtype=torch.bool))
    if x.advantages is None:
        raise ValueError(f"correction {correction.name!r} needs the advantages (one per sequence); pass advantages=")
    mean_kl = -x.row_log_ratio / x.row_count.clamp(min=1.0)  # sampler minus trainer, as TRL's kl_div
    keep = ~x.advantages.isnan() & ((x.advantages >= 0) | (mean_kl <= correction.params["threshold"]))
    return Weights(keep.to(torch.float64), keep, torch.zeros_like(keep))


@torch.no_grad()
def correct_flat(correction: Correction, x: CorrectionInput) -> Weights:
    """``correction`` at every position of ``x``: weights 0 and keep False off the mask.

    Examples:
        >>> x = CorrectionInput(torch.tensor([0.5, 2.0], dtype=torch.float64), torch.tensor([True, True]),
        ...                     Segments(torch.tensor([2]), total=2))
        >>> out = correct_flat(parse_correction("token_truncate:2.0"), x)
        >>> [round(w, 4) for w in out.weights.tolist()], out.clipped.tolist()
        ([1.6487, 2.0], [False, True])
    """
    spec = correction.spec
    if spec.level == "sequence":
        rows = correct_rows(correction, x)
        keep = x.mask & x.rows.spread(rows.keep)
        weights = torch.where(x.mask, x.rows.spread(rows.weights), 0.0)  # a row's weight may be inf: no inf * 0
        return Weights(weights, keep, x.mask & x.rows.spread(rows.clipped))
    result = _weights(correction, x, x.zeroed, x.mask)
    return Weights(result.weights * x.mask, result.keep, result.clipped)  # off the mask the ratio is 1


def _weights(correction: Correction, x: CorrectionInput, log_ratio: torch.Tensor, mask: torch.Tensor) -> Weights:
    """The weights of ``log_ratio`` (``x``'s rows' or its positions') where ``mask``: verl's truncated IS (``exp`` of
    the log ratio clamped to ±20, capped at ``threshold``), verl's rejection, or TRL's truncate (the ratio clamped into
    [clip_min, clip_max]) or mask (0 outside it)."""
    params = correction.params
    if correction.spec.family == "verl_is":
        ratio = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
        return Weights(ratio.clamp(max=params["threshold"]), mask, mask & (ratio > params["threshold"]))
    if correction.spec.family == "verl_rs":
        keep = mask & _verl_rejection_keep(correction, x)
        return Weights(keep.to(torch.float64), keep, torch.zeros_like(keep))
    ratio = torch.exp(log_ratio)
    low, high = params["clip_min"], params["clip_max"]
    outside = torch.zeros_like(mask)
    if low is not None:
        outside |= ratio < low
    if high is not None:
        outside |= ratio > high
    if correction.spec.formula.endswith("truncate"):
        weight = ratio if low is None and high is None else ratio.clamp(min=low, max=high)
        return Weights(weight, mask, mask & outside)
    return Weights(ratio.masked_fill(outside, 0.0), mask & ~outside, torch.zeros_like(mask))


_VERL_ESTIMATORS = {  # of the log ratio log r: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.exp(log_r) - 1.0 - log_r,
}


def _verl_rejection_keep(correction: Correction, x: CorrectionInput) -> torch.Tensor:
    """verl's keep (``compute_rollout_rejection_mask``): per position for token options, per row for sequence options.

    The statistic is read from the log ratio with a missing one as NaN: a NaN fails every bound,
    so verl rejects the token, or (sequence options) its whole row.
    """
    option = correction.spec.formula
    safe = x.log_ratio.where(x.finite, math.nan).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)  # off the mask: unread
    kind = option[-2:]
    stat = _VERL_ESTIMATORS[kind](safe)
    if option.startswith("seq_max"):
        peak = x.rows.max(stat.masked_fill(~x.mask, -math.inf))  # verl: masked -inf, an empty row's max is 0
        stat = torch.where(peak == -math.inf, 0.0, peak)
    elif option.startswith("seq_"):
        stat = x.rows.sum(stat.masked_fill(~x.mask, 0.0))
        if option.startswith("seq_mean"):
            stat = stat / (x.row_count + VERL_MEAN_EPSILON)
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

    Examples:
        >>> t, s = torch.zeros(2, 3), torch.full((2, 3), -0.5)
        >>> apply_correction("sequence_mask", t, s, torch.ones(2, 3)).keep.any().item()  # e^1.5 = 4.5 > 3
        False
    """
    correction = parse_correction(correction)
    for key, tensor in (("trainer_logprobs", trainer_logprobs), ("sampler_logprobs", sampler_logprobs), ("mask", mask)):
        check(repr(key), tensor, torch.Tensor, "a [B, T] tensor")
        if tensor.dim() != 2:
            raise ValueError(f"{key!r} must be a [B, T] tensor, got shape {tuple(tensor.shape)}")
        if tensor.shape != trainer_logprobs.shape:
            raise ValueError(f"{key!r} has shape {tuple(tensor.shape)} but 'trainer_logprobs' has "
                             f"{tuple(trainer_logprobs.shape)}; the fields must be aligned position by position")
        if key != "mask":
            check_logprobs_dtype(repr(key), tensor)
    batch, width = trainer_logprobs.shape
    device = trainer_logprobs.device
    shapes = f"({batch},) or ({batch}, 1)"
    per_row = None
    if advantages is not None:
        check("'advantages'", advantages, torch.Tensor, f"a tensor of shape {shapes}")
        if tuple(advantages.shape) not in ((batch,), (batch, 1)):
            raise ValueError(f"'advantages' has shape {tuple(advantages.shape)}; expected {shapes}, one per sequence")
        per_row = advantages.detach().reshape(batch).to(device=device, dtype=torch.float64)
    elif correction.spec.needs_advantages:
        raise ValueError(f"correction {correction.name!r} needs 'advantages' of shape {shapes}")
    trainer = trainer_logprobs.detach()
    log_ratio = trainer.to(torch.float64) - sampler_logprobs.detach().to(device=device, dtype=torch.float64)
    active = mask.detach().to(device) > 0
    rows = Segments(torch.full((batch,), width, dtype=torch.int64, device=device), total=batch * width)
    flat = correct_flat(correction, CorrectionInput(log_ratio.reshape(-1), active.reshape(-1), rows, per_row))
    return CorrectionResult(
        weights=flat.weights.reshape(batch, width).to(torch.promote_types(trainer.dtype, torch.float32)),
        keep=flat.keep.reshape(batch, width),
        clipped=flat.clipped.reshape(batch, width),
        log_ratio=log_ratio,
    )
