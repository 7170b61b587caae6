"""Divergence statistics of all ranks, in two collectives whose per-rank size does not grow with the ranks.

``reduce_across_ranks(stats, group)`` gives every rank the same ``DivergenceStats`` of all
ranks' batches, rank 0's first, each collective on one float64 buffer laid out from the states:

1. ``all_gather`` of a small header per rank: its datum and action-token counts, its maxima (every
   ``"max"`` state), the |d| of its ``top_n`` worst rows, one random number and, with strata, the
   width its groups need. From the gathered headers every rank computes, identically: the maxima,
   which ``top_n`` (rank, row) pairs are the worst of all (ties: the lower rank, then the rank's own
   order, as a merge in rank order keeps them), each rank's datum offset and its share of the sample.
2. ``all_reduce`` (sum) of one body: every ``"sum"`` state, and the places of the chosen rows, of
   the sample and of the groups (by group index), where each rank writes its own values and zeros
   elsewhere: the sum is the assembled result, exactly (each place receives one value and zeros).

The sample: rank r holds a uniform sample of its n_r action tokens. The union's sample of
K = min(sample_size, N) diffs takes from rank r its a_r diffs of smallest key, in batch order, with
a_r = floor((K C_r + s) / N) - floor((K C_{r-1} + s) / N), C_r = n_0 + ... + n_r, s uniform in
{0, ..., N - 1} (rank 0's random number): K n_r / N rounded down or up, adding up to K, exactly
K n_r / N on average. Every token is kept with probability K / N, a stratified sample with
proportional allocation, so a percentile's rank error stays under 3 sqrt(q (1 - q) / K). While
N <= sample_size every diff is kept, in rank order, as a merge keeps them.

No host synchronization on an accelerator with a ``sample_size`` (the groups then take
``max_groups + 1`` body places, fixed); without one (every diff kept) the body's length is read
from the headers. Bytes received per rank with W ranks under ring collectives (``received_bytes``):
``8 ((W - 1) header + 2 (W - 1) / W body``).

Example (megabytes one rank receives per logged step at 1,024 ranks, with the monitor's defaults):
    >>> round(received_bytes(world=1024, top_n=20, sample_size=100_000) / 1e6, 1)
    2.1
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.divergence.per_datum import DEFAULT_MAX_GROUPS
from loops_callbacks.divergence.statistics import DivergenceStats, layout_of
from loops_callbacks.divergence.states import GROUP_ROWS, ROW, Layout


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
    """
    header, body = message_sizes(layout or layout_of(True, DEFAULT_MAX_GROUPS), top_n, sample_size)
    return round(8 * ((world - 1) * header + 2 * (world - 1) * body / world))


@torch.no_grad()
def reduce_across_ranks(
    stats: DivergenceStats, group: ProcessGroup | Any, *, generator: torch.Generator | None = None
) -> DivergenceStats:
    """Statistics of every rank's batches, rank 0's first, the same on every rank (module docstring).

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
    (module docstring). Integer arithmetic on the counts' device; exact while sample_size * N < 2**63.

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
