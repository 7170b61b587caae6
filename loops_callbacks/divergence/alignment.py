"""Do the sampler's logprobs sit at the wrong positions? Offsets of any size, from mergeable sums.

The commonest alignment bugs move the sampler's values along the row: one or a few positions
late or early (o > 0: the trainer's value at k matches the sampler's at k + o; o < 0: at
k − |o|), or completion-only logprobs left at position 0 instead of at the completion (the
value of the completion's j-th token sits at j: o = −(the row's first action position), which
differs per row). ``offset_sums(flat)`` measures both, as one float64 vector of a fixed size
(``OFFSET_SIZE``) that merges by sum across micro-batches and ranks:

* every row votes for its best offset. On its first ``OFFSET_WINDOW`` positions (all of a
  shorter row), the gap between the trainer's action-token values t[k] and the sampler's s[k + o]
  is computed for every o at once (cross-correlations by FFT, vectorized over rows on the
  batch's device). A pair's gap is 1 − cos(ω (s − t)) averaged over two frequencies: about
  (ω δ)² / 2 for a small difference δ, and bounded, so one outlying value weighs like one
  unrelated pair; an action token left without a pair at o counts as unrelated, so that no
  offset wins by leaving a bad pair out. The o with the smallest gap is the row's vote. Votes
  fall into ``OFFSET_BINS`` bins (exact for |o| <= 8, by powers of two above), and each bin sums
  its rows, o, o², the mean gap of the voted pairs and of the aligned pairs (o = 0): an offset is
  the bin most rows vote for, its size the bin's mean o, its strength the ratio of the two gaps;
* the left-aligned hypothesis is tested directly on every action token in the window: the gap
  |t[k] − s[k − first]| against |t[k] − s[k]| (each capped at ``GAP_CAP`` nats, so that one
  sentinel-like outlier cannot decide), over rows whose first action position is above 0, and
  the rows whose vote is exactly −first are counted.

Sampler values that are non-finite, exactly 0.0 (padding; prompt positions without a logprob) or
below ``LOGPROB_FLOOR`` (sentinels) pair with nothing. Rows with fewer than ``MIN_OVERLAP``
action tokens do not vote. ``read_offsets`` turns the host vector into an ``Offsets``; an offset
larger than the window, or action tokens beyond it, are not seen.

Cost: a few passes over the [rows, window] positions plus six FFTs of twice the window per row,
in groups of about ``GROUP_POSITIONS`` positions; no host synchronization off the CPU.

Examples:
    >>> import torch
    >>> from loops_callbacks.divergence.flat_batch import flatten_padded
    >>> trainer = -torch.rand(8, 24, generator=torch.Generator().manual_seed(0)) * 3
    >>> sampler = torch.cat([torch.zeros(8, 3), trainer[:, :-3]], dim=1)  # each value 3 positions late
    >>> flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=trainer, mask=torch.ones(8, 24))
    >>> found = read_offsets(offset_sums(flat).numpy())
    >>> found.offset, found.share, found.ratio < 1e-9
    (3.0, 1.0, True)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from loops_callbacks.divergence.flat_batch import LOGPROB_FLOOR, FlatBatch


OFFSET_WINDOW = 2048
"""Positions read from the start of each row (all of a shorter row): an action token beyond
them, or an offset reaching beyond them, is not seen."""
EXACT = 8
"""Offsets up to this size each have their own bin; larger ones share a bin per power of two."""
_LOG_BINS = max(int(math.ceil(math.log2(OFFSET_WINDOW))) - int(math.log2(EXACT)), 0)
OFFSET_BINS = 2 * _LOG_BINS + 2 * EXACT + 1
"""Vote bins: ``_LOG_BINS`` for o < −8 (largest first), −8 … 8, then ``_LOG_BINS`` for o > 8."""
BIN_FIELDS = ("rows", "sum_offset", "sum_offset2", "sum_gap_voted", "sum_gap_aligned")
"""What each bin sums over the rows that vote for it (the gaps are mean squared gaps per row)."""
LEFT_FIELDS = ("left_rows", "left_vote_rows", "left_pairs", "left_gap", "left_gap_aligned")
"""The left-aligned test: rows with a first action position > 0, those whose vote is −first,
action tokens paired at k − first, and the capped gaps there and at k."""
OFFSET_SIZE = len(BIN_FIELDS) * OFFSET_BINS + len(LEFT_FIELDS)
"""Length of ``offset_sums``' vector: the bins field by field, then ``LEFT_FIELDS``."""
FREQUENCIES = (2.0, 3.2)
"""ω of the bounded pair gap 1 − mean cos(ω δ) (two, so that no single δ = 2π/ω aliases to a match)."""
GAP_CAP = 10.0
MIN_OVERLAP = 8
"""A row votes when it has at least this many action tokens in its window: in shorter rows of a
peaked policy (values all near 0), a neighbour's value can match as well as the aligned one."""
GROUP_POSITIONS = 1 << 16
"""Positions (rows x window) transformed at a time: about 35 MB of complex128 FFT temporaries, however
long the rows (a Python loop over groups of rows, no sync)."""


