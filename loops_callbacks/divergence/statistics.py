"""Mergeable sampler-vs-trainer divergence statistics, kept on the batch's device.

``DivergenceStats.from_batch`` reads a ``FlatBatch`` once into sums, counts, maxima, the
``top_n`` most divergent tokens (with their context token ids) and a sample of the per-token
diffs d = trainer logprob − sampler logprob. Statistics of micro-batches combine with ``merge``,
those of ranks with ``reduce_across_ranks`` (module ``reduction``), exactly as if computed on the
concatenated batch (sums up to floating-point summation order; counts, maxima and rows exactly).
``to_host`` moves everything to the host in one transfer, the only synchronization.

Which totals and extrema there are, and how each reduces, is declared once in ``layout``
(``STATISTICS``); ``from_batch`` gives each its formula by name.

The sample keeps every diff when ``sample_size`` is ``None`` (the plain functions). With a
``sample_size`` it is a uniform sample without replacement of the union (bottom-k of one random
key per token, which merges exactly), so percentiles stay exact while the union has at most
``sample_size`` tokens. Across ranks it becomes a stratified sample with proportional allocation
(every token kept with the same probability; see ``reduction``).

Example:
    >>> import torch
    >>> from loops_callbacks.divergence.action_tokens import flatten_padded
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> host = DivergenceStats.from_batch(flat).to_host()
    >>> host.totals["n_action_tokens"], host.totals["sum_d"], host.diffs.tolist()
    (2.0, -0.5, [-0.5, 0.0])
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loops_callbacks.correction import Correction
from loops_callbacks.divergence.action_tokens import FlatBatch
from loops_callbacks.divergence.alignment import offset_sums
from loops_callbacks.divergence.layout import (
    CONTEXT_KINDS,
    EXTREMA,
    SIGNATURE_TOTALS,
    ROW,
    TOKEN_BUCKETS,
    TOTAL_INDEX,
    TOTALS,
    ExtraStatistics,
    Packing,
    context_total,
    pack_named,
)
from loops_callbacks.divergence.reduction import Collectives, reduce_across_ranks
from loops_callbacks.divergence.shadow import shadow_statistics, shadow_values
from loops_callbacks.divergence.strata import (
    COLUMNS,
    GROUP_ROWS,
    PROBABILITY_EDGES,
    Strata,
    StratumSums,
    TokenPlaces,
    by_group,
    by_lag,
    merged_groups,
)
from loops_callbacks.divergence.token_context import NO_TOKEN
from loops_callbacks.validation import check_int

__all__ = [
    "DivergenceStats",
    "HostDivergence",
    "TOTALS",
    "TOTAL_INDEX",
    "EXTREMA",
    "ROW",
    "IS_RATIO_CLAMP",
    "TOKEN_BUCKETS",
    "LOGPROB_CEILING",
    "LOGPROB_FLOOR",
    "FIRST_ACTIONS",
    "LATER_ACTIONS_FROM",
]

IS_RATIO_CLAMP = 80.0
"""The importance ratio e^d is exp(min(d, 80)): finite for any diff, as in the Loops SDK."""

LOGPROB_CEILING = 1e-4
"""A logprob above this is not float rounding of log(1) = 0: the value is not a logprob."""
LOGPROB_FLOOR = -1e4
"""A logprob below this (e.g. ``torch.finfo(torch.float32).min``) is a sentinel, not a probability."""
_16_BIT = (torch.bfloat16, torch.float16)
CHUNK_POSITIONS = 1 << 18
"""On the CPU, ``from_batch`` reads at most about this many positions at a time (whole datums)."""
OFFSET_CHUNK_POSITIONS = 1 << 15
"""On the CPU, the offset votes (``alignment.offset_sums``: FFTs over whole rows, about 450 bytes
per position at their peak) are read at most about this many positions at a time."""
P_HIGH = float(np.log(0.5))
"""Sampler logprob above which a token is "likely" (p > 0.5) for the sign-split signature."""
P_LOW = float(np.log(0.1))
"""Sampler logprob below which a token is "unlikely" (p < 0.1)."""
FIRST_ACTIONS = 4
"""A datum's first this many action tokens are its "first" ones for the context fade (``_context_sums``)."""
LATER_ACTIONS_FROM = 8
"""A datum's action tokens from this one on (0-based) are its "later" ones: a gap between the two
sets (about 4 tokens) keeps a fade that lasts a few tokens out of both means."""


