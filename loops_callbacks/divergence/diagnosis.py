"""Why do the sampler and the trainer disagree? A likely cause per logged step, with its evidence.

Each common cause leaves its own signature in the numbers the monitor already has
(``signatures``), so one host-side rule, applied to every logged step, names the likeliest:

=================  =========================================================  ======================
cause              signature (the rule, checked in this order)                 confidence grows with
=================  =========================================================  ======================
``unclear``        fewer than 64 action tokens (``dropout`` if observed)      (0)
``none``           d = 0 exactly on at least half the tokens (99% when both    share of d = 0
                   sides' logprobs came as 16-bit floats: rounded that
                   coarsely, they match on most tokens across a real gap)
``shift``          with ``alignment`` offsets: most rows vote for one offset  how far below 0.1
                   o != 0 and its gap ratio is < 0.1 (any size), or the
                   left-aligned test's ratio is < 0.1; else shift_ratio < 0.1
``stale``          per-lag numbers (``by_lag``): mean |d| grows with the      the growth
                   policy lag (>= 1.5x from the lowest to the highest lag)
``dropout``        observed: dropout with p > 0 live in the LightningModule   (1: an observation)
                   (``evidence``); beside the three causes above it is only
                   added to the message ("also seen")
``stale``          the run's history (``trend``): since k3 was last at the    the growth
                   floor, it has grown step after step (Spearman >= 0.5 over
                   >= 3 steps, the latest third >= 2x the earliest): weights
                   a few steps old look like a mild T, far out of date like
                   unrelated distributions; not when per-lag numbers show
                   every datum current or a gap flat across lags
``unrelated``      Pearson(t, s) < 0.3                                        how far below 0.3
``truncation``     under 2% of tokens with d > 0, mean e^d < 1 − 3 SE and     how few d > 0
                   the slope of t on s >= 0.95 (T < 1 has a slope of T)
``temperature``    Pearson >= 0.97 and |slope of t on s − 1| >= 0.15 (the     |slope − 1|, sign_split
                   slope estimates T, on flat distributions too), or
                   sign_split >= 0.9 (d of one sign on p > 0.5, the other on
                   p < 0.1)
``unclear``        context_fade >= 1.5 and its z >= 3: |d| on each datum's    (0)
                   first action tokens is 1.5x or more |d| on its later
                   ones of the same sampler probability, beyond noise; at
                   any gap size. A prompt difference (template, BOS, system
                   prompt) or a prefix / KV cache from older weights leaves
                   it, and so can an engine whose rounding grows with the
                   first tokens' logits: the message says so, no cause is
                   named, and precision or staleness is not
``precision``      k3 below the precision bound                               how far below the bound
``stale``          token identity explains d: token_eta2 >= 0.1, unless a     token_eta2
                   mild temperature could explain it too (Pearson >= 0.95,
                   the slope 0.1 or more from 1: training sharpens a policy
                   as a temperature would) or per-lag numbers are present
                   (they did not show the gap growing with the lag)
``unclear``        none of the above                                          (0)
=================  =========================================================  ======================

Before any of these, the monitor checks the inputs themselves (``guard_rail.impossible_inputs``):
logprobs above 1e-4 (probabilities?), below -1e4 (sentinels) or every trainer logprob exactly 0.0
make the step's cause ``impossible_inputs`` (confidence 1: a fact, not a hint), never a statistical
cause that such numbers would mimic (probabilities passed as logprobs look like truncation).

The precision bound is 1e-3 until ``Calibration`` has seen ``calibration_steps`` healthy logged
steps (diagnosed ``none`` or ``precision``), then 20 times their median k3 (never above 1e-3):
a step whose gap is well above the engine's own noise floor is not called precision. The other
thresholds are ratios or correlations that do not depend on the engine's noise.

A diagnosis is a hint with its evidence, not a certainty: the message names the numbers that
triggered it; ``unclear`` with its numbers is the answer when no signature fits cleanly (e.g.
token identity explains d but the slope says a temperature could too). Known confusions
(``benchmarks/bench_diagnosis.py``): a slight template change on completions too short for a
context fade (fewer than 9 action tokens), or one that does not fade, can look like precision or,
through token identity, like staleness; weights far out of date like a template error when the
run's history cannot show the gap growing (both make t and s unrelated); weights a few steps old
like a mild temperature (training sharpens the policy as a lower sampler temperature would).

A gap on the first tokens is read from where it sits, not its size: another first prompt token
can move the completion's logprobs no more than a bf16 sampler does (k3 about 1e-5 to 3e-4 on the
held-out GPT-2), but on the first action tokens of each datum about twice as much as on its later
ones, and so does a prompt KV cache from older weights. Such a step is not called precision or
stale; but it is not named a context difference either: an engine whose rounding grows with the
logits' size, where a completion's first tokens are more confident than its later ones, or top-k
under bf16 noise where they are flatter, leave the same fade (synthetic batches in
``tests/divergence/test_diagnosis_context.py``), so the step is ``unclear`` with the fade and
what to check. The comparison is made among tokens of the same sampler probability, which keeps
a temperature, a bf16 sampler or top-k that move less predictable first tokens more from
reading as a fade on the held-out GPT-2 (set 2 of ``benchmarks/heldout_faults.py``), and the
fade must stand 3 standard errors above noise.

Token identity is weak evidence at small gaps: on the tuning generator a bf16 sampler's rounding
noise alone gives token_eta2 of 0.05 at the median, 0.10 at the 90th percentile (up to 0.17), so the
threshold is 0.1, not 0.05 (stale recall there: 109 of 111 steps, against 110).

Staleness has three sources of evidence, strongest first: per-datum policy versions (``by_lag``),
the run's k3 trend, token identity. On the tuning generator (2 seeds x 20 steps per setting) the
trend alone named 35 of 76 stale steps and token identity alone 76 of 76; on its other settings
27 and 46 of 70, together 53.

Example:
    >>> sig = {"frac_d_zero": 0.0, "shift_ratio": 3e-8, "shift_direction": 1.0, "pearson": 0.1}
    >>> found = diagnose(sig, n_tokens=900)
    >>> found.cause, round(found.confidence, 2)
    ('shift', 1.0)
    >>> print(found.message)
    likely cause: sampler logprobs are shifted by one position (shift ratio 3e-08); check the alignment of logprobs with target tokens (position k must hold the logprob of the token predicted at k; here the trainer's value at k matches the sampler's at k+1)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loops_callbacks.divergence.evidence import DirectEvidence
from loops_callbacks.divergence.metrics import SCALAR_METRICS

__all__ = ["CAUSES", "DROPOUT", "IMPOSSIBLE_INPUTS", "Calibration", "Diagnosis", "diagnose", "diagnosis_metrics"]

IMPOSSIBLE_INPUTS = "impossible_inputs"
"""The cause named when the inputs are not logprobs at all: no statistical cause is judged then."""
DROPOUT = "dropout"
"""The cause named when dropout is seen live in the trainer (``evidence``): an observation, not a guess."""
CAUSES = (
    IMPOSSIBLE_INPUTS, "none", DROPOUT, "shift", "unrelated", "truncation", "temperature", "precision", "stale",
    "unclear",
)
"""Every cause a step can be given, in the order they are checked (``unclear`` last)."""

MIN_TOKENS = 64
ZERO_SHARE = 0.5
ZERO_SHARE_16_BIT = 0.99
SHIFT_RATIO = 0.1
UNRELATED_PEARSON = 0.3
CONTEXT_FADE = 1.5
CONTEXT_Z = 3.0
TRUNCATION_POSITIVE_SHARE = 0.02
TRUNCATION_SE = 3.0
SIGN_SPLIT = 0.9
TEMPERATURE_PEARSON = 0.97
TEMPERATURE_SLOPE = 0.15
AMBIGUOUS_SLOPE = 0.1
TRUNCATION_MIN_SLOPE = 0.95
OFFSET_SHARE = 0.5
LAG_MIN_TOKENS = 32
LAG_GROWTH = 1.5
TREND_MIN_STEPS = 3
TREND_SPEARMAN = 0.5
TREND_GROWTH = 2.0
TREND_STEPS = 32
STALE_ETA2 = 0.1
PRECISION_MAX_K3 = 1e-3
CALIBRATION_FACTOR = 20.0

_WHAT = {
    IMPOSSIBLE_INPUTS: "the inputs are not valid logprobs",
    "none": "no mismatch",
    DROPOUT: "observed: the trainer's logprobs include dropout noise",
    "unrelated": "sampler and trainer score unrelated distributions",
    "truncation": "the sampler truncates (top-k / top-p) and reports renormalized logprobs",
    "temperature": "a temperature is applied on one side only",
    "stale": "the sampler's weights are out of date",
    "precision": "numerical precision (e.g. bf16 kernels)",
    "unclear": "unclear",
}
_CHECK = {
    IMPOSSIBLE_INPUTS: "fix the inputs first (position k must hold log p of the token predicted at k, a number "
    "<= 0); no other cause can be judged on them",
    "none": "",
    DROPOUT: "compute the trainer's logprobs without dropout (model.eval() for the scoring forward, or dropout 0 "
    "in the model's config, as TRL does for RL); the sampler never applies dropout",
    "unrelated": "check the chat template, BOS and special tokens and the tokenizer on both sides, and that the "
    "sampler loaded the trainer's weights at all",
    "truncation": "check that the sampler reports logprobs of the full distribution (not of the top-k / top-p "
    "renormalized one), or apply the same truncation in the trainer",
    "temperature": "check that the sampler's logprobs are at temperature 1, or divide the trainer's logits by the "
    "same temperature",
    "stale": "check that the sampler receives the trainer's weights every step (sync frequency, failed or "
    "partial weight loads)",
    "precision": "check the sampler's dtype and kernels; a gap at this level is usually harmless",
    "unclear": "no single cause's signature fits; look at the worst-tokens table",
}
_FADE_WHAT = "unclear: the gap sits on each completion's first tokens and fades after them"
_FADE_CHECK = (
    "a difference in the prompt both sides score (chat template, BOS and special tokens, system prompt) or a "
    "sampler's prefix / KV cache kept across a weight update leaves this; so can an engine whose rounding grows "
    "where the first tokens' logits are larger, so check the prompts and the cache first"
)


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of one logged step, how sure the rule is (0 to 1), and the numbers behind it.

    ``problems`` says what is impossible about the inputs (cause ``impossible_inputs`` only);
    ``observed`` what was seen directly about the trainer (``evidence.DirectEvidence.facts``) when
    it is the cause; ``also_seen`` the same facts beside another cause (live dropout that the numbers
    do not point to).
    """

    cause: str
    confidence: float
    evidence: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    observed: str = ""
    also_seen: str = ""

    @classmethod
    def impossible_inputs(cls, problems: Iterable[str]) -> Diagnosis:
        """The diagnosis of a step whose inputs are not logprobs (``guard_rail.impossible_inputs``' texts).

        Example:
            >>> print(Diagnosis.impossible_inputs(["3 of 4 sampler logprobs are > 0"]).message)
            likely cause: the inputs are not valid logprobs: 3 of 4 sampler logprobs are > 0; fix the inputs first (position k must hold log p of the token predicted at k, a number <= 0); no other cause can be judged on them
        """
        return cls(IMPOSSIBLE_INPUTS, 1.0, problems=tuple(problems))

    @property
    def is_observation(self) -> bool:
        """Whether the cause was seen directly (impossible inputs, live dropout), not inferred from statistics."""
        return self.cause in (IMPOSSIBLE_INPUTS, DROPOUT)

    @property
    def message(self) -> str:
        """One sentence for logs and the guard rail: the cause, its evidence, what to check."""
        if self.cause == "none":
            return f"no mismatch ({_format(self.evidence)})"
        if self.cause == IMPOSSIBLE_INPUTS:
            return f"likely cause: {_WHAT[self.cause]}: {'; '.join(self.problems)}; {_CHECK[self.cause]}"
        if self.cause == "shift":
            what, check = _shift_texts(self.evidence)
        elif self.cause == "unclear" and "context_fade" in self.evidence:
            what, check = _FADE_WHAT, _FADE_CHECK
        else:
            what, check = _WHAT[self.cause], _CHECK[self.cause]
        if self.cause == "temperature":
            what += f" (slope of trainer on sampler logprobs {self.evidence['temperature']:.2f})"
        if self.observed:
            what += f": {self.observed}"
        also = f"; also seen: {self.also_seen}" if self.also_seen else ""
        return f"likely cause: {what} ({_format(self.evidence)}); {check}{also}"


