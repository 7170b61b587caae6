"""The statistics of a logged step: each declared (``State``) beside the formula that fills it, merged across
micro-batches, reduced across ranks in two fixed-size collectives, and read on the host in one transfer.

Read it in this order: ``StatisticsOptions`` (what a monitor keeps) and the declarations (``MAIN``,
``SIGNATURE_STATES``, the strata, ``shadow_statistics``); ``of_chunk``, every formula for one chunk of a
``FlatBatch``, with ``offset_sums`` (are the sampler's values at the wrong positions?) and ``shadow_values`` (what a
correction would do); ``DivergenceStats`` (``from_batch``, ``merge``, ``to_host``) and ``reduce_across_ranks``;
``HostDivergence`` and the logged formulas read from it (``scalar_metrics``, ``sampling_metrics``,
``signature_numbers``, ``stratum_scalars``, ``shadow_scalars``). The long form of each part, with every formula, is
the docs' page "How a step's statistics are computed" (``docs/statistics.md``).

Examples:
    >>> from loops_callbacks.divergence.batch import flatten_padded
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> host = DivergenceStats.from_batch(flat, StatisticsOptions(top_n=1)).to_host()
    >>> scalar_metrics(host, prefix="")["kl_sample_train_v1_loops"], host.worst.shape[0]
    (0.25, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from loops_callbacks.correction import Correction, parse_correction
from loops_callbacks.correction.compute import CorrectionInput, Segments, Weights, correct_flat, correct_rows
from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.divergence.batch import (
    CONTEXT_AFTER, CONTEXT_BEFORE, DEFAULT_MAX_GROUPS, LOGPROB_FLOOR, MAX_SERVERS, NO_TOKEN, PER_DATUM, DatumTokens,
    FlatBatch, PaddedTokens,
)
from loops_callbacks.validation import LOGPROB_ROUNDING, check_bool, check_int

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


@functools.lru_cache(maxsize=None)
def device_constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-d tensor on ``device``, made once per device and without a host transfer (on a GPU,
    one fill per value: a copy from the host would wait for the device).

    >>> device_constant((0.0, 2.0), torch.float64, torch.device("cpu")).tolist()
    [0.0, 2.0]
    """
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.stack([torch.full((), value, dtype=dtype, device=device) for value in values])


def renumber(record: torch.Tensor, datum_offset: torch.Tensor | float) -> torch.Tensor:
    """A ``prompt_first`` record (or ``[..., PROMPT_RECORD]`` records) whose datums come ``datum_offset`` later."""
    if not isinstance(datum_offset, torch.Tensor):
        return record - float(datum_offset) * PROMPT_SCALE
    return record - datum_offset.to(record.dtype).reshape(*datum_offset.shape, *([1] * (record.dim()
                                                                                         - datum_offset.dim()))) * PROMPT_SCALE


@torch.no_grad()
def offset_sums(flat: FlatBatch) -> torch.Tensor:
    """Float64 ``[OFFSET_SIZE]`` on the batch's device (docs/statistics.md); sums, so parts merge by ``+``.

    Examples:
        >>> import torch
        >>> from loops_callbacks.divergence.batch import flatten_padded
        >>> trainer = -torch.rand(8, 24, generator=torch.Generator().manual_seed(0)) * 3
        >>> sampler = torch.cat([torch.zeros(8, 3), trainer[:, :-3]], dim=1)  # each value 3 positions late
        >>> flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=trainer, mask=torch.ones(8, 24))
        >>> found = read_offsets(offset_sums(flat).numpy())
        >>> found.offset, found.share, found.ratio < 1e-9
        (3.0, 1.0, True)
    """
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
        bins.index_add_(1, torch.bucketize(vote, device_constant(_BIN_UPPER_BOUNDS, torch.int64, vote.device)), votes)
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
    omega = device_constant((0.0, *FREQUENCIES), torch.float64, m.device)[:, None, None]
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


_BIN_UPPER_BOUNDS = tuple(
    [-(2 ** (p + 2)) - 1 for p in range(_LOG_BINS, 0, -1)]
    + list(range(-EXACT, EXACT + 1))
    + [2 ** (p + 3) for p in range(1, _LOG_BINS)]
)
"""The largest offset of each bin but the last (bins: o <= -2^(p+2) - 1 by power p, -8 … 8, then
o <= 2^(p+3)); ``torch.bucketize`` finds a vote's bin."""




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


TOKEN_BUCKETS = 1024
"""Token ids are hashed (id mod 1024) into this many buckets of (count, sum d, sum d²): a fixed,
mergeable buffer whatever the vocabulary (``token_eta2`` corrects for the buckets' number)."""
PROBABILITY_EDGES = (0.01, 0.1, 0.5, 0.9)
"""Edges of the sampler-probability buckets (a bucket holds its lower edge)."""
_LOG_EDGES = tuple(math.log(p) for p in PROBABILITY_EDGES)
PROBABILITY_STRATA = ("p_lt_0.01", "p_0.01_0.1", "p_0.1_0.5", "p_0.5_0.9", "p_ge_0.9")
POSITION_STRATA = ("pos_q1", "pos_q2", "pos_q3", "pos_q4")
LAG_STRATA = ("lag_0", "lag_1", "lag_2", "lag_3", "lag_4_7", "lag_8_plus")
LAG_LABELS = ("0", "1", "2", "3", "4-7", "8+")
LAG_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0)
"""The lag strata's lower edges."""
AHEAD_STRATUM = "lag_ahead"
"""The tokens of datums whose policy version is ahead of the trainer (also counted at lag 0)."""
STRATUM_NAMES = PROBABILITY_STRATA + POSITION_STRATA + LAG_STRATA + (AHEAD_STRATUM,)
"""The strata of the fixed-shape ``strata`` sums, in order; the groups are a table of their own."""
MASK_ROW = 2**26
"""A refused mask position is stored as ``row * MASK_ROW + position`` (exact in float64 below 2**27 rows)."""
COLUMNS = ("n_tokens", "sum_k3", "sum_abs_d", "sum_is_ratio")
"""What each stratum sums over its tokens (k3 = e^d - 1 - d, e^d = exp(min(d, 80)))."""
GROUP_ROWS = 1 + len(COLUMNS)
"""Rows of the groups' table: each column a group's index (row 0; ``max_groups``: group_other) and its sums."""
CONTEXT_KINDS = ("n_first", "sum_abs_d_first", "sum_d2_first", "n_later", "sum_abs_d_later", "sum_d2_later")
"""What the context fade (``statistics``) keeps per sampler-probability bucket, on each datum's first
``FIRST_ACTIONS`` action tokens and on those from the ``LATER_ACTIONS_FROM``-th on."""


def context_total(kind: str, bucket: int) -> str:
    """The name of a context-fade sum: ``kind`` one of ``CONTEXT_KINDS``, ``bucket`` a sampler-probability bucket.

    Examples:
        >>> context_total("n_first", 0)
        'n_first_actions_p_lt_0.01'
    """
    return f"{kind}_actions_{PROBABILITY_STRATA[bucket]}"


@dataclass(frozen=True)
class State:
    """One statistic: its name, how two batches' values combine, and its shape (``()``: a number)."""

    name: str
    reduction: Literal["sum", "max"]
    shape: tuple[int, ...] = ()


def _sums(*names: str) -> tuple[State, ...]:
    return tuple(State(name, "sum") for name in names)


MAIN = (
    *_sums("n_datums", "n_datums_with_actions", "n_action_tokens", "n_skipped_nonfinite", "n_trainer_zero"),
    *_sums("sum_d", "sum_d2", "sum_is_ratio", "sum_is_ratio2", "sum_k3", "sum_sampler", "sum_seq_mean_d"),
    *_sums("sum_seq_is_ratio", "n_abs_gt_1", "n_abs_gt_2", "n_abs_gt_4", "n_is_ratio_gt_2", "n_is_ratio_lt_half"),
    *_sums("n_abs_gt_half"),
    # logprobs above LOGPROB_ROUNDING (probabilities?) and below LOGPROB_FLOOR (sentinels) on the action tokens;
    # -inf and +inf on the counted tokens (a sampled token of probability 0, or above 1)
    *_sums("n_sampler_above_zero", "n_trainer_above_zero", "n_sampler_below_floor", "n_trainer_below_floor"),
    *_sums("n_sampler_neg_inf", "n_trainer_neg_inf", "n_sampler_pos_inf", "n_trainer_pos_inf"),
    # masked-in positions, those with a NaN advantage; what was sampled (t + H, H, V over masked-in positions)
    *_sums("n_masked_in", "n_advantage_nan", "n_sampling_tokens", "sum_sampling_gap", "sum_sampling_entropy"),
    *_sums("sum_sampling_varentropy"),
    # the entropies' masked-in positions (0: not given), those no distribution can have, those t rules out
    *_sums("n_sampling_given", "n_entropy_nan", "n_entropy_inf", "n_entropy_negative", "n_varentropy_nan"),
    *_sums("n_varentropy_inf", "n_varentropy_negative", "n_sampling_ruled_out"),
    # mask < 0 or NaN where it was not read per micro-batch (an accelerator)
    *_sums("n_mask_refused"),
    *(State(name, "max") for name in ("max_d", "neg_min_d", "max_seq_mean_d", "max_sampler", "neg_min_sampler",
                                      "max_trainer", "neg_min_trainer")),
    # the one token's t + H furthest above 0, and (negated) below: sampling_z_trimmed
    State("max_sampling_gap", "max"), State("neg_min_sampling_gap", "max"),
    # the policy lags of the datums with action tokens (-inf without versions): the lag, as the versions state it
    State("max_lag", "max"), State("neg_min_lag", "max"),
    # the first refused mask position, negated (row * MASK_ROW + position)
    State("neg_min_mask_refused_at", "max"),
)
"""What every step keeps (``scalar_metrics``' inputs)."""
SIGNATURE_STATES = (
    # t = trainer, s = sampler logprob: Pearson(t, s), the slope of t on s, the spread of d²
    *_sums("sum_trainer", "sum_sampler2", "sum_trainer2", "sum_sampler_trainer", "sum_d4", "n_d_neg", "n_d_pos"),
    *_sums("n_both_16_bit", "n_p_high", "n_p_high_d_pos", "n_p_high_d_neg", "sum_abs_d_p_high", "n_p_low"),
    *_sums("n_p_low_d_pos", "n_p_low_d_neg", "sum_abs_d_p_low"),
    # adjacent action tokens of a datum: |d[k]| + |d[k+1]|, |t[k] - s[k+1]|, |t[k+1] - s[k]|
    *_sums("n_pairs", "sum_abs_d_pairs", "sum_abs_shift_next", "sum_abs_shift_prev"),
    *_sums(*(context_total(kind, bucket) for kind in CONTEXT_KINDS for bucket in range(len(PROBABILITY_STRATA)))),
    State("token_sums", "sum", (3, TOKEN_BUCKETS)),  # per hashed token id: count, sum d, sum d²
    State("offset_sums", "sum", (OFFSET_SIZE,)),  # the rows' votes for an offset (``statistics``)
    # the sampler's prompts against the trainer's (``batch``): datums compared, those that differ, and the first
    # differing datum's record, keyed by its datum (``Layout.renumbered``)
    *_sums("n_prompt_datums_compared", "n_prompt_datums_differ"), State("prompt_first", "max", (PROMPT_RECORD,)),
    # per sampling server (``sampler_server``): action tokens, sum k3, then its datums by lag bucket (``LAG_STRATA``):
    # sums, so that they travel in the reduction's body, whose size per rank does not grow with the ranks
    State("server_sums", "sum", (2 + len(LAG_STRATA), MAX_SERVERS)),
)
"""The diagnosis' sums (``signature_numbers``), kept when ``diagnose``."""
STRATA = (State("strata", "sum", (len(COLUMNS), len(STRATUM_NAMES))),)
"""The divergence by stratum, kept with ``max_groups`` (and the groups' table, merged its own way)."""


class ROW:
    """Columns of a worst-token row (all float64; token ids are exact below 2**53)."""

    ABS, DIFF, SAMPLER, TRAINER, DATUM, POSITION, TOKEN = range(7)
    BEFORE = slice(7, 7 + CONTEXT_BEFORE)  # model_input ids before index k+1, NO_TOKEN-padded on the left
    AFTER = slice(7 + CONTEXT_BEFORE, 7 + CONTEXT_BEFORE + CONTEXT_AFTER)  # the id at k+1, then the ids after it
    WIDTH = 7 + CONTEXT_BEFORE + CONTEXT_AFTER