@dataclass(frozen=True)
class HostDivergence:
    """Statistics on the host: named totals and extrema, worst rows, and the kept diffs in order."""

    totals: dict[str, float]
    extrema: dict[str, float]
    worst: np.ndarray  # [rows, ROW.WIDTH], most divergent first, empty rows removed
    diffs: np.ndarray  # float64, the sampled diffs in batch order
    token_sums: np.ndarray | None = None  # float64 [3, TOKEN_BUCKETS]: count, sum d, sum d² per bucket
    strata: dict[str, StratumSums] | None = None  # by stratum name (``strata``); None: not kept
    offset_sums: np.ndarray | None = None  # float64 [alignment.OFFSET_SIZE]: the offset votes; None: not kept
    extra_totals: dict[str, float] = field(default_factory=dict)  # the shadow statistics' sums, by name
    extra_extrema: dict[str, float] = field(default_factory=dict)  # and their extrema

    @property
    def by_lag(self) -> dict[str, StratumSums]:
        """The step's divergence by policy lag, for a diagnosis of stale weights; ``{}`` without versions.

        Keys ``"0"``, ``"1"``, ``"2"``, ``"3"``, ``"4-7"``, ``"8+"`` in that order (all six, empty
        buckets with ``n_tokens == 0``), present when at least one action token of the step came
        from a datum with a policy version. Lag = the trainer's optimizer step minus the datum's
        policy version (the optimizer steps its sampler's weights were behind; ``step_input``).
        Each value is a ``StratumSums``: ``n_tokens``, ``sum_k3``, ``sum_abs_d``, ``sum_is_ratio``
        and the means ``k3``, ``abs_d_mean``, ``is_ratio_mean`` (NaN when empty). Stale weights
        show as k3 growing with the lag.
        """
        return by_lag(self.strata) if self.strata is not None else {}