@dataclass
class Calibration:
    """The precision bound, learned from the first healthy logged steps of a run (module docstring),
    and the run's recent k3 (``trend``, oldest first) for the history rule of ``stale``."""

    calibration_steps: int = 5
    healthy_k3: list[float] = field(default_factory=list)
    recent_k3: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=TREND_STEPS))

    @property
    def precision_max_k3(self) -> float:
        if len(self.healthy_k3) < self.calibration_steps:
            return PRECISION_MAX_K3
        floor = statistics.median(self.healthy_k3)
        return min(PRECISION_MAX_K3, max(CALIBRATION_FACTOR * floor, 1e-9))

    @property
    def trend(self) -> tuple[float, ...]:
        """k3 of the last ``TREND_STEPS`` logged steps with a diagnosis, oldest first (``diagnose(trend=)``)."""
        return tuple(self.recent_k3)

    def observe(self, diagnosis: Diagnosis, k3: float) -> None:
        """Learn from a step: its k3 joins the trend; while calibrating, healthy steps set the floor."""
        if math.isfinite(k3):
            self.recent_k3.append(max(k3, 0.0))
        if len(self.healthy_k3) < self.calibration_steps and diagnosis.cause in ("none", "precision") and math.isfinite(k3):
            self.healthy_k3.append(max(k3, 0.0))


