"""The guard rail: judging one logged step, and what its inputs make impossible to trust.

A logged step *exceeds* when the watched metric is above ``max_kl``, and also when the step cannot
be trusted — the guard rail treats what it cannot judge as unsafe:

* more than ``max_nonfinite_fraction`` of the masked-in action tokens had a missing, NaN or
  infinite logprob (all of them: the metrics are missing altogether);
* the watched metric is NaN or infinite, or negative where it cannot be (every metric but
  ``kl_sample_train_v1_loops``, ``diff_mean``, ``seq_log_ratio_mean`` and ``chi2_token``);
* a logprob is below ``LOGPROB_FLOOR`` (-1e4): a sentinel such as ``torch.finfo(float32).min``,
  whose diff overflows every formula;
* the sampling engine says its weights are unknown (``SamplerFacts.weights_unknown``: a weight push
  into it failed part way);
* the inputs are impossible (``impossible_inputs``, each also one warning per run): a logprob of -inf
  or +inf on an action token (a sampled token of probability 0 or above 1), one above 0 beyond
  ``LOGPROB_ROUNDING``, trainer logprobs all exactly 0.0, an entropy or varentropy that is NaN,
  infinite or negative, or that the token's own logprob rules out; or ``sampling_z`` is not a number
  (no varentropy to scale by where the tokens' logprobs are not -entropy).

With ``max_sampling_z`` (off by default) a step also exceeds when |``sampling_z``| is above it with
and without its most extreme token (``metrics.held_sampling_z``): the tokens were drawn from another
distribution than the trainer's, which the logprobs alone cannot show (``metrics.sampling_metrics``;
needs the trainer's entropies in the batch).

A step without masked-in action tokens is not judged (nothing to compare); the monitor warns when
every logged step of a run is like that.

Examples:
    >>> totals = {"n_action_tokens": 0.0, "n_skipped_nonfinite": 64.0}
    >>> host = HostDivergence(totals, {})
    >>> rail = GuardRail(max_kl=0.05)
    >>> rail.untrusted({"n_action_tokens": 0.0}, host)
    '64 of 64 action tokens had a non-finite logprob (None, NaN or inf), more than max_nonfinite_fraction = 0.01'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.divergence.batch import LOGPROB_FLOOR
from loops_callbacks.divergence.statistics import SCALAR_METRICS, held_sampling_z
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.validation import check, check_choice, check_int, check_real

SIGNED_METRICS = frozenset({"kl_sample_train_v1_loops", "diff_mean", "seq_log_ratio_mean", "chi2_token"})
"""Metrics that may be negative; every other scalar metric is >= 0 on valid logprobs."""


class SampleTrainDivergenceError(RuntimeError):
    """Raised by ``KLSampleTrainMonitor(on_exceed="raise")`` when a logged step exceeds the guard rail."""


def watchable_metric(kl_metric: str, prefix: str) -> str:
    """The bare name of ``kl_metric`` (a bare name or a prefixed key); ``ValueError`` for any other name.

    Examples:
        >>> watchable_metric("div/kl_sample_train_k3", "div/")
        'kl_sample_train_k3'
        >>> watchable_metric("kl_k3", "div/")
        Traceback (most recent call last):
        ...
        ValueError: kl_metric='kl_k3' is not a metric the monitor logs; use one of ['kl_sample_train_v1_loops', ...
    """
    name = kl_metric.removeprefix(prefix) if prefix else kl_metric
    if name not in SCALAR_METRICS:
        which = f"prefix {prefix!r}" if prefix else "monitor's prefix"
        raise ValueError(
            f"kl_metric={kl_metric!r} is not a metric the monitor logs; use one of {list(SCALAR_METRICS)} "
            f"(or the full key, with the {which})"
        )
    return name


@dataclass(frozen=True)
class GuardRail:
    """The guard rail's settings (``KLSampleTrainMonitor(guard_rail=...)``) and its judgement of a step.

    ``max_kl``: the bound on ``kl_metric`` (bare, ``"kl_sample_train_k3"``, or with the monitor's prefix);
    ``None``: no bound (untrusted steps are then still warned about, never acted on). ``patience``: logged
    steps in a row that exceed before acting. ``on_exceed``: ``"warn"``, ``"stop"`` (end training cleanly, as
    ``EarlyStopping`` does) or ``"raise"`` (``SampleTrainDivergenceError``). ``max_nonfinite_fraction``: a step
    whose masked-in action tokens had more than this share of missing, NaN or infinite logprobs exceeds.
    ``max_sampling_z``: a bound on |``sampling_z``|, the check of what was sampled (needs the trainer's
    entropies); ``None``: off. A step's scalars are judged by their bare names.
    """

    max_kl: float | None = None
    kl_metric: str = "kl_sample_train_k3"
    patience: int = 1
    on_exceed: Literal["warn", "stop", "raise"] = "stop"
    max_nonfinite_fraction: float = 0.01
    max_sampling_z: float | None = None

    def __post_init__(self) -> None:
        check("kl_metric", self.kl_metric, str, "a str")
        if not any(self.kl_metric.endswith(name) for name in SCALAR_METRICS):  # a prefix is the monitor's to check
            watchable_metric(self.kl_metric, "")
        check_int("patience", self.patience, least=1)
        check_choice("on_exceed", self.on_exceed, ("warn", "stop", "raise"))
        bounds = (("max_kl", math.inf, "a number >= 0"), ("max_nonfinite_fraction", 1.0, "a number in [0, 1]"),
                  ("max_sampling_z", math.inf, "a number >= 0"))
        for name, most, what in bounds:  # numbers of any real type, kept as floats (None: no bound, but the fraction)
            value = check_real(name, getattr(self, name), least=0.0, most=most, what=what,
                               optional=name != "max_nonfinite_fraction")
            object.__setattr__(self, name, value)

    @property
    def judges(self) -> bool:
        """Whether any bound is set (else the guard rail never exceeds)."""
        return self.max_kl is not None or self.max_sampling_z is not None

    def untrusted(self, scalars: Mapping[str, float], host: HostDivergence,
                  facts: SamplerFacts | None = None) -> str | None:
        """Why this step's numbers cannot be trusted, or ``None`` when they can (or there is nothing); ``facts``,
        what the sampling engine says of itself, may say that its weights are unknown."""
        n, skipped = host.totals["n_action_tokens"], host.totals["n_skipped_nonfinite"]
        masked_in = n + skipped
        if masked_in == 0:
            return None
        if facts is not None and facts.weights_unknown:
            return ("the sampling engine's weights are unknown (a weight push into it failed part way): its logprobs "
                    "are of no known policy")
        if skipped / masked_in > self.max_nonfinite_fraction or n == 0:
            return "; ".join([
                f"{skipped:.0f} of {masked_in:.0f} action tokens had a non-finite logprob (None, NaN or inf), "
                f"more than max_nonfinite_fraction = {self.max_nonfinite_fraction:g}",
                *_infinite_problems(host.totals).values()])
        problems = impossible_inputs(host)
        sentinel = _sentinel(host)
        value = scalars[self.kl_metric]
        if not math.isfinite(value) or (value < 0 and self.kl_metric not in SIGNED_METRICS):
            impossible = f"{self.kl_metric} cannot be {'negative' if math.isfinite(value) else value}"
            why = sentinel or _positive(host) or impossible
            return f"{self.kl_metric} = {value:.3g}: {why}"
        # what no sampled token's logprobs, entropies or check can be (a sentinel said first, as itself)
        reasons = [sentinel, *(text for key, text in problems.items() if not key.endswith("_below_floor"))]
        return "; ".join(reason for reason in reasons if reason) or None

    def exceeds(self, scalars: Mapping[str, float], host: HostDivergence, *, prefix: str = "",
                facts: SamplerFacts | None = None) -> str | None:
        """Why this step exceeds the guard rail, or ``None``; an untrusted step always exceeds.

        The message names the metric by its logged key, ``prefix + kl_metric``.
        """
        if not self.judges:
            return None
        reason = self.untrusted(scalars, host, facts)
        if reason is not None:
            return f"the step cannot be trusted: {reason}"
        value = scalars.get(self.kl_metric)
        if self.max_kl is not None and value is not None and value > self.max_kl:
            return f"{prefix}{self.kl_metric} = {value:.6g} exceeded max_kl = {self.max_kl:g}"
        z = scalars.get("sampling_z")
        held = held_sampling_z(scalars) if z is not None else None  # one unlikely token does not stop a run
        if self.max_sampling_z is not None and held is not None and not abs(held) <= self.max_sampling_z:
            side = "sharper" if z > 0 else "flatter" if z < 0 else "unknown"
            return (
                f"{prefix}sampling_z = {z:.3g} ({held:.3g} without its most extreme token) exceeded max_sampling_z = "
                f"{self.max_sampling_z:g}: the tokens were drawn {side} than the trainer's distribution (effective "
                f"temperature {scalars.get('sampling_temperature', math.nan):.3g})"
            )
        return None


def impossible_inputs(host: HostDivergence) -> dict[str, str]:
    """Problems with the logprobs themselves, by a stable key (for warning once per run).

    Examples:
        >>> from loops_callbacks.divergence.statistics import MAIN
        >>> totals = {s.name: 0.0 for s in MAIN if s.reduction == "sum"} | {"n_action_tokens": 4.0, "n_sampler_above_zero": 3.0}
        >>> impossible_inputs(HostDivergence(totals, {"max_sampler": 0.9}))
        {'sampler_above_zero': '3 of 4 sampler logprobs are > 0 (largest 0.9): these look like probabilities, not logprobs'}
    """
    totals, extrema = host.totals, host.extrema
    n = totals["n_action_tokens"]
    found = {}
    if n > 0 and totals["n_trainer_zero"] == n:
        found["trainer_all_zero"] = (
            f"every one of the {n:.0f} action tokens' trainer logprobs is exactly 0.0: the loss probably "
            "emitted no per-token logprobs (are all advantages 0?); the divergence metrics are meaningless"
        )
    for side in ("sampler", "trainer"):
        above = totals[f"n_{side}_above_zero"]
        if above:
            found[f"{side}_above_zero"] = (
                f"{above:.0f} of {n:.0f} {side} logprobs are > 0 (largest {extrema[f'max_{side}']:.3g}): "
                "these look like probabilities, not logprobs"
            )
        below = totals[f"n_{side}_below_floor"]
        if below:
            found[f"{side}_below_floor"] = (
                f"{below:.0f} of {n:.0f} {side} logprobs are below {LOGPROB_FLOOR:g} "
                f"(smallest {-extrema[f'neg_min_{side}']:.3g}): these look like sentinel values, not logprobs"
            )
    return found | _infinite_problems(totals) | _entropy_problems(totals)


def _infinite_problems(totals: Mapping[str, float]) -> dict[str, str]:
    """The counted tokens with a logprob of -inf or +inf, by side, with what each means."""
    counted = totals["n_action_tokens"] + totals["n_skipped_nonfinite"]
    found = {}
    for side in ("sampler", "trainer"):
        for sign, what in (("neg", _ZERO_PROBABILITY[side]), ("pos", "a logprob is at most 0")):
            infinite = totals.get(f"n_{side}_{sign}_inf", 0.0)
            if infinite:
                found[f"{side}_{sign}_inf"] = (
                    f"{infinite:.0f} of {counted:.0f} action tokens have a {side} logprob of "
                    f"{'-' if sign == 'neg' else '+'}inf: {what}"
                )
    return found


_ZERO_PROBABILITY = {
    "trainer": "the trainer gives probability 0 to tokens the sampler drew, the strongest mismatch there is (check "
               "the tokenizer and vocabulary on both sides, and any logits mask, top-k or top-p in the trainer's "
               "forward)",
    "sampler": "the sampler reports probability 0 for tokens it drew (a logprob its top-k / top-p filtering set to "
               "-inf, or a placeholder: give None where a logprob is missing)",
}


def _entropy_problems(totals: Mapping[str, float]) -> dict[str, str]:
    """What the trainer's entropies hold that no distribution has, or that the tokens' own logprobs rule out, on
    the masked-in positions (``sums.sampling_positions``), by a stable key."""
    given = totals.get("n_sampling_given", 0.0)
    found = {}
    for field in ("entropy", "varentropy"):
        counts = {kind: totals.get(f"n_{field}_{kind}", 0.0) for kind in ("nan", "inf", "negative")}
        if sum(counts.values()):
            parts = ", ".join(f"{count:.0f} {'NaN' if kind == 'nan' else kind}" for kind, count in counts.items() if count)
            found[f"{field}_invalid"] = (
                f"'training_{field}' is impossible at {sum(counts.values()):.0f} of {given:.0f} masked-in positions "
                f"({parts}): a{'n' if field == 'entropy' else ''} {field} is a finite number >= 0; such positions are "
                "left out of the check of what was sampled"
            )
    if totals.get("n_sampling_tokens") and totals["sum_sampling_varentropy"] == 0 and totals["sum_sampling_gap"]:
        found["sampling_unscaled"] = (
            f"'training_varentropy' is 0 at every one of the {totals['n_sampling_tokens']:.0f} positions checked while "
            f"the sampled tokens' logprobs are not -'training_entropy' (they sum to {totals['sum_sampling_gap']:.3g} "
            "from it): no distribution has both, so sampling_z is not a number"
        )
    ruled_out = totals.get("n_sampling_ruled_out", 0.0)
    if ruled_out:
        found["sampling_ruled_out"] = (
            f"{ruled_out:.0f} of {given:.0f} masked-in positions have a trainer logprob t that their 'training_entropy' "
            "H and 'training_varentropy' V rule out (a token of probability e^t adds e^t (t + H)² to V, more than V "
            "there): the three must be of one distribution (token_logprobs(..., with_entropy=True) on the same "
            "logits, at temperature 1)"
        )
    return found


def _sentinel(host: HostDivergence) -> str | None:
    for side in ("sampler", "trainer"):
        if host.totals[f"n_{side}_below_floor"]:
            return f"a {side} logprob of {-host.extrema[f'neg_min_{side}']:.3g} looks like a sentinel"
    return None


def _positive(host: HostDivergence) -> str | None:
    for side in ("sampler", "trainer"):
        if host.totals[f"n_{side}_above_zero"]:
            return f"{side} logprobs up to {host.extrema[f'max_{side}']:.3g} are > 0: probabilities passed as logprobs?"
    return None

