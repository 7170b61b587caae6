"""Every statistic a step keeps, declared once by name with its reduction, and where each sits.

A ``State`` is a name, a reduction (``"sum"``; ``"max"``, minima stored negated) and a shape, as
torchmetrics' ``add_state(name, default, dist_reduce_fx)`` declares one; its formula, by the same
name, is in ``sums``. Merging micro-batches, the one host transfer and the reduction across ranks
follow from the declarations (``statistics``, ``reduction``): every sum is added, every maximum
maxed; the two tables that merge their own way keep their order here (``ranked_rows``: the worst
tokens, ``by_group``: the groups). A monitor's declarations follow its options (``statistics.layout_of``):
the diagnosis' sums when ``diagnose``, the strata with ``max_groups``, the shadow statistics of its corrections.

Examples:
    >>> layout = Layout(MAIN, max_groups=None, corrections=())
    >>> sums, maxima = layout.pack({s.name: torch.tensor(1.0) for s in layout.states})
    >>> sums.shape == (layout.sizes["sum"],), layout.read(maxima.numpy(), "max")[0]["max_d"]
    (True, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from loops_callbacks.correction import Correction
from loops_callbacks.divergence.alignment import OFFSET_SIZE
from loops_callbacks.divergence.flat_batch import CONTEXT_AFTER, CONTEXT_BEFORE
from loops_callbacks.divergence.prompts import PROMPT_RECORD, renumber

TOKEN_BUCKETS = 1024
"""Token ids are hashed (id mod 1024) into this many buckets of (count, sum d, sum d²): a fixed,
mergeable buffer whatever the vocabulary (``metrics.token_eta2`` corrects for the buckets' number)."""
PROBABILITY_EDGES = (0.01, 0.1, 0.5, 0.9)
"""Edges of the sampler-probability buckets (a bucket holds its lower edge)."""
PROBABILITY_STRATA = ("p_lt_0.01", "p_0.01_0.1", "p_0.1_0.5", "p_0.5_0.9", "p_ge_0.9")
POSITION_STRATA = ("pos_q1", "pos_q2", "pos_q3", "pos_q4")
LAG_STRATA = ("lag_0", "lag_1", "lag_2", "lag_3", "lag_4_7", "lag_8_plus")
LAG_LABELS = ("0", "1", "2", "3", "4-7", "8+")
LAG_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0)
"""The lag strata's lower edges."""
AHEAD_STRATUM = "lag_ahead"
"""The tokens of datums whose policy version is ahead of the trainer (also counted at lag 0)."""
MAX_SERVERS = 8
"""Servers the divergence is kept for (``sampler_server``), in the order the run first named them; more share the
last slot."""
STRATUM_NAMES = PROBABILITY_STRATA + POSITION_STRATA + LAG_STRATA + (AHEAD_STRATUM,)
"""The strata of the fixed-shape ``strata`` sums, in order; the groups are a table of their own."""
MASK_ROW = 2**26
"""A refused mask position is stored as ``row * MASK_ROW + position`` (exact in float64 below 2**27 rows)."""
COLUMNS = ("n_tokens", "sum_k3", "sum_abs_d", "sum_is_ratio")
"""What each stratum sums over its tokens (k3 = e^d - 1 - d, e^d = exp(min(d, 80)))."""
GROUP_ROWS = 1 + len(COLUMNS)
"""Rows of the groups' table: each column a group's index (row 0; ``max_groups``: group_other) and its sums."""
CONTEXT_KINDS = ("n_first", "sum_abs_d_first", "sum_d2_first", "n_later", "sum_abs_d_later", "sum_d2_later")
"""What the context fade (``metrics``) keeps per sampler-probability bucket, on each datum's first
``sums.FIRST_ACTIONS`` action tokens and on those from the ``sums.LATER_ACTIONS_FROM``-th on."""


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
"""What every step keeps (``metrics.scalar_metrics``' inputs)."""
SIGNATURES = (
    # t = trainer, s = sampler logprob: Pearson(t, s), the slope of t on s, the spread of d²
    *_sums("sum_trainer", "sum_sampler2", "sum_trainer2", "sum_sampler_trainer", "sum_d4", "n_d_neg", "n_d_pos"),
    *_sums("n_both_16_bit", "n_p_high", "n_p_high_d_pos", "n_p_high_d_neg", "sum_abs_d_p_high", "n_p_low"),
    *_sums("n_p_low_d_pos", "n_p_low_d_neg", "sum_abs_d_p_low"),
    # adjacent action tokens of a datum: |d[k]| + |d[k+1]|, |t[k] - s[k+1]|, |t[k+1] - s[k]|
    *_sums("n_pairs", "sum_abs_d_pairs", "sum_abs_shift_next", "sum_abs_shift_prev"),
    *_sums(*(context_total(kind, bucket) for kind in CONTEXT_KINDS for bucket in range(len(PROBABILITY_STRATA)))),
    State("token_sums", "sum", (3, TOKEN_BUCKETS)),  # per hashed token id: count, sum d, sum d²
    State("offset_sums", "sum", (OFFSET_SIZE,)),  # the rows' votes for an offset (``alignment``)
    # the sampler's prompts against the trainer's (``prompts``): datums compared, those that differ, and the first
    # differing datum's record, keyed by its datum (``Layout.renumbered``)
    *_sums("n_prompt_datums_compared", "n_prompt_datums_differ"), State("prompt_first", "max", (PROMPT_RECORD,)),
    # per sampling server (``sampler_server``): action tokens, sum k3, then its datums by lag bucket (``LAG_STRATA``):
    # sums, so that they travel in the reduction's body, whose size per rank does not grow with the ranks
    State("server_sums", "sum", (2 + len(LAG_STRATA), MAX_SERVERS)),
)
"""The diagnosis' sums (``metrics.signature_numbers``), kept when ``diagnose``."""
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
    """Which states a monitor keeps, and where each sits in the packed ``sums`` and ``maxima`` vectors."""

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
        """The float64 ``sums`` and ``maxima`` vectors of one formula per declared name (``KeyError`` otherwise)."""
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