def diagnose(
    signatures: Mapping[str, float],
    *,
    n_tokens: float,
    precision_max_k3: float = PRECISION_MAX_K3,
    evidence: DirectEvidence | None = None,
    by_lag: Mapping[str, Any] | None = None,
    trend: Sequence[float] = (),
) -> Diagnosis:
    """The likely cause of a step with these ``signatures`` (``signatures.signature_numbers``).

    ``evidence`` is what was seen directly about the trainer (``evidence.observe_training``): live
    dropout is named, as an observation with confidence 1, before every cause but those whose
    signature nothing else leaves (no mismatch, an offset, a gap growing with the policy lag);
    beside those the facts are added to the message (``also seen``). ``by_lag`` is the step's divergence by policy
    lag (``HostDivergence.by_lag``: label -> sums with ``n_tokens`` and ``abs_d_mean``); ``trend``
    the k3 of the run's previous logged steps, oldest first (``Calibration.trend``).
    """
    sig = dict(signatures)

    def get(name: str) -> float:
        return sig.get(name, math.nan)

    dropout = evidence is not None and evidence.dropout_active
    seen = evidence.facts if dropout and evidence is not None else ""
    statistical = _statistical_cause(sig, n_tokens=n_tokens, precision_max_k3=precision_max_k3, by_lag=by_lag,
                                     trend=trend, dropout_seen=dropout)
    if statistical.cause == DROPOUT and evidence is not None:
        numbers = {"dropout_modules": float(evidence.dropout_modules), "dropout_p": evidence.max_dropout_p}
        numbers["k3"] = get("kl_sample_train_k3")
        return Diagnosis(DROPOUT, 1.0, numbers, observed=evidence.facts)
    return dataclasses.replace(statistical, also_seen=seen) if seen else statistical


