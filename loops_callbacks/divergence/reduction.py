"""Divergence statistics of all ranks, with per-rank traffic that does not grow with the ranks.

``reduce_across_ranks(stats, collectives)`` gives every rank the same ``DivergenceStats`` of all ranks'
batches, rank 0's first, in two collectives, each on one packed float64 buffer:

1. ``all_gather`` of a header per rank, ``len(PER_RANK_TOTALS) + len(EXTREMA) + top_n + 1`` values:
   the rank's per-rank totals (``layout.STATISTICS``: all but the diagnosis' sums), extrema, the
   |d| of its ``top_n`` worst rows (already ranked) and one random number. From the gathered headers every rank computes, identically and without a loop over
   ranks: the totals (summed in rank order), the extrema (max), which ``top_n`` (rank, row) pairs
   are the worst of all ranks and in which order, each rank's datum offset, and each rank's share
   of the percentile sample.
2. ``all_reduce`` (sum) of one body, ``top_n * ROW.WIDTH + S + sample_size + 1`` values, in which
   each rank writes its own chosen rows and sampled diffs at their final places and zeros
   everywhere else. The sum is the assembled result, exactly: each place receives one value and
   zeros. The body also carries the diagnosis' sums, summed as they are (S = the 51
   ``SUMMED_TOTALS`` + 3 * TOKEN_BUCKETS per-token-id sums), so that the per-rank header stays small; their
   summation order is the collective's (exact for counts, and for any sum on 2 ranks). A monitor's
   own declarations ride along at a size fixed by its options: the stratum sums (4 x 16 values,
   ``strata``) and its corrections' shadow sums in the body, their extrema (8 values) in the
   header. With the diagnosis on, the offset votes (``alignment.offset_sums``, a fixed few hundred
   values) ride in the body too. The groups' sums (``strata.Strata.group_table``) ride in the body
   by group index, 4 values for ``group_other`` and for each index up to the largest any rank saw
   (none without a ``group`` key; each rank's header says the width it needs), and on an accelerator
   for every index below ``max_groups``, so that nothing there waits for a host read.

Bytes received per rank with W ranks, under the ring algorithms gloo and NCCL use for large
buffers (``received_bytes``): ``8 * ((W - 1) * header + 2 * (W - 1) / W * body)``. With the
monitor's defaults (``top_n=20``, ``sample_size=100_000``: header 50, body 104,484 values) that is
1.67 MB plus 400 B per rank: 2.08 MB at 1,024 ranks, where gathering every rank's statistics
received about 1.6 MB per rank (1.6 GB at 1,024).

Worst rows are exact: the global ``top_n`` by |d| (ties: lower rank, then the rank's own order,
which is datum then position) are those a merge in rank order keeps, with datums renumbered.

The percentile sample. Rank r holds a uniform sample of its n_r action tokens (its ``sample_size``
smallest random keys). The union's sample of K = min(sample_size, N) diffs, N = n_0 + ... + n_{W-1},
takes from rank r its a_r diffs of smallest key, in batch order, with

    a_r = floor((K * C_r + s) / N) - floor((K * C_{r-1} + s) / N),   C_r = n_0 + ... + n_r,

and s uniform in {0, ..., N - 1} (from rank 0's random number; integer arithmetic, the same on
every rank). a_r is K * n_r / N rounded down or up, the shares add up to K, and E[a_r] = K * n_r / N
exactly, so every action token is kept with probability exactly K / N; within a rank the kept
diffs are a uniform sample without replacement. That is a stratified sample with proportional
allocation: for the fraction of diffs below any value its variance is at most that of a simple
random sample of the same size, so a percentile's rank error stays under 3 * sqrt(q (1 - q) / K)
as documented. Rounding the shares to whole tokens shifts that fraction by less than
sum_r |p_r - p| / K <= (W / K) * max_r |p_r - p| (p_r: rank r's fraction below the value, p: the
union's); at 1,024 ranks and the default sample that is under 0.01 * max_r |p_r - p|, negligible
when ranks see data from the same distribution. While N <= sample_size every diff is kept, in
rank order, exactly as a merge keeps them.

A single rank gets its statistics back unchanged. Host synchronizations: none on an accelerator
when a ``sample_size`` is set (every shape is fixed, the groups' width too); without one (every
diff kept, as the plain functions do) the body's length is read from the headers, one
synchronization.

Header and body are ``layout.Packing``s: their parts are read by name.

Example (megabytes one rank receives per logged step at 1,024 ranks, with the defaults):
    >>> round(received_bytes(world=1024, top_n=20, sample_size=100_000) / 1e6, 1)
    2.1
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from loops_callbacks.divergence.layout import (
    EXTREMA,
    PER_RANK_TOTALS,
    ROW,
    SUMMED_TOTALS,
    TOKEN_BUCKETS,
    TOTAL_INDEX,
    TOTALS,
    Packing,
)
from loops_callbacks.divergence.strata import GROUP_ROWS

if TYPE_CHECKING:  # statistics imports this module; the reduction only reads and replaces the fields
    from loops_callbacks.divergence.statistics import DivergenceStats

__all__ = [
    "Collectives",
    "ProcessGroupCollectives",
    "as_collectives",
    "body_length",
    "body_packing",
    "header_length",
    "header_packing",
    "received_bytes",
    "reduce_across_ranks",
    "stratified_allocation",
]

FLOAT64_BYTES = 8


@runtime_checkable
class Collectives(Protocol):
    """A process group as the reduction uses it: this rank, the world, and two collectives."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape everywhere) stacked in rank order: ``[world_size, ...]``."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's ``tensor``; may reuse ``tensor``'s storage."""
        ...


class ProcessGroupCollectives:
    """``torch.distributed`` collectives on ``group`` (default: the world), one call each.

    ``device``: where buffers travel when it is not where the statistics are (NCCL needs the GPU).

    Example:
        >>> ProcessGroupCollectives().world_size  # no process group: one rank
        1
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if _distributed() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if _distributed() else 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        sent = self._to_device(tensor).contiguous()
        gathered = sent.new_empty((self.world_size, *sent.shape))
        if dist.get_backend(self.group) == "nccl":
            dist.all_gather_into_tensor(gathered, sent, group=self.group)
        else:  # gloo has no all_gather_into_tensor; it fills the rows of ``gathered`` in place
            dist.all_gather(list(gathered.unbind(0)), sent, group=self.group)
        return gathered.to(tensor.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._to_device(tensor).contiguous()
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        return buffer.to(tensor.device)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device is None else tensor.to(self.device)


class _StrategyCollectives:
    """A Lightning strategy's own ``all_gather`` and ``reduce``, for strategies not on ``torch.distributed``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    def rank(self) -> int:
        return int(self.strategy.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.strategy.world_size)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.all_gather(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.reduce(tensor, reduce_op="sum")


def as_collectives(collectives: Collectives | Any) -> Collectives:
    """``collectives`` itself, or those of a Lightning strategy (``trainer.strategy``).

    A strategy running on ``torch.distributed`` (DDP, FSDP, DeepSpeed) is served by
    ``torch.distributed`` directly, since Lightning's ``reduce`` runs a barrier before each
    all-reduce (one more collective, and a host synchronization under NCCL); other strategies
    through their own ``all_gather`` and ``reduce``.
    """
    if isinstance(collectives, Collectives):
        return collectives
    strategy = collectives
    if _distributed() and dist.get_world_size() == strategy.world_size:
        device = strategy.root_device if dist.get_backend() == "nccl" else None
        return ProcessGroupCollectives(device=device)
    return _StrategyCollectives(strategy)


def header_packing(top_n: int, extra_extrema: int = 0, group_width: int = 0) -> Packing:
    """A rank's header: its per-rank totals, extrema, the ``extra_extrema`` extrema the monitor declares
    (``layout.ExtraStatistics``), its worst rows' |d|, one random number and, with strata
    (``group_width=1``: one value), the width its groups take in the body (``_group_columns``)."""
    return Packing(
        totals=len(PER_RANK_TOTALS), extrema=len(EXTREMA), extra_extrema=extra_extrema, worst_abs=top_n, draw=1,
        group_width=group_width,
    )


def body_packing(
    top_n: int, capacity: int, strata: int = 0, extra_totals: int = 0, offsets: int = 0, groups: int = 0
) -> Packing:
    """The summed body: the worst rows, the summed totals, the per-token-id sums, the ``offsets``
    offset votes (``alignment.offset_sums``, with the diagnosis' sums), the ``strata`` stratum
    sums (``strata.Strata``) and the ``extra_totals`` sums the monitor declares
    (``layout.ExtraStatistics``), a fixed number per monitor each, the ``groups`` group sums by
    index (as wide as the largest index any rank saw), the sample and one slot that takes every
    unchosen diff."""
    return Packing(
        worst=top_n * ROW.WIDTH,
        totals=len(SUMMED_TOTALS),
        token_sums=3 * TOKEN_BUCKETS,
        offsets=offsets,
        strata=strata,
        extra_totals=extra_totals,
        groups=groups,
        sample=capacity,
        unchosen=1,
    )


def header_length(top_n: int) -> int:
    """Values in a rank's header (``header_packing``)."""
    return header_packing(top_n).length


def body_length(top_n: int, sample_size: int) -> int:
    """Values in the summed body (``body_packing``)."""
    return body_packing(top_n, sample_size).length


def received_bytes(world: int, top_n: int, sample_size: int) -> int:
    """Bytes one rank receives per reduction with ring collectives (what gloo measures, too).

    The ring all-gather brings the ``world - 1`` other headers; the ring all-reduce of the body
    receives ``2 * (world - 1) / world`` of it (reduce-scatter, then all-gather).

    Example:
        >>> header, body = header_length(top_n=0), body_length(top_n=0, sample_size=10)
        >>> received_bytes(world=2, top_n=0, sample_size=10) == 8 * (header + 2 * 1 / 2 * body)
        True
    """
    gather = (world - 1) * header_length(top_n)
    reduce = 2 * (world - 1) * body_length(top_n, sample_size) / world
    return round(FLOAT64_BYTES * (gather + reduce))


@torch.no_grad()
def reduce_across_ranks(
    stats: DivergenceStats, collectives: Collectives | Any, *, generator: torch.Generator | None = None
) -> DivergenceStats:
    """Statistics of every rank's batches, rank 0's first, the same on every rank.

    A collective: every rank calls it, with statistics of one ``top_n`` and ``sample_size``.
    ``collectives`` is a ``Collectives`` or a Lightning strategy; ``generator`` (on the statistics'
    device) draws the one random number of the sample's allocation (default: torch's global RNG).
    The result is for reading (``to_host``): its sample keys only mark the filled places, so it
    is not meant to be merged again.
    """
    collectives = as_collectives(collectives)
    world, rank = collectives.world_size, collectives.rank
    if world == 1:
        return stats
    device = stats.totals.device
    top_n = stats.worst.shape[0]
    per_rank, summed = _total_indices(device)
    extra_totals, extra_extrema = stats.extras_or_empty()
    kept_strata = stats.stratification is not None
    columns = _group_columns(stats)  # where each of this rank's groups goes in the body
    header = header_packing(top_n, extra_extrema.numel(), group_width=int(kept_strata))
    mine = header.pack(
        totals=stats.totals.index_select(0, per_rank),
        extrema=stats.extrema,
        extra_extrema=extra_extrema,
        worst_abs=stats.worst[:, ROW.ABS],
        draw=torch.rand(1, dtype=torch.float64, device=device, generator=generator),
        group_width=_width_needed(columns, device) if kept_strata else stats.totals.new_zeros(0),
    )
    ranks = header.unpack(collectives.all_gather(mine))  # each part [world, ...]
    rank_totals = dict(zip(PER_RANK_TOTALS, ranks["totals"].unbind(1)))
    datums = rank_totals["n_datums"]
    datum_offsets = torch.cumsum(datums, 0) - datums
    counts = rank_totals["n_action_tokens"].to(torch.int64)
    share, start = stratified_allocation(counts, stats.sample_size, ranks["draw"][0, 0])

    capacity = stats.sample_size
    if capacity is None:  # every diff is kept: the body is as long as the union
        capacity = int(counts.sum())
    strata = stats.strata if stats.strata is not None else stats.totals.new_zeros(0)
    offsets = stats.offset_sums if stats.offset_sums is not None else stats.totals.new_zeros(0)
    width = _body_group_width(stats, ranks["group_width"]) if kept_strata else 0
    groups = torch.zeros(GROUP_ROWS - 1, width, dtype=torch.float64, device=device)
    if columns is not None and stats.group_strata is not None:
        groups.index_add_(1, columns, stats.group_strata[1:])
    body = body_packing(top_n, capacity, strata.numel(), extra_totals.numel(), offsets.numel(), groups.numel())
    sample = torch.zeros(capacity + 1, dtype=torch.float64, device=device)
    _add_sample(sample, stats, share[rank], start[rank])
    reduced = body.unpack(
        collectives.all_reduce_sum(
            body.pack(
                worst=_chosen_rows(stats.worst, ranks["worst_abs"], datum_offsets[rank], rank),
                totals=stats.totals.index_select(0, summed),
                token_sums=stats.token_sums_or_zeros(),
                offsets=offsets,
                strata=strata,
                extra_totals=extra_totals,
                groups=groups,
                sample=sample[:capacity],
                unchosen=sample[capacity:],
            )
        )
    )
    totals = torch.empty(len(TOTALS), dtype=torch.float64, device=device)
    # summed in rank order, as merging rank by rank does (bit for bit on the CPU)
    totals[per_rank] = torch.cumsum(ranks["totals"], 0)[-1]
    totals[summed] = reduced["totals"]
    keys = None
    if stats.sample_size is not None:
        filled = torch.arange(capacity, device=device) < share.sum()
        keys = torch.zeros(capacity, dtype=torch.float64, device=device).masked_fill_(~filled, float("inf"))
    return dataclasses.replace(
        stats,
        totals=totals,
        extrema=ranks["extrema"].amax(0),
        worst=reduced["worst"].reshape(top_n, ROW.WIDTH),
        sample_values=reduced["sample"],
        sample_keys=keys,
        token_sums=reduced["token_sums"].reshape(3, TOKEN_BUCKETS),
        strata=None if stats.strata is None else reduced["strata"].reshape(stats.strata.shape),
        group_strata=None if width == 0 else torch.cat(
            [_group_indices(stats, width, device), reduced["groups"].reshape(GROUP_ROWS - 1, width)]
        ),
        offset_sums=None if stats.offset_sums is None else reduced["offsets"],
        extra_totals=None if stats.extra_totals is None else reduced["extra_totals"],
        extra_extrema=None if stats.extra_extrema is None else ranks["extra_extrema"].amax(0),
    )


def _group_columns(stats: DivergenceStats) -> torch.Tensor | None:
    """The body column of each column of the rank's group table (int64; ``None`` without one): 0 for
    ``group_other`` (index ``max_groups``), index + 1 for the others, so that the body is as wide as
    the largest index given, whatever ``max_groups``."""
    if stats.group_strata is None or stats.stratification is None:
        return None
    index = stats.group_strata[0].to(torch.int64)
    return torch.where(index >= stats.stratification.max_groups, 0, index + 1)


def _body_group_width(stats: DivergenceStats, widths: torch.Tensor) -> int:
    """The body columns of the groups: on the CPU the largest any rank needs (the headers are on the host);
    on an accelerator ``max_groups + 1``, fixed, so that no host read waits for the device."""
    if widths.device.type == "cpu":
        return int(widths.max())
    assert stats.stratification is not None
    return stats.stratification.max_groups + 1


def _width_needed(columns: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[1]`` float64 on the device: the body columns the rank's groups need (0 without any)."""
    if columns is None or columns.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=device)
    return columns.max().add(1).to(torch.float64).reshape(1)


def _group_indices(stats: DivergenceStats, width: int, device: torch.device) -> torch.Tensor:
    """``[1, width]``: the group index of each body column (``_group_columns``), as a group table's first row."""
    assert stats.stratification is not None
    indices = torch.arange(-1, width - 1, dtype=torch.float64, device=device)
    indices[0] = stats.stratification.max_groups
    return indices[None]


@functools.lru_cache(maxsize=None)
def _total_indices(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the per-rank and the summed totals sit in ``totals``, on ``device`` (made once per device)."""
    per_rank = torch.tensor([TOTAL_INDEX[name] for name in PER_RANK_TOTALS], device=device)
    summed = torch.tensor([TOTAL_INDEX[name] for name in SUMMED_TOTALS], device=device)
    return per_rank, summed


def stratified_allocation(
    counts: torch.Tensor, sample_size: int | None, draw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's share of the union's sample and where its diffs start, from the ranks' counts.

    ``counts``: int64 action tokens per rank; ``draw``: a float in [0, 1), the same on every
    rank. Shares are K * n_r / N rounded down or up by one shared shift s = floor(draw * N), add
    up to K = min(sample_size, N), and average K * n_r / N exactly over s (module docstring).
    Integer arithmetic on the counts' device; exact while sample_size * N < 2**63.

    Example:
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

    ``worst_abs`` is ``[world, top_n]``: every rank's ranked |d|. A stable descending sort of it
    flattened in rank order breaks ties by rank, then by each rank's own order: a merge's order.
    """
    top_n = worst.shape[0]
    if top_n == 0:
        return worst
    order = torch.sort(worst_abs.reshape(-1), descending=True, stable=True).indices[:top_n]
    owner = torch.div(order, top_n, rounding_mode="floor")
    rows = worst.index_select(0, order - owner * top_n)
    rows[:, ROW.DATUM] += datum_offset
    return rows.masked_fill_((owner != rank)[:, None], 0.0)


def _add_sample(slots: torch.Tensor, stats: DivergenceStats, share: torch.Tensor, start: torch.Tensor) -> None:
    """Add the rank's ``share`` diffs of smallest key to ``slots``, in batch order, from place ``start``.

    The last place takes every unchosen diff as a zero, so no shape depends on the data.
    """
    values = stats.sample_values.to(torch.float64)
    chosen = _smallest(stats.keys_or_zeros(), share)
    places = torch.where(chosen, start + torch.cumsum(chosen, 0) - 1, slots.shape[0] - 1)
    slots.index_add_(0, places, values.masked_fill(~chosen, 0.0))


def _smallest(keys: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask of the ``count`` smallest keys, ties to the earliest; ``count`` is a 0-d int64 tensor.

    On the CPU the threshold comes from ``kthvalue`` (reading ``count`` costs nothing there);
    elsewhere from a sort, which needs no host synchronization.

    Example:
        >>> _smallest(torch.tensor([0.5, 0.1, 0.5, 0.3]), torch.tensor(3)).tolist()
        [True, True, False, True]
    """
    if keys.numel() == 0:
        return torch.zeros_like(keys, dtype=torch.bool)
    if keys.device.type == "cpu":
        k = int(count)
        if k == 0:
            return torch.zeros_like(keys, dtype=torch.bool)
        threshold = torch.kthvalue(keys, k).values
    else:
        threshold = torch.sort(keys).values.gather(0, (count - 1).clamp(min=0).reshape(1)).squeeze(0)
    below = keys < threshold
    tied = keys == threshold
    return below | (tied & (torch.cumsum(tied, 0) <= count - below.sum()))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
