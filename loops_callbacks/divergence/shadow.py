"""Shadow statistics of rollout corrections: what each listed correction would do to a batch, without applying it.

For a list of parsed corrections (``parse_corrections``) and one ``FlatBatch``, ``shadow_values``
gives mergeable sums, counts and maxima (0-d float64 tensors, by name); ``shadow_statistics`` declares
each name with its reduction (``states.State``: sums add, maxima take the max, minima are stored
negated), so micro-batches and ranks merge exactly; ``shadow_scalars`` turns merged values into
the logged scalars:

* ``correction/<name>/frac_tokens_masked``, ``frac_seqs_masked``: the share of action tokens
  (of sequences with at least one) the correction would drop;
* ``correction/<name>/frac_tokens_clipped``, ``frac_seqs_clipped``: the share a truncation would change;
* ``correction/<name>/ess_tokens``, ``ess_seqs``: the effective sample size (Σw)² / (n Σw²) of its
  weights, dropped tokens weighing 0; a sequence's weight is the mean of its tokens' weights;
* ``correction/<name>/mean_weight``;
* ``correction/raw/token_ratio_max`` / ``_min``, ``seq_ratio_max`` / ``_min`` (the product of a
  sequence's token ratios) and ``seq_geo_ratio_max`` / ``_min`` (its geometric mean): the raw
  ratios p_trainer / p_sampler before any truncation. Only action tokens count: padding never
  reads as a ratio of 0 (SkyRL's ``is_ratio_min`` does read 0 with padding; that is its bug).

The action tokens are those the main metrics count (``FlatBatch.active``). A token with a missing or
non-finite logprob is in none of these numbers, though it may decide its sequence's fate as ``correct_flat``
reads it (verl's rejection drops a sequence with one; TRL's and verl's IS leave it out of the sequence's ratio). Each correction is computed
by ``correct_flat`` (``correct_rows`` for sequence-level ones, without spreading each row's fate over
its tokens), the functions ``apply_correction`` uses: what is logged is what applying it would do.

Examples:
    >>> import torch
    >>> from loops_callbacks.divergence.flat_batch import flatten_padded
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

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from loops_callbacks.correction import Correction, parse_correction
from loops_callbacks.correction.compute import CorrectionInput, Segments, Weights, correct_flat, correct_rows
from loops_callbacks.divergence.flat_batch import FlatBatch
from loops_callbacks.divergence.states import State
from loops_callbacks.divergence.sums import max_and_negated_min


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

    ``advantages`` (one per datum, ``[B]``: ``per_datum.advantages``) is needed only by ``off_policy_mask``;
    NaN marks a datum whose advantages could not be read: its sequence is not kept, and counted with ``rank``
    (this process's) for ``no_advantage_message``. Nothing synchronizes with the device.
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
    """The logged scalars (module docstring) from merged totals and extrema, by statistic name.

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