@dataclass(frozen=True)
class DivergenceStats:
    """Divergence statistics of one or more batches; see the module docstring."""

    totals: torch.Tensor  # float64 [len(TOTALS)]
    extrema: torch.Tensor  # float64 [len(EXTREMA)]
    worst: torch.Tensor  # float64 [top_n, ROW.WIDTH]; rows with ABS = -inf are empty
    sample_values: torch.Tensor  # float64 [m] diffs
    sample_keys: torch.Tensor | None  # float64 [m]; +inf marks an empty slot; None: all kept
    sample_size: int | None = None
    token_sums: torch.Tensor | None = None  # float64 [3, TOKEN_BUCKETS]; None reads as zeros
    strata: torch.Tensor | None = None  # float64 [len(strata.COLUMNS), Strata.width]; None: not kept
    stratification: Strata | None = None  # which strata ``strata`` holds
    group_strata: torch.Tensor | None = None  # float64 [strata.GROUP_ROWS, K], the groups seen; None: no group key
    offset_sums: torch.Tensor | None = None  # float64 [alignment.OFFSET_SIZE] with the signatures; None: not kept
    extra_totals: torch.Tensor | None = None  # float64 [len(extra.totals)]: the corrections' shadow sums
    extra_extrema: torch.Tensor | None = None  # float64 [len(extra.extrema)]: their maxima
    extra: ExtraStatistics | None = None  # the names of those two

    @classmethod
    @torch.no_grad()
    def from_batch(
        cls,
        flat: FlatBatch,
        *,
        top_n: int = 0,
        sample_size: int | None = None,
        generator: torch.Generator | None = None,
        signatures: bool = True,
        strata: Strata | None = None,
        corrections: Sequence[Correction] = (),
        rank: int = 0,
    ) -> DivergenceStats:
        """Read one flattened batch; ``top_n`` worst rows carry token ids when ``flat.tokens`` is set.

        ``strata`` keeps the divergence by stratum (module ``strata``; lags and groups from
        ``flat.lags`` / ``flat.groups``); ``None`` keeps none. ``corrections`` (parsed, module
        ``loops_callbacks.correction``) adds their shadow statistics (``shadow.shadow_values``, which
        counts this process's ``rank`` where advantages could not be read).

        ``signatures=False`` skips the diagnosis' sums (they stay zero): the plain SDK functions,
        which report no diagnosis, do not pay for them. On the CPU a batch of more than
        ``CHUNK_POSITIONS`` positions is read in whole-datum chunks, merged as micro-batches are,
        so a step's temporaries stay a few chunks' worth whatever its size.
        """
        check_int("top_n", top_n, least=0)
        if sample_size is not None:
            check_int("sample_size", sample_size, least=1, what=" or None")
        chunks = flat.datum_chunks(CHUNK_POSITIONS) if _on_host(flat.device) else [flat]
        return cls.concatenated(
            [
                cls._from_chunk(chunk, top_n, sample_size, generator, signatures, strata, tuple(corrections), rank)
                for chunk in chunks
            ]
        )

    @classmethod
    def _from_chunk(
        cls,
        flat: FlatBatch,
        top_n: int,
        sample_size: int | None,
        generator: torch.Generator | None,
        signatures: bool,
        strata: Strata | None,
        corrections: tuple[Correction, ...],
        rank: int,
    ) -> DivergenceStats:
        # On the CPU, select the action tokens (fewer, cheaper passes); on accelerators keep
        # fixed shapes and mask instead, so that nothing waits for the device.
        compact = _on_host(flat.device)
        active = flat.active
        if compact:
            d = _select(flat.diff, active)
            valid = None
        else:
            d = flat.diff.masked_fill(~active, 0.0)
            valid = active
        is_ratio = d.clamp(max=IS_RATIO_CLAMP).exp_()
        if valid is not None:
            is_ratio.masked_fill_(~valid, 0.0)
        abs_d = d.abs()
        row_counts, scored, seq_mean, seq_is_ratio = _sequence_stats(d, active, flat.row_lengths, compact)
        sampler = _select(flat.sampler, active) if compact else flat.sampler.masked_fill(~active, 0.0)
        trainer = _select(flat.trainer, active) if compact else flat.trainer.masked_fill(~active, 0.0)
        device = d.device
        sampling_sums, sampling_extrema = _sampling_sums(flat)
        sums: dict[str, torch.Tensor] = {
            "n_datums": torch.full((), float(flat.n_datums), dtype=torch.float64, device=device),
            "n_scored_datums": torch.count_nonzero(scored),
            "n_action_tokens": torch.count_nonzero(active),
            "n_skipped_nonfinite": torch.count_nonzero(flat.counted & ~active),
            "n_trainer_zero": torch.count_nonzero((flat.trainer == 0.0) & active),
            "sum_d": d.sum(),
            "sum_d2": torch.dot(d, d),
            "sum_is_ratio": is_ratio.sum(),
            "sum_is_ratio2": torch.dot(is_ratio, is_ratio),
            "sum_sampler": sampler.sum(dtype=torch.float64),
            "n_abs_gt_1": torch.count_nonzero(abs_d > 1.0),
            "n_abs_gt_2": torch.count_nonzero(abs_d > 2.0),
            "n_abs_gt_4": torch.count_nonzero(abs_d > 4.0),
            "n_is_ratio_gt_2": torch.count_nonzero(is_ratio > 2.0),
            "n_is_ratio_lt_half": torch.count_nonzero(is_ratio < 0.5 if valid is None else (is_ratio < 0.5) & valid),
            "sum_seq_mean_d": seq_mean.sum(),
            "sum_seq_is_ratio": seq_is_ratio.sum(),
            "n_sampler_above_zero": torch.count_nonzero(sampler > LOGPROB_CEILING),
            "n_trainer_above_zero": torch.count_nonzero(trainer > LOGPROB_CEILING),
            "n_sampler_below_floor": torch.count_nonzero(sampler < LOGPROB_FLOOR),
            "n_trainer_below_floor": torch.count_nonzero(trainer < LOGPROB_FLOOR),
            **_advantage_counts(flat),
            **sampling_sums,
        }
        places = None  # each token's datum, rank and probability bucket, once for the strata and the diagnosis
        if signatures or strata is not None:
            places = TokenPlaces.of(active, flat.row_lengths, row_counts, sampler, compact=valid is None)
        if signatures:
            sums.update(_signature_sums(flat, d, abs_d, sampler, trainer, valid))
            sums.update(_context_sums(abs_d, places, valid))
        else:
            sums.update(dict.fromkeys(SIGNATURE_TOTALS, torch.zeros((), dtype=torch.float64, device=device)))
        # k3 = e^d - 1 - d, once; without strata every use of the ratio is above, so its buffer becomes k3
        k3 = is_ratio.sub_(1.0).sub_(d) if strata is None else (is_ratio - 1.0).sub_(d)
        if valid is not None:
            k3.masked_fill_(~valid, 0.0)
        sums["sum_k3"] = k3.sum()
        stratum_sums = group_strata = None
        if strata is not None and places is not None:
            stratum_sums = strata.sums(
                d=d, abs_d=abs_d, is_ratio=is_ratio, k3=k3, places=places, row_counts=row_counts,
                lags=flat.lags, valid=valid,
            )
            if flat.groups is not None:
                group_strata = strata.group_table(
                    abs_d=abs_d, is_ratio=is_ratio, k3=k3, places=places, groups=flat.groups, valid=valid
                )
        totals = pack_named(TOTALS, sums)
        inf = float("inf")
        max_d, neg_min_d = _max_and_negated_min(d, valid)
        max_sampler, neg_min_sampler = _max_and_negated_min(sampler, valid)
        max_trainer, neg_min_trainer = _max_and_negated_min(trainer, valid)
        extrema = pack_named(
            EXTREMA,
            {
                "max_d": max_d,
                "neg_min_d": neg_min_d,
                "max_seq_mean_d": _min_max(seq_mean.masked_fill(~scored, -inf))[1],
                "max_sampler": max_sampler,
                "neg_min_sampler": neg_min_sampler,
                "max_trainer": max_trainer,
                "neg_min_trainer": neg_min_trainer,
                **sampling_extrema,
            },
        )
        worst = torch.zeros(0, ROW.WIDTH, dtype=torch.float64, device=device)
        if top_n:
            ranked = abs_d if valid is None else abs_d.masked_fill(~valid, -inf)
            chosen = _stable_top_k(ranked, min(top_n, ranked.shape[0]))
            flat_index = _positions_of_selected(active, flat.row_lengths, row_counts, chosen) if compact else chosen
            worst = _worst_rows(flat, flat_index, chosen, ranked, d, top_n)
        keys = None
        if sample_size is not None:
            keys = torch.rand(d.shape, dtype=torch.float64, device=device, generator=generator)
        if valid is not None:
            keys = (keys if keys is not None else torch.zeros_like(d)).masked_fill(~valid, inf)
        token_sums = _token_sums(flat, d, valid, compact) if signatures else None
        offsets = _offset_sums(flat, compact) if signatures else None
        stats = cls(
            totals, extrema, worst, d, keys, sample_size, token_sums, stratum_sums, strata, group_strata, offsets
        )
        if corrections:
            extra = ExtraStatistics(shadow_statistics(corrections))
            extra_totals, extra_extrema = extra.pack(shadow_values(flat, corrections, flat.datum_advantages, rank=rank))
            stats = dataclasses.replace(stats, extra_totals=extra_totals, extra_extrema=extra_extrema, extra=extra)
        return stats._capped()

    def merge(self, later: DivergenceStats) -> DivergenceStats:
        """Statistics of this batch followed by ``later`` (datum indices of ``later`` shift)."""
        return DivergenceStats.concatenated([self, later])

    @staticmethod
    def concatenated(parts: Sequence[DivergenceStats]) -> DivergenceStats:
        """Statistics of ``parts`` in order, as ``merge`` one after the other gives them, copying each sample once."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        worst = []
        datums = torch.zeros((), dtype=torch.float64, device=first.totals.device)
        for part in parts:
            shifted = part.worst.clone()
            shifted[:, ROW.DATUM] += datums
            worst.append(shifted)
            datums = datums + part.totals[TOTAL_INDEX["n_datums"]]
        keys = None
        if any(part.sample_keys is not None for part in parts):
            keys = torch.cat([part.keys_or_zeros() for part in parts])
        return DivergenceStats(
            totals=functools.reduce(operator.add, [part.totals for part in parts]),
            extrema=functools.reduce(torch.maximum, [part.extrema for part in parts]),
            worst=_rank_rows(torch.cat(worst), max(part.worst.shape[0] for part in parts)),
            sample_values=torch.cat([part.sample_values for part in parts]),
            sample_keys=keys,
            sample_size=first.sample_size,
            token_sums=functools.reduce(_add_or_none, [part.token_sums for part in parts]),
            strata=functools.reduce(_add_or_none, [part.strata for part in parts]),
            stratification=first.stratification,
            group_strata=merged_groups([part.group_strata for part in parts]),
            offset_sums=functools.reduce(_add_or_none, [part.offset_sums for part in parts]),
            extra_totals=functools.reduce(_add_or_none, [part.extra_totals for part in parts]),
            extra_extrema=functools.reduce(_max_or_none, [part.extra_extrema for part in parts]),
            extra=first.extra,
        )._capped()

    def reduce_across_ranks(
        self, collectives: Collectives | Any, *, generator: torch.Generator | None = None
    ) -> DivergenceStats:
        """Statistics of every rank's batches, rank 0's first, the same on every rank.

        A collective: every rank calls it. ``collectives`` is a ``reduction.Collectives`` or a
        Lightning strategy (``trainer.strategy``); ``generator`` draws the sample allocation's one
        random number. Two collectives whose size does not grow with the ranks beyond a few
        hundred bytes per rank; ``loops_callbacks.divergence.reduction`` says what they carry.
        """
        return reduce_across_ranks(self, collectives, generator=generator)

    def to_host(self) -> HostDivergence:
        """Everything on the host, in one device-to-host transfer."""
        token_sums = self.token_sums_or_zeros()
        strata = self.strata if self.strata is not None else self.totals.new_zeros(0)
        groups = self.group_strata if self.group_strata is not None else self.totals.new_zeros(GROUP_ROWS, 0)
        extra_totals, extra_extrema = self.extras_or_empty()
        offsets = self.offset_sums if self.offset_sums is not None else self.totals.new_zeros(0)
        keys = self.sample_keys if self.sample_keys is not None else self.sample_values.new_zeros(0)
        transfer = Packing(
            totals=len(TOTALS),
            extrema=len(EXTREMA),
            token_sums=token_sums.numel(),
            strata=strata.numel(),
            groups=groups.numel(),
            offsets=offsets.numel(),
            extra_totals=extra_totals.numel(),
            extra_extrema=extra_extrema.numel(),
            worst=self.worst.numel(),
            values=self.sample_values.numel(),
            keys=keys.numel(),
        )
        packed = transfer.pack(
            totals=self.totals,
            extrema=self.extrema,
            token_sums=token_sums,
            strata=strata,
            groups=groups,
            offsets=offsets,
            extra_totals=extra_totals,
            extra_extrema=extra_extrema,
            worst=self.worst,
            values=self.sample_values,
            keys=keys,
        )
        parts = transfer.unpack(packed.cpu())
        parts["groups"] = by_group(parts["groups"].reshape(GROUP_ROWS, -1))
        part = {name: value.numpy() for name, value in parts.items()}
        worst = part["worst"].reshape(-1, ROW.WIDTH)
        extra = self.extra or ExtraStatistics()
        named_totals, named_extrema = extra.unpack(part["extra_totals"], part["extra_extrema"])
        return HostDivergence(
            totals=dict(zip(TOTALS, part["totals"].tolist())),
            extrema=dict(zip(EXTREMA, part["extrema"].tolist())),
            worst=worst[worst[:, ROW.ABS] > float("-inf")],
            diffs=part["values"][part["keys"] < np.inf] if self.sample_keys is not None else part["values"],
            token_sums=part["token_sums"].reshape(3, TOKEN_BUCKETS),
            strata=None
            if self.stratification is None
            else self.stratification.host(
                part["strata"].reshape(len(COLUMNS), -1), part["groups"] if self.group_strata is not None else None
            ),
            offset_sums=part["offsets"] if self.offset_sums is not None else None,
            extra_totals=named_totals,
            extra_extrema=named_extrema,
        )

    def extras_or_empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shadow sums and extrema; empty vectors when none are kept."""
        empty = self.totals.new_zeros(0)
        return (
            self.extra_totals if self.extra_totals is not None else empty,
            self.extra_extrema if self.extra_extrema is not None else empty,
        )

    def token_sums_or_zeros(self) -> torch.Tensor:
        """The per-token-id sums; zeros when they were not kept (``signatures=False``)."""
        return self.token_sums if self.token_sums is not None else self.totals.new_zeros(3, TOKEN_BUCKETS)

    def keys_or_zeros(self) -> torch.Tensor:
        """The sample's keys; zeros (every diff kept, in order) when there are none."""
        return self.sample_keys if self.sample_keys is not None else torch.zeros_like(self.sample_values)

    def _capped(self) -> DivergenceStats:
        """Keep the ``sample_size`` smallest keys, in batch order (no-op when uncapped or small)."""
        if self.sample_size is None or self.sample_keys is None or self.sample_keys.shape[0] <= self.sample_size:
            return self
        keep = torch.topk(self.sample_keys, self.sample_size, largest=False, sorted=False).indices.sort().values
        return dataclasses.replace(
            self,
            sample_values=self.sample_values.index_select(0, keep),
            sample_keys=self.sample_keys.index_select(0, keep),
        )


