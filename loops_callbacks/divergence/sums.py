"""The formula of every statistic ``states`` declares, by its name, for one chunk of a ``FlatBatch``.

On the CPU the action tokens are selected first (fewer, cheaper passes; the formulas' ``active`` is then
``None``); on an accelerator every position is kept and ``active`` (``FlatBatch.active``) masks them, so
that no shape depends on the data and nothing waits for the device. With d = trainer - sampler logprob, e^d = exp(min(d, 80)) the importance ratio and
k3 = e^d - 1 - d. Everything is a sum, a count or an extremum, so chunks, micro-batches and ranks
merge by their reduction.

Examples:
    >>> from loops_callbacks.divergence.flat_batch import flatten_padded
    >>> from loops_callbacks.divergence.statistics import layout_of
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> values, worst, sample, sample_keys, groups = of_chunk(flat, layout_of(diagnose=False), 0, None, None)
    >>> float(values["sum_d"]), int(values["n_action_tokens"]), sample.tolist()
    (-0.5, 2, [-0.5, 0.0])
"""

from __future__ import annotations

import functools
import math
import operator
import numpy as np
import torch

from loops_callbacks.divergence.alignment import offset_sums
from loops_callbacks.divergence.flat_batch import LOGPROB_FLOOR, NO_TOKEN, FlatBatch
from loops_callbacks.divergence.prompts import prompt_values
from loops_callbacks.divergence.states import (
    GROUP_ROWS, LAG_STRATA, MASK_ROW, MAX_SERVERS, POSITION_STRATA, PROBABILITY_EDGES, PROBABILITY_STRATA, ROW,
    STRATUM_NAMES, TOKEN_BUCKETS, Layout, by_group, context_total, ranked_rows,
)
from loops_callbacks.validation import LOGPROB_ROUNDING

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


@torch.no_grad()
def of_chunk(
    flat: FlatBatch, layout: Layout, top_n: int, sample_size: int | None, generator: torch.Generator | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Every declared state's value by name (but the shadow statistics: ``shadow``), the ``top_n`` worst rows,
    the sampled diffs and their keys (``None``: all kept), and the groups' table (``None`` without groups or
    strata)."""
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
    if signatures or strata:  # each token's datum, rank among its datum's action tokens, probability bucket
        datum, rank_in_datum = _datums_and_ranks(flat.active, flat.row_lengths, row_counts, compact=compact)
        p_bucket = _probability_buckets(sampler)
    if signatures:
        values.update(_signature_sums(flat, d, abs_d, sampler, trainer, active))
        values.update(_context_sums(abs_d, rank_in_datum, p_bucket, active))
        values["token_sums"] = _token_sums(flat, d, active, compact)
        chunks = flat.datum_chunks(OFFSET_CHUNK_POSITIONS) if compact else [flat]
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
        values["strata"] = _strata_sums(d, abs_d, is_ratio, k3, datum, rank_in_datum, p_bucket, row_counts,
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
    """The diagnosis' sums and counts over the action tokens (``states.SIGNATURES``)."""
    s, t = sampler.to(torch.float64), trainer.to(torch.float64)
    negative, positive = d < 0, d > 0
    high, low = sampler > P_HIGH, sampler < P_LOW
    if active is not None:  # masked-out places hold s = 0 (p = 1): keep them out of the buckets
        high &= active
        low &= active
    d2 = d * d
    count, n_16_bit = torch.count_nonzero, torch.zeros((), device=d.device)
    if flat.sampler.dtype in _16_BIT and flat.trainer.dtype in _16_BIT:  # rounded to 16 bits, exact matches say less
        n_16_bit = count(active) if active is not None else torch.tensor(float(d.numel()), device=d.device)
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


def _context_sums(abs_d: torch.Tensor, rank: torch.Tensor, p_bucket: torch.Tensor, active: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
    """Tokens, |d| and d² on each datum's first ``FIRST_ACTIONS`` action tokens and on those from the
    ``LATER_ACTIONS_FROM``-th on, per sampler-probability bucket (``states.CONTEXT_KINDS``)."""
    buckets = len(PROBABILITY_STRATA)
    values = torch.stack([torch.ones_like(abs_d), abs_d, abs_d * abs_d])
    sums: dict[str, torch.Tensor] = {}
    for part, chosen in (("first", rank < FIRST_ACTIONS), ("later", rank >= LATER_ACTIONS_FROM)):
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
                 rank: torch.Tensor, p_bucket: torch.Tensor, row_counts: torch.Tensor, lags: torch.Tensor | None,
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
    quartile = rank.mul(4).div_(row_counts.index_select(0, datum).clamp_(min=1), rounding_mode="floor")
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


def _datums_and_ranks(active: torch.Tensor, row_lengths: torch.Tensor, row_counts: torch.Tensor, *, compact: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each place's datum and its rank among its datum's action tokens (0: the datum's first); the places are
    the action tokens alone (``compact``) or every position (then: the action tokens before it in its datum).

    Examples:
        >>> active = torch.tensor([False, True, True, True, False, True])
        >>> datum, rank = _datums_and_ranks(active, torch.tensor([4, 2]), torch.tensor([3, 1]), compact=True)
        >>> datum.tolist(), rank.tolist()
        ([0, 0, 0, 1], [0, 1, 2, 0])
    """
    device = active.device
    datum = torch.repeat_interleave(torch.arange(row_lengths.numel(), device=device), row_lengths,
                                    output_size=active.numel())
    if compact:
        datum = datum[active]
        first = torch.cumsum(row_counts, 0) - row_counts  # each datum's first action token
        return datum, torch.arange(datum.numel(), device=device).sub_(first.index_select(0, datum))
    rank = torch.cumsum(active, 0).sub_(active.to(torch.int64))  # action tokens before each place
    starts = (torch.cumsum(row_lengths, 0) - row_lengths).clamp(max=max(active.numel() - 1, 0))
    rank -= (rank.index_select(0, starts) if rank.numel() else starts).index_select(0, datum)
    return datum, rank


@functools.lru_cache(maxsize=None)
def _edges(device: torch.device) -> torch.Tensor:
    """The log ``PROBABILITY_EDGES`` on ``device``, made once per device, so that no step copies them from the host."""
    return torch.tensor([math.log(p) for p in PROBABILITY_EDGES], dtype=torch.float64, device=device)


def _probability_buckets(sampler: torch.Tensor) -> torch.Tensor:
    """Each sampler logprob's bucket of ``PROBABILITY_EDGES`` (0: p < 0.01, ..., 4: p >= 0.9), int64."""
    return torch.bucketize(sampler.to(torch.float64), _edges(sampler.device), right=True)


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
