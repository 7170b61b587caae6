"""The metric formulas: host-side statistics in, the Loops-named metrics dict out.

This is the one place each formula lives; the plain functions and the Lightning callback both
call ``scalar_metrics``. With n action tokens (mask > 0, advantage != 0 where advantages are
given, both logprobs finite), d = trainer − sampler logprob, w = exp(min(d, 80)) the importance
ratio e^d (``is_ratio`` in the code; the SDK's worst-tokens column calls it ``is_weight``) and
s = sampler logprob, each key (after the prefix, default ``optim/train-sample-div/``) is:

==============================  ====================================================================
``kl_sample_train_v1_loops``    −mean(d)
``kl_sample_train_v2_loops``    ½·mean(d²)
``kl_sample_train_k3``          mean(w − 1 − d)
``is_ratio_mean``               mean(w)
``ess_fraction``                (Σw)² / (n·Σw²), 0 when the denominator is 0
``diff_mean``                   mean(d)
``diff_abs_p50/p90/p99``        percentiles of |d| (numpy's linear method)
``diff_abs_max``                max |d|
``frac_abs_gt_1/2/4``           share of tokens with |d| > 1, 2, 4
``entropy``                     −mean(s)
``n_action_tokens``             n
``is_ratio_max``, ``_min``      max w, min w
``chi2_token``                  mean(w²) − 1
``seq_log_ratio_mean``          mean over datums with action tokens of the datum's mean d
``seq_is_ratio_mean``           mean over those datums of exp(min(mean d, 80))
``seq_is_ratio_max``            max over those datums of exp(min(mean d, 80))
``frac_is_ratio_gt_2``          share of tokens with w > 2
``frac_is_ratio_lt_0.5``        share of tokens with w < 0.5
``n_sequences``                 datums in the batch
``n_skipped_nonfinite``         masked-in positions dropped for a None/NaN/inf logprob
==============================  ====================================================================

The first 15 are the Loops SDK's keys and formulas; the rest are this package's (all in
``SCALAR_METRICS``, in this order). With no action tokens only ``n_action_tokens`` (0.0) and the two counts are
returned.

With the trainer's entropy H and varentropy V at each position (``training_entropy`` and
``training_varentropy``, from ``token_logprobs(with_entropy=True)``), over the masked-in positions
whatever their advantage, the check of what was sampled adds (``SAMPLING_METRICS``):

==============================  ====================================================================
``sampling_z``                  Σ(t + H) / √ΣV: about standard normal when the tokens were drawn from
                                the trainer's distribution; > 0 drawn sharper (T < 1, top-p, top-k),
                                < 0 flatter
``sampling_z_trimmed``          the same without the one token that moved the sum furthest its way: a
                                shift of the whole distribution survives it, one unlikely draw does not
``sampling_bias``               mean(t + H), nats per token
``sampling_relative_bias``      Σ(t + H) / ΣH
``sampling_temperature``        1 − Σ(t + H) / ΣV: the sampling temperature that would leave this bias
                                (first order in T − 1; about 1 for an honest sampler)
==============================  ====================================================================

Positions whose H or V no distribution has (NaN, ±inf, negative) are left out of the sums, and said
(``guard_rail.impossible_inputs``); with ΣV = 0 and Σ(t + H) ≠ 0 the three ratios are NaN, never infinite.

Examples:
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import HostDivergence
    >>> host = HostDivergence(totals={"n_action_tokens": 0.0, "n_datums": 2.0, "n_skipped_nonfinite": 1.0},
    ...                       extrema={})
    >>> scalar_metrics(host, prefix="div/")
    {'div/n_action_tokens': 0.0, 'div/n_sequences': 2.0, 'div/n_skipped_nonfinite': 1.0}
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from loops_callbacks.divergence.statistics import HostDivergence, StratumSums
from loops_callbacks.divergence.sums import IS_RATIO_CLAMP

DEFAULT_PREFIX = "optim/train-sample-div/"

SCALAR_METRICS = (
    # the Loops SDK's keys, in its order
    "kl_sample_train_v1_loops", "kl_sample_train_v2_loops", "kl_sample_train_k3", "is_ratio_mean", "ess_fraction",
    "diff_mean", "diff_abs_p50", "diff_abs_p90", "diff_abs_p99", "diff_abs_max", "frac_abs_gt_1", "frac_abs_gt_2",
    "frac_abs_gt_4", "entropy", "n_action_tokens",
    # the keys this package adds beside them
    "is_ratio_max", "is_ratio_min", "chi2_token", "seq_log_ratio_mean", "seq_is_ratio_mean", "seq_is_ratio_max",
    "frac_is_ratio_gt_2", "frac_is_ratio_lt_0.5", "n_sequences", "n_skipped_nonfinite",
)
"""Every scalar key (after the prefix) a step with action tokens logs."""

SAMPLING_METRICS = (
    "sampling_z", "sampling_z_trimmed", "sampling_bias", "sampling_relative_bias", "sampling_temperature"
)
"""The keys of the check of what was sampled, logged when the trainer's entropy and varentropy are given."""