def ranked_rows(rows: torch.Tensor, top_n: int) -> torch.Tensor:
    """Rows ordered by |d| descending, then datum, then position; the first ``top_n``."""
    order = torch.sort(rows[:, ROW.POSITION], stable=True).indices
    order = order[torch.sort(rows[order, ROW.DATUM], stable=True).indices]
    order = order[torch.sort(rows[order, ROW.ABS], descending=True, stable=True).indices]
    return rows[order[:top_n]]


def by_group(table: torch.Tensor) -> torch.Tensor:
    """The groups' table with one column per group, in ascending order of their index.

    Examples:
        >>> by_group(torch.tensor([[1.0, 0.0, 1.0], [2.0, 1.0, 5.0]])).tolist()
        [[0.0, 1.0], [1.0, 7.0]]
    """
    indices, column = torch.unique(table[0], return_inverse=True)
    merged = table.new_zeros(table.shape[0], indices.numel())
    merged[0] = indices
    merged[1:].index_add_(1, column, table[1:])
    return merged


class Layout:
    """Which states a monitor keeps, and where each sits in the packed ``statistics`` and ``maxima`` vectors."""

    def __init__(self, states: tuple[State, ...], max_groups: int | None, corrections: tuple[Correction, ...]):
        self.states, self.max_groups, self.corrections = states, max_groups, corrections
        self.slots: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name: (start, size, shape) in its vector
        ends = {"sum": 0, "max": 0}
        for state in states:
            size = math.prod(state.shape)
            self.slots[state.name] = (ends[state.reduction], size, state.shape)
            ends[state.reduction] += size
        self.sizes = ends
        self.names = {kind: [s.name for s in states if s.reduction == kind] for kind in ends}

    def index(self, name: str) -> int:
        return self.slots[name][0]

    def pack(self, values: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The float64 ``statistics`` and ``maxima`` vectors of one formula per declared name (``KeyError`` otherwise).

        Examples:
            >>> layout = Layout(MAIN, max_groups=None, corrections=())
            >>> sums, maxima = layout.pack({s.name: torch.tensor(1.0) for s in layout.states})
            >>> sums.shape == (layout.sizes["sum"],), layout.read(maxima.numpy(), "max")[0]["max_d"]
            (True, 1.0)
        """
        extra = sorted(set(values) - set(self.slots))
        missing = [name for name in self.slots if name not in values]
        if extra or missing:
            raise KeyError(f"statistics {extra} are computed but not declared; {missing} are declared but have no "
                           "formula")
        return tuple(torch.cat([values[name].reshape(-1).to(torch.float64) for name in self.names[kind]])
                     if self.names[kind] else torch.zeros(0, dtype=torch.float64) for kind in ("sum", "max"))

    def renumbered(self, maxima: torch.Tensor, datum_offset: torch.Tensor | float) -> torch.Tensor:
        """``maxima`` (``[..., sizes["max"]]``) of a batch whose datums come ``datum_offset`` later: the maxima keyed
        by their datum (``prompt_first``) shifted, so that the elementwise maximum keeps the earliest datum's."""
        if "prompt_first" not in self.slots:
            return maxima
        start, size, _ = self.slots["prompt_first"]
        shifted = maxima.clone()
        shifted[..., start : start + size] = renumber(maxima[..., start : start + size], datum_offset)
        return shifted

    def read(self, vector: np.ndarray, kind: str) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """A host vector back by name: the numbers, and the arrays in their shapes."""
        numbers, arrays = {}, {}
        for name in self.names[kind]:
            start, size, shape = self.slots[name]
            if shape:
                arrays[name] = vector[start : start + size].reshape(shape)
            else:
                numbers[name] = float(vector[start])
        return numbers, arrays


IS_RATIO_CLAMP = 80.0
"""The importance ratio e^d is exp(min(d, 80)): finite for any diff, as in the Loops SDK."""
OFFSET_CHUNK_POSITIONS = 1 << 15
"""On the CPU the offset votes (FFTs over whole rows) are read at most about this many positions at a time."""
P_HIGH, P_LOW = math.log(0.5), math.log(0.1)
"""Sampler logprobs above which a token is "likely" (p > 0.5), below which "unlikely" (p < 0.1)."""
FIRST_ACTIONS = 4
"""A datum's first this many action tokens are its "first" ones for the context fade."""
LATER_ACTIONS_FROM = 8
"""A datum's action tokens from this one on (0-based) are its "later" ones: the gap between the two
sets keeps a fade that lasts a few tokens out of both means."""
RULED_OUT_SLACK = {32: (1e-2, 1e-5), 16: (0.1, 1e-2)}
"""By the narrowest width of t, H and V: (ρ, α) of the rounding allowed the bound |t + H| e^(t/2) <= √V (a token of
probability p = e^t adds p (t + H)² to V): flagged beyond (1 + ρ) √V + ρ H + α."""
_16_BIT = (torch.bfloat16, torch.float16)


def datum_chunks(flat: FlatBatch, positions: int) -> Iterator[FlatBatch]:
    """Consecutive whole-datum slices (views) of ``flat``, about ``positions`` positions each; the batch itself when
    small: the statistics read a large batch in chunks, so that their temporaries stay small.

    A chunk ends with the first datum that reaches a multiple of ``positions``, so a datum is
    never split. Reads the row lengths on the host: for the CPU, where that is free.

    Examples:
        >>> from loops_callbacks.divergence.batch import flatten_padded
        >>> flat = flatten_padded(sampler_logprobs=torch.zeros(3, 4), training_logprobs=torch.zeros(3, 4),
        ...                       mask=torch.ones(3, 4))
        >>> [chunk.n_datums for chunk in datum_chunks(flat, 5)]
        [2, 1]
    """
    ends = torch.cumsum(flat.row_lengths, 0)
    total = int(ends[-1]) if ends.numel() else 0
    if total <= positions:
        yield flat
        return
    cuts = torch.searchsorted(ends, torch.arange(positions, total, positions), right=False) + 1
    first = start = 0
    for end in torch.unique_consecutive(torch.cat([cuts, torch.tensor([flat.n_datums])])).tolist():
        stop = int(ends[end - 1])
        yield FlatBatch(**{
            field.name: _cut(getattr(flat, field.name), (first, end) if field.name in PER_DATUM else (start, stop))
            for field in dataclasses.fields(flat)
        })
        first, start = end, stop


def _cut(value: Any, bounds: tuple[int, int]) -> Any:
    if value is None:
        return value
    return value.rows(*bounds) if isinstance(value, (PaddedTokens, DatumTokens)) else value[bounds[0] : bounds[1]]


@torch.no_grad()
def of_chunk(
    flat: FlatBatch, layout: Layout, top_n: int, sample_size: int | None, generator: torch.Generator | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every declared state's value by name (but the shadow statistics: ``statistics``), the ``top_n`` worst rows,
    the sampled diffs and their keys (``None``: all kept), and the groups' table (``None`` without groups or
    strata).

    Examples:
        >>> from loops_callbacks.divergence.batch import flatten_padded
        >>> from loops_callbacks.divergence.statistics import layout_of
        >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
        ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
        >>> values, worst, sample, sample_keys, groups = of_chunk(flat, layout_of(diagnose=False), 0, None, None)
        >>> float(values["sum_d"]), int(values["n_action_tokens"]), sample.tolist()
        (-0.5, 2, [-0.5, 0.0])
    """
    compact = _on_host(flat.device)
    active = None if compact else flat.active
    d, sampler, trainer = (_select(x, flat.active) if compact else x.masked_fill(~active, 0.0)
                           for x in (flat.diff, flat.sampler, flat.trainer))
    is_ratio = d.clamp(max=IS_RATIO_CLAMP).exp_()
    if active is not None:
        is_ratio.masked_fill_(~active, 0.0)
    abs_d = d.abs()
    row_counts = _row_sums(flat.active, flat.row_lengths)  # int64 action tokens per datum
    with_actions = row_counts > 0
    seq_mean = (_row_sums(d, row_counts if compact else flat.row_lengths) / row_counts.clamp(min=1)).masked_fill(
        ~with_actions, 0.0)
    seq_is_ratio = torch.exp(seq_mean.clamp(max=IS_RATIO_CLAMP)).masked_fill(~with_actions, 0.0)
    count, inf = torch.count_nonzero, math.inf
    values: dict[str, torch.Tensor] = {
        "n_datums": torch.full((), float(flat.n_datums), dtype=torch.float64, device=d.device),
        "n_datums_with_actions": count(with_actions), "n_action_tokens": count(flat.active),
        "n_skipped_nonfinite": count(flat.counted & ~flat.active),
        "n_trainer_zero": count((flat.trainer == 0.0) & flat.active),
        "sum_d": d.sum(), "sum_d2": torch.dot(d, d), "sum_is_ratio": is_ratio.sum(),
        "sum_is_ratio2": torch.dot(is_ratio, is_ratio), "sum_sampler": sampler.sum(dtype=torch.float64),
        "sum_seq_mean_d": seq_mean.sum(), "sum_seq_is_ratio": seq_is_ratio.sum(),
        "n_abs_gt_1": count(abs_d > 1.0), "n_abs_gt_2": count(abs_d > 2.0), "n_abs_gt_4": count(abs_d > 4.0),
        "n_abs_gt_half": count(abs_d > 0.5),
        "n_is_ratio_gt_2": count(is_ratio > 2.0),
        "n_is_ratio_lt_half": count(is_ratio < 0.5 if active is None else (is_ratio < 0.5) & active),
        "n_sampler_above_zero": count(sampler > LOGPROB_ROUNDING), "n_trainer_above_zero": count(trainer > LOGPROB_ROUNDING),
        "n_sampler_below_floor": count(sampler < LOGPROB_FLOOR), "n_trainer_below_floor": count(trainer < LOGPROB_FLOOR),
        **_infinite_counts(flat, compact),
        **_mask_refused(flat),
        "n_masked_in": count(flat.masked_in),
        "n_advantage_nan": count(flat.advantage_nan) if flat.advantage_nan is not None else torch.zeros((), device=d.device),
        "max_seq_mean_d": max_and_negated_min(seq_mean, with_actions)[0],
        **dict(zip(("max_lag", "neg_min_lag"), max_and_negated_min(
            flat.lags.to(torch.float64) if flat.lags is not None else seq_mean[:0], with_actions))),
        **_sampling_sums(flat),
    }
    for name, x in (("d", d), ("sampler", sampler), ("trainer", trainer)):
        values[f"max_{name}"], values[f"neg_min_{name}"] = max_and_negated_min(x, active)
    signatures, strata = "token_sums" in layout.slots, "strata" in layout.slots
    if signatures or strata:  # each token's datum, order among its datum's action tokens, probability bucket
        datum, order_in_datum = _datums_and_orders(flat.active, flat.row_lengths, row_counts, compact=compact)
        p_bucket = _probability_buckets(sampler)
    if signatures:
        values.update(_signature_sums(flat, d, abs_d, sampler, trainer, active))
        values.update(_context_sums(abs_d, order_in_datum, p_bucket, active))
        values["token_sums"] = _token_sums(flat, d, active, compact)
        chunks = datum_chunks(flat, OFFSET_CHUNK_POSITIONS) if compact else [flat]
        values["offset_sums"] = functools.reduce(operator.add, [offset_sums(chunk) for chunk in chunks])
        values.update(prompt_values(flat))
    # k3 = e^d - 1 - d, once; without strata every use of the ratio is above, so its buffer becomes k3
    k3 = is_ratio.sub_(1.0).sub_(d) if not strata else (is_ratio - 1.0).sub_(d)
    if active is not None:
        k3.masked_fill_(~active, 0.0)
    values["sum_k3"] = k3.sum()
    if signatures:
        values |= _server_values(flat, k3, row_counts, compact, with_actions)
    groups = None
    if strata:
        values["strata"] = _strata_sums(d, abs_d, is_ratio, k3, datum, order_in_datum, p_bucket, row_counts,
                                        flat.lags, active)
        if flat.groups is not None:
            groups = _group_table(abs_d, is_ratio, k3, datum, flat.groups, active, layout.max_groups)
    worst = torch.zeros(0, ROW.WIDTH, dtype=torch.float64, device=d.device)
    if top_n:
        ranked = abs_d if active is None else abs_d.masked_fill(~active, -inf)
        chosen = _stable_top_k(ranked, min(top_n, ranked.shape[0]))
        index = torch.from_numpy(np.flatnonzero(flat.active.numpy())).index_select(0, chosen) if compact else chosen
        worst = _worst_rows(flat, index, chosen, ranked, d, top_n)
    sample_keys = None if sample_size is None else torch.rand(d.shape, dtype=torch.float64, device=d.device,
                                                       generator=generator)
    if active is not None:
        sample_keys = (sample_keys if sample_keys is not None else torch.zeros_like(d)).masked_fill(~active, inf)
    return values, worst, d, sample_keys, groups


def _signature_sums(flat: FlatBatch, d: torch.Tensor, abs_d: torch.Tensor, sampler: torch.Tensor,
                    trainer: torch.Tensor, active: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The diagnosis' sums and counts over the action tokens (``SIGNATURE_STATES``)."""
    s, t = sampler.to(torch.float64), trainer.to(torch.float64)
    negative, positive = d < 0, d > 0
    high, low = sampler > P_HIGH, sampler < P_LOW
    if active is not None:  # masked-out places hold s = 0 (p = 1): keep them out of the buckets
        high &= active
        low &= active
    d2 = d * d
    count, n_16_bit = torch.count_nonzero, torch.zeros((), device=d.device)
    if flat.sampler.dtype in _16_BIT and flat.trainer.dtype in _16_BIT:  # rounded to 16 bits, exact matches say less
        n_16_bit = count(active) if active is not None else torch.full((), float(d.numel()), device=d.device)
    sums = {
        "sum_trainer": t.sum(), "sum_sampler2": torch.dot(s, s), "sum_trainer2": torch.dot(t, t),
        "sum_sampler_trainer": torch.dot(s, t), "sum_d4": torch.dot(d2, d2),
        "n_d_neg": count(negative), "n_d_pos": count(positive),
        "n_both_16_bit": n_16_bit,
        "n_p_high": count(high), "n_p_high_d_pos": count(high & positive), "n_p_high_d_neg": count(high & negative),
        "sum_abs_d_p_high": torch.dot(abs_d, high.to(torch.float64)),
        "n_p_low": count(low), "n_p_low_d_pos": count(low & positive), "n_p_low_d_neg": count(low & negative),
        "sum_abs_d_p_low": torch.dot(abs_d, low.to(torch.float64)),
    }
    # pairs (k, k+1) of action tokens in one datum, on the flat (uncompacted) positions
    length = flat.diff.shape[0]
    starts = torch.zeros(length + 1, dtype=torch.bool, device=d.device)
    starts.index_fill_(0, torch.cumsum(flat.row_lengths, 0), True)  # position k begins a datum (k > 0)
    pair = flat.active[:-1] & flat.active[1:] & ~starts[1:length]
    s, t, weight = flat.sampler.to(torch.float64), flat.trainer.to(torch.float64), pair.to(torch.float64)
    gap = torch.nan_to_num(flat.diff.abs(), nan=0.0, posinf=0.0)  # non-finite only off the pairs
    return sums | {
        "n_pairs": count(pair), "sum_abs_d_pairs": torch.dot(gap[:-1] + gap[1:], weight),
        "sum_abs_shift_next": torch.dot(torch.nan_to_num((t[:-1] - s[1:]).abs_(), nan=0.0, posinf=0.0), weight),
        "sum_abs_shift_prev": torch.dot(torch.nan_to_num((t[1:] - s[:-1]).abs_(), nan=0.0, posinf=0.0), weight),
    }


def _server_values(flat: FlatBatch, k3: torch.Tensor, row_counts: torch.Tensor, compact: bool,
                   with_actions: torch.Tensor) -> dict[str, torch.Tensor]:
    """``server_sums``: each server's action tokens, sum of k3 and datums per lag bucket (``LAG_STRATA``), over the
    datums with action tokens and a server (a last column, dropped, takes the others)."""
    sums = torch.zeros(2 + len(LAG_STRATA), MAX_SERVERS + 1, dtype=torch.float64, device=k3.device)
    if flat.servers is not None:
        slot = flat.servers.masked_fill((flat.servers < 0) | ~with_actions, MAX_SERVERS)
        sums[0].index_add_(0, slot, row_counts.to(torch.float64))
        sums[1].index_add_(0, slot, _row_sums(k3, row_counts if compact else flat.row_lengths))
        if flat.lags is not None:
            bucket = torch.where(flat.lags < 4, flat.lags.clamp(min=0), torch.where(flat.lags < 8, 4, 5))
            sums.view(-1).index_add_(0, (bucket + 2) * (MAX_SERVERS + 1) + slot, torch.ones_like(slot, dtype=sums.dtype))
    return {"server_sums": sums[:, :MAX_SERVERS].contiguous()}


def _infinite_counts(flat: FlatBatch, compact: bool) -> dict[str, torch.Tensor]:
    """The counted tokens whose sampler or trainer logprob is -inf (a sampled token of probability 0) or +inf; read
    on the skipped tokens alone on the CPU (usually none), on every position elsewhere (no shape follows the data)."""
    skipped = flat.counted & ~flat.active
    values = {"sampler": flat.sampler, "trainer": flat.trainer}
    if compact:
        values = {side: _select(x, skipped) for side, x in values.items()}
    counts = {}
    for side, x in values.items():
        for name, sign in (("neg_inf", -math.inf), ("pos_inf", math.inf)):
            found = x == sign
            counts[f"n_{side}_{name}"] = torch.count_nonzero(found if compact else found & skipped)
    return counts


def _mask_refused(flat: FlatBatch) -> dict[str, torch.Tensor]:
    """How many positions ``flat.mask_refused`` marks, and the first (``row * MASK_ROW + position``, negated)."""
    refused = flat.mask_refused
    if refused is None or refused.numel() == 0:
        zero, none = (torch.full((), value, dtype=torch.float64, device=flat.device) for value in (0.0, -math.inf))
        return {"n_mask_refused": zero, "neg_min_mask_refused_at": none}
    ends = torch.cumsum(flat.row_lengths, 0)
    first = torch.where(refused, torch.arange(refused.numel(), device=refused.device), refused.numel()).amin()
    row = torch.searchsorted(ends, first, right=True).clamp(max=max(flat.n_datums - 1, 0))
    start = (ends - flat.row_lengths).index_select(0, row.reshape(1))[0] if flat.n_datums else first
    at = (row * MASK_ROW + first - start).to(torch.float64)
    return {"n_mask_refused": torch.count_nonzero(refused),
            "neg_min_mask_refused_at": torch.where(refused.any(), -at, -math.inf)}


def _sampling_sums(flat: FlatBatch) -> dict[str, torch.Tensor]:
    """Over masked-in positions with a finite trainer logprob t and an entropy H and varentropy V a distribution
    can have (whatever their advantage: a selection by reward would bias the check), the count and the sums of
    t + H, H and V; the largest t + H and the smallest (negated), -inf without such positions. Beside them
    (``sampling_positions``): how many masked-in positions had the entropies, how many hold an H or V no
    distribution has, and how many an H and V that the token's own t rules out."""
    names = ("n_sampling_tokens", "sum_sampling_gap", "sum_sampling_entropy", "sum_sampling_varentropy")
    extrema = ("max_sampling_gap", "neg_min_sampling_gap")
    positions = sampling_positions(flat)
    if positions is None:
        zero, none = (torch.full((), value, dtype=torch.float64, device=flat.device) for value in (0.0, -math.inf))
        counted = [f"n_{name}" for name in SAMPLING_CHECKS] + ["n_sampling_given"]
        return dict.fromkeys((*names, *counted), zero) | dict.fromkeys(extrema, none)
    t, h, v = (x.to(torch.float64) for x in (flat.trainer, flat.entropy, flat.varentropy))
    drawn, gap = positions.pop("drawn"), t + h
    sums = {name: torch.where(drawn, part, 0.0).sum() for name, part in zip(names, (drawn.double(), gap, h, v))}
    counts = {f"n_{name}": torch.count_nonzero(found) for name, found in positions.items()}
    return sums | counts | dict(zip(extrema, max_and_negated_min(gap, drawn))) | {
        "n_sampling_given": torch.count_nonzero(flat.masked_in)}


SAMPLING_CHECKS = ("entropy_nan", "entropy_inf", "entropy_negative", "varentropy_nan", "varentropy_inf",
                   "varentropy_negative", "sampling_ruled_out")
"""What ``sampling_positions`` marks beside the positions the check reads (``n_<name>`` is each one's count)."""


def sampling_positions(flat: FlatBatch) -> dict[str, torch.Tensor] | None:
    """Bool ``[L]`` masks of the masked-in positions, by ``SAMPLING_CHECKS``' names, and ``drawn``: the positions the
    check of what was sampled reads; ``None`` without the entropies.

    An entropy H or varentropy V is impossible when NaN, ±inf (said once, as inf) or negative beyond rounding
    (H < -``LOGPROB_ROUNDING``, V < -``LOGPROB_ROUNDING`` (1 + H²)). Of the rest, a token of probability p = e^t
    adds p (t + H)² to V, so |t + H| e^(t/2) <= √V for any distribution: beyond (1 + ρ) √V + ρ H + α
    (``RULED_OUT_SLACK``, by the narrowest width of the three) the token's own logprob rules its H and V out.
    """
    if flat.entropy is None or flat.varentropy is None:
        return None
    masked_in, fields = flat.masked_in, (flat.trainer, flat.entropy, flat.varentropy)
    wide = torch.float64 if any(x.dtype == torch.float64 for x in fields) else torch.float32  # a check, not a sum
    t, h, v = (x.to(wide) for x in fields)
    floors = {"entropy": -LOGPROB_ROUNDING, "varentropy": h.square().add_(1.0).mul_(-LOGPROB_ROUNDING)}
    found = {}
    for name, x in (("entropy", h), ("varentropy", v)):
        inf = masked_in & torch.isinf(x)
        found |= {f"{name}_nan": masked_in & torch.isnan(x), f"{name}_inf": inf,
                  f"{name}_negative": masked_in & (x < floors[name]) & ~inf}  # -inf is said once, as inf
    drawn = masked_in & torch.isfinite(t) & torch.isfinite(h) & torch.isfinite(v) & (h >= floors["entropy"]) & (
        v >= floors["varentropy"])
    rho, alpha = RULED_OUT_SLACK[min(16 if x.dtype in _16_BIT else 32 for x in fields)]
    bound = v.clamp(min=0.0).sqrt_().mul_(1.0 + rho).add_(h.abs(), alpha=rho).add_(alpha)
    found["sampling_ruled_out"] = drawn & ((t + h).abs_().mul_(t.clamp(max=0.0).mul_(0.5).exp_()) > bound)
    return found | {"drawn": drawn}


def _context_sums(abs_d: torch.Tensor, order: torch.Tensor, p_bucket: torch.Tensor, active: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
    """Tokens, |d| and d² on each datum's first ``FIRST_ACTIONS`` action tokens and on those from the
    ``LATER_ACTIONS_FROM``-th on, per sampler-probability bucket (``CONTEXT_KINDS``)."""
    buckets = len(PROBABILITY_STRATA)
    values = torch.stack([torch.ones_like(abs_d), abs_d, abs_d * abs_d])
    sums: dict[str, torch.Tensor] = {}
    for part, chosen in (("first", order < FIRST_ACTIONS), ("later", order >= LATER_ACTIONS_FROM)):
        if active is not None:
            chosen &= active
        slot = torch.where(chosen, p_bucket, buckets)  # the others in one more slot, dropped
        totals = abs_d.new_zeros(len(values), buckets + 1).index_add_(1, slot, values)
        for row, name in enumerate(("n", "sum_abs_d", "sum_d2")):
            sums.update({context_total(f"{name}_{part}", b): totals[row, b] for b in range(buckets)})
    return sums


def _token_sums(flat: FlatBatch, d: torch.Tensor, active: torch.Tensor | None, compact: bool) -> torch.Tensor:
    """Float64 ``[3, TOKEN_BUCKETS]``: per hashed token id, the count, sum of d and sum of d²."""
    buckets = torch.zeros(3, TOKEN_BUCKETS + 1, dtype=torch.float64, device=d.device)  # last: unknown ids
    if flat.token_ids is not None:
        ids = _select(flat.token_ids, flat.active) if compact else flat.token_ids
        known = ids >= 0 if active is None else (ids >= 0) & active
        buckets.index_add_(1, torch.where(known, ids.remainder(TOKEN_BUCKETS), TOKEN_BUCKETS),
                           torch.stack([torch.ones_like(d), d, d * d]))
    return buckets[:, :TOKEN_BUCKETS]


def _strata_sums(d: torch.Tensor, abs_d: torch.Tensor, is_ratio: torch.Tensor, k3: torch.Tensor, datum: torch.Tensor,
                 order: torch.Tensor, p_bucket: torch.Tensor, row_counts: torch.Tensor, lags: torch.Tensor | None,
                 active: torch.Tensor | None) -> torch.Tensor:
    """Float64 ``[len(COLUMNS), len(STRATUM_NAMES)]``: each stratum's tokens, Σ k3, Σ |d|, Σ e^d; a family is one
    index per token (others: a last, dropped column), four ``bincount``s on the CPU, else one ``index_add_``."""
    trash = len(STRATUM_NAMES)
    weights = (k3, abs_d, is_ratio)  # a place off the action tokens goes to the trash column
    out = torch.zeros(1 + len(weights), trash + 1, dtype=torch.float64, device=d.device)
    stacked = None if _on_host(d.device) else torch.stack([torch.ones_like(d), *weights])

    def add(index: torch.Tensor) -> None:
        if active is not None:
            index.masked_fill_(~active, trash)
        if stacked is not None:
            out.index_add_(1, index, stacked)
            return
        out[0] += torch.bincount(index, minlength=trash + 1)
        for row, weight in enumerate(weights, start=1):
            out[row] += torch.bincount(index, weights=weight, minlength=trash + 1)

    position, lag = len(PROBABILITY_STRATA), len(PROBABILITY_STRATA) + len(POSITION_STRATA)
    add(p_bucket.clone())
    quartile = order.mul(4).div_(row_counts.index_select(0, datum).clamp_(min=1), rounding_mode="floor")
    add(quartile.clamp_(max=3).add_(position))
    if lags is not None:
        bucket = torch.where(lags < 4, lags.clamp(min=0), torch.where(lags < 8, 4, 5))
        add(bucket.add_(lag).index_select(0, datum))
        add(torch.full_like(lags, trash).masked_fill_(lags < 0, lag + len(LAG_STRATA)).index_select(0, datum))
    return out[:, :trash]


def _group_table(abs_d: torch.Tensor, is_ratio: torch.Tensor, k3: torch.Tensor, datum: torch.Tensor,
                 groups: torch.Tensor, active: torch.Tensor | None, max_groups: int) -> torch.Tensor:
    """Float64 ``[GROUP_ROWS, K]``: each group's index (``max_groups``: ``group_other``) and its sums, from one
    int64 id per datum: a column per datum, merged into one per group where that reads nothing (the CPU)."""
    weights = torch.stack([torch.ones_like(k3), k3, abs_d, is_ratio])
    if active is not None:
        weights.masked_fill_(~active, 0.0)
    table = torch.zeros(GROUP_ROWS, groups.numel(), dtype=torch.float64, device=k3.device)
    table[0] = groups.clamp(max=max_groups)
    table[1:].index_add_(1, datum, weights)
    return merged_groups(table)


def merged_groups(table: torch.Tensor) -> torch.Tensor:
    """``by_group`` on the CPU (the groups' number is read there); elsewhere the table as it is (side by side:
    the reduction and ``to_host`` merge them)."""
    return by_group(table) if _on_host(table.device) else table


def _datums_and_orders(active: torch.Tensor, row_lengths: torch.Tensor, row_counts: torch.Tensor, *, compact: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each place's datum and its order among its datum's action tokens (0: the datum's first); the places are
    the action tokens alone (``compact``) or every position (then: the action tokens before it in its datum).

    Examples:
        >>> active = torch.tensor([False, True, True, True, False, True])
        >>> datum, order = _datums_and_orders(active, torch.tensor([4, 2]), torch.tensor([3, 1]), compact=True)
        >>> datum.tolist(), order.tolist()
        ([0, 0, 0, 1], [0, 1, 2, 0])
    """
    device = active.device
    datum = torch.repeat_interleave(torch.arange(row_lengths.numel(), device=device), row_lengths,
                                    output_size=active.numel())
    if compact:
        datum = datum[active]
        first = torch.cumsum(row_counts, 0) - row_counts  # each datum's first action token
        return datum, torch.arange(datum.numel(), device=device).sub_(first.index_select(0, datum))
    order = torch.cumsum(active, 0).sub_(active.to(torch.int64))  # action tokens before each place
    starts = (torch.cumsum(row_lengths, 0) - row_lengths).clamp(max=max(active.numel() - 1, 0))
    order -= (order.index_select(0, starts) if order.numel() else starts).index_select(0, datum)
    return datum, order




def _probability_buckets(sampler: torch.Tensor) -> torch.Tensor:
    """Each sampler logprob's bucket of ``PROBABILITY_EDGES`` (0: p < 0.01, ..., 4: p >= 0.9), int64."""
    return torch.bucketize(sampler.to(torch.float64), device_constant(_LOG_EDGES, torch.float64, sampler.device),
                          right=True)


def _on_host(device: torch.device) -> bool:
    """Whether reading the host is free here (the CPU), so that shapes may follow the data."""
    return device.type == "cpu"


def _select(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values[keep]`` on the CPU; numpy's compress is about 3x faster than ``masked_select``."""
    if values.dtype in _16_BIT or values.requires_grad:
        return values.detach().masked_select(keep)
    return torch.from_numpy(np.compress(keep.numpy(), values.numpy()))


def _row_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of each consecutive run of ``lengths[i]`` values (bools are counted); no host sync off the CPU."""
    rows = lengths.numel()
    if _on_host(values.device):
        sums = np.zeros(rows, dtype=np.float64 if values.is_floating_point() else np.int64)
        nonempty = lengths.numpy() > 0
        if nonempty.any():  # reduceat sums runs between consecutive, strictly increasing starts
            starts = (np.cumsum(lengths.numpy()) - lengths.numpy())[nonempty]
            sums[nonempty] = np.add.reduceat(values.numpy(), starts, dtype=sums.dtype)
        return torch.from_numpy(sums)
    summed = values if values.is_floating_point() else values.to(torch.int64)
    row_of = torch.repeat_interleave(torch.arange(rows, device=values.device), lengths, output_size=values.numel())
    return torch.zeros(rows, dtype=summed.dtype, device=values.device).index_add_(0, row_of, summed)


def max_and_negated_min(values: torch.Tensor, where: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, -min) of ``values`` where ``where`` (all when ``None``), float64; -inf for both when there are none."""
    if values.numel() == 0:  # aminmax of nothing is an error
        none = torch.full((), -math.inf, dtype=torch.float64, device=values.device)
        return none, none
    if where is None:
        low, high = torch.aminmax(values)
    else:
        low, high = values.masked_fill(~where, math.inf).amin(), values.masked_fill(~where, -math.inf).amax()
    return high.to(torch.float64), -low.to(torch.float64)


def _stable_top_k(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values, ties broken by the earliest index, in index order."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=ranked.device)
    if _on_host(ranked.device):
        # The k-th largest of a strided subset is a lower bound of the k-th largest of all, so
        # every value at or above it is a candidate (about k * stride of them); rank those only.
        stride = max(1, min(64, ranked.shape[0] // (4 * k)))
        bound = torch.topk(ranked[::stride] if stride > 1 else ranked, k, sorted=False).values.min()
        candidates = (ranked >= bound).nonzero().squeeze(1)
        order = torch.sort(ranked.index_select(0, candidates), descending=True, stable=True).indices[:k]
        return candidates.index_select(0, order).sort().values
    # Fixed shapes (no host sync): all values above the k-th, then the earliest ties.
    threshold = torch.topk(ranked, k, sorted=False).values.min()
    above, tied = ranked > threshold, ranked == threshold
    take = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
    return torch.topk(take.to(torch.float32), k, sorted=False).indices.sort().values


def _worst_rows(flat: FlatBatch, flat_index: torch.Tensor, chosen: torch.Tensor, ranked: torch.Tensor,
                d: torch.Tensor, top_n: int) -> torch.Tensor:
    """``ROW`` rows of the chosen tokens, ranked, padded with empty rows to ``top_n``."""
    rows = torch.full((top_n, ROW.WIDTH), float(NO_TOKEN), dtype=torch.float64, device=d.device)
    rows[:, ROW.ABS] = -math.inf
    if chosen.shape[0] == 0:
        return rows
    row_ends = torch.cumsum(flat.row_lengths, 0)
    datum = torch.searchsorted(row_ends, flat_index, right=True)
    position = flat_index - (row_ends - flat.row_lengths).index_select(0, datum)
    picked = rows[: chosen.shape[0]]
    picked[:, ROW.ABS] = ranked.index_select(0, chosen)
    picked[:, ROW.DIFF] = d.index_select(0, chosen)
    picked[:, ROW.SAMPLER] = flat.sampler.index_select(0, flat_index).to(torch.float64)
    picked[:, ROW.TRAINER] = flat.trainer.index_select(0, flat_index).to(torch.float64)
    picked[:, ROW.DATUM] = datum.to(torch.float64)
    picked[:, ROW.POSITION] = position.to(torch.float64)
    if flat.tokens is not None:
        token, before, after = flat.tokens.lookup(datum, position)
        picked[:, ROW.TOKEN], picked[:, ROW.BEFORE], picked[:, ROW.AFTER] = token, before, after
    return ranked_rows(rows, top_n)


PREFIX = "correction/"
"""Logged scalars' prefix."""
SHARED_TOTALS = ("n_tokens", "n_datums_with_actions", "n_datums_no_advantage")
# the raw log ratios' extrema, and those of the ranks whose advantages could not be read
SHARED_EXTREMA = tuple(f"{extremum}_{name}" for name in ("token_log_ratio", "seq_log_ratio", "seq_mean_log_ratio",
                                                            "rank_no_advantage") for extremum in ("max", "neg_min"))
PER_CORRECTION_TOTALS = (
    "n_tokens_masked", "n_tokens_clipped", "n_datums_masked", "n_datums_clipped",
    "sum_weight", "sum_weight2", "sum_seq_weight", "sum_seq_weight2",
)


def parse_corrections(corrections: Sequence[str | Correction]) -> tuple[Correction, ...]:
    """Each spec parsed; two with one name are a ``ValueError`` (their statistics would collide).

    Examples:
        >>> [c.name for c in parse_corrections(["sequence_mask", "geo"])]
        ['sequence_mask', 'geo']
    """
    if isinstance(corrections, (str, Correction, Mapping)):  # a dict's keys alone would be read, its values dropped
        raise TypeError(
            f"corrections must be a list of specs, got a {type(corrections).__name__} ({corrections!r}); write e.g. "
            "['sequence_mask:3.0', 'token_truncate(clip_max=1.5)'] or [Correction('token_truncate', {'clip_max': 1.5})]"
            " (YAML: a list of strings, or of 'method:' / 'params:' mappings)"
        )
    parsed = tuple(parse_correction(c) for c in corrections)
    names = [c.name for c in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"corrections {repeated} are listed more than once")
    return parsed


def _key(correction: Correction | None, stat: str) -> str:
    return f"correction:{'' if correction is None else correction.name}:{stat}"


def shadow_statistics(corrections: Sequence[Correction]) -> tuple[State, ...]:
    """Every statistic ``shadow_values`` returns, with its reduction; none for an empty list.

    Examples:
        >>> [s.name for s in shadow_statistics(parse_corrections(["geo"]))][2:4]
        ['correction::n_datums_no_advantage', 'correction:geo:n_tokens_masked']
    """
    if not corrections:
        return ()
    totals = [_key(None, s) for s in SHARED_TOTALS] + [_key(c, s) for c in corrections for s in PER_CORRECTION_TOTALS]
    return (*(State(n, "sum") for n in totals), *(State(_key(None, s), "max") for s in SHARED_EXTREMA))


@torch.no_grad()
def shadow_values(
    flat: FlatBatch, corrections: Sequence[Correction], advantages: torch.Tensor | None = None, *, rank: int = 0
) -> dict[str, torch.Tensor]:
    """The shadow statistics of one batch, by name: 0-d float64 tensors on the batch's device.

    ``advantages`` (one per datum, ``[B]``: ``read_advantages``) is needed only by ``off_policy_mask``;
    NaN marks a datum whose advantages could not be read: its sequence is not kept, and counted with ``rank``
    (this process's) for ``no_advantage_message``. Nothing synchronizes with the device.

    Examples:
        >>> import torch
        >>> from loops_callbacks.divergence.batch import flatten_padded
        >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -1.0]]), training_logprobs=torch.zeros(1, 2),
        ...                       mask=torch.ones(1, 2))
        >>> corrections = parse_corrections(["token_mask:2.0"])
        >>> values = shadow_values(flat, corrections)
        >>> scalars = shadow_scalars(values, values, corrections)
        >>> scalars["correction/token_mask(clip_max=2.0)/frac_tokens_masked"]
        1.0
        >>> round(scalars["correction/raw/token_ratio_max"], 3)
        2.718
    """
    if not corrections:
        return {}
    diff, mask = flat.diff, flat.counted
    rows = Segments(flat.row_lengths, total=diff.numel())
    if advantages is not None:
        advantages = advantages.detach().to(device=diff.device, dtype=torch.float64)
    x = CorrectionInput(diff, mask, rows, advantages)
    count = x.row_count
    with_actions = count > 0
    unjudged = count.new_zeros(())
    if advantages is not None:
        unjudged = (with_actions & advantages.isnan()).sum().to(torch.float64)
    values: dict[str, torch.Tensor] = {
        _key(None, "n_tokens"): count.sum(),
        _key(None, "n_datums_with_actions"): with_actions.sum().to(torch.float64),
        _key(None, "n_datums_no_advantage"): unjudged,
    }
    values.update(_extrema("rank_no_advantage", torch.full_like(unjudged, float(rank)), unjudged > 0))
    values.update(_extrema("token_log_ratio", diff, x.finite))
    values.update(_extrema("seq_log_ratio", x.row_log_ratio, with_actions))
    values.update(_extrema("seq_mean_log_ratio", x.row_log_ratio / count.clamp(min=1.0), with_actions))
    for correction in corrections:
        if correction.spec.level == "sequence":
            values.update(_sequence_level(correction, correct_rows(correction, x), count, with_actions))
        else:
            values.update(_token_level(correction, correct_flat(correction, x), x))
    return values


def _sequence_level(correction: Correction, rows: Weights, count: torch.Tensor, with_actions: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
    """The statistics of a sequence-level correction from its rows alone (every token of a row shares its fate)."""
    dropped, clipped = with_actions & ~rows.keep, with_actions & rows.clipped
    weight = rows.weights * with_actions  # a row without action tokens is no sequence; its weight never applies
    return _per_correction(correction, (count * dropped).sum(), (count * clipped).sum(), dropped.sum(), clipped.sum(),
                           (count * weight).sum(), (count * weight.square()).sum(), weight.sum(), weight.square().sum())


def _token_level(correction: Correction, result: Weights, x: CorrectionInput) -> dict[str, torch.Tensor]:
    """The statistics of a token-level correction over ``x.finite``; a sequence's weight is its tokens' mean."""
    weights, clipped = result.weights * x.finite, result.clipped & x.finite
    seq_weight = x.rows.sum(weights) / x.row_count.clamp(min=1.0)  # 0 for a row without action tokens
    zero = weights.new_zeros(())
    can_drop, can_clip = _can_drop(correction), not _can_drop(correction)
    dropped = x.finite & ~result.keep if can_drop else None
    return _per_correction(
        correction, dropped.sum() if can_drop else zero, clipped.sum() if can_clip else zero,
        _rows_with_any(dropped, x) if can_drop else zero, _rows_with_any(clipped, x) if can_clip else zero,
        weights.sum(), weights.square().sum(), seq_weight.sum(), seq_weight.square().sum(),
    )


def _per_correction(correction: Correction, *values: torch.Tensor) -> dict[str, torch.Tensor]:
    """``PER_CORRECTION_TOTALS`` of ``correction``, in that order, as float64."""
    return {_key(correction, stat): value.to(torch.float64) for stat, value in zip(PER_CORRECTION_TOTALS, values,
                                                                                    strict=True)}


def _can_drop(correction: Correction) -> bool:
    """Masks and rejections drop tokens and never clip; truncations clip and never drop."""
    return not (correction.spec.family == "verl_is" or correction.spec.formula.endswith("truncate"))


def _rows_with_any(flags: torch.Tensor, x: CorrectionInput) -> torch.Tensor:
    return (x.rows.sum(flags.to(torch.float64)) > 0).sum().to(torch.float64)


def _extrema(name: str, values: torch.Tensor, where: torch.Tensor) -> dict[str, torch.Tensor]:
    """``max_<name>`` and ``neg_min_<name>`` over ``where`` (-inf when empty)."""
    high, neg_low = max_and_negated_min(values, where)
    return {_key(None, f"max_{name}"): high, _key(None, f"neg_min_{name}"): neg_low}


def shadow_scalars(
    totals: Mapping[str, float | torch.Tensor],
    extrema: Mapping[str, float | torch.Tensor],
    corrections: Sequence[Correction],
) -> dict[str, float]:
    """The logged scalars (docs/statistics.md) from merged totals and extrema, by statistic name.

    Nothing is logged for a step without action tokens (every share would be 0 / 0).
    """
    if not corrections:
        return {}
    total = {name: float(value) for name, value in totals.items()}
    peak = {name: float(value) for name, value in extrema.items()}
    n_tokens, n_with_actions = total[_key(None, "n_tokens")], total[_key(None, "n_datums_with_actions")]
    if n_tokens == 0:
        return {}
    scalars = {}
    for name, stat in (("token_ratio", "token_log_ratio"), ("seq_ratio", "seq_log_ratio"),
                       ("seq_geo_ratio", "seq_mean_log_ratio")):
        high, neg_low = peak[_key(None, f"max_{stat}")], peak[_key(None, f"neg_min_{stat}")]
        if high > -math.inf:  # -inf: every action token's log ratio was NaN
            scalars[f"{PREFIX}raw/{name}_max"] = _exp(high)
            scalars[f"{PREFIX}raw/{name}_min"] = _exp(-neg_low)
    for correction in corrections:
        sums = {stat: total[_key(correction, stat)] for stat in PER_CORRECTION_TOTALS}
        out = f"{PREFIX}{correction.name}/"
        scalars[out + "frac_tokens_masked"] = sums["n_tokens_masked"] / n_tokens
        scalars[out + "frac_tokens_clipped"] = sums["n_tokens_clipped"] / n_tokens
        scalars[out + "frac_seqs_masked"] = sums["n_datums_masked"] / n_with_actions
        scalars[out + "frac_seqs_clipped"] = sums["n_datums_clipped"] / n_with_actions
        scalars[out + "ess_tokens"] = _ess(sums["sum_weight"], sums["sum_weight2"], n_tokens)
        scalars[out + "ess_seqs"] = _ess(sums["sum_seq_weight"], sums["sum_seq_weight2"], n_with_actions)
        scalars[out + "mean_weight"] = sums["sum_weight"] / n_tokens
    return scalars


def no_advantage_message(
    totals: Mapping[str, float | torch.Tensor], extrema: Mapping[str, float | torch.Tensor], label: str
) -> str | None:
    """What to say about sequences whose advantages could not be read (``shadow_values``), from merged totals
    and extrema (every rank's): how many, and on which ranks; ``None`` when there are none.

    Examples:
        >>> totals = {"correction::n_datums_no_advantage": 4.0, "correction::n_datums_with_actions": 8.0}
        >>> extrema = {"correction::max_rank_no_advantage": 1.0, "correction::neg_min_rank_no_advantage": -1.0}
        >>> no_advantage_message(totals, extrema, "'advantages'").split(";")[0]
        "off_policy_mask had no usable 'advantages' for 4 of the step's 8 sequences, on rank 1"
    """
    n = float(totals.get(_key(None, "n_datums_no_advantage"), 0.0))
    if not n > 0:
        return None
    low = -float(extrema[_key(None, "neg_min_rank_no_advantage")])
    high = float(extrema[_key(None, "max_rank_no_advantage")])
    ranks = f"rank {low:.0f}" if low == high else f"ranks {low:.0f} (lowest) to {high:.0f} (highest)"
    return (
        f"off_policy_mask had no usable {label} for {n:.0f} of the step's "
        f"{float(totals[_key(None, 'n_datums_with_actions')]):.0f} sequences, on {ranks}; it cannot judge them, so its "
        "shadow metrics count them as masked (give one advantage per datum, or per token)"
    )


def _ess(total: float, total2: float, n: float) -> float:
    """(Σw)² / (n Σw²): 1 for equal weights, 1/n for one weight alone, 0 when every weight is 0."""
    return 0.0 if total2 == 0 else total * total / (n * total2)


def _exp(log_ratio: float) -> float:
    return math.exp(log_ratio) if log_ratio < 709.0 else math.inf


CHUNK_POSITIONS = 1 << 18
"""On the CPU, ``from_batch`` reads at most about this many positions at a time (whole datums)."""


@functools.lru_cache(maxsize=64)
def layout_of(diagnose: bool = True, max_groups: int | None = None, corrections: tuple[Correction, ...] = ()
              ) -> Layout:
    """The states a monitor with these options keeps: every step's, the diagnosis' sums when ``diagnose``,
    the strata with ``max_groups``, the shadow statistics of ``corrections``; made once per set of options."""
    check_int("max_groups", max_groups, least=1, optional=True)
    states = MAIN + (SIGNATURE_STATES if diagnose else ()) + (STRATA if max_groups is not None else ())
    return Layout(states + shadow_statistics(corrections), max_groups, corrections)


@dataclass(frozen=True)
class StatisticsOptions:
    """What ``DivergenceStats.from_batch`` reads, checked once when made: the ``top_n`` worst rows, a sample of at
    most ``sample_size`` diffs, the diagnosis' sums when ``diagnose`` (the plain SDK functions need none), the strata
    with ``max_groups``, and the shadow statistics of ``corrections`` (specs or parsed ones: ``parse_corrections``).

    >>> StatisticsOptions(top_n=5, diagnose=False).layout.sizes["sum"] < StatisticsOptions().layout.sizes["sum"]
    True
    """

    top_n: int = 0
    sample_size: int | None = None
    diagnose: bool = True
    max_groups: int | None = None
    corrections: tuple[Correction, ...] = ()
    layout: Layout = field(init=False, repr=False, compare=False)
    """The states these options keep (``layout_of``)."""

    def __post_init__(self) -> None:
        check_int("top_n", self.top_n, least=0)
        check_int("sample_size", self.sample_size, least=1, optional=True)
        check_bool("diagnose", self.diagnose)
        object.__setattr__(self, "corrections", parse_corrections(self.corrections))  # specs, or parsed already
        object.__setattr__(self, "layout", layout_of(self.diagnose, self.max_groups, self.corrections))


@dataclass(frozen=True)
class DivergenceStats:
    """Statistics of one or more batches on their device (docs/statistics.md); ``reduce_across_ranks`` reduces them."""

    sums: torch.Tensor  # float64 [layout.sizes["sum"]]
    maxima: torch.Tensor  # float64 [layout.sizes["max"]]; -inf when empty
    worst: torch.Tensor  # float64 [top_n, ROW.WIDTH], most divergent first; rows with ABS = -inf are empty
    sample: torch.Tensor  # float64 [m] diffs, in batch order
    sample_keys: torch.Tensor | None  # float64 [m]; +inf marks an empty slot; None: every diff kept
    layout: Layout
    sample_size: int | None = None
    groups: torch.Tensor | None = None  # float64 [GROUP_ROWS, K], the groups seen; None: no group key

    @classmethod
    @torch.no_grad()
    def from_batch(
        cls,
        flat: FlatBatch,
        options: StatisticsOptions = StatisticsOptions(),  # noqa: B008 - frozen
        *,
        generator: torch.Generator | None = None,
        rank: int = 0,
    ) -> DivergenceStats:
        """Read one flattened batch as ``options`` say (checked when they were made): the worst rows (with token
        ids when ``flat.tokens`` is set), a sample of diffs (``generator`` draws their keys), and the states their
        layout declares, with this process's ``rank`` where a correction could not read advantages. On the CPU a
        batch of more than ``CHUNK_POSITIONS`` positions is read in whole-datum chunks, so its temporaries stay
        small.

        Examples:
            >>> from loops_callbacks.divergence.batch import flatten_padded
            >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
            ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
            >>> host = DivergenceStats.from_batch(flat).to_host()
            >>> host.totals["n_action_tokens"], host.totals["sum_d"], host.diffs.tolist()
            (2.0, -0.5, [-0.5, 0.0])
        """
        layout, top_n, sample_size = options.layout, options.top_n, options.sample_size
        chunks = datum_chunks(flat, CHUNK_POSITIONS) if flat.device.type == "cpu" else [flat]
        parts = []
        for chunk in chunks:
            values, worst, sample, sample_keys, groups = of_chunk(chunk, layout, top_n, sample_size, generator)
            if layout.corrections:
                values.update(shadow_values(chunk, layout.corrections, chunk.datum_advantages, rank=rank))
            # each chunk keeps its sample_size smallest keys at once: the merged sample is the same, and a
            # large batch never holds every position's diff and key until the end
            parts.append(cls(*layout.pack(values), worst, sample, sample_keys, layout, sample_size, groups).capped())
        return cls.concatenated(parts)

    def merge(self, later: DivergenceStats) -> DivergenceStats:
        """Statistics of this batch followed by ``later`` (datum indices of ``later`` shift)."""
        return DivergenceStats.concatenated([self, later])

    @staticmethod
    def concatenated(parts: Sequence[DivergenceStats]) -> DivergenceStats:
        """Statistics of ``parts`` in order, as ``merge`` one after the other gives them."""
        if len(parts) == 1:
            return parts[0].capped()  # one chunk's diffs beyond sample_size are cut as merged ones are
        first = parts[0]
        n_datums = first.layout.index("n_datums")
        worst, maxima, datums = [], [], 0.0
        for part in parts:
            worst.append(part.worst.clone())
            worst[-1][:, ROW.DATUM] += datums
            maxima.append(part.layout.renumbered(part.maxima, datums))
            datums = datums + part.sums[n_datums]
        sample_keys = None
        if any(part.sample_keys is not None for part in parts):
            sample_keys = torch.cat([part.sample_keys if part.sample_keys is not None else torch.zeros_like(part.sample)
                                     for part in parts])
        groups = [part.groups for part in parts if part.groups is not None]
        return dataclasses.replace(
            first,
            sums=functools.reduce(torch.add, [part.sums for part in parts]),
            maxima=functools.reduce(torch.maximum, maxima),
            worst=ranked_rows(torch.cat(worst), max(part.worst.shape[0] for part in parts)),
            sample=torch.cat([part.sample for part in parts]),
            sample_keys=sample_keys,
            groups=merged_groups(torch.cat(groups, dim=1)) if groups else None,
        ).capped()

    def capped(self) -> DivergenceStats:
        """The ``sample_size`` diffs of smallest key, in batch order (itself when uncapped or small)."""
        if self.sample_size is None or self.sample_keys is None or self.sample_keys.shape[0] <= self.sample_size:
            return self
        keep = torch.topk(self.sample_keys, self.sample_size, largest=False, sorted=False).indices.sort().values
        return dataclasses.replace(self, sample=self.sample.index_select(0, keep),
                                   sample_keys=self.sample_keys.index_select(0, keep))

    def to_host(self) -> HostDivergence:
        """Everything on the host, in one device-to-host transfer."""
        sample_keys = self.sample_keys if self.sample_keys is not None else self.sample.new_zeros(0)
        groups = self.groups if self.groups is not None else self.sample.new_zeros(GROUP_ROWS, 0)
        parts = [self.sums, self.maxima, self.worst.reshape(-1), self.sample, sample_keys, groups.reshape(-1)]
        host = torch.cat(parts).cpu().numpy()
        sums, maxima, worst, sample, keys_, groups_ = np.split(host, np.cumsum([part.numel() for part in parts])[:-1])
        totals, arrays = self.layout.read(sums, "sum")
        extrema, max_arrays = self.layout.read(maxima, "max")
        arrays |= max_arrays
        worst = worst.reshape(-1, ROW.WIDTH)
        strata = None
        if self.layout.max_groups is not None:
            strata = {name: StratumSums(*map(float, arrays["strata"][:, i])) for i, name in enumerate(STRATUM_NAMES)}
            table = by_group(torch.from_numpy(groups_.reshape(GROUP_ROWS, -1))).numpy()
            for index, *column in table[:, table[1] > 0].T.tolist():  # the groups with tokens, in index order
                strata["group_other" if index >= self.layout.max_groups else f"group_{int(index)}"] = StratumSums(*column)
        return HostDivergence(
            totals, extrema, worst[worst[:, ROW.ABS] > -math.inf],
            sample[keys_ < math.inf] if self.sample_keys is not None else sample, arrays, strata,
        )


@dataclass(frozen=True)
class StratumSums:
    """One stratum's sums on the host (``COLUMNS``), and the three numbers they give (NaN without tokens).

    Examples:
        >>> stratum = StratumSums(n_tokens=4.0, sum_k3=0.2, sum_abs_d=2.0, sum_is_ratio=4.4)
        >>> stratum.k3, stratum.abs_d_mean, stratum.is_ratio_mean
        (0.05, 0.5, 1.1)
    """

    n_tokens: float
    sum_k3: float
    sum_abs_d: float
    sum_is_ratio: float

    @property
    def k3(self) -> float:
        return self.sum_k3 / self.n_tokens if self.n_tokens else math.nan

    @property
    def abs_d_mean(self) -> float:
        return self.sum_abs_d / self.n_tokens if self.n_tokens else math.nan

    @property
    def is_ratio_mean(self) -> float:
        return self.sum_is_ratio / self.n_tokens if self.n_tokens else math.nan


@dataclass(frozen=True)
class HostDivergence:
    """Statistics on the host: the numbers by name (sums in ``totals``, maxima in ``extrema``), the worst
    rows, the kept diffs in order, the non-scalar sums by name (``arrays``) and the strata by name."""

    totals: dict[str, float]
    extrema: dict[str, float]
    worst: np.ndarray = field(default_factory=lambda: np.zeros((0, ROW.WIDTH)))  # most divergent first
    diffs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64, the sampled diffs in batch order
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # token_sums, offset_sums, strata, prompt_first
    strata: dict[str, StratumSums] | None = None

    @property
    def token_sums(self) -> np.ndarray | None:
        return self.arrays.get("token_sums")

    @property
    def offset_sums(self) -> np.ndarray | None:
        return self.arrays.get("offset_sums")

    @property
    def by_lag(self) -> dict[str, StratumSums]:
        """The lag strata by ``LAG_LABELS`` (``"0"`` … ``"8+"``, all six in order) when some token had a
        policy version, else ``{}``: stale weights show as k3 growing with the lag."""
        lags = {label: self.strata[name] for label, name in zip(LAG_LABELS, LAG_STRATA)} if self.strata else {}
        return lags if any(stratum.n_tokens for stratum in lags.values()) else {}


def message_sizes(layout: Layout, top_n: int, sample_size: int) -> tuple[int, int]:
    """Values in a rank's header and in the summed body, for statistics of ``layout`` (groups: none given)."""
    strata = int(layout.max_groups is not None)
    header = 2 + layout.sizes["max"] + top_n + 1 + strata
    return header, top_n * ROW.WIDTH + layout.sizes["sum"] + sample_size + 1


def received_bytes(world: int, top_n: int, sample_size: int, layout: Layout | None = None) -> int:
    """Bytes one rank receives per reduction with ring collectives (what gloo measures, too): the ``world - 1``
    other headers, and ``2 (world - 1) / world`` of the body (reduce-scatter, then all-gather).

    Examples:
        >>> header, body = message_sizes(layout_of(), top_n=0, sample_size=10)
        >>> received_bytes(world=2, top_n=0, sample_size=10, layout=layout_of()) == 8 * (header + body)
        True

    Example (megabytes one rank receives per logged step at 1,024 ranks, with the monitor's defaults):
        >>> round(received_bytes(world=1024, top_n=20, sample_size=100_000) / 1e6, 1)
        2.1
    """
    header, body = message_sizes(layout or layout_of(True, DEFAULT_MAX_GROUPS), top_n, sample_size)
    return round(8 * ((world - 1) * header + 2 * (world - 1) * body / world))


@torch.no_grad()
def reduce_across_ranks(
    stats: DivergenceStats, group: ProcessGroup | Any, *, generator: torch.Generator | None = None
) -> DivergenceStats:
    """Statistics of every rank's batches, rank 0's first, the same on every rank (docs/statistics.md).

    A collective: every rank calls it, with statistics of one layout, ``top_n`` and ``sample_size``.
    ``group`` is a ``ProcessGroup`` or a Lightning strategy (``ProcessGroup.of``); ``generator`` (on the statistics'
    device) draws the one random number of the sample's allocation. The result is for reading
    (``to_host``): its sample_keys only mark the filled places, so it is not merged again.
    """
    group = ProcessGroup.of(group)
    world, rank = group.world_size, group.rank
    if world == 1:
        return stats
    layout, device, top_n = stats.layout, stats.sums.device, stats.worst.shape[0]
    strata = layout.max_groups is not None
    columns = _group_columns(stats)  # where each of this rank's groups goes in the body
    needed = torch.zeros(int(strata), dtype=torch.float64, device=device)
    if columns is not None and columns.numel():
        needed = columns.max().add(1).to(torch.float64).reshape(1)
    counts = torch.stack([stats.sums[layout.index("n_datums")], stats.sums[layout.index("n_action_tokens")]])
    draw = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
    header = [counts, stats.maxima, stats.worst[:, ROW.ABS], draw, needed]
    gathered = group.all_gather(torch.cat(header))
    counts, maxima, worst_abs, draws, widths = gathered.split([part.numel() for part in header], dim=1)
    datum_offsets = torch.cumsum(counts[:, 0], 0) - counts[:, 0]
    tokens = counts[:, 1].to(torch.int64)
    share, start = stratified_allocation(tokens, stats.sample_size, draws[0, 0])
    capacity = stats.sample_size if stats.sample_size is not None else int(tokens.sum())
    width = _groups_width(layout, widths) if strata else 0
    groups = torch.zeros(GROUP_ROWS - 1, width, dtype=torch.float64, device=device)
    if columns is not None:
        groups.index_add_(1, columns, stats.groups[1:])
    sample = torch.zeros(capacity + 1, dtype=torch.float64, device=device)  # the last place takes the unchosen
    own_keys = stats.sample_keys if stats.sample_keys is not None else torch.zeros_like(stats.sample)
    chosen = _smallest(own_keys, share[rank])
    places = torch.where(chosen, start[rank] + torch.cumsum(chosen, 0) - 1, capacity)
    sample.index_add_(0, places, stats.sample.to(torch.float64).masked_fill(~chosen, 0.0))
    body = [_chosen_rows(stats.worst, worst_abs, datum_offsets[rank], rank).reshape(-1), stats.sums,
            groups.reshape(-1), sample]
    rows, sums, groups, sample = group.all_reduce_sum(torch.cat(body)).split([p.numel() for p in body])
    sample_keys = None
    if stats.sample_size is not None:
        sample_keys = torch.zeros(capacity, dtype=torch.float64, device=device)
        sample_keys.masked_fill_(torch.arange(capacity, device=device) >= share.sum(), math.inf)
    if width:
        indices = torch.arange(-1, width - 1, dtype=torch.float64, device=device)  # body place 0: group_other
        indices[0] = layout.max_groups
        groups = torch.cat([indices[None], groups.reshape(GROUP_ROWS - 1, width)])
    return dataclasses.replace(
        stats, sums=sums, maxima=layout.renumbered(maxima, datum_offsets).amax(0),  # the earliest datum's record
        worst=rows.reshape(top_n, ROW.WIDTH), sample=sample[:capacity],
        sample_keys=sample_keys, groups=groups if width else None,
    )


def _groups_width(layout: Layout, widths: torch.Tensor) -> int:
    """The body places of the groups: on the CPU the most any rank needs (the headers are on the host); on an
    accelerator ``max_groups + 1``, fixed, so that no host read waits for the device."""
    return int(widths.max()) if widths.device.type == "cpu" else layout.max_groups + 1


def _group_columns(stats: DivergenceStats) -> torch.Tensor | None:
    """The body place of each column of the rank's group table (int64; ``None`` without one): 0 for
    ``group_other`` (index ``max_groups``), index + 1 for the others, so that the body is as wide as the
    largest index given, whatever ``max_groups``."""
    if stats.groups is None or stats.layout.max_groups is None:
        return None
    index = stats.groups[0].to(torch.int64)
    return torch.where(index >= stats.layout.max_groups, 0, index + 1)


def stratified_allocation(
    counts: torch.Tensor, sample_size: int | None, draw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's share of the union's sample and where its diffs start, from the ranks' counts.

    ``counts``: int64 action tokens per rank; ``draw``: a float in [0, 1), the same on every rank
    (docs/statistics.md). Integer arithmetic on the counts' device; exact while sample_size * N < 2**63.

    Examples:
        >>> share, start = stratified_allocation(torch.tensor([3, 0, 5]), 4, torch.tensor(0.5))
        >>> share.tolist(), start.tolist()
        ([2, 0, 2], [0, 2, 2])
    """
    cumulative = torch.cumsum(counts, 0)
    total = cumulative[-1]
    kept = total if sample_size is None else total.clamp(max=sample_size)
    shift = torch.minimum((draw * total).floor().to(torch.int64), (total - 1).clamp(min=0))
    ends = torch.div(kept * cumulative + shift, total.clamp(min=1), rounding_mode="floor")
    starts = torch.cat([torch.zeros_like(ends[:1]), ends[:-1]])  # floor(shift / N) = 0
    return ends - starts, starts


def _chosen_rows(worst: torch.Tensor, worst_abs: torch.Tensor, datum_offset: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows among the global ``top_n``, at their final places; zeros elsewhere.

    ``worst_abs`` is ``[world, top_n]``: every rank's ranked |d|; a stable descending sort of it flattened
    in rank order breaks ties by rank, then by each rank's own order: a merge's order.
    """
    top_n = worst.shape[0]
    if top_n == 0:
        return worst
    order = torch.sort(worst_abs.reshape(-1), descending=True, stable=True).indices[:top_n]
    owner = torch.div(order, top_n, rounding_mode="floor")
    rows = worst.index_select(0, order - owner * top_n)
    rows[:, ROW.DATUM] += datum_offset
    return rows.masked_fill_((owner != rank)[:, None], 0.0)


def _smallest(sample_keys: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask of the ``count`` smallest keys, ties to the earliest; ``count`` is a 0-d int64 tensor. On the CPU
    the threshold comes from ``kthvalue`` (reading ``count`` is free there), elsewhere from a sort.

    Examples:
        >>> _smallest(torch.tensor([0.5, 0.1, 0.5, 0.3]), torch.tensor(3)).tolist()
        [True, True, False, True]
    """
    if sample_keys.numel() == 0 or (sample_keys.device.type == "cpu" and int(count) == 0):
        return torch.zeros_like(sample_keys, dtype=torch.bool)
    if sample_keys.device.type == "cpu":
        threshold = torch.kthvalue(sample_keys, int(count)).values
    else:
        threshold = torch.sort(sample_keys).values.gather(0, (count - 1).clamp(min=0).reshape(1)).squeeze(0)
    below, tied = sample_keys < threshold, sample_keys == threshold
    return below | (tied & (torch.cumsum(tied, 0) <= count - below.sum()))


DEFAULT_PREFIX = "optim/train-sample-div/"

SCALAR_METRICS = (
    # the Loops SDK's keys, in its order
    "kl_sample_train_v1_loops", "kl_sample_train_v2_loops", "kl_sample_train_k3", "is_ratio_mean", "ess_fraction",
    "diff_mean", "diff_abs_p50", "diff_abs_p90", "diff_abs_p99", "diff_abs_max", "frac_abs_gt_1", "frac_abs_gt_2",
    "frac_abs_gt_4", "entropy", "n_action_tokens",
    # the keys this package adds beside them
    "is_ratio_max", "is_ratio_min", "chi2_token", "seq_log_ratio_mean", "seq_is_ratio_mean", "seq_is_ratio_max",
    "frac_is_ratio_gt_2", "frac_is_ratio_lt_0.5", "frac_abs_gt_0.5", "n_sequences", "n_skipped_nonfinite",
)
"""Every scalar key (after the prefix) a step with action tokens logs."""

SAMPLING_METRICS = (
    "sampling_z", "sampling_z_trimmed", "sampling_bias", "sampling_relative_bias", "sampling_temperature"
)
"""The keys of the check of what was sampled, logged when the trainer's entropy and varentropy are given."""

STRATUM_METRICS = ("k3", "abs_d_mean", "is_ratio_mean", "n_tokens")
"""The scalars logged per stratum with tokens: ``stratum/<name>/<metric>``."""


def scalar_metrics(host: HostDivergence, *, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The scalar metrics (docs/statistics.md); with no action tokens only ``n_action_tokens`` (0.0)
    and the two counts. Problems with the inputs are for the caller to report
    (``loops_callbacks.divergence.guard_rail.impossible_inputs``).

    Examples:
        >>> import numpy as np
        >>> from loops_callbacks.divergence.statistics import HostDivergence
        >>> host = HostDivergence(totals={"n_action_tokens": 0.0, "n_datums": 2.0, "n_skipped_nonfinite": 1.0},
        ...                       extrema={})
        >>> scalar_metrics(host, prefix="div/")
        {'div/n_action_tokens': 0.0, 'div/n_sequences': 2.0, 'div/n_skipped_nonfinite': 1.0}
    """
    t, e = host.totals, host.extrema
    n = t["n_action_tokens"]
    counts = {"n_sequences": t["n_datums"], "n_skipped_nonfinite": t["n_skipped_nonfinite"]}
    if n == 0:
        return {prefix + "n_action_tokens": 0.0, **{prefix + k: v for k, v in counts.items()}}
    # numpy's linear method, partitioning the fresh |d| array in place (no second copy of the diffs)
    abs_percentiles = np.percentile(np.abs(host.diffs), (50, 90, 99), overwrite_input=True).tolist()
    ess_denominator = n * t["sum_is_ratio2"]
    with_actions = t["n_datums_with_actions"]
    values = {
        "kl_sample_train_v1_loops": -t["sum_d"] / n,
        "kl_sample_train_v2_loops": 0.5 * t["sum_d2"] / n,
        "kl_sample_train_k3": kl_sample_train_k3(t),
        "is_ratio_mean": is_ratio_mean(t),
        "ess_fraction": t["sum_is_ratio"] ** 2 / ess_denominator if ess_denominator != 0 else 0.0,
        "diff_mean": t["sum_d"] / n,
        **dict(zip(("diff_abs_p50", "diff_abs_p90", "diff_abs_p99"), abs_percentiles)),
        "diff_abs_max": max(e["max_d"], e["neg_min_d"]),
        "frac_abs_gt_1": t["n_abs_gt_1"] / n,
        "frac_abs_gt_2": t["n_abs_gt_2"] / n,
        "frac_abs_gt_4": t["n_abs_gt_4"] / n,
        "entropy": -t["sum_sampler"] / n,
        "n_action_tokens": float(n),
        "is_ratio_max": is_ratio(e["max_d"]),  # exp is monotone: the weight of the largest diff
        "is_ratio_min": is_ratio(-e["neg_min_d"]),
        "chi2_token": t["sum_is_ratio2"] / n - 1.0,
        "seq_log_ratio_mean": t["sum_seq_mean_d"] / with_actions,
        "seq_is_ratio_mean": t["sum_seq_is_ratio"] / with_actions,
        "seq_is_ratio_max": is_ratio(e["max_seq_mean_d"]),
        "frac_is_ratio_gt_2": t["n_is_ratio_gt_2"] / n,
        "frac_is_ratio_lt_0.5": t["n_is_ratio_lt_half"] / n,
        "frac_abs_gt_0.5": t["n_abs_gt_half"] / n,
        **counts,
        **sampling_metrics(t, e),
    }
    return {prefix + name: float(value) for name, value in values.items()}


def sampling_metrics(totals: Mapping[str, float], extrema: Mapping[str, float]) -> dict[str, float]:
    """The check of what was sampled (docs/statistics.md), or ``{}`` without the trainer's entropies.

    Example (tokens drawn sharper than the trainer's distribution: their logprobs above -H; the one token
    furthest above, 0.5 nats, left out of ``sampling_z_trimmed``):
        >>> sums = {"n_sampling_tokens": 100.0, "sum_sampling_gap": 20.0, "sum_sampling_entropy": 150.0,
        ...         "sum_sampling_varentropy": 64.0}
        >>> extrema = {"max_sampling_gap": 0.5, "neg_min_sampling_gap": 3.0}
        >>> metrics = sampling_metrics(sums, extrema)
        >>> [round(metrics[name], 3) for name in ("sampling_z", "sampling_z_trimmed", "sampling_temperature")]
        [2.5, 2.438, 0.688]
    """
    n = totals.get("n_sampling_tokens", 0.0)
    if not n > 0:
        return {}
    gap, entropy, varentropy = (totals[f"sum_sampling_{name}"] for name in ("gap", "entropy", "varentropy"))
    # the one token that moved the sum furthest its way: a draw a heavy tail allows must not decide alone
    extreme = extrema["max_sampling_gap"] if gap > 0 else -extrema["neg_min_sampling_gap"] if gap < 0 else 0.0
    if varentropy > 0:
        z, temperature = gap / math.sqrt(varentropy), 1.0 - gap / varentropy
        trimmed = (gap - extreme) / math.sqrt(varentropy)
    else:  # no variance to scale by (every distribution uniform on its support, a point mass): drawn as described
        # only where each token's t is -H; otherwise not a number, never an infinite z (the entropies' check says why)
        z = trimmed = 0.0 if gap == 0 else math.nan
        temperature = 1.0 if gap == 0 else math.nan
    return {
        "sampling_z": z,
        "sampling_z_trimmed": trimmed,
        "sampling_bias": gap / n,
        "sampling_relative_bias": gap / entropy if entropy > 0 else math.nan,
        "sampling_temperature": temperature,
    }


def held_sampling_z(scalars: Mapping[str, float]) -> float:
    """The part of ``sampling_z`` that ``sampling_z_trimmed`` keeps: the smaller of the two when they agree in
    sign, 0 when leaving one token out turns it round, NaN without the check. What the diagnosis and the guard
    rail judge, so one unlikely token is never the whole case.

    Examples:
        >>> held_sampling_z({"sampling_z": -7.9, "sampling_z_trimmed": 0.4}), held_sampling_z({"sampling_z": 30.0,
        ...     "sampling_z_trimmed": 29.5})
        (0.0, 29.5)
    """
    z, trimmed = scalars.get("sampling_z", math.nan), scalars.get("sampling_z_trimmed", math.nan)
    if math.isnan(z) or math.isnan(trimmed):
        return z
    return math.copysign(min(abs(z), abs(trimmed)), z) if z * trimmed > 0 else 0.0


def kl_sample_train_k3(totals: Mapping[str, float]) -> float:
    """mean(e^d − 1 − d) over the action tokens (``totals`` has some); the diagnosis reads it too."""
    return totals["sum_k3"] / totals["n_action_tokens"]


def is_ratio_mean(totals: Mapping[str, float]) -> float:
    """mean(e^d), the trainer's mass on the sampler's support; ``totals`` has action tokens."""
    return totals["sum_is_ratio"] / totals["n_action_tokens"]


def is_ratio(d: float) -> float:
    """The importance ratio exp(min(d, 80)) of one diff; finite for any d."""
    return math.exp(min(d, IS_RATIO_CLAMP))


def histogram_values(diffs: np.ndarray, max_tokens: int) -> np.ndarray:
    """``diffs`` evenly subsampled to at most ``max_tokens`` values (``<= 0``: no cap).

    Value i of m is ``diffs[round(i * (n - 1) / (m - 1))]``, as in the Loops SDK.

    Examples:
        >>> histogram_values(np.arange(10.0), 4).tolist()
        [0.0, 3.0, 6.0, 9.0]
    """
    n = diffs.shape[0]
    if max_tokens <= 0 or n <= max_tokens:
        return diffs
    if max_tokens == 1:
        return diffs[:1]
    index = np.round(np.arange(max_tokens, dtype=np.float64) * (n - 1) / (max_tokens - 1)).astype(np.int64)
    return diffs[index]


def stratum_scalars(strata: Mapping[str, StratumSums]) -> dict[str, float]:
    """``stratum/<name>/<metric>`` (``STRATUM_METRICS``) for every stratum with tokens, without prefix.

    Examples:
        >>> scalars = stratum_scalars({"pos_q1": StratumSums(2.0, 0.1, 1.0, 2.0), "pos_q2": StratumSums(0, 0, 0, 0)})
        >>> list(scalars)[:2], scalars["stratum/pos_q1/k3"]
        (['stratum/pos_q1/k3', 'stratum/pos_q1/abs_d_mean'], 0.05)
    """
    return {f"stratum/{name}/{metric}": float(getattr(stratum, metric))
            for name, stratum in strata.items() if stratum.n_tokens for metric in STRATUM_METRICS}


SIGNATURES = (
    "frac_d_zero", "frac_d_pos", "both_16_bit_share", "sampler_all_zero", "is_ratio_mean", "is_ratio_se", "pearson", "temperature",
    "temperature_se", "relative_gap", "relative_gap_se", "sign_split", "temperature_sign", "shift_ratio",
    "shift_direction", "token_eta2", "low_high_abs_ratio", "rms_d", "kl_sample_train_k3", "sd_ratio", "context_fade",
    "context_fade_z", "offset", "offset_share", "offset_ratio", "left_aligned_ratio", "left_aligned_share", "lag_min", "lag_max",
)

CONTEXT_MIN_TOKENS = 64
"""Fewest compared tokens (the buckets' weights together) for a ``context_fade``."""
CONTEXT_BUCKET_MIN_TOKENS = 16
"""Fewest first and later action tokens (each) for a sampler-probability bucket to count in it."""


def signature_numbers(host: HostDivergence) -> dict[str, float]:
    """The signature numbers (docs/statistics.md; all NaN without action tokens).

    Examples:
        >>> from loops_callbacks.divergence.statistics import MAIN, SIGNATURE_STATES
        >>> totals = {s.name: 0.0 for s in MAIN + SIGNATURE_STATES if not s.shape} | {"n_action_tokens": 4.0,
        ...     "sum_is_ratio": 4.0, "sum_is_ratio2": 4.0, "sum_sampler": -4.0, "sum_trainer": -4.0, "sum_sampler2": 6.0,
        ...     "sum_trainer2": 6.0, "sum_sampler_trainer": 6.0}
        >>> sig = signature_numbers(HostDivergence(totals, {}))
        >>> sig["frac_d_zero"], sig["pearson"], sig["temperature"], sig["is_ratio_mean"]
        (1.0, 1.0, 1.0, 1.0)
    """
    t = host.totals
    n = t["n_action_tokens"]
    if n == 0:
        return dict.fromkeys(SIGNATURES, math.nan)
    mean_is_ratio = is_ratio_mean(t)
    var_s = t["sum_sampler2"] / n - (t["sum_sampler"] / n) ** 2
    var_t = t["sum_trainer2"] / n - (t["sum_trainer"] / n) ** 2
    cov = t["sum_sampler_trainer"] / n - (t["sum_sampler"] / n) * (t["sum_trainer"] / n)
    high, low = t["n_p_high"], t["n_p_low"]
    high_pos, high_neg = _share(t["n_p_high_d_pos"], high), _share(t["n_p_high_d_neg"], high)
    low_pos, low_neg = _share(t["n_p_low_d_pos"], low), _share(t["n_p_low_d_neg"], low)
    sharper = min(high_neg, low_pos)  # T < 1: the sampler over-weights likely tokens
    flatter = min(high_pos, low_neg)
    pairs = t["n_pairs"]
    aligned = _share(t["sum_abs_d_pairs"], 2 * pairs)
    after, before = _share(t["sum_abs_shift_next"], pairs), _share(t["sum_abs_shift_prev"], pairs)
    mean_d2 = t["sum_d2"] / n
    d2_se = math.sqrt(max(t["sum_d4"] / n - mean_d2**2, 0.0) / n)
    slope = cov / var_s if var_s > 0 else math.nan
    return {
        "frac_d_zero": 1.0 - (t["n_d_neg"] + t["n_d_pos"]) / n,
        "frac_d_pos": t["n_d_pos"] / n,
        "both_16_bit_share": t["n_both_16_bit"] / n,
        "sampler_all_zero": float(t["sum_sampler2"] == 0.0),  # a sum of squares is 0 only where each is
        "is_ratio_mean": mean_is_ratio,
        "is_ratio_se": math.sqrt(max(t["sum_is_ratio2"] / n - mean_is_ratio**2, 0.0) / n),
        "pearson": cov / math.sqrt(var_s * var_t) if var_s > 0 and var_t > 0 else math.nan,
        "temperature": slope,
        "temperature_se": math.sqrt(max(var_t - slope * cov, 0.0) / (n * var_s)) if var_s > 0 else math.nan,
        "relative_gap": mean_d2 / var_s if var_s > 0 else (0.0 if mean_d2 == 0 else math.inf),
        "relative_gap_se": d2_se / var_s if var_s > 0 else math.nan,
        "sign_split": max(sharper, flatter) if high and low else math.nan,
        "temperature_sign": -1.0 if sharper >= flatter else 1.0,
        "shift_ratio": _ratio(min(after, before), aligned),
        "shift_direction": 1.0 if after <= before else -1.0,
        "token_eta2": token_eta2(host.token_sums),
        "low_high_abs_ratio": _ratio(_share(t["sum_abs_d_p_low"], low), _share(t["sum_abs_d_p_high"], high)),
        "rms_d": math.sqrt(mean_d2),
        "kl_sample_train_k3": kl_sample_train_k3(t),
        "sd_ratio": math.sqrt(var_t / var_s) if var_s > 0 and var_t >= 0 else math.nan,
        **dict(zip(("context_fade", "context_fade_z"), _context_fade(t))),
        **_offset_numbers(host.offset_sums),
        **_lag_numbers(host.extrema),
        **sampling_metrics(t, host.extrema),  # the check of what was sampled, when the trainer's entropies were given
    }


class ServerDivergence(NamedTuple):
    """One sampling server's share of a step: its URL, action tokens, mean k3, and the lowest and highest lag
    buckets of its datums (``LAG_STRATA``, by their lower edge: 0, 1, 2, 3, 4 for 4-7, 8 for 8+; NaN without
    versions)."""

    url: str
    n_action_tokens: float
    kl_sample_train_k3: float
    lag_min: float
    lag_max: float


def server_numbers(host: HostDivergence, servers: Sequence[str]) -> dict[int, ServerDivergence]:
    """The divergence by sampling server, by slot (``servers``: the run's URLs in slot order; the last slot holds
    any beyond ``MAX_SERVERS``), for the servers with action tokens this step.

    Examples:
        >>> sums = np.zeros((8, 3))
        >>> sums[:2] = [[10.0, 0.0, 5.0], [0.1, 0.0, 0.5]]  # action tokens, sum of k3
        >>> sums[2, 0], sums[4, 2] = 2, 1  # datums at lag 0 (server 0) and at lag 2 (server 2)
        >>> found = server_numbers(HostDivergence({}, {}, arrays={"server_sums": sums}), ["http://a", "http://b", "http://c"])
        >>> list(found), found[2]
        ([0, 2], ServerDivergence(url='http://c', n_action_tokens=5.0, kl_sample_train_k3=0.1, lag_min=2.0, lag_max=2.0))
    """
    sums = host.arrays.get("server_sums")
    if sums is None:
        return {}
    found = {}
    for slot, url in enumerate(servers[:MAX_SERVERS]):
        n = float(sums[0, slot])
        if n > 0:
            shared = slot == MAX_SERVERS - 1 and len(servers) > MAX_SERVERS
            buckets = np.flatnonzero(sums[2:, slot])
            low, high = (LAG_EDGES[buckets[0]], LAG_EDGES[buckets[-1]]) if buckets.size else (math.nan, math.nan)
            found[slot] = ServerDivergence(f"{url} and later servers" if shared else url, n, float(sums[1, slot]) / n,
                                           low, high)
    return found


def _lag_numbers(extrema: dict[str, float]) -> dict[str, float]:
    """The smallest and largest policy lag of the step's datums with action tokens (NaN without versions)."""
    high, low = extrema.get("max_lag", -math.inf), -extrema.get("neg_min_lag", -math.inf)
    return {"lag_min": low, "lag_max": high} if high > -math.inf else {"lag_min": math.nan, "lag_max": math.nan}


def _offset_numbers(offsets: np.ndarray | None) -> dict[str, float]:
    if offsets is None:
        return dict.fromkeys(SIGNATURES[SIGNATURES.index("offset") : SIGNATURES.index("lag_min")], math.nan)
    found = read_offsets(offsets)
    return {"offset": found.offset, "offset_share": found.share, "offset_ratio": found.ratio,
            "left_aligned_ratio": found.left_ratio, "left_aligned_share": found.left_share}


def token_eta2(token_sums: np.ndarray | None) -> float:
    """Share of d's variance between token-id buckets, adjusted for their number (epsilon²).

    ``token_sums`` is ``[3, buckets]``: count, sum d, sum d². Plain eta² = SS_between / SS_total
    grows with the number of non-empty buckets G even when token identity explains nothing
    (about (G − 1) / (n − 1)); the adjusted share 1 − (SS_within / (n − G)) / (SS_total / (n − 1))
    is about 0 then. NaN with fewer than 2 buckets, n <= G or no variance.

    Examples:
        >>> token_eta2(np.array([[2.0, 2.0], [2.0, -2.0], [2.0, 2.0]]))  # d = 1, 1 | -1, -1
        1.0
    """
    if token_sums is None:
        return math.nan
    count, total, squares = token_sums
    used = count > 0
    groups, n = int(used.sum()), float(count.sum())
    if groups < 2 or n <= groups:
        return math.nan
    ss_total = float(squares.sum()) - float(total.sum()) ** 2 / n
    if not ss_total > 0:
        return math.nan
    ss_within = max(float(squares.sum()) - float((total[used] ** 2 / count[used]).sum()), 0.0)
    return 1.0 - (ss_within / (n - groups)) / (ss_total / (n - 1))


def _context_fade(totals: dict[str, float]) -> tuple[float, float]:
    """The context fade and its z score (docs/statistics.md): per sampler-probability bucket the log
    of mean |d| on the datums' first action tokens over mean |d| on their later ones, averaged with
    weights (the smaller of the bucket's two token counts); z is that mean over its standard error
    (each mean's from the spread of |d|, by the delta method). NaN below ``CONTEXT_MIN_TOKENS`` of
    weight; a bucket with no gap on one side (mean |d| of 0) cannot say how much it fades and is left out."""
    weighted_logs = weight = variance = 0.0
    for bucket in range(len(PROBABILITY_STRATA)):
        first, later = totals[context_total("n_first", bucket)], totals[context_total("n_later", bucket)]
        if first < CONTEXT_BUCKET_MIN_TOKENS or later < CONTEXT_BUCKET_MIN_TOKENS:
            continue
        first_mean = totals[context_total("sum_abs_d_first", bucket)] / first
        later_mean = totals[context_total("sum_abs_d_later", bucket)] / later
        if not (first_mean > 0 and later_mean > 0):
            continue
        first_var = max(totals[context_total("sum_d2_first", bucket)] / first - first_mean**2, 0.0)
        later_var = max(totals[context_total("sum_d2_later", bucket)] / later - later_mean**2, 0.0)
        share = min(first, later)
        weighted_logs += share * math.log(first_mean / later_mean)
        weight += share
        variance += share**2 * (first_var / (first * first_mean**2) + later_var / (later * later_mean**2))
    if weight < CONTEXT_MIN_TOKENS:
        return math.nan, math.nan
    log_fade = weighted_logs / weight
    spread = math.sqrt(variance) / weight
    return math.exp(log_fade), (log_fade / spread if spread > 0 else math.copysign(math.inf, log_fade))


def _share(part: float, whole: float) -> float:
    return part / whole if whole else math.nan


def _ratio(top: float, bottom: float) -> float:
    if math.isnan(top) or math.isnan(bottom):
        return math.nan
    if bottom == 0:
        return 0.0 if top == 0 else math.inf
    return top / bottom