@dataclass(frozen=True)
class Offsets:
    """What ``offset_sums`` says about a step (host numbers; NaN where nothing was measured).

    ``offset`` is the mean vote of the bin most rows voted for (0.0 when that is the aligned bin),
    ``share`` that bin's share of the voting ``rows``, ``spread`` the standard deviation of the
    votes in it, ``ratio`` its gap at the vote over its gap at o = 0 (small: the offset explains
    the mismatch). ``left_ratio`` and ``left_share`` are the left-aligned test's gap ratio and the
    share of rows (with a first action position > 0) whose vote was −first.
    """

    rows: float
    offset: float
    share: float
    spread: float
    ratio: float
    left_rows: float
    left_ratio: float
    left_share: float


@torch.no_grad()
def offset_sums(flat: FlatBatch) -> torch.Tensor:
    """Float64 ``[OFFSET_SIZE]`` on the batch's device (module docstring); sums, so parts merge by ``+``."""
    device = flat.diff.device
    out = torch.zeros(OFFSET_SIZE, dtype=torch.float64, device=device)
    length, rows = flat.diff.shape[0], flat.n_datums
    if length == 0 or rows == 0:
        return out
    # the window: OFFSET_WINDOW, or less when no row is that long (read on the host only on the CPU)
    longest = int(flat.row_lengths.max()) if flat.row_lengths.device.type == "cpu" else length
    width = max(1, min(OFFSET_WINDOW, longest))
    values = torch.stack([flat.sampler.to(torch.float64), flat.trainer.to(torch.float64)])
    starts = torch.cumsum(flat.row_lengths, 0) - flat.row_lengths
    bins = out[: len(BIN_FIELDS) * OFFSET_BINS].view(len(BIN_FIELDS), OFFSET_BINS)
    group = max(1, GROUP_POSITIONS // max(width, 1))
    for begin in range(0, rows, group):
        end = min(begin + group, rows)
        window = _Window.of(values, flat.active, starts[begin:end], flat.row_lengths[begin:end], width)
        voted, vote, gap_voted, gap_aligned = _row_votes(window)
        weight, o = voted.to(torch.float64), vote.to(torch.float64)  # each voting row, summed into its bin
        votes = torch.stack([weight, weight * o, weight * o * o, weight * gap_voted, weight * gap_aligned])
        bins.index_add_(1, torch.bucketize(vote, _bin_upper(vote.device)), votes)
        out[len(BIN_FIELDS) * OFFSET_BINS :] += _left_aligned(window, voted=voted, vote=vote)
    return out


def read_offsets(sums: np.ndarray) -> Offsets:
    """The ``Offsets`` of a host ``offset_sums`` vector (merged over micro-batches and ranks)."""
    count, total, squares, gap_voted, gap_aligned = sums[: len(BIN_FIELDS) * OFFSET_BINS].reshape(len(BIN_FIELDS), -1)
    left_rows, left_vote_rows, left_pairs, left_gap, left_gap_aligned = sums[len(BIN_FIELDS) * OFFSET_BINS :]
    rows = float(count.sum())
    nan = float("nan")
    if rows == 0:
        offset = share = spread = ratio = nan
    else:
        best = int(np.argmax(count))  # ties: the first bin, largest early offsets first; the aligned bin wins over them
        if count[best] == count[_ALIGNED_BIN]:
            best = _ALIGNED_BIN
        n = count[best]
        offset = float(total[best] / n)
        share = float(n / rows)
        spread = float(math.sqrt(max(squares[best] / n - offset**2, 0.0)))
        if gap_aligned[best] > 0:
            ratio = float(gap_voted[best] / gap_aligned[best])
        else:
            ratio = 0.0 if best == _ALIGNED_BIN else nan
    left_ratio = float(left_gap / left_gap_aligned) if left_pairs and left_gap_aligned > 0 else nan
    left_share = float(left_vote_rows / left_rows) if left_rows else nan
    return Offsets(rows, offset + 0.0, share, spread, ratio, float(left_rows), left_ratio, left_share)


_ALIGNED_BIN = _LOG_BINS + EXACT


@dataclass(frozen=True)
class _Window:
    """The first ``width`` positions of a group of rows, padded: [rows, width] each."""

    s: torch.Tensor  # float64 sampler logprobs (0 off the row)
    t: torch.Tensor  # float64 trainer logprobs
    active: torch.Tensor  # bool, FlatBatch.active in the row (its action tokens)
    usable: torch.Tensor  # bool, sampler values that can pair (finite, not exactly 0, not a sentinel)
    first: torch.Tensor  # int64 [rows], first action position; width when none

    @classmethod
    def of(
        cls, values: torch.Tensor, active: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, width: int
    ) -> _Window:
        steps = torch.arange(width, device=values.device)
        in_row = steps < lengths[:, None]
        index = (starts[:, None] + steps).clamp_(max=values.shape[1] - 1)
        s, t = values[:, index].unbind(0)
        active = active[index] & in_row
        usable = torch.isfinite(s) & (s != 0.0) & (s > LOGPROB_FLOOR) & in_row
        first = torch.where(active, steps, width).amin(dim=-1)
        return cls(s, t, active, usable, first)


def _row_votes(window: _Window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: whether it votes, its vote o, and the mean gap of its pairs at o and at 0.

    The gap of a pair is 1 − mean over ``FREQUENCIES`` of cos(ω (s − t)): about (ω δ)² / 2 for a
    small difference δ, at most 2 for any, so one outlying value weighs like one unrelated pair.
    The vote minimizes the gap over the row's action tokens, an unpaired one counting 1 (an
    unrelated pair's mean), so that no offset wins by leaving a bad pair out.
    """
    width = window.s.shape[1]
    m = window.active.to(torch.float64)
    v = window.usable.to(torch.float64)
    t = torch.where(window.active, window.t, 0.0)
    s = torch.where(window.usable, window.s, 0.0)
    size = 2 * width
    omega = torch.tensor((0.0, *FREQUENCIES), dtype=torch.float64, device=m.device)[:, None, None]
    waves_t = torch.polar(m.expand(len(omega), -1, -1), omega * t)  # ω = 0 counts the pairs
    waves_s = torch.polar(v.expand(len(omega), -1, -1), omega * s)
    # corr(a, b)(o) = sum_k conj(a[k]) b[k + o] = ifft(conj(A) B)(o mod size)
    spectra = torch.fft.fft(waves_t, n=size).conj_physical_().mul_(torch.fft.fft(waves_s, n=size))
    correlations = torch.fft.ifft(spectra, n=size).real
    offsets = torch.arange(-(width - 1), width, device=m.device)
    correlations = correlations[:, :, offsets.remainder(size)]
    paired = correlations[0].round_()
    gap_sum = (paired - correlations[1:].mean(0)).clamp_(min=0.0)
    n_action = m.sum(-1, keepdim=True)
    penalized = (gap_sum + (n_action - paired)) / n_action.clamp(min=1.0)
    score = torch.where(paired > 0, penalized + 1e-9 * offsets.abs(), float("inf"))
    best = torch.argmin(score, dim=-1)
    voted = n_action.squeeze(-1) >= MIN_OVERLAP
    gap = gap_sum / paired.clamp(min=1.0)
    return voted, offsets.index_select(0, best), gap.gather(1, best[:, None]).squeeze(1), gap[:, width - 1]


_BIN_UPPER_BOUNDS = (
    [-(2 ** (p + 2)) - 1 for p in range(_LOG_BINS, 0, -1)]
    + list(range(-EXACT, EXACT + 1))
    + [2 ** (p + 3) for p in range(1, _LOG_BINS)]
)
"""The largest offset of each bin but the last (bins: o <= -2^(p+2) - 1 by power p, -8 … 8, then
o <= 2^(p+3)); ``torch.bucketize`` finds a vote's bin."""


@functools.lru_cache(maxsize=None)
def _bin_upper(device: torch.device) -> torch.Tensor:
    """``_BIN_UPPER_BOUNDS`` as int64 on ``device``, made once per device (no host copy per step)."""
    return torch.tensor(_BIN_UPPER_BOUNDS, dtype=torch.int64, device=device)


def _left_aligned(window: _Window, *, voted: torch.Tensor, vote: torch.Tensor) -> torch.Tensor:
    """``LEFT_FIELDS`` of a group: rows with first > 0, their votes at −first, pairs, gaps at k − first and at k."""
    width = window.s.shape[1]
    steps = torch.arange(width, device=window.s.device)
    shifted = (window.first > 0) & (window.first < width)
    source = (steps - window.first[:, None]).clamp_(min=0)
    pair = window.active & shifted[:, None] & (steps >= window.first[:, None]) & window.usable.gather(1, source)
    weight = pair.to(torch.float64)
    left = (window.t - window.s.gather(1, source)).abs_().nan_to_num_(0.0, GAP_CAP, GAP_CAP).clamp_(max=GAP_CAP)
    aligned = (window.t - window.s).abs_().nan_to_num_(0.0, GAP_CAP, GAP_CAP).clamp_(max=GAP_CAP)
    votes_left = (voted & shifted & (vote == -window.first)).sum(dtype=torch.float64)
    return torch.stack([shifted.sum(dtype=torch.float64), votes_left, weight.sum(), (left * weight).sum(),
                        (aligned * weight).sum()])