STRATUM_METRICS = ("k3", "abs_d_mean", "is_ratio_mean", "n_tokens")
"""The scalars logged per stratum with tokens: ``stratum/<name>/<metric>``."""


def scalar_metrics(host: HostDivergence, *, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """The scalar metrics of the module docstring; with no action tokens only ``n_action_tokens`` (0.0)
    and the two counts. Problems with the inputs are for the caller to report
    (``loops_callbacks.divergence.guard_rail.impossible_inputs``)."""
    t, e = host.totals, host.extrema
    n = t["n_action_tokens"]
    counts = {"n_sequences": t["n_datums"], "n_skipped_nonfinite": t["n_skipped_nonfinite"]}
    if n == 0:
        return {prefix + "n_action_tokens": 0.0, **{prefix + k: v for k, v in counts.items()}}
    # numpy's linear method, partitioning the fresh |d| array in place (no second copy of the diffs)
    abs_percentiles = np.percentile(np.abs(host.diffs), (50, 90, 99), overwrite_input=True).tolist()
    ess_denominator = n * t["sum_is_ratio2"]
    with_actions = t["n_datums_with_actions"]
    values = {
        "kl_sample_train_v1_loops": -t["sum_d"] / n,
        "kl_sample_train_v2_loops": 0.5 * t["sum_d2"] / n,
        "kl_sample_train_k3": kl_sample_train_k3(t),
        "is_ratio_mean": is_ratio_mean(t),
        "ess_fraction": t["sum_is_ratio"] ** 2 / ess_denominator if ess_denominator != 0 else 0.0,
        "diff_mean": t["sum_d"] / n,
        **dict(zip(("diff_abs_p50", "diff_abs_p90", "diff_abs_p99"), abs_percentiles)),
        "diff_abs_max": max(e["max_d"], e["neg_min_d"]),
        "frac_abs_gt_1": t["n_abs_gt_1"] / n,
        "frac_abs_gt_2": t["n_abs_gt_2"] / n,
        "frac_abs_gt_4": t["n_abs_gt_4"] / n,
        "entropy": -t["sum_sampler"] / n,
        "n_action_tokens": float(n),
        "is_ratio_max": is_ratio(e["max_d"]),  # exp is monotone: the weight of the largest diff
        "is_ratio_min": is_ratio(-e["neg_min_d"]),
        "chi2_token": t["sum_is_ratio2"] / n - 1.0,
        "seq_log_ratio_mean": t["sum_seq_mean_d"] / with_actions,
        "seq_is_ratio_mean": t["sum_seq_is_ratio"] / with_actions,
        "seq_is_ratio_max": is_ratio(e["max_seq_mean_d"]),
        "frac_is_ratio_gt_2": t["n_is_ratio_gt_2"] / n,
        "frac_is_ratio_lt_0.5": t["n_is_ratio_lt_half"] / n,
        **counts,
        **sampling_metrics(t, e),
    }
    return {prefix + name: float(value) for name, value in values.items()}


def sampling_metrics(totals: Mapping[str, float], extrema: Mapping[str, float]) -> dict[str, float]:
    """The check of what was sampled (module docstring), or ``{}`` without the trainer's entropies.

    Example (tokens drawn sharper than the trainer's distribution: their logprobs above -H; the one token
    furthest above, 0.5 nats, left out of ``sampling_z_trimmed``):
        >>> sums = {"n_sampling_tokens": 100.0, "sum_sampling_gap": 20.0, "sum_sampling_entropy": 150.0,
        ...         "sum_sampling_varentropy": 64.0}
        >>> extrema = {"max_sampling_gap": 0.5, "neg_min_sampling_gap": 3.0}
        >>> metrics = sampling_metrics(sums, extrema)
        >>> [round(metrics[name], 3) for name in ("sampling_z", "sampling_z_trimmed", "sampling_temperature")]
        [2.5, 2.438, 0.688]
    """
    n = totals.get("n_sampling_tokens", 0.0)
    if not n > 0:
        return {}
    gap, entropy, varentropy = (totals[f"sum_sampling_{name}"] for name in ("gap", "entropy", "varentropy"))
    # the one token that moved the sum furthest its way: a draw a heavy tail allows must not decide alone
    extreme = extrema["max_sampling_gap"] if gap > 0 else -extrema["neg_min_sampling_gap"] if gap < 0 else 0.0
    if varentropy > 0:
        z, temperature = gap / math.sqrt(varentropy), 1.0 - gap / varentropy
        trimmed = (gap - extreme) / math.sqrt(varentropy)
    else:  # no variance to scale by (every distribution uniform on its support, a point mass): drawn as described
        # only where each token's t is -H; otherwise not a number, never an infinite z (the entropies' check says why)
        z = trimmed = 0.0 if gap == 0 else math.nan
        temperature = 1.0 if gap == 0 else math.nan
    return {
        "sampling_z": z,
        "sampling_z_trimmed": trimmed,
        "sampling_bias": gap / n,
        "sampling_relative_bias": gap / entropy if entropy > 0 else math.nan,
        "sampling_temperature": temperature,
    }


def held_sampling_z(scalars: Mapping[str, float]) -> float:
    """The part of ``sampling_z`` that ``sampling_z_trimmed`` keeps: the smaller of the two when they agree in
    sign, 0 when leaving one token out turns it round, NaN without the check. What the diagnosis and the guard
    rail judge, so one unlikely token is never the whole case.

    Examples:
        >>> held_sampling_z({"sampling_z": -7.9, "sampling_z_trimmed": 0.4}), held_sampling_z({"sampling_z": 30.0,
        ...     "sampling_z_trimmed": 29.5})
        (0.0, 29.5)
    """
    z, trimmed = scalars.get("sampling_z", math.nan), scalars.get("sampling_z_trimmed", math.nan)
    if math.isnan(z) or math.isnan(trimmed):
        return z
    return math.copysign(min(abs(z), abs(trimmed)), z) if z * trimmed > 0 else 0.0


def kl_sample_train_k3(totals: Mapping[str, float]) -> float:
    """mean(e^d − 1 − d) over the action tokens (``totals`` has some); the diagnosis reads it too."""
    return totals["sum_k3"] / totals["n_action_tokens"]


def is_ratio_mean(totals: Mapping[str, float]) -> float:
    """mean(e^d), the trainer's mass on the sampler's support; ``totals`` has action tokens."""
    return totals["sum_is_ratio"] / totals["n_action_tokens"]


def is_ratio(d: float) -> float:
    """The importance ratio exp(min(d, 80)) of one diff; finite for any d."""
    return math.exp(min(d, IS_RATIO_CLAMP))


def histogram_values(diffs: np.ndarray, max_tokens: int) -> np.ndarray:
    """``diffs`` evenly subsampled to at most ``max_tokens`` values (``<= 0``: no cap).

    Value i of m is ``diffs[round(i * (n - 1) / (m - 1))]``, as in the Loops SDK.

    Examples:
        >>> histogram_values(np.arange(10.0), 4).tolist()
        [0.0, 3.0, 6.0, 9.0]
    """
    n = diffs.shape[0]
    if max_tokens <= 0 or n <= max_tokens:
        return diffs
    if max_tokens == 1:
        return diffs[:1]
    index = np.round(np.arange(max_tokens, dtype=np.float64) * (n - 1) / (max_tokens - 1)).astype(np.int64)
    return diffs[index]


def stratum_scalars(strata: Mapping[str, StratumSums]) -> dict[str, float]:
    """``stratum/<name>/<metric>`` (``STRATUM_METRICS``) for every stratum with tokens, without prefix.

    Examples:
        >>> scalars = stratum_scalars({"pos_q1": StratumSums(2.0, 0.1, 1.0, 2.0), "pos_q2": StratumSums(0, 0, 0, 0)})
        >>> list(scalars)[:2], scalars["stratum/pos_q1/k3"]
        (['stratum/pos_q1/k3', 'stratum/pos_q1/abs_d_mean'], 0.05)
    """
    return {f"stratum/{name}/{metric}": float(getattr(stratum, metric))
            for name, stratum in strata.items() if stratum.n_tokens for metric in STRATUM_METRICS}