def _advantage_counts(flat: FlatBatch) -> dict[str, torch.Tensor]:
    """The masked-in positions and those of them with a NaN advantage (``FlatBatch.advantage_nan``),
    counted on the batch's device; without advantages the masked-in positions are the counted ones.

    Example:
        >>> from loops_callbacks.divergence.action_tokens import flatten_padded
        >>> flat = flatten_padded(sampler_logprobs=torch.zeros(1, 3), training_logprobs=torch.zeros(1, 3),
        ...                       mask=torch.tensor([[0.0, 1.0, 1.0]]),
        ...                       advantages=torch.tensor([[float("nan"), float("nan"), 1.0]]))
        >>> {name: int(count) for name, count in _advantage_counts(flat).items()}
        {'n_masked_in': 2, 'n_advantage_nan': 1}
    """
    if flat.masked_in is None or flat.advantage_nan is None:
        n_counted = torch.count_nonzero(flat.counted)
        return {"n_masked_in": n_counted, "n_advantage_nan": torch.zeros_like(n_counted)}
    return {
        "n_masked_in": torch.count_nonzero(flat.masked_in),
        "n_advantage_nan": torch.count_nonzero(flat.advantage_nan),
    }


def _signature_sums(
    flat: FlatBatch,
    d: torch.Tensor,
    abs_d: torch.Tensor,
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    valid: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The diagnosis' sums and counts; ``d``, ``sampler``, ``trainer`` as in ``from_batch``.

    Everything is a sum or a count, so it merges across micro-batches and ranks like the totals.
    The shift sums read adjacent positions of the flat (uncompacted) arrays, masked so that a
    pair never crosses from one datum into the next.
    """
    s = sampler.to(torch.float64)
    t = trainer.to(torch.float64)
    negative, positive = d < 0, d > 0
    high, low = sampler > P_HIGH, sampler < P_LOW
    d_squared = d * d
    if valid is not None:  # masked-out places hold s = 0 (p = 1): keep them out of the buckets
        high &= valid
        low &= valid
    sums = {
        "sum_trainer": t.sum(),
        "sum_sampler2": torch.dot(s, s),
        "sum_trainer2": torch.dot(t, t),
        "sum_sampler_trainer": torch.dot(s, t),
        "sum_d4": torch.dot(d_squared, d_squared),
        "n_d_neg": torch.count_nonzero(negative),
        "n_d_pos": torch.count_nonzero(positive),
        "n_both_16_bit": _both_16_bit(flat, d, valid),
        "n_p_high": torch.count_nonzero(high),
        "n_p_high_d_pos": torch.count_nonzero(high & positive),
        "n_p_high_d_neg": torch.count_nonzero(high & negative),
        "sum_abs_d_p_high": torch.dot(abs_d, high.to(torch.float64)),
        "n_p_low": torch.count_nonzero(low),
        "n_p_low_d_pos": torch.count_nonzero(low & positive),
        "n_p_low_d_neg": torch.count_nonzero(low & negative),
        "sum_abs_d_p_low": torch.dot(abs_d, low.to(torch.float64)),
    }
    sums.update(_shift_sums(flat))
    return sums


def _sampling_sums(flat: FlatBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Totals and extrema for the check of what was sampled (``metrics.sampling_metrics``): over masked-in
    positions with a finite trainer logprob t, entropy H and varentropy V, the count and the sums of t + H, H
    and V; and the largest t + H and the smallest (negated), -inf without such positions."""
    names = ("n_sampling_tokens", "sum_sampling_gap", "sum_sampling_entropy", "sum_sampling_varentropy")
    if flat.entropy is None or flat.varentropy is None:
        zero, none = (torch.full((), value, dtype=torch.float64, device=flat.device) for value in (0.0, -math.inf))
        return dict.fromkeys(names, zero), {"max_sampling_gap": none, "neg_min_sampling_gap": none}
    trainer = flat.trainer.to(torch.float64)
    entropy, varentropy = flat.entropy.to(torch.float64), flat.varentropy.to(torch.float64)
    masked_in = flat.masked_in if flat.masked_in is not None else flat.counted
    drawn = masked_in & torch.isfinite(trainer) & torch.isfinite(entropy) & torch.isfinite(varentropy)
    gap = trainer + entropy
    parts = (drawn.to(torch.float64), gap, entropy, varentropy)
    sums = {name: torch.where(drawn, part, 0.0).sum() for name, part in zip(names, parts)}
    highest, neg_lowest = _max_and_negated_min(gap, drawn)
    return sums, {"max_sampling_gap": highest, "neg_min_sampling_gap": neg_lowest}


def _both_16_bit(flat: FlatBatch, d: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The action tokens whose sampler and trainer logprobs both came as 16-bit floats (all of the
    batch's or none): rounded to 16 bits, the two are often exactly equal despite a gap, so an
    exact match says less there (``frac_d_zero``). ``d`` and ``valid`` as in ``from_batch``."""
    if flat.sampler.dtype not in _16_BIT or flat.trainer.dtype not in _16_BIT:
        return torch.zeros((), dtype=torch.float64, device=d.device)
    if valid is not None:
        return torch.count_nonzero(valid)
    return torch.full((), float(d.numel()), dtype=torch.float64, device=d.device)


def _shift_sums(flat: FlatBatch) -> dict[str, torch.Tensor]:
    """Over pairs (k, k+1) of active positions in one datum: sum |d| and the one-position-shifted gaps."""
    length = flat.diff.shape[0]
    device = flat.diff.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if length < 2:
        return {"n_pairs": zero, "sum_abs_d_pairs": zero, "sum_abs_shift_next": zero, "sum_abs_shift_prev": zero}
    starts = torch.zeros(length + 1, dtype=torch.bool, device=device)
    starts.index_fill_(0, torch.cumsum(flat.row_lengths, 0), True)  # position k begins a datum (k > 0)
    pair = flat.active[:-1] & flat.active[1:] & ~starts[1:length]
    s = flat.sampler.to(torch.float64)
    t = flat.trainer.to(torch.float64)
    weight = pair.to(torch.float64)
    abs_d = torch.nan_to_num(flat.diff.abs(), nan=0.0, posinf=0.0)  # non-finite only off the pairs
    return {
        "n_pairs": torch.count_nonzero(pair),
        "sum_abs_d_pairs": torch.dot(abs_d[:-1] + abs_d[1:], weight),
        "sum_abs_shift_next": torch.dot(torch.nan_to_num((t[:-1] - s[1:]).abs_(), nan=0.0, posinf=0.0), weight),
        "sum_abs_shift_prev": torch.dot(torch.nan_to_num((t[1:] - s[:-1]).abs_(), nan=0.0, posinf=0.0), weight),
    }


def _context_sums(abs_d: torch.Tensor, places: TokenPlaces, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Tokens, |d| and d² on each datum's first ``FIRST_ACTIONS`` action tokens and on its action
    tokens from the ``LATER_ACTIONS_FROM``-th on (0-based), per sampler-probability bucket
    (``strata.PROBABILITY_EDGES``): the context fade and its significance (``signatures``), compared
    within a bucket so that a completion whose first tokens are harder to predict does not read as a
    fade. ``abs_d``, ``places`` and ``valid`` as in ``from_batch`` (the action tokens alone when
    ``valid`` is None).

    Example:
        >>> from loops_callbacks.divergence.strata import TokenPlaces
        >>> d = torch.tensor([-0.4] * 4 + [-0.1] * 8, dtype=torch.float64)  # the sampler gives p = 1
        >>> places = TokenPlaces.of(torch.ones(12, dtype=torch.bool), torch.tensor([12]), torch.tensor([12]),
        ...                         torch.zeros(12), compact=True)
        >>> sums = _context_sums(d.abs(), places, None)
        >>> [round(float(sums[context_total(kind, 4)]), 3) for kind in CONTEXT_KINDS]
        [4.0, 1.6, 0.64, 4.0, 0.4, 0.04]
    """
    buckets = len(PROBABILITY_EDGES) + 1
    values = torch.stack([torch.ones_like(abs_d), abs_d, abs_d * abs_d])  # the rows of CONTEXT_KINDS' sums
    sums: dict[str, torch.Tensor] = {}
    for part, chosen in (("first", places.rank < FIRST_ACTIONS), ("later", places.rank >= LATER_ACTIONS_FROM)):
        if valid is not None:
            chosen &= valid
        slot = torch.where(chosen, places.p_bucket, buckets)  # the others in one more slot, dropped
        totals = abs_d.new_zeros(len(values), buckets + 1).index_add_(1, slot, values)
        for row, name in enumerate(("n", "sum_abs_d", "sum_d2")):
            sums.update({context_total(f"{name}_{part}", bucket): totals[row, bucket] for bucket in range(buckets)})
    return sums


def _token_sums(flat: FlatBatch, d: torch.Tensor, valid: torch.Tensor | None, compact: bool) -> torch.Tensor:
    """Float64 ``[3, TOKEN_BUCKETS]``: per hashed token id, the count, sum of d and sum of d²."""
    buckets = torch.zeros(3, TOKEN_BUCKETS + 1, dtype=torch.float64, device=d.device)  # last: unknown ids
    if flat.token_ids is None:
        return buckets[:, :TOKEN_BUCKETS]
    ids = _select(flat.token_ids, flat.active) if compact else flat.token_ids
    known = ids >= 0
    if valid is not None:
        known &= valid
    index = torch.where(known, ids.remainder(TOKEN_BUCKETS), TOKEN_BUCKETS)
    values = torch.stack([torch.ones_like(d), d, d * d])
    buckets.index_add_(1, index, values)
    return buckets[:, :TOKEN_BUCKETS]


def _offset_sums(flat: FlatBatch, compact: bool) -> torch.Tensor:
    """``alignment.offset_sums`` of ``flat``; on the CPU summed over ``OFFSET_CHUNK_POSITIONS`` chunks."""
    if not compact:
        return offset_sums(flat)
    return functools.reduce(operator.add, [offset_sums(chunk) for chunk in flat.datum_chunks(OFFSET_CHUNK_POSITIONS)])


def _add_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _max_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return torch.maximum(a, b)


def _on_host(device: torch.device) -> bool:
    """Whether host synchronizations are free here (the CPU), so data-dependent shapes are fine."""
    return device.type == "cpu"


def _max_and_negated_min(values: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, -min) of ``values`` where ``valid`` (all when ``None``); -inf for both when there are none."""
    inf = float("inf")
    if valid is None:
        low, high = _min_max(values)
    else:
        low, high = _min_max(values.masked_fill(~valid, inf))[0], _min_max(values.masked_fill(~valid, -inf))[1]
    return high, -low


def _select(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values[keep]`` on the CPU; numpy's compress is about 3x faster than ``masked_select``."""
    if values.dtype in (torch.bfloat16, torch.float16) or values.requires_grad:
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


def _sequence_stats(
    d: torch.Tensor, active: torch.Tensor, row_lengths: torch.Tensor, compact: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per datum: action-token count, whether it has any, mean d, and exp(min(mean d, 80)).

    ``d`` holds the selected action tokens (``compact``) or every position with 0 elsewhere.
    """
    row_counts = _row_sums(active, row_lengths)  # int64
    seq_sum = _row_sums(d, row_counts if compact else row_lengths)
    scored = row_counts > 0
    seq_mean = (seq_sum / row_counts.clamp(min=1)).masked_fill(~scored, 0.0)
    seq_is_ratio = torch.exp(seq_mean.clamp(max=IS_RATIO_CLAMP)).masked_fill(~scored, 0.0)
    return row_counts, scored, seq_mean, seq_is_ratio


def _min_max(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) as float64; (inf, -inf) when empty."""
    if values.numel() == 0:
        inf = torch.full((), float("inf"), dtype=torch.float64, device=values.device)
        return inf, -inf
    low, high = torch.aminmax(values)
    return low.to(torch.float64), high.to(torch.float64)


def _stable_top_k(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values, ties broken by the earliest index, in index order."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=ranked.device)
    if _on_host(ranked.device):
        # The k-th largest of a strided subset is a lower bound of the k-th largest of all, so
        # every value at or above it is a candidate (about k * stride of them); rank those only.
        stride = max(1, min(64, ranked.shape[0] // (4 * k)))
        bound = torch.topk(ranked[::stride], k, sorted=False).values.min() if stride > 1 else None
        if bound is None:
            bound = torch.topk(ranked, k, sorted=False).values.min()
        candidates = (ranked >= bound).nonzero().squeeze(1)
        order = torch.sort(ranked.index_select(0, candidates), descending=True, stable=True).indices[:k]
        return candidates.index_select(0, order).sort().values
    # Fixed shapes (no host sync): all values above the k-th, then the earliest ties.
    threshold = torch.topk(ranked, k, sorted=False).values.min()
    above = ranked > threshold
    tied = ranked == threshold
    take = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
    return torch.topk(take.to(torch.float32), k, sorted=False).indices.sort().values


def _positions_of_selected(
    active: torch.Tensor, row_lengths: torch.Tensor, counts: torch.Tensor, selected: torch.Tensor
) -> torch.Tensor:
    """Flat indices of the ``selected`` entries of ``active``'s selection (CPU; a few rows).

    ``counts``: int64 action tokens per datum.
    """
    ends = torch.cumsum(counts, 0)
    rows = torch.searchsorted(ends, selected, right=True)
    row_starts = torch.cumsum(row_lengths, 0) - row_lengths
    flat = []
    for row, rank in zip(rows.tolist(), (selected - (ends - counts).index_select(0, rows)).tolist()):
        start = int(row_starts[row])
        flat.append(start + int(active[start : start + int(row_lengths[row])].nonzero()[rank]))
    return torch.tensor(flat, dtype=torch.int64)


def _worst_rows(
    flat: FlatBatch,
    flat_index: torch.Tensor,
    chosen: torch.Tensor,
    ranked: torch.Tensor,
    d: torch.Tensor,
    top_n: int,
) -> torch.Tensor:
    """``ROW`` rows of the chosen tokens, ranked, padded with empty rows to ``top_n``."""
    rows = torch.full((top_n, ROW.WIDTH), float(NO_TOKEN), dtype=torch.float64, device=d.device)
    rows[:, ROW.ABS] = float("-inf")
    k = chosen.shape[0]
    if k == 0:
        return rows
    row_ends = torch.cumsum(flat.row_lengths, 0)
    datum = torch.searchsorted(row_ends, flat_index, right=True)
    position = flat_index - (row_ends - flat.row_lengths).index_select(0, datum)
    picked = rows[:k]
    picked[:, ROW.ABS] = ranked.index_select(0, chosen)
    picked[:, ROW.DIFF] = d.index_select(0, chosen)
    picked[:, ROW.SAMPLER] = flat.sampler.index_select(0, flat_index).to(torch.float64)
    picked[:, ROW.TRAINER] = flat.trainer.index_select(0, flat_index).to(torch.float64)
    picked[:, ROW.DATUM] = datum.to(torch.float64)
    picked[:, ROW.POSITION] = position.to(torch.float64)
    if flat.tokens is not None:
        token, before, after = flat.tokens.lookup(datum, position)
        picked[:, ROW.TOKEN] = token.to(torch.float64)
        picked[:, ROW.BEFORE] = before.to(torch.float64)
        picked[:, ROW.AFTER] = after.to(torch.float64)
    return _rank_rows(rows, top_n)


def _rank_rows(rows: torch.Tensor, top_n: int) -> torch.Tensor:
    """Rows ordered by |d| descending, then datum, then position; the first ``top_n``."""
    order = torch.sort(rows[:, ROW.POSITION], stable=True).indices
    order = order[torch.sort(rows[order, ROW.DATUM], stable=True).indices]
    order = order[torch.sort(rows[order, ROW.ABS], descending=True, stable=True).indices]
    return rows[order[:top_n]]
