"""The statistics a step keeps, declared once by name with their reduction, and their packing.

Every total (a sum or a count) and every extremum of ``DivergenceStats`` is one ``Statistic``
in ``STATISTICS``: its name, how two batches' values combine (``"sum"`` or ``"max"``, minima
stored negated), and whether the reduction across ranks carries each rank's value (``per_rank``:
summed in rank order, bit for bit as a merge, and read per rank for the datum offsets and the
sample's allocation) or only their sum (the diagnosis' sums, the advantage counts). A new
statistic is one declaration here plus its formula in ``statistics.DivergenceStats.from_batch``;
merging, the reduction across ranks and the host transfer follow from the declaration.

A monitor may declare more statistics of its own (``ExtraStatistics``: the shadow statistics of
its corrections, ``shadow.shadow_statistics``); they are packed by name the same way, their sums
carried in the reduction's summed body and their extrema in the per-rank header.

``Packing`` lays named parts end to end in one float64 vector and reads them back by name: the
host transfer and both collectives of the reduction use it, so nothing is found by position.

Example:
    >>> packing = Packing(totals=2, extrema=1)
    >>> vector = packing.pack(totals=torch.tensor([3.0, 4.0]), extrema=torch.tensor([5.0]))
    >>> {name: part.tolist() for name, part in packing.unpack(vector).items()}
    {'totals': [3.0, 4.0], 'extrema': [5.0]}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from loops_callbacks.divergence.strata import PROBABILITY_STRATA
from loops_callbacks.divergence.token_context import CONTEXT_AFTER, CONTEXT_BEFORE

__all__ = [
    "CONTEXT_KINDS",
    "CONTEXT_TOTALS",
    "EXTREMA",
    "ExtraStatistics",
    "PER_RANK_TOTALS",
    "ROW",
    "SIGNATURE_TOTALS",
    "STATISTICS",
    "SUMMED_TOTALS",
    "TOKEN_BUCKETS",
    "TOTALS",
    "TOTAL_INDEX",
    "Packing",
    "Statistic",
    "context_total",
    "pack_named",
]


@dataclass(frozen=True)
class Statistic:
    """One named statistic and how it reduces (module docstring)."""

    name: str
    reduction: Literal["sum", "max"]
    per_rank: bool = False
    signature: bool = False  # one of the diagnosis' sums, read only when signatures are (``from_batch``)


def _total(name: str, *, per_rank: bool = True) -> Statistic:
    return Statistic(name, "sum", per_rank)


def _signature_total(name: str) -> Statistic:
    return Statistic(name, "sum", per_rank=False, signature=True)


def _extremum(name: str) -> Statistic:
    return Statistic(name, "max", per_rank=True)


def context_total(kind: str, bucket: int) -> str:
    """The name of a context-fade total: ``kind`` one of ``CONTEXT_KINDS``, ``bucket`` a sampler-probability bucket.

    Example:
        >>> context_total("n_first", 0)
        'n_first_actions_p_lt_0.01'
    """
    return f"{kind}_actions_{PROBABILITY_STRATA[bucket]}"


CONTEXT_KINDS = ("n_first", "sum_abs_d_first", "sum_d2_first", "n_later", "sum_abs_d_later", "sum_d2_later")
"""What the context fade keeps per sampler-probability bucket (``statistics``' ``_context_sums``)."""
CONTEXT_TOTALS = tuple(
    context_total(kind, bucket) for kind in CONTEXT_KINDS for bucket in range(len(PROBABILITY_STRATA))
)


STATISTICS = (
    _total("n_datums"),
    _total("n_scored_datums"),  # datums with at least one action token
    _total("n_action_tokens"),
    _total("n_skipped_nonfinite"),
    _total("n_trainer_zero"),  # action tokens whose trainer logprob is exactly 0.0
    _total("sum_d"),
    _total("sum_d2"),
    _total("sum_is_ratio"),  # the importance ratio e^d = exp(min(d, 80))
    _total("sum_is_ratio2"),
    _total("sum_k3"),
    _total("sum_sampler"),
    _total("n_abs_gt_1"),
    _total("n_abs_gt_2"),
    _total("n_abs_gt_4"),
    _total("n_is_ratio_gt_2"),
    _total("n_is_ratio_lt_half"),
    _total("sum_seq_mean_d"),
    _total("sum_seq_is_ratio"),
    _total("n_sampler_above_zero"),  # logprobs > LOGPROB_CEILING: impossible (probabilities passed as logprobs?)
    _total("n_trainer_above_zero"),
    _total("n_sampler_below_floor"),  # logprobs < LOGPROB_FLOOR: a sentinel, not a probability
    _total("n_trainer_below_floor"),
    # The diagnosis' signature sums (``signatures``), t = trainer, s = sampler; zero when not read:
    _signature_total("sum_trainer"),  # with sum_sampler and the next three: Pearson(t, s), slope of t on s
    _signature_total("sum_sampler2"),
    _signature_total("sum_trainer2"),
    _signature_total("sum_sampler_trainer"),
    _signature_total("sum_d4"),  # with sum_d2: the standard error of mean d² (the relative gap's)
    _signature_total("n_d_neg"),  # tokens with d < 0; with n_d_pos, the rest have d == 0 exactly
    _signature_total("n_d_pos"),
    _signature_total("n_both_16_bit"),  # tokens whose sampler and trainer logprobs both came as 16-bit floats
    _signature_total("n_p_high"),  # tokens the sampler gave p = e^s > 0.5
    _signature_total("n_p_high_d_pos"),
    _signature_total("n_p_high_d_neg"),
    _signature_total("sum_abs_d_p_high"),
    _signature_total("n_p_low"),  # tokens the sampler gave p < 0.1
    _signature_total("n_p_low_d_pos"),
    _signature_total("n_p_low_d_neg"),
    _signature_total("sum_abs_d_p_low"),
    _signature_total("n_pairs"),  # adjacent action tokens k, k+1 of one datum
    _signature_total("sum_abs_d_pairs"),  # over those pairs: |d[k]| + |d[k+1]|
    _signature_total("sum_abs_shift_next"),  # |t[k] - s[k+1]|: the sampler's value one position later
    _signature_total("sum_abs_shift_prev"),  # |t[k+1] - s[k]|: the sampler's value one position earlier
    # the context fade, per sampler-probability bucket (strata.PROBABILITY_STRATA): tokens, |d| and d² on each
    # datum's first FIRST_ACTIONS action tokens, and on those from the LATER_ACTIONS_FROM-th on (0-based)
    *(_signature_total(name) for name in CONTEXT_TOTALS),
    # Only their sum is read (the monitor's warning), so they ride in the body too; always counted:
    _total("n_masked_in", per_rank=False),  # positions with mask > 0, whatever their advantage
    _total("n_advantage_nan", per_rank=False),  # of those, with a NaN advantage (read as 0: not action tokens)
    # What was sampled (``sampling_*`` metrics): over masked-in positions with a finite trainer logprob t, entropy H
    # and varentropy V, whatever their advantage (a selection by reward would bias the check); zero without H and V
    _total("n_sampling_tokens", per_rank=False),
    _total("sum_sampling_gap", per_rank=False),  # sum of t + H: about 0 when the tokens were drawn from the trainer's
    _total("sum_sampling_entropy", per_rank=False),  # sum of H
    _total("sum_sampling_varentropy", per_rank=False),  # sum of V
    _extremum("max_d"),
    _extremum("neg_min_d"),
    _extremum("max_seq_mean_d"),
    _extremum("max_sampler"),
    _extremum("neg_min_sampler"),
    _extremum("max_trainer"),
    _extremum("neg_min_trainer"),
    _extremum("max_sampling_gap"),  # the one token's t + H furthest above 0, and (negated) below: sampling_z_trimmed
    _extremum("neg_min_sampling_gap"),
)
"""Every total and extremum, in the order they are stored."""

TOTALS = tuple(s.name for s in STATISTICS if s.reduction == "sum")
"""The sums and counts, in the order of ``DivergenceStats.totals``."""
EXTREMA = tuple(s.name for s in STATISTICS if s.reduction == "max")
"""The maxima (minima stored negated, so every extremum merges with max), in the order of
``DivergenceStats.extrema``; -inf when empty."""
TOTAL_INDEX = {name: i for i, name in enumerate(TOTALS)}
"""Position of each named total in ``DivergenceStats.totals``."""
PER_RANK_TOTALS = tuple(s.name for s in STATISTICS if s.reduction == "sum" and s.per_rank)
"""Totals whose every rank's value the reduction gathers (its header)."""
SIGNATURE_TOTALS = tuple(s.name for s in STATISTICS if s.signature)
"""The diagnosis' sums: zero when the signatures are not read (the plain SDK functions)."""
SUMMED_TOTALS = tuple(s.name for s in STATISTICS if s.reduction == "sum" and not s.per_rank)
"""Totals the reduction only sums (its body): the diagnosis' sums and the advantage counts, so the per-rank
header stays small."""

TOKEN_BUCKETS = 1024
"""Token ids are hashed (id mod 1024) into this many buckets of (count, sum d, sum d²): a fixed,
mergeable buffer whatever the vocabulary. Below 1,024 ids every id has its own bucket; above, a
bucket pools about V / 1024 ids, which dilutes token identity's share of the variance (eta²) but
keeps it meaningful (``signatures.token_eta2`` corrects for the buckets' number)."""


class ROW:
    """Columns of a worst-token row (all float64; token ids are exact below 2**53)."""

    ABS, DIFF, SAMPLER, TRAINER, DATUM, POSITION, TOKEN = range(7)
    BEFORE = slice(7, 7 + CONTEXT_BEFORE)  # model_input ids before index k+1, NO_TOKEN-padded on the left
    AFTER = slice(7 + CONTEXT_BEFORE, 7 + CONTEXT_BEFORE + CONTEXT_AFTER)  # the id at k+1, then the ids after it
    WIDTH = 7 + CONTEXT_BEFORE + CONTEXT_AFTER


def pack_named(names: tuple[str, ...], values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Float64 ``[len(names)]``: ``values[name]`` (0-d tensors) in the order of ``names``.

    Every name must have a value (``KeyError`` naming the one without a formula); extra values
    are an error too, so a formula and its declaration cannot drift apart.

    Example:
        >>> pack_named(("a", "b"), {"b": torch.tensor(2), "a": torch.tensor(1.5)}).tolist()
        [1.5, 2.0]
    """
    extra = sorted(set(values) - set(names))
    if extra:
        raise KeyError(f"statistics {extra} are computed but not declared in layout.STATISTICS")
    missing = [name for name in names if name not in values]
    if missing:
        raise KeyError(f"statistics {missing} are declared in layout.STATISTICS but have no formula")
    return torch.stack([values[name].to(torch.float64) for name in names])


@dataclass(frozen=True)
class ExtraStatistics:
    """Statistics one monitor declares beside ``STATISTICS``, packed by name like them.

    Example:
        >>> extra = ExtraStatistics((Statistic("n_kept", "sum"), Statistic("max_w", "max")))
        >>> totals, extrema = extra.pack({"n_kept": torch.tensor(3), "max_w": torch.tensor(2.5)})
        >>> extra.unpack(totals.numpy(), extrema.numpy())
        ({'n_kept': 3.0}, {'max_w': 2.5})
    """

    statistics: tuple[Statistic, ...] = ()

    @property
    def totals(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.statistics if s.reduction == "sum")

    @property
    def extrema(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.statistics if s.reduction == "max")

    def pack(self, values: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 ``(totals, extrema)`` vectors of ``values`` (one 0-d tensor per declared name, no other)."""
        extra = sorted(set(values) - set(self.totals) - set(self.extrema))
        if extra:
            raise KeyError(f"statistics {extra} are computed but not declared")
        return self._stack(self.totals, values), self._stack(self.extrema, values)

    def unpack(self, totals: np.ndarray, extrema: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
        """The host vectors back by name."""
        return dict(zip(self.totals, totals.tolist())), dict(zip(self.extrema, extrema.tolist()))

    @staticmethod
    def _stack(names: tuple[str, ...], values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not names:
            return torch.zeros(0, dtype=torch.float64, device=next(iter(values.values()), torch.zeros(0)).device)
        return pack_named(names, {name: values[name] for name in names if name in values})


class Packing:
    """Named parts of given lengths, end to end in one vector (module docstring).

    ``unpack`` works on the last dimension, so a ``[world, length]`` stack of packed vectors
    unpacks into ``[world, part]`` views.
    """

    def __init__(self, **lengths: int) -> None:
        self.lengths = lengths

    @property
    def length(self) -> int:
        return sum(self.lengths.values())

    def pack(self, **parts: torch.Tensor) -> torch.Tensor:
        """One float64 vector of ``parts`` (flattened), in the declared order."""
        if list(parts) != list(self.lengths):
            raise KeyError(f"pack expects the parts {list(self.lengths)} in this order, got {list(parts)}")
        pieces = [part.reshape(-1).to(torch.float64) for part in parts.values()]
        for (name, length), piece in zip(self.lengths.items(), pieces):
            if piece.numel() != length:
                raise ValueError(f"part {name!r} has {piece.numel()} values, the packing declares {length}")
        return torch.cat(pieces)

    def unpack(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``vector``'s last dimension, by name."""
        if vector.shape[-1] != self.length:
            raise ValueError(f"a packed vector has {self.length} values, got {vector.shape[-1]}")
        parts, start = {}, 0
        for name, length in self.lengths.items():
            parts[name] = vector[..., start : start + length]
            start += length
        return parts