def _statistical_cause(
    sig: Mapping[str, float],
    *,
    n_tokens: float,
    precision_max_k3: float,
    by_lag: Mapping[str, Any] | None,
    trend: Sequence[float],
    dropout_seen: bool,
) -> Diagnosis:
    """``diagnose``'s rules in order; ``DROPOUT`` (no numbers yet) where live dropout is the likeliest cause.

    Live dropout is named after the causes whose signature nothing else leaves (no mismatch, an
    offset, a gap that grows with the policy lag), so a dropout layer the logprobs never pass
    through (a value head) does not hide those. Its noise can be as small as a bf16 engine's (a
    small GPT-2 with dropout 0.1: k3 below 1e-3), so it is named whatever the gap's size: a dropout
    layer that is live but unused while the logprobs are computed reads as dropout.
    """

    def get(name: str) -> float:
        return sig.get(name, math.nan)

    def found(cause: str, margin: float, *names: str) -> Diagnosis:
        return Diagnosis(cause, _confidence(margin), {name: get(name) for name in names})

    if n_tokens < MIN_TOKENS:  # too few tokens for a statistical cause; an observation needs none
        too_few = Diagnosis("unclear", 0.0, {"n_action_tokens": float(n_tokens)})
        return Diagnosis(DROPOUT, 1.0) if dropout_seen else too_few
    # logprobs rounded to 16 bits on both sides match exactly on most tokens even across a real gap
    zero_share, sure_at = (ZERO_SHARE_16_BIT, 1.0) if get("both_16_bit_share") >= 0.5 else (ZERO_SHARE, 0.9)
    if get("frac_d_zero") >= zero_share:
        return found("none", (get("frac_d_zero") - zero_share) / (sure_at - zero_share), "frac_d_zero")
    offset = _offset(sig)
    if offset is not None:
        return offset
    lags = _lag_growth(by_lag)
    if lags is not None and lags["lag_growth"] >= LAG_GROWTH:
        return Diagnosis("stale", _confidence((lags["lag_growth"] - LAG_GROWTH) / LAG_GROWTH), lags)
    if dropout_seen:
        return Diagnosis(DROPOUT, 1.0)
    k3 = get("kl_sample_train_k3")
    # versions outrank history: every datum current, or a gap flat across lags, is not staleness
    versions_clear = _all_current(by_lag) or (lags is not None and lags["lag_growth"] < LAG_GROWTH)
    growing = None if versions_clear else _trend_growth([*trend, k3], floor=precision_max_k3)
    if growing is not None:  # weights a few steps old look like a mild temperature, far out of date like unrelated
        return Diagnosis("stale", _confidence((growing["k3_growth"] - TREND_GROWTH) / TREND_GROWTH), growing)
    if get("pearson") < UNRELATED_PEARSON:
        return found("unrelated", (UNRELATED_PEARSON - get("pearson")) / UNRELATED_PEARSON, "pearson")
    slope = get("temperature")
    if (
        get("frac_d_pos") < TRUNCATION_POSITIVE_SHARE
        and get("is_ratio_mean") < 1.0 - TRUNCATION_SE * get("is_ratio_se")
        and not slope < TRUNCATION_MIN_SLOPE
    ):
        margin = (TRUNCATION_POSITIVE_SHARE - get("frac_d_pos")) / TRUNCATION_POSITIVE_SHARE
        return found("truncation", margin, "frac_d_pos", "is_ratio_mean", "is_ratio_se", "temperature")
    pearson, off_one = get("pearson"), abs(slope - 1.0)
    if pearson >= TEMPERATURE_PEARSON and off_one >= TEMPERATURE_SLOPE:
        margin = (off_one - TEMPERATURE_SLOPE) / TEMPERATURE_SLOPE
        return found("temperature", margin, "temperature", "pearson", "sd_ratio")
    if get("sign_split") >= SIGN_SPLIT:
        return found("temperature", (get("sign_split") - SIGN_SPLIT) / (1 - SIGN_SPLIT), "sign_split", "temperature")
    # a gap on the first tokens, at any size: not precision or staleness, but not named either (module docstring)
    if get("context_fade") >= CONTEXT_FADE and get("context_fade_z") >= CONTEXT_Z:
        fade = ("context_fade", "context_fade_z", "kl_sample_train_k3")
        return Diagnosis("unclear", 0.0, {name: get(name) for name in fade})
    if k3 < precision_max_k3:
        margin = math.log10(precision_max_k3 / max(k3, 1e-300))
        evidence_numbers = {"k3": k3, "k3_bound": precision_max_k3, "token_eta2": get("token_eta2")}
        return Diagnosis("precision", _confidence(margin), evidence_numbers)
    unclear = {"k3": k3, "token_eta2": get("token_eta2"), "pearson": get("pearson"), "temperature": slope}
    if lags is not None:  # versions are known and the gap does not grow with the lag: not stale
        return Diagnosis("unclear", 0.0, unclear | lags)
    # a slope off 1 with t and s tightly related: a mild temperature, or weights a few steps old
    # (training sharpens the policy as a temperature would); the numbers cannot tell them apart
    temperature_like = pearson >= 0.95 and off_one >= AMBIGUOUS_SLOPE
    if get("token_eta2") >= STALE_ETA2 and not temperature_like:
        evidence_numbers = {"token_eta2": get("token_eta2"), "k3": k3}
        return Diagnosis("stale", _confidence((get("token_eta2") - STALE_ETA2) / 0.2), evidence_numbers)
    return Diagnosis("unclear", 0.0, unclear)


