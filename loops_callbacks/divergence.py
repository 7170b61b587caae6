"""Mergeable sampler-vs-trainer divergence statistics, kept on the batch's device.

``DivergenceStats.from_batch`` reads a ``FlatBatch`` once into sums, counts, maxima, the
``top_n`` most divergent tokens (with their context token ids) and a sample of the per-token
diffs d = trainer logprob − sampler logprob. Statistics of micro-batches and of ranks combine
with ``merge`` / ``all_gather`` exactly as if computed on the concatenated batch (sums up to
floating-point summation order; counts, maxima and rows exactly). ``to_host`` moves everything
to the host in one transfer, the only synchronization.

The sample keeps every diff when ``sample_size`` is ``None`` (the plain functions). With a
``sample_size`` it is a uniform sample without replacement of the union (bottom-k of one random
key per token, which merges exactly), so percentiles stay exact while the union has at most
``sample_size`` tokens.

Example:
    >>> import torch
    >>> from loops_callbacks.action_tokens import flatten_padded
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> host = DivergenceStats.from_batch(flat).to_host()
    >>> host.totals["n_action_tokens"], host.totals["sum_d"], host.diffs.tolist()
    (2.0, -0.5, [-0.5, 0.0])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from loops_callbacks.action_tokens import NO_TOKEN, FlatBatch

__all__ = ["DivergenceStats", "HostDivergence", "TOTALS", "EXTREMA", "ROW", "W_CLAMP"]

W_CLAMP = 80.0
"""Importance weights are exp(min(d, 80)): finite for any diff, as in the Loops SDK."""

TOTALS = (
    "n_datums",
    "n_scored_datums",  # datums with at least one action token
    "n_action_tokens",
    "n_skipped_nonfinite",
    "n_trainer_zero",  # action tokens whose trainer logprob is exactly 0.0
    "sum_d",
    "sum_d2",
    "sum_w",
    "sum_w2",
    "sum_k3",
    "sum_sampler",
    "n_abs_gt_1",
    "n_abs_gt_2",
    "n_abs_gt_4",
    "n_w_gt_2",
    "n_w_lt_half",
    "sum_seq_mean_d",
    "sum_seq_w",
)
EXTREMA = ("max_abs_d", "max_w", "neg_min_w", "max_seq_w")
_T = {name: i for i, name in enumerate(TOTALS)}

CONTEXT_BEFORE = 40
CONTEXT_AFTER = 20


class ROW:
    """Columns of a worst-token row (all float64; token ids are exact below 2**53)."""

    ABS, DIFF, SAMPLER, TRAINER, DATUM, POSITION, TOKEN = range(7)
    BEFORE = slice(7, 7 + CONTEXT_BEFORE)  # model_input ids before position k+1, NO_TOKEN-padded on the left
    AFTER = slice(7 + CONTEXT_BEFORE, 7 + CONTEXT_BEFORE + CONTEXT_AFTER)  # ids after it
    WIDTH = 7 + CONTEXT_BEFORE + CONTEXT_AFTER


@dataclass(frozen=True)
class HostDivergence:
    """Statistics on the host: named totals and extrema, worst rows, and the kept diffs in order."""

    totals: dict[str, float]
    extrema: dict[str, float]
    worst: np.ndarray  # [rows, ROW.WIDTH], most divergent first, empty rows removed
    diffs: np.ndarray  # float64, the sampled diffs in batch order


@dataclass(frozen=True)
class DivergenceStats:
    """Divergence statistics of one or more batches; see the module docstring."""

    totals: torch.Tensor  # float64 [len(TOTALS)]
    extrema: torch.Tensor  # float64 [len(EXTREMA)], -inf when there are no tokens
    worst: torch.Tensor  # float64 [top_n, ROW.WIDTH]; rows with ABS = -inf are empty
    sample_values: torch.Tensor  # float64 [m] diffs
    sample_keys: torch.Tensor  # float64 [m]; +inf marks an empty slot
    sample_size: int | None = None

    @classmethod
    def from_batch(
        cls,
        flat: FlatBatch,
        *,
        top_n: int = 0,
        sample_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> DivergenceStats:
        """Read one flattened batch. ``top_n`` rows need ``flat`` built ``with_tokens`` for ids."""
        if top_n < 0:
            raise ValueError(f"top_n must be >= 0, got {top_n}")
        if sample_size is not None and sample_size < 1:
            raise ValueError(f"sample_size must be >= 1 or None, got {sample_size}")
        # On the CPU, select the action tokens (cheaper passes, no sync cost); on accelerators
        # keep fixed shapes and mask instead, so nothing waits for the device.
        if flat.device.type == "cpu":
            where = flat.active.nonzero().squeeze(1)
            valid = None
        else:
            where = None
            valid = flat.active
        pick = (lambda x: x) if where is None else (lambda x: x.index_select(0, where))
        zero_invalid = (lambda x, fill=0.0: x) if valid is None else (lambda x, fill=0.0: x.masked_fill(~valid, fill))

        sampler = zero_invalid(pick(flat.sampler))
        trainer = zero_invalid(pick(flat.trainer))
        d = trainer - sampler
        abs_d = d.abs()
        w = zero_invalid(torch.exp(d.clamp(max=W_CLAMP)))
        k3 = zero_invalid(w - 1.0 - d)
        ones = torch.ones_like(d) if valid is None else valid.to(torch.float64)
        datum = pick(flat.datum)

        n_datums = flat.n_datums
        seq_sum = torch.zeros(n_datums, dtype=torch.float64, device=d.device).index_add_(0, datum, d)
        seq_count = torch.zeros(n_datums, dtype=torch.float64, device=d.device).index_add_(0, datum, ones)
        scored = seq_count > 0
        seq_mean = seq_sum / seq_count.clamp(min=1.0)
        seq_w = torch.exp(seq_mean.clamp(max=W_CLAMP)).masked_fill(~scored, 0.0)
        is_valid = ones > 0

        def count(condition: torch.Tensor) -> torch.Tensor:
            return torch.count_nonzero(condition if valid is None else condition & valid)

        totals = torch.stack(
            [
                torch.tensor(float(n_datums), dtype=torch.float64, device=d.device),
                torch.count_nonzero(scored),
                ones.sum(),
                torch.count_nonzero(flat.counted & ~flat.active),
                count(trainer == 0.0),
                d.sum(),
                (d * d).sum(),
                w.sum(),
                (w * w).sum(),
                k3.sum(),
                sampler.sum(),
                count(abs_d > 1.0),
                count(abs_d > 2.0),
                count(abs_d > 4.0),
                count(w > 2.0),
                count(w < 0.5),
                seq_mean.masked_fill(~scored, 0.0).sum(),
                seq_w.sum(),
            ]
        ).to(torch.float64)
        neg_inf = float("-inf")
        extrema = torch.stack(
            [
                _max_or(zero_invalid(abs_d, neg_inf), neg_inf),
                _max_or(zero_invalid(w, neg_inf), neg_inf),
                _max_or(zero_invalid(-w, neg_inf), neg_inf),
                _max_or(seq_w.masked_fill(~scored, neg_inf), neg_inf),
            ]
        )
        ranked = abs_d if valid is None else abs_d.masked_fill(~valid, neg_inf)
        flat_index = torch.arange(d.shape[0], device=d.device) if where is None else where
        worst = _worst_rows(flat, ranked, d, sampler, trainer, flat_index, top_n)
        keys = _sample_keys(is_valid, sample_size, generator)
        return cls(totals, extrema, worst, d, keys, sample_size)._capped()

    def merge(self, later: DivergenceStats) -> DivergenceStats:
        """Statistics of this batch followed by ``later`` (datum indices of ``later`` shift)."""
        shifted = later.worst.clone()
        shifted[:, ROW.DATUM] += self.totals[_T["n_datums"]]
        top_n = max(self.worst.shape[0], later.worst.shape[0])
        return DivergenceStats(
            totals=self.totals + later.totals,
            extrema=torch.maximum(self.extrema, later.extrema),
            worst=_rank_rows(torch.cat([self.worst, shifted]), top_n),
            sample_values=torch.cat([self.sample_values, later.sample_values]),
            sample_keys=torch.cat([self.sample_keys, later.sample_keys]),
            sample_size=self.sample_size,
        )._capped()

    def all_gather(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> DivergenceStats:
        """Statistics of every rank's batches, rank 0's first; ``gather`` returns ``[world, ...]``.

        Every rank must call it (it is a collective); each gets the same result.
        """
        size = self.sample_keys.shape[0] if self.sample_size is not None else None
        if size is None:  # the sample is not capped: ranks hold different lengths, pad to the longest
            size = int(gather(torch.tensor([self.sample_keys.shape[0]], device=self.totals.device)).max())
        pad = size - self.sample_keys.shape[0]
        values = torch.nn.functional.pad(self.sample_values, (0, pad))
        keys = torch.nn.functional.pad(self.sample_keys, (0, pad), value=float("inf"))
        parts = zip(gather(self.totals), gather(self.extrema), gather(self.worst), gather(values), gather(keys))
        merged: DivergenceStats | None = None
        for totals, extrema, worst, part_values, part_keys in parts:
            part = DivergenceStats(totals, extrema, worst, part_values, part_keys, self.sample_size)
            merged = part if merged is None else merged.merge(part)
        assert merged is not None
        return merged

    def to_host(self) -> HostDivergence:
        """Everything on the host, in one device-to-host transfer."""
        pieces = [self.totals, self.extrema, self.worst.reshape(-1), self.sample_values, self.sample_keys]
        packed = torch.cat([p.to(torch.float64) for p in pieces]).cpu().numpy()
        sizes = np.cumsum([p.numel() for p in pieces])[:-1]
        totals, extrema, worst, values, keys = np.split(packed, sizes)
        worst = worst.reshape(-1, ROW.WIDTH)
        return HostDivergence(
            totals=dict(zip(TOTALS, totals.tolist())),
            extrema=dict(zip(EXTREMA, extrema.tolist())),
            worst=worst[worst[:, ROW.ABS] > float("-inf")],
            diffs=values[keys < np.inf],
        )

    def _capped(self) -> DivergenceStats:
        """Keep the ``sample_size`` smallest keys, in batch order (no-op when uncapped or small)."""
        if self.sample_size is None or self.sample_keys.shape[0] <= self.sample_size:
            return self
        keep = torch.topk(self.sample_keys, self.sample_size, largest=False, sorted=False).indices.sort().values
        return DivergenceStats(
            self.totals,
            self.extrema,
            self.worst,
            self.sample_values.index_select(0, keep),
            self.sample_keys.index_select(0, keep),
            self.sample_size,
        )


def _max_or(values: torch.Tensor, empty: float) -> torch.Tensor:
    if values.numel() == 0:
        return torch.tensor(empty, dtype=torch.float64, device=values.device)
    return values.max()


def _sample_keys(valid: torch.Tensor, sample_size: int | None, generator: torch.Generator | None) -> torch.Tensor:
    if sample_size is None:
        keys = torch.zeros(valid.shape, dtype=torch.float64, device=valid.device)
    else:
        keys = torch.rand(valid.shape, dtype=torch.float64, device=valid.device, generator=generator)
    return keys.masked_fill(~valid, float("inf"))


def _worst_rows(
    flat: FlatBatch,
    ranked: torch.Tensor,
    d: torch.Tensor,
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    flat_index: torch.Tensor,
    top_n: int,
) -> torch.Tensor:
    """The ``top_n`` largest |d| (ties: earliest token first) as ``ROW`` rows, context included."""
    device = d.device
    k = min(top_n, ranked.shape[0])
    rows = torch.full((top_n, ROW.WIDTH), float(NO_TOKEN), dtype=torch.float64, device=device)
    rows[:, ROW.ABS] = float("-inf")
    if k == 0:
        return rows
    # Exact, stable top-k without a host sync: everything above the k-th value, then the
    # earliest of the values equal to it.
    threshold = torch.topk(ranked, k, sorted=False).values.min()
    above = ranked > threshold
    tied = ranked == threshold
    take = above | (tied & (torch.cumsum(tied, 0) <= k - above.sum()))
    chosen = torch.topk(take.to(torch.float32), k, sorted=False).indices.sort().values

    index = flat_index.index_select(0, chosen)
    datum = flat.datum.index_select(0, index)
    position = index - flat.row_starts.index_select(0, datum)
    length = flat.row_lengths.index_select(0, datum)
    picked = rows[:k]
    picked[:, ROW.ABS] = ranked.index_select(0, chosen)
    picked[:, ROW.DIFF] = d.index_select(0, chosen)
    picked[:, ROW.SAMPLER] = sampler.index_select(0, chosen)
    picked[:, ROW.TRAINER] = trainer.index_select(0, chosen)
    picked[:, ROW.DATUM] = datum.to(torch.float64)
    picked[:, ROW.POSITION] = position.to(torch.float64)
    if flat.input_ids is not None and flat.target_tokens is not None:
        centre = position + 1  # the token predicted at position k sits at k + 1 of model_input
        start = flat.row_starts.index_select(0, datum)
        next_token = _tokens_at(flat.input_ids, start, centre, length)
        target = flat.target_tokens.index_select(0, index)
        picked[:, ROW.TOKEN] = torch.where(target != NO_TOKEN, target, next_token).to(torch.float64)
        before = centre[:, None] + torch.arange(-CONTEXT_BEFORE, 0, device=device)
        after = centre[:, None] + torch.arange(1, CONTEXT_AFTER + 1, device=device)
        picked[:, ROW.BEFORE] = _tokens_at(flat.input_ids, start[:, None], before, length[:, None]).to(torch.float64)
        picked[:, ROW.AFTER] = _tokens_at(flat.input_ids, start[:, None], after, length[:, None]).to(torch.float64)
    return _rank_rows(rows, top_n)


def _tokens_at(
    input_ids: torch.Tensor, start: torch.Tensor, position: torch.Tensor, length: torch.Tensor
) -> torch.Tensor:
    """``model_input[position]`` of each row, ``NO_TOKEN`` outside ``[0, length)``."""
    inside = (position >= 0) & (position < length)
    flat = (start + position.clamp(min=0)).clamp(max=max(input_ids.shape[0] - 1, 0))
    if input_ids.shape[0] == 0:
        return torch.full(position.shape, NO_TOKEN, dtype=torch.int64, device=position.device)
    return torch.where(inside, input_ids[flat], torch.full_like(flat, NO_TOKEN))


def _rank_rows(rows: torch.Tensor, top_n: int) -> torch.Tensor:
    """Rows ordered by |d| descending, then datum, then position; the first ``top_n``."""
    order = torch.sort(rows[:, ROW.POSITION], stable=True).indices
    order = order[torch.sort(rows[order, ROW.DATUM], stable=True).indices]
    order = order[torch.sort(rows[order, ROW.ABS], descending=True, stable=True).indices]
    return rows[order[:top_n]]
