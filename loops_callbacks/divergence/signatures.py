"""The signature numbers of a logged step, from its mergeable sums: what the diagnosis reads.

A *signature number* is one number of a step that a cause leaves its mark on (logged as
``signature/<name>``; each cause's pattern across them is in the docs' rules table). Two of them
need a word: the *context fade* (``context_fade``) is how many times larger the gap is on each
completion's first action tokens than on its later ones (a different prompt on the two sides
leaves it), and ``token_eta2`` is the share of the gap's variance that the token's identity
explains (stale weights leave it: each token's logit is off by its own amount).

With n action tokens, s = sampler logprob, t = trainer logprob, d = t − s, p = e^s:

======================  ============================================================================
``frac_d_zero``         share of tokens with d exactly 0 (most, for identical float32 models)
``frac_d_pos``          share with d > 0 (about 0 under top-k / top-p truncation)
``both_16_bit_share``   share whose sampler and trainer logprobs both came as 16-bit floats (exact matches say less)
``sampler_all_zero``    1 when every sampler logprob is exactly 0.0 (p = 1: a greedy sampler's truncated logprobs,
                        or logprobs never filled in), else 0
``is_ratio_mean``       mean e^d: the trainer's mass on the sampler's support (1 for full support)
``is_ratio_se``         its standard error, sqrt(var(e^d) / n)
``pearson``             Pearson correlation of t and s (about 0 for unrelated distributions)
``temperature``         slope of t regressed on s (about the sampler's temperature when only it has one)
``temperature_se``      its standard error, sqrt(var(t − slope·s) / (n var(s)))
``relative_gap``        mean d² / var(s): the gap relative to the spread of the sampler's logprobs. Rounding
                        noise scales with the logits, so this stays level while a model sharpens and k3 grows
                        (``diagnosis``' noise floor is calibrated on it)
``relative_gap_se``     its standard error, from the spread of d² (sqrt(var(d²) / n) / var(s))
``sign_split``          min of the shares of one sign of d on p > 0.5 and of the other on p < 0.1
``temperature_sign``    -1 when d < 0 on likely tokens (a sharper sampler, T < 1), +1 otherwise
``shift_ratio``         mean |t[k] − s[k±1]| / mean |t[k] − s[k]| over adjacent action tokens of a datum, the smaller side
``shift_direction``     +1 when s[k+1] matches t[k] better, -1 when s[k−1] does (the sampler's values are one position early / late)
``token_eta2``          share of d's variance explained by token id (hashed buckets), corrected for their number
``low_high_abs_ratio``  mean |d| on p < 0.1 over mean |d| on p > 0.5 (large for precision noise)
``rms_d``               sqrt(mean d²)
``kl_sample_train_k3``  mean(e^d − 1 − d)
``sd_ratio``            sd(t) / sd(s): about T under a one-sided temperature, about 1 for noise of either side
``context_fade``        mean |d| on each datum's first ``FIRST_ACTIONS`` (4) action tokens over mean |d| on its
                        action tokens from the ``LATER_ACTIONS_FROM``-th (8, 0-based) on, within each sampler-probability bucket (``states.PROBABILITY_EDGES``; their geometric
                        mean, NaN with fewer than 64 tokens compared): well above 1 when the two sides conditioned
                        on different prompts (template, BOS, a prefix cache from old weights), about 1 for noise,
                        temperature and truncation even where the first tokens are harder to predict
``context_fade_z``      the fade's log over its standard error (from the spread of |d| on each side): how far it is
                        from what noise alone gives (about 0)
``offset``              the offset most rows vote for (``alignment``; o > 0: t[k] matches s[k + o]), 0 when aligned
``offset_share``        the share of rows voting for it
``offset_ratio``        their mean squared gap at the offset over the gap at 0 (about 0: the offset explains d)
``left_aligned_ratio``  capped mean |t[k] − s[k − first]| / mean |t[k] − s[k]| (completion-only logprobs at 0)
``left_aligned_share``  share of rows (first action position > 0) whose vote is −first
``sampling_*``          the check of what was sampled (``metrics.sampling_metrics``), with the trainer's entropies
======================  ============================================================================

The last five need the step's ``alignment.offset_sums`` (``host.offset_sums``);
they are NaN without them.

``is_ratio_mean`` and ``kl_sample_train_k3`` are the scalar metrics of those names (one formula,
``metrics``); they are logged once, as scalars, not again as signatures.

A number is NaN when the step has too little of what it needs (no pairs, an empty bucket).

Examples:
    >>> from loops_callbacks.divergence.states import MAIN, SIGNATURES
    >>> totals = {s.name: 0.0 for s in MAIN + SIGNATURES if not s.shape} | {"n_action_tokens": 4.0,
    ...     "sum_is_ratio": 4.0, "sum_is_ratio2": 4.0, "sum_sampler": -4.0, "sum_trainer": -4.0, "sum_sampler2": 6.0,
    ...     "sum_trainer2": 6.0, "sum_sampler_trainer": 6.0}
    >>> sig = signature_numbers(HostDivergence(totals, {}))
    >>> sig["frac_d_zero"], sig["pearson"], sig["temperature"], sig["is_ratio_mean"]
    (1.0, 1.0, 1.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from loops_callbacks.divergence.alignment import read_offsets
from loops_callbacks.divergence.metrics import is_ratio_mean, kl_sample_train_k3, sampling_metrics
from loops_callbacks.divergence.states import LAG_EDGES, MAX_SERVERS, PROBABILITY_STRATA, context_total
from loops_callbacks.divergence.statistics import HostDivergence

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
    """The numbers of the module docstring (all NaN without action tokens)."""
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
    """The context fade and its z score (module docstring): per sampler-probability bucket the log
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