def _offset(sig: Mapping[str, float]) -> Diagnosis | None:
    """``shift`` from the alignment offsets when measured, else from the one-position shift ratio; None: aligned."""
    get = lambda name: sig.get(name, math.nan)  # noqa: E731
    left, share = get("left_aligned_ratio"), get("left_aligned_share")
    if left < SHIFT_RATIO and share >= OFFSET_SHARE:
        margin = math.log10(SHIFT_RATIO / max(left, 1e-300)) / 2
        return Diagnosis("shift", _confidence(margin), {"left_aligned_ratio": left, "left_aligned_share": share})
    if not math.isnan(get("offset")):
        ratio, offset = get("offset_ratio"), get("offset")
        if offset != 0 and get("offset_share") >= OFFSET_SHARE and ratio < SHIFT_RATIO:
            margin = math.log10(SHIFT_RATIO / max(ratio, 1e-300)) / 2
            numbers = {"shift_ratio": get("shift_ratio")} if abs(offset) == 1 else {}  # the one-position number
            numbers |= {"offset": offset, "offset_share": get("offset_share"), "offset_ratio": ratio}
            return Diagnosis("shift", _confidence(margin), numbers)
        return None
    if get("shift_ratio") < SHIFT_RATIO:
        margin = math.log10(SHIFT_RATIO / max(get("shift_ratio"), 1e-300)) / 2
        numbers = {"shift_ratio": get("shift_ratio"), "shift_direction": get("shift_direction")}
        return Diagnosis("shift", _confidence(margin), numbers)
    return None


