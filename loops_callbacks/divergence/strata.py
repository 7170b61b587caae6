"""Divergence by stratum: where in the batch the sampler–trainer gap lives.

Every action token falls in one stratum of each family, and each stratum keeps four sums
(``COLUMNS``): its tokens, Σ k3 (k3 = e^d − 1 − d), Σ |d| and Σ e^d (the importance ratio,
``exp(min(d, 80))``), so that k3, mean |d| and the IS-ratio mean of the stratum follow and two
batches' sums add up (micro-batches, ranks). The families:

* ``p_*``: the sampler's probability p = e^s of the token: < 0.01, 0.01–0.1, 0.1–0.5, 0.5–0.9,
  ≥ 0.9 (a bucket holds its lower edge);
* ``pos_q1`` … ``pos_q4``: the token's place among its datum's action tokens: token j of n is in
  quartile ⌊4j / n⌋ + 1 (so a datum with 1 action token puts it in ``pos_q1``);
* ``lag_0``, ``lag_1``, ``lag_2``, ``lag_3``, ``lag_4_7``, ``lag_8_plus``: the datum's policy lag
  (``FlatBatch.lags``: the trainer's optimizer step minus the policy version that sampled the
  datum); empty when the step carries no versions. A negative lag (a version ahead of the
  trainer, which cannot be) is counted at lag 0 and also in ``lag_ahead``, a family of its own
  that holds only those tokens, so they are counted without a host read;
* ``group_0`` … ``group_{G-1}``, ``group_other``: the datum's group id (task, environment) when
  the step carries one; ids ≥ ``max_groups`` are pooled in ``group_other``.

The first four families' sums are one float64 ``[len(COLUMNS), strata.width]`` array of fixed
shape: it merges by addition and travels in the reduction's summed body. The groups' are a table
(``group_table``) of the groups seen, ``[GROUP_ROWS, K]``: each column a group's index (row 0) and
its sums, so that their cost follows the groups given, never ``max_groups``; none without a
``group`` key. Tables merge by concatenation (``merged_groups``: one column per group on the CPU).

Example:
    >>> strata = Strata(max_groups=2)
    >>> strata.names[:5], strata.names[-1], strata.group_name(1), strata.group_name(2)
    (('p_lt_0.01', 'p_0.01_0.1', 'p_0.1_0.5', 'p_0.5_0.9', 'p_ge_0.9'), 'lag_ahead', 'group_1', 'group_other')
    >>> stratum = StratumSums(n_tokens=4.0, sum_k3=0.2, sum_abs_d=2.0, sum_is_ratio=4.4)
    >>> stratum.k3, stratum.abs_d_mean, stratum.is_ratio_mean
    (0.05, 0.5, 1.1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loops_callbacks.validation import check_int

__all__ = [
    "AHEAD_STRATUM",
    "COLUMNS",
    "GROUP_ROWS",
    "LAG_STRATA",
    "POSITION_STRATA",
    "PROBABILITY_EDGES",
    "PROBABILITY_STRATA",
    "STRATUM_METRICS",
    "Strata",
    "StratumSums",
    "TokenPlaces",
    "by_group",
    "datums_and_ranks",
    "lag_bucket",
    "merged_groups",
    "probability_buckets",
    "stratum_scalars",
]

COLUMNS = ("n_tokens", "sum_k3", "sum_abs_d", "sum_is_ratio")
"""The sums each stratum keeps, in the order of the array's rows."""
GROUP_ROWS = 1 + len(COLUMNS)
"""Rows of a group table (``Strata.group_table``): the group's index, then its ``COLUMNS``."""
PROBABILITY_EDGES = (0.01, 0.1, 0.5, 0.9)
"""Edges of the sampler-probability buckets (a bucket holds its lower edge)."""
PROBABILITY_STRATA = ("p_lt_0.01", "p_0.01_0.1", "p_0.1_0.5", "p_0.5_0.9", "p_ge_0.9")
POSITION_STRATA = ("pos_q1", "pos_q2", "pos_q3", "pos_q4")
LAG_STRATA = ("lag_0", "lag_1", "lag_2", "lag_3", "lag_4_7", "lag_8_plus")
AHEAD_STRATUM = "lag_ahead"
"""The tokens of datums whose policy version is ahead of the trainer (also counted at lag 0)."""
LAG_LABELS = ("0", "1", "2", "3", "4-7", "8+")
"""How ``HostDivergence.by_lag`` names the lag buckets, in order."""
STRATUM_METRICS = ("k3", "abs_d_mean", "is_ratio_mean", "n_tokens")
"""The scalars logged per stratum with tokens: ``stratum/<name>/<metric>``."""
DEFAULT_MAX_GROUPS = 8