def _lag_growth(by_lag: Mapping[str, Any] | None) -> dict[str, float] | None:
    """Mean |d| per lag bucket with enough tokens, and its growth from the lowest to the highest lag.

    None when fewer than two buckets have ``LAG_MIN_TOKENS`` tokens (nothing to compare).
    """
    if not by_lag:
        return None
    kept = [(label, stratum) for label, stratum in by_lag.items() if stratum.n_tokens >= LAG_MIN_TOKENS]
    if len(kept) < 2:
        return None
    means = [stratum.abs_d_mean for _, stratum in kept]
    growth = means[-1] / means[0] if means[0] > 0 else (math.inf if means[-1] > 0 else 1.0)
    rising = all(later >= 0.9 * earlier for earlier, later in zip(means, means[1:]))
    numbers = {f"abs_d_lag_{label}": mean for (label, _), mean in zip(kept, means)}
    numbers["lag_growth"] = growth if rising else min(growth, 1.0)
    return numbers


def _all_current(by_lag: Mapping[str, Any] | None) -> bool:
    """Whether the datums carried versions and every one with tokens was at lag 0."""
    if not by_lag:
        return False
    counted = [label for label, stratum in by_lag.items() if stratum.n_tokens > 0]
    return counted == ["0"]


def _trend_growth(series: Sequence[float], *, floor: float) -> dict[str, float] | None:
    """Evidence that k3 has grown step after step since it was last at ``floor`` (the last value is now)."""
    at_floor = [i for i, value in enumerate(series) if value <= floor]
    if not at_floor or at_floor[-1] == len(series) - 1:
        return None  # never in sync in the window, or in sync now
    since = list(series[at_floor[-1] + 1 :])
    if len(since) < TREND_MIN_STEPS:
        return None
    third = max(1, len(since) // 3)
    early, late = statistics.fmean(since[:third]), statistics.fmean(since[-third:])
    growth = late / early if early > 0 else math.inf
    rho = _spearman(since)
    if growth < TREND_GROWTH or rho < TREND_SPEARMAN:
        return None
    return {"k3": since[-1], "k3_steps_since_floor": float(len(since)), "k3_growth": growth, "k3_spearman": rho}


def _spearman(values: Sequence[float]) -> float:
    """Spearman's rank correlation of ``values`` with their order (ties ranked by position)."""
    n = len(values)
    ranks = [0.0] * n
    for rank, index in enumerate(sorted(range(n), key=lambda i: values[i])):
        ranks[index] = float(rank)
    mean = (n - 1) / 2
    spread = sum((i - mean) ** 2 for i in range(n))
    return sum((i - mean) * (r - mean) for i, r in enumerate(ranks)) / spread if spread else 0.0


def _shift_texts(evidence: Mapping[str, float]) -> tuple[str, str]:
    """What a shift is and what to check, with its size and direction."""
    if "left_aligned_ratio" in evidence:
        return (
            "completion-only sampler logprobs are left-aligned at position 0 instead of at the completion",
            "place the sampler's logprobs at the completion's positions (position k must hold the logprob of the "
            "token predicted at k; here the trainer's value at k matches the sampler's at k − the row's first "
            "action position)",
        )
    offset = int(round(evidence.get("offset", evidence.get("shift_direction", 1.0))))
    size = abs(offset)
    what = f"sampler logprobs are shifted by {'one position' if size == 1 else f'{size} positions'}"
    sign = "+" if offset > 0 else "−"
    check = (
        "check the alignment of logprobs with target tokens (position k must hold the logprob of the token "
        f"predicted at k; here the trainer's value at k matches the sampler's at k{sign}{size})"
    )
    return what, check


def diagnosis_metrics(diagnosis: Diagnosis, signatures: Mapping[str, float], *, prefix: str) -> dict[str, float]:
    """Scalars to log: ``diagnosis/<cause>`` (1.0 for the named cause, else 0), the confidence and the signatures.

    A signature that is also a scalar metric (``is_ratio_mean``, ``kl_sample_train_k3``) is left
    out: it is logged once, under the scalar's key.

    Example:
        >>> d = Diagnosis("stale", 0.75, {"token_eta2": 0.2})
        >>> m = diagnosis_metrics(d, {"temperature": 1.0}, prefix="div/")
        >>> m["div/diagnosis/stale"], m["div/diagnosis/none"], m["div/diagnosis/confidence"], m["div/signature/temperature"]
        (1.0, 0.0, 0.75, 1.0)
    """
    metrics = {f"{prefix}diagnosis/{cause}": float(cause == diagnosis.cause) for cause in CAUSES}
    metrics[f"{prefix}diagnosis/confidence"] = float(diagnosis.confidence)
    metrics.update(
        {f"{prefix}signature/{name}": float(value) for name, value in signatures.items() if name not in SCALAR_METRICS}
    )
    return metrics


def _confidence(margin: float) -> float:
    """0.5 at the threshold, growing with the margin (0 to 1 past it) to 1."""
    return 0.5 + 0.5 * min(max(margin, 0.0), 1.0) if math.isfinite(margin) else 0.5


def _format(evidence: Mapping[str, float]) -> str:
    shown = {name: value for name, value in evidence.items() if name not in ("shift_direction", "offset")}
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in shown.items())