def datums_and_ranks(
    active: torch.Tensor, row_lengths: torch.Tensor, row_counts: torch.Tensor, *, compact: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each place's datum and its rank among its datum's action tokens (0: the datum's first).

    ``compact``: the places are the action tokens alone, datum after datum (as ``from_batch``
    selects them on the CPU); else every position of the flat batch (a place that is not an action
    token gets the number of action tokens before it in its datum). ``active`` marks the action
    tokens among the positions, ``row_lengths`` the positions and ``row_counts`` the action tokens
    per datum. No host synchronization.

    Example:
        >>> active = torch.tensor([False, True, True, True, False, True])
        >>> datum, rank = datums_and_ranks(active, torch.tensor([4, 2]), torch.tensor([3, 1]), compact=True)
        >>> datum.tolist(), rank.tolist()
        ([0, 0, 0, 1], [0, 1, 2, 0])
    """
    device = active.device
    datum = torch.repeat_interleave(
        torch.arange(row_lengths.numel(), device=device), row_lengths, output_size=active.numel()
    )
    if compact:
        datum = datum[active]
        first = torch.cumsum(row_counts, 0) - row_counts  # each datum's first action token
        return datum, torch.arange(datum.numel(), device=device).sub_(first.index_select(0, datum))
    rank = torch.cumsum(active, 0).sub_(active.to(torch.int64))  # action tokens before each place
    starts = (torch.cumsum(row_lengths, 0) - row_lengths).clamp(max=max(active.numel() - 1, 0))
    rank -= (rank.index_select(0, starts) if rank.numel() else starts).index_select(0, datum)
    return datum, rank


_LOG_PROBABILITY_EDGES: dict[torch.device, torch.Tensor] = {}


def probability_buckets(sampler: torch.Tensor) -> torch.Tensor:
    """Each sampler logprob's bucket of ``PROBABILITY_EDGES`` (0: p < 0.01, ..., 4: p >= 0.9), int64.

    The edges are made once per device, so that no step copies them from the host.

    Example:
        >>> probability_buckets(torch.log(torch.tensor([0.005, 0.05, 0.3, 0.7, 0.95]))).tolist()
        [0, 1, 2, 3, 4]
    """
    edges = _LOG_PROBABILITY_EDGES.get(sampler.device)
    if edges is None:
        edges = torch.tensor([math.log(p) for p in PROBABILITY_EDGES], dtype=torch.float64, device=sampler.device)
        _LOG_PROBABILITY_EDGES[sampler.device] = edges
    return torch.bucketize(sampler.to(torch.float64), edges, right=True)


@dataclass(frozen=True)
class TokenPlaces:
    """Where each place of a chunk is: its datum, its rank among its datum's action tokens
    (``datums_and_ranks``) and its sampler-probability bucket (``probability_buckets``), worked out
    once for everything that groups tokens by them (the strata, the diagnosis' first-token sums).

    Example:
        >>> active = torch.tensor([True, True, False, True])
        >>> places = TokenPlaces.of(active, torch.tensor([3, 1]), torch.tensor([2, 1]), torch.log(torch.tensor(
        ...     [0.95, 0.3, 0.05])), compact=True)
        >>> places.datum.tolist(), places.rank.tolist(), places.p_bucket.tolist()
        ([0, 0, 1], [0, 1, 0], [4, 2, 1])
    """

    datum: torch.Tensor  # int64, each place's datum
    rank: torch.Tensor  # int64, action tokens before it in its datum
    p_bucket: torch.Tensor  # int64, its bucket of PROBABILITY_EDGES

    @classmethod
    def of(
        cls,
        active: torch.Tensor,
        row_lengths: torch.Tensor,
        row_counts: torch.Tensor,
        sampler: torch.Tensor,
        *,
        compact: bool,
    ) -> TokenPlaces:
        """The places of ``sampler``'s tokens: the action tokens alone (``compact``) or every position."""
        datum, rank = datums_and_ranks(active, row_lengths, row_counts, compact=compact)
        return cls(datum, rank, probability_buckets(sampler))


def lag_bucket(lags: torch.Tensor) -> torch.Tensor:
    """The ``LAG_STRATA`` index of each lag (non-negative int64): 0–3 as they are, 4–7 → 4, 8 and more → 5.

    Example:
        >>> lag_bucket(torch.tensor([0, 3, 4, 7, 8, 100])).tolist()
        [0, 3, 4, 4, 5, 5]
    """
    return torch.where(lags < 4, lags, torch.where(lags < 8, 4, 5))


@dataclass(frozen=True)
class StratumSums:
    """One stratum's sums on the host, and the three numbers they give (NaN without tokens)."""

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
class Strata:
    """The strata one monitor keeps: every family, with ``max_groups`` groups (module docstring)."""

    max_groups: int = DEFAULT_MAX_GROUPS

    def __post_init__(self) -> None:
        check_int("max_groups", self.max_groups, least=1)

    @property
    def names(self) -> tuple[str, ...]:
        """The strata of the fixed-shape array, in its order (the groups are named by ``group_name``)."""
        return PROBABILITY_STRATA + POSITION_STRATA + LAG_STRATA + (AHEAD_STRATUM,)

    @property
    def width(self) -> int:
        return len(self.names)

    @property
    def offsets(self) -> dict[str, int]:
        """Where each family's first stratum sits."""
        position = len(PROBABILITY_STRATA)
        lag = position + len(POSITION_STRATA)
        return {"p": 0, "pos": position, "lag": lag, "ahead": lag + len(LAG_STRATA)}

    def group_name(self, index: int) -> str:
        """``group_<index>``, or ``group_other`` for ``max_groups`` (where larger and negative ids go)."""
        return "group_other" if index >= self.max_groups else f"group_{index}"

    @torch.no_grad()
    def sums(
        self,
        *,
        d: torch.Tensor,
        abs_d: torch.Tensor,
        is_ratio: torch.Tensor,
        k3: torch.Tensor,
        places: TokenPlaces,
        row_counts: torch.Tensor,
        lags: torch.Tensor | None,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Float64 ``[len(COLUMNS), width]`` of one chunk.

        ``d``, ``abs_d``, ``is_ratio``, ``k3`` (``e^d - 1 - d``, as the statistics computed it)
        and ``places`` hold the action tokens (``valid is None``) or
        every position with ``valid`` marking the action tokens, as in ``from_batch``;
        ``row_counts`` is the action tokens per datum; ``lags`` one int64 per datum
        (a negative lag: a version ahead of the trainer, at lag 0 and in ``lag_ahead``).
        Places that are not action tokens go to a last column that is dropped. Each family is one
        index per token; on the CPU its sums are four weighted ``bincount``s (the temporaries stay a
        few 1-D arrays), elsewhere one ``index_add_`` (``bincount`` would read its size on the host).
        """
        device = d.device
        trash = self.width
        datum = places.datum
        offsets = self.offsets
        weights = (k3, abs_d, is_ratio)
        if valid is not None:
            weights = tuple(weight.masked_fill(~valid, 0.0) for weight in weights)
        out = torch.zeros(len(COLUMNS), trash + 1, dtype=torch.float64, device=device)

        stacked = None if _reads_free(device) else torch.stack([torch.ones_like(d), *weights])

        def add(index: torch.Tensor) -> None:
            if valid is not None:
                index.masked_fill_(~valid, trash)
            if stacked is not None:
                out.index_add_(1, index, stacked)
                return
            out[0] += torch.bincount(index, minlength=trash + 1)
            for row, weight in enumerate(weights, start=1):
                out[row] += torch.bincount(index, weights=weight, minlength=trash + 1)

        add(places.p_bucket + offsets["p"])
        quartile = places.rank.mul(4).div_(row_counts.index_select(0, datum).clamp_(min=1), rounding_mode="floor")
        add(quartile.clamp_(max=3).add_(offsets["pos"]))
        del quartile
        if lags is not None:
            add(lag_bucket(lags.clamp(min=0)).add_(offsets["lag"]).index_select(0, datum))
            add(torch.full_like(lags, trash).masked_fill_(lags < 0, offsets["ahead"]).index_select(0, datum))
        return out[:, :trash]

    @torch.no_grad()
    def group_table(
        self,
        *,
        abs_d: torch.Tensor,
        is_ratio: torch.Tensor,
        k3: torch.Tensor,
        places: TokenPlaces,
        groups: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Float64 ``[GROUP_ROWS, K]`` of one chunk: each group's index (row 0; ``max_groups`` for
        ``group_other``) and its sums, from ``groups`` (one int64 id >= 0 per datum) and the tokens as
        ``sums`` takes them. One column per datum, merged into one per group where that costs no host
        read (``merged_groups``).

        Example:
            >>> places = TokenPlaces.of(torch.ones(3, dtype=torch.bool), torch.tensor([1, 2]), torch.tensor([1, 2]),
            ...                         torch.zeros(3), compact=True)
            >>> ones = torch.ones(3, dtype=torch.float64)
            >>> Strata(2).group_table(abs_d=ones, is_ratio=ones, k3=ones, places=places, groups=torch.tensor([5, 5]),
            ...                       valid=None).tolist()  # both datums in group_other
            [[2.0], [3.0], [3.0], [3.0], [3.0]]
        """
        weights = torch.stack([torch.ones_like(k3), k3, abs_d, is_ratio])
        if valid is not None:
            weights.masked_fill_(~valid, 0.0)
        table = torch.zeros(GROUP_ROWS, groups.numel(), dtype=torch.float64, device=k3.device)
        table[0] = groups.clamp(max=self.max_groups)
        table[1:].index_add_(1, places.datum, weights)
        return merged_groups([table])

    def host(self, sums: np.ndarray, groups: np.ndarray | None = None) -> dict[str, StratumSums]:
        """Each stratum's sums by name, from the array ``sums`` and the group table ``groups`` (its groups
        with tokens, in the order of their indices)."""
        named = {name: StratumSums(*map(float, sums[:, i])) for i, name in enumerate(self.names)}
        if groups is not None:
            for index, *column in groups[:, groups[1] > 0].T.tolist():
                named[self.group_name(int(index))] = StratumSums(*column)
        return named


def merged_groups(tables: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The group tables' columns together (``None`` when there are none), one column per group in
    ascending order on the CPU; elsewhere side by side, since finding the groups would read the host.

    Example:
        >>> a, b = torch.tensor([[1.0, 0.0], [2.0, 1.0]]), torch.tensor([[1.0], [5.0]])
        >>> merged_groups([a, None, b]).tolist()
        [[0.0, 1.0], [1.0, 7.0]]
    """
    present = [table for table in tables if table is not None]
    if not present:
        return None
    table = torch.cat(present, dim=1) if len(present) > 1 else present[0]
    return by_group(table) if _reads_free(table.device) else table


def by_group(table: torch.Tensor) -> torch.Tensor:
    """The group table with one column per group, in ascending order (their number is read: on the host).

    Example:
        >>> by_group(torch.tensor([[1.0, 0.0, 1.0], [2.0, 1.0, 5.0]])).tolist()
        [[0.0, 1.0], [1.0, 7.0]]
    """
    indices, column = torch.unique(table[0], return_inverse=True)
    merged = table.new_zeros(table.shape[0], indices.numel())
    merged[0] = indices
    merged[1:].index_add_(1, column, table[1:])
    return merged


def _reads_free(device: torch.device) -> bool:
    """Whether a size that depends on the data (``bincount``'s, ``unique``'s) is free of host
    synchronization here (the CPU)."""
    return device.type == "cpu"


def by_lag(strata: Mapping[str, StratumSums]) -> dict[str, StratumSums]:
    """The lag strata by ``LAG_LABELS`` ("0" … "8+", in order), or ``{}`` when no token had a version.

    Example:
        >>> sums = {name: StratumSums(0.0, 0.0, 0.0, 0.0) for name in LAG_STRATA}
        >>> by_lag(sums)
        {}
    """
    lags = {label: strata[name] for label, name in zip(LAG_LABELS, LAG_STRATA)}
    return lags if any(stratum.n_tokens for stratum in lags.values()) else {}


def stratum_scalars(strata: Mapping[str, StratumSums]) -> dict[str, float]:
    """``stratum/<name>/<metric>`` (``STRATUM_METRICS``) for every stratum with tokens, without prefix.

    Example:
        >>> scalars = stratum_scalars({"pos_q1": StratumSums(2.0, 0.1, 1.0, 2.0), "pos_q2": StratumSums(0, 0, 0, 0)})
        >>> list(scalars), scalars["stratum/pos_q1/k3"]
        (['stratum/pos_q1/k3', 'stratum/pos_q1/abs_d_mean', 'stratum/pos_q1/is_ratio_mean', 'stratum/pos_q1/n_tokens'], 0.05)
    """
    scalars = {}
    for name, stratum in strata.items():
        if stratum.n_tokens:
            for metric in STRATUM_METRICS:
                scalars[f"stratum/{name}/{metric}"] = float(getattr(stratum, metric))
    return scalars
