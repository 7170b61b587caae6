"""Why do the sampler and the trainer disagree? A likely cause per logged step, with its evidence.

Each common cause leaves its own signature in the numbers the monitor already has
(``signatures``), so one host-side rule, applied to every logged step, names the likeliest.
The rules, in the order they are tried (d = trainer − sampler logprob; the full table, with what
each cause's numbers look like and where the thresholds come from, is in the docs):

1. ``unclear`` with fewer than 64 action tokens; ``none`` when d = 0 exactly on half the tokens
   (99% when both sides came as 16-bit floats) and the rest is within noise; ``shift`` when the
   logprobs match at an offset.
2. **The noise gate.** The gap is read relative to the spread of the sampler's logprobs,
   ``relative_gap`` = mean d² / var(s): rounding noise scales with the logits, so this stays level
   while a model sharpens and k3 grows 100-fold. A step whose relative gap is within the run's
   noise bound (its log above the bound's by less than 3 relative standard errors) is ``precision``
   — or ``unclear`` when the gap sits on the completions' first tokens — and no other cause is named:
   at that size none would help anyone; but where the versions show every datum behind the trainer
   and the gap is beyond 3x the calibrated floor itself, ``stale``.
3. Beyond noise: ``stale`` when the gap grows with the policy lag (per-datum ``policy_version``),
   when every datum is equally behind the trainer, or when the gap has grown step after step since it
   was last within noise (the run's history); then ``unrelated`` (Pearson < 0.3), ``truncation``,
   ``temperature`` (a slope of t on s at least 0.15 — 0.05 where the versions show every datum
   current — and 3 standard errors from 1, or a sign split that the slope agrees with), the first-token fade (``unclear``), and ``stale`` from token
   identity (bf16 rounding of the weights leaves it too: read once the run is calibrated, or
   before that above ``NOISE_CEILING``, a gap no engine's rounding is taken to reach).

**The noise floor** (``Calibration``). Before a run is calibrated the bound is the prior
``NOISE_PRIOR`` (1e-3; 1e-8 when the engine says its weights are float32 and the trainer computes
in full precision). The floor is the median relative gap of the run's latest healthy steps
(named ``none`` or ``precision``), and the bound ``NOISE_FACTOR`` (20) times it; it follows a floor
that drifts. A bf16 engine's healthy gap can sit above the prior: while not yet calibrated, an
``unclear`` step whose every number is rounding noise's (``noise_shaped``: a relative gap at most
1e-2, the slope within 0.05 of 1, no sign split, no first-token fade) calibrates too. What keeps a
fault present from step 0 out: every cause with a signature is tried first, the ceiling, and the
first floor is taken only from steps that agree within 10x (a gap growing from step 0 does not).

**Direct evidence** (``evidence``). Live dropout in the trainer is named as an observation
(confidence 1), before any statistical cause but ``none``; beside it (``Diagnosis.beyond``) what
dropout cannot explain — an offset, a gap growing with the lag or over the steps — is said too,
the observation first. Inputs that are not logprobs (``guard_rail.impossible_inputs``) are
``impossible_inputs`` before everything.

A diagnosis is a hint with its evidence, not a certainty: the message names the numbers that
triggered it, and ``unclear`` with its numbers is the answer when no signature fits cleanly.

Example:
    >>> sig = {"frac_d_zero": 0.0, "shift_ratio": 3e-8, "shift_direction": 1.0, "pearson": 0.1}
    >>> found = diagnose(sig, n_tokens=900)
    >>> found.cause, round(found.confidence, 2)
    ('shift', 1.0)
    >>> print(found.message)
    likely cause: sampler logprobs are shifted by one position (shift ratio 3e-08); check the alignment of logprobs with target tokens (position k must hold the logprob of the token predicted at k; here the trainer's value at k matches the sampler's at k+1)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loops_callbacks.divergence.evidence import DirectEvidence, SamplerFacts
from loops_callbacks.divergence.metrics import SAMPLING_METRICS, SCALAR_METRICS, held_sampling_z


IMPOSSIBLE_INPUTS = "impossible_inputs"
"""The cause named when the inputs are not logprobs at all: no statistical cause is judged then."""
DROPOUT = "dropout"
"""The cause named when dropout is seen live in the trainer (``evidence``): an observation, not a guess."""
SAMPLING = "sampling"
"""The cause named when the tokens were drawn from another distribution than the logprobs describe."""
PREFIX_CACHE = "prefix_cache"
"""The cause named when the engine says its prefix cache outlived a weight reload (``SamplerFacts``)."""
CAUSES = (
    IMPOSSIBLE_INPUTS, "none", DROPOUT, "shift", SAMPLING, PREFIX_CACHE, "unrelated", "truncation", "temperature",
    "precision", "stale", "unclear",
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
NOISE_PRIOR = 1e-3
"""The largest relative gap taken as rounding noise before the run is calibrated."""
NOISE_PRIOR_FULL_PRECISION = 1e-8
"""The same, when the engine says its weights are float32 or float64 and the trainer computes in full precision
(float32 rounding alone leaves relative gaps near 1e-13; an fp32 vLLM engine against a HF forward about 1e-10)."""
NOISE_FACTOR = 20.0
"""Once calibrated, a gap within this many times the run's noise floor is rounding noise."""
NOISE_MIN = 1e-9
"""The smallest noise bound (float32 rounding alone leaves relative gaps near 1e-13)."""
NOISE_SE = 3.0
"""A gap is beyond noise when its log exceeds the bound's by this many relative standard errors."""
NOISE_CEILING = 1e-2
"""No step with a larger relative gap is taken as rounding noise, calibrated or not."""
NOISE_SLOPE = 0.05
"""A step taken as noise has its slope of t on s this close to 1."""
CALIBRATION_SPREAD = 10.0
"""The steps of a first calibration agree within this factor."""
HEALTHY_STEPS = 16
"""The latest healthy steps whose median is the floor (it follows a floor that drifts as a model sharpens)."""
SLOPE_SE = 3.0
"""A temperature's slope is at least this many standard errors from 1."""
CURRENT_TEMPERATURE_SLOPE = 0.05
"""The slope's distance from 1 that names a temperature where the versions show every datum current."""
LAG_NOISE_FACTOR = 3.0
"""Where the versions show every datum behind, a gap beyond this many times the calibrated floor is staleness."""
SAMPLING_Z = 5.0
"""|sampling_z| from which the tokens are taken as drawn from another distribution (``metrics.sampling_metrics``)."""

_TEXTS = {  # cause: (what it is, what to check)
    IMPOSSIBLE_INPUTS: ("the inputs are not valid logprobs", "fix the inputs first (position k must hold log p of the "
                        "token predicted at k, a number <= 0); no other cause can be judged on them"),
    "none": ("no mismatch", ""),
    DROPOUT: ("observed: the trainer's logprobs include dropout noise", "compute the trainer's logprobs without dropout "
              "(model.eval() for the scoring forward, or dropout 0 in the model's config, as TRL does for RL); the "
              "sampler never applies dropout"),
    "unrelated": ("sampler and trainer score unrelated distributions", "check the chat template, BOS and special "
                  "tokens and the tokenizer on both sides, and that the sampler loaded the trainer's weights at all"),
    "truncation": ("the sampler truncates (top-k / top-p) and reports renormalized logprobs", "check that the "
                   "sampler reports logprobs of the full distribution (not of the top-k / top-p renormalized one), "
                   "or apply the same truncation in the trainer"),
    "temperature": ("a temperature is applied on one side only", "check that the sampler's logprobs are at "
                    "temperature 1, or divide the trainer's logits by the same temperature"),
    "stale": ("the sampler's weights are out of date", "check that the sampler receives the trainer's weights every "
              "step (sync frequency, failed or partial weight loads)"),
    "precision": ("numerical precision (e.g. bf16 kernels)", "check the sampler's dtype and kernels; a gap at this "
                  "level is usually harmless"),
    SAMPLING: ("the tokens were not drawn from the distribution the sampler's logprobs describe", "check the "
               "sampler's logprobs mode (vLLM: logprobs_mode='processed_logprobs') or the sampling settings: the "
               "importance ratio of every correction is not the behaviour policy's"),
    PREFIX_CACHE: ("the sampler's prefix cache holds KV computed with older weights", "reset the prefix cache after "
                   "every weight update (vLLM: llm.reset_prefix_cache()) or salt it per weight version"),
    "unclear": ("unclear", "no single cause's signature fits; look at the worst-tokens table"),
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
    it is the cause; ``beyond`` a finding that the observed dropout cannot explain (a gap that
    grows over the steps or with the policy lag, an offset), said after the observation.
    """

    cause: str
    confidence: float
    evidence: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    observed: str = ""
    beyond: Diagnosis | None = None

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
        """Whether the cause was seen directly (impossible inputs, live dropout, the engine's own account of its
        prefix cache or sampling settings), not inferred from statistics."""
        return self.cause in (IMPOSSIBLE_INPUTS, DROPOUT) or bool(self.observed)

    @property
    def label(self) -> str:
        """The cause, with the finding beyond it: ``"dropout + stale"`` (the run summary counts these)."""
        return f"{self.cause} + {self.beyond.cause}" if self.beyond is not None else self.cause

    @property
    def message(self) -> str:
        """One sentence for logs and the guard rail: the cause, its evidence, what to check."""
        if self.cause == "none":
            return f"no mismatch ({_format(self.evidence)})"
        if self.cause == IMPOSSIBLE_INPUTS:
            what, check = _TEXTS[self.cause]
            return f"likely cause: {what}: {'; '.join(self.problems)}; {check}"
        beyond = f"; and beyond what dropout explains: {self.beyond._finding}" if self.beyond is not None else ""
        return f"likely cause: {self._finding}{beyond}"

    @property
    def _finding(self) -> str:
        """The cause, its numbers and what to check."""
        if self.cause == "shift":
            what, check = _shift_texts(self.evidence)
        elif self.cause == "unclear" and "context_fade" in self.evidence:
            what, check = _FADE_WHAT, _FADE_CHECK
        else:
            what, check = _TEXTS[self.cause]
        if self.cause == "temperature":
            what += f" (slope of trainer on sampler logprobs {self.evidence['temperature']:.2f})"
        if self.cause == SAMPLING and math.isfinite(self.evidence.get("sampling_z", math.nan)):
            side = "sharper" if self.evidence["sampling_z"] > 0 else "flatter"
            temperature = self.evidence.get("sampling_temperature", math.nan)
            estimate = f": effective temperature ≈ {temperature:.1f}" if 0.2 <= temperature <= 5.0 else ""
            what += f" (drawn {side}{estimate})"
        if self.observed:
            what += f": {self.observed}"
        numbers = f" ({_format(self.evidence)})" if self.evidence else ""
        return f"{what}{numbers}; {check}"


@dataclass
class Calibration:
    """What the monitor learns over a run for the diagnosis: the run's rounding-noise floor and its
    recent gaps (module docstring, "The noise floor").

    ``healthy_gaps`` holds the relative gaps (``signatures``' ``relative_gap``) of the latest
    ``HEALTHY_STEPS`` steps taken as healthy; the floor is their median once ``calibration_steps``
    of them agree. ``recent_gaps`` holds the last ``TREND_STEPS`` relative gaps (the history rule).
    Every field is plain data: the monitor's checkpoint state is these fields.

    Example:
        >>> calibration = Calibration(calibration_steps=2)
        >>> calibration.noise_bound  # the prior, until calibrated
        0.001
        >>> for gap in (2e-5, 3e-5):
        ...     calibration.observe(Diagnosis("precision", 0.9), {"relative_gap": gap})
        >>> calibration.noise_bound
        0.0005
    """

    calibration_steps: int = 5
    healthy_gaps: list[float] = field(default_factory=list)
    recent_gaps: list[float] = field(default_factory=list)

    @property
    def calibrated(self) -> bool:
        """Whether the floor is known (never, with ``calibration_steps=0``: the prior bound then holds)."""
        return self.calibration_steps > 0 and len(self.healthy_gaps) >= self.calibration_steps

    @property
    def noise_floor(self) -> float | None:
        """The median relative gap of the healthy steps; ``None`` until calibrated."""
        return statistics.median(self.healthy_gaps) if self.calibrated else None

    @property
    def noise_bound(self) -> float:
        """The largest relative gap taken as rounding noise: ``NOISE_FACTOR`` x the floor, the prior before."""
        floor = self.noise_floor
        return NOISE_PRIOR if floor is None else max(NOISE_FACTOR * floor, NOISE_MIN)

    def observe(self, diagnosis: Diagnosis, signatures: Mapping[str, float]) -> None:
        """Learn from a step: its relative gap joins the history; a healthy one sets the floor.

        A step is healthy when named ``none`` or ``precision``; while the run is not calibrated yet,
        also an ``unclear`` step whose every signature is rounding noise's (``noise_shaped``): a bf16
        engine's floor can sit above the prior. The first floor is taken only from steps that agree
        (the largest within ``CALIBRATION_SPREAD`` x the smallest): a gap growing from step 0 does not.
        """
        gap = signatures.get("relative_gap", math.nan)
        if not math.isfinite(gap):
            return
        self.recent_gaps = [*self.recent_gaps, gap][-TREND_STEPS:]
        healthy = diagnosis.cause in ("none", "precision") or (
            not self.calibrated and diagnosis.cause == "unclear" and noise_shaped(signatures)
        )
        if not healthy:
            return
        gaps = [*self.healthy_gaps, gap][-HEALTHY_STEPS:]
        if len(self.healthy_gaps) < self.calibration_steps:  # not calibrated: keep the latest steps that agree
            while len(gaps) > 1 and max(gaps) > CALIBRATION_SPREAD * max(min(gaps), NOISE_MIN / NOISE_FACTOR):
                gaps = gaps[1:]
        self.healthy_gaps = gaps


def noise_shaped(signatures: Mapping[str, float]) -> bool:
    """Whether a step's numbers are what rounding noise leaves: a relative gap at most ``NOISE_CEILING``,
    the slope of t on s within ``NOISE_SLOPE`` of 1, no sign split, no gap on the first tokens.

    Example:
        >>> noise_shaped({"relative_gap": 2e-3, "temperature": 0.999, "sign_split": 0.3})
        True
        >>> noise_shaped({"relative_gap": 2e-3, "temperature": 0.9, "sign_split": 0.3})  # a mild temperature
        False
    """
    get = lambda name: signatures.get(name, math.nan)  # noqa: E731
    return (
        get("relative_gap") <= NOISE_CEILING
        and abs(get("temperature") - 1.0) <= NOISE_SLOPE
        and not get("sign_split") >= SIGN_SPLIT
        and not (get("context_fade") >= CONTEXT_FADE and get("context_fade_z") >= CONTEXT_Z)
    )


def diagnose(
    signatures: Mapping[str, float],
    *,
    n_tokens: float,
    noise_floor: float | None = None,
    evidence: DirectEvidence | None = None,
    facts: SamplerFacts | None = None,
    by_lag: Mapping[str, Any] | None = None,
    trend: Sequence[float] = (),
) -> Diagnosis:
    """The likely cause of a step with these ``signatures`` (``signatures.signature_numbers``).

    ``noise_floor`` is the run's calibrated relative gap (``Calibration.noise_floor``; ``None``
    before calibration: the prior bound, and token identity is not read). ``evidence`` is what was
    seen directly about the trainer (``evidence.observe_training``): live dropout is named as an
    observation with confidence 1, and beside it (``beyond``) what dropout cannot explain: an
    offset, a gap growing with the policy lag or over the steps. ``facts`` is what the sampling engine
    says about itself (``evidence.SamplerFacts``): raw logprobs reported while sampling at another
    temperature or truncated, and a prefix cache kept across a weight reload, are named from it.
    ``by_lag`` is the step's divergence
    by policy lag (``HostDivergence.by_lag``: label -> sums with ``n_tokens`` and ``abs_d_mean``);
    ``trend`` the relative gaps of the run's previous logged steps, oldest first
    (``Calibration.recent_gaps``).
    """
    sig = dict(signatures)
    full_precision = (
        facts is not None and facts.dtype in ("float32", "float64")
        and not (evidence is not None and evidence.reduced_precision)
    )
    prior = NOISE_PRIOR_FULL_PRECISION if full_precision else NOISE_PRIOR
    bound = prior if noise_floor is None else max(NOISE_FACTOR * noise_floor, NOISE_MIN)
    lag_bound = bound if noise_floor is None else max(LAG_NOISE_FACTOR * noise_floor, NOISE_MIN)
    context = {
        "noise_bound": bound, "lag_bound": lag_bound, "calibrated": noise_floor is not None, "facts": facts,
        "by_lag": by_lag, "trend": trend,
    }
    statistical = _statistical_cause(sig, n_tokens=n_tokens, **context)
    if evidence is None or not evidence.dropout_active or statistical.cause == "none":
        return statistical  # no mismatch: live dropout does not reach these logprobs
    numbers = {"dropout_modules": float(evidence.dropout_modules), "dropout_p": evidence.max_dropout_p}
    numbers["k3"] = sig.get("kl_sample_train_k3", math.nan)
    beyond = _beyond_dropout(sig, n_tokens=n_tokens, **context)
    return Diagnosis(DROPOUT, 1.0, numbers, observed=evidence.facts, beyond=beyond)


def _beyond_dropout(
    sig: Mapping[str, float], *, n_tokens: float, noise_bound: float, by_lag: Mapping[str, Any] | None,
    trend: Sequence[float], **_: Any,
) -> Diagnosis | None:
    """What live dropout cannot explain: an offset, a gap growing with the policy lag or over the steps."""
    if n_tokens < MIN_TOKENS:
        return None
    offset = _offset(sig)
    if offset is not None or not _beyond_noise(sig, noise_bound):
        return offset
    lags = _lag_growth(by_lag)
    if lags is not None and lags["lag_growth"] >= LAG_GROWTH:
        return Diagnosis("stale", _confidence((lags["lag_growth"] - LAG_GROWTH) / LAG_GROWTH), lags)
    return _growing(sig, by_lag, lags, trend, noise_bound, since_floor=False)


def _beyond_noise(sig: Mapping[str, float], noise_bound: float) -> bool:
    """Whether the relative gap exceeds ``noise_bound`` beyond its error: log(gap / bound) above ``NOISE_SE``
    relative standard errors (the gap's own error scaled to the bound, so a heavy-tailed step far above the
    bound is still beyond it); an unknown gap: yes."""
    gap, gap_se = sig.get("relative_gap", math.nan), sig.get("relative_gap_se", math.nan)
    if math.isnan(gap):
        return True
    if gap <= noise_bound:
        return False
    relative_se = gap_se / gap if math.isfinite(gap_se) and gap > 0 else 0.0
    return math.log(gap / noise_bound) > NOISE_SE * relative_se


def _growing(
    sig: Mapping[str, float], by_lag: Mapping[str, Any] | None, lags: dict[str, float] | None,
    trend: Sequence[float], noise_bound: float, *, since_floor: bool = True,
) -> Diagnosis | None:
    """``stale`` when the relative gap has grown step after step (``_trend_growth``), unless the versions
    show every datum current or a gap flat across lags (versions outrank history). ``since_floor``: only
    since it was last at the noise bound (beside live dropout, whose noise lifts it off: over the window)."""
    if _common_lag(by_lag) == 0 or (lags is not None and lags["lag_growth"] < LAG_GROWTH):
        return None
    series = [*trend, sig.get("relative_gap", math.nan)]
    growing = _trend_growth(series, floor=noise_bound if since_floor else -math.inf, from_start=not since_floor)
    if growing is None:
        return None
    return Diagnosis("stale", _confidence((growing["gap_growth"] - TREND_GROWTH) / TREND_GROWTH), growing)


def _statistical_cause(
    sig: Mapping[str, float],
    *,
    n_tokens: float,
    noise_bound: float,
    lag_bound: float,
    calibrated: bool,
    facts: SamplerFacts | None,
    by_lag: Mapping[str, Any] | None,
    trend: Sequence[float],
) -> Diagnosis:
    """``diagnose``'s rules in order (module docstring), on the numbers and the engine's facts."""

    def get(name: str) -> float:
        return sig.get(name, math.nan)

    def found(cause: str, margin: float, *names: str) -> Diagnosis:
        return Diagnosis(cause, _confidence(margin), {name: get(name) for name in names})

    if n_tokens < MIN_TOKENS:
        return Diagnosis("unclear", 0.0, {"n_action_tokens": float(n_tokens)})
    # logprobs rounded to 16 bits on both sides match exactly on most tokens even across a real gap
    zero_share, sure_at = (ZERO_SHARE_16_BIT, 1.0) if get("both_16_bit_share") >= 0.5 else (ZERO_SHARE, 0.9)
    sampling = _sampling(sig, facts)  # named only where the logprobs agree: were the tokens drawn from them?
    if sampling is not None and not sampling.observed and facts is not None and facts.stale_prefix_cache:
        # KV from older weights: the draws came from another distribution, as the engine itself says
        sampling = Diagnosis(PREFIX_CACHE, 1.0, dict(sampling.evidence), observed=_PREFIX_CACHE_SEEN)
    within_noise = not _beyond_noise(sig, noise_bound)
    # most tokens exactly equal and the rest within noise (a collapsed policy matches exactly where p = 1)
    if get("frac_d_zero") >= zero_share and within_noise:
        return sampling or found("none", (get("frac_d_zero") - zero_share) / (sure_at - zero_share), "frac_d_zero")
    offset = _offset(sig)
    if offset is not None:
        return offset
    gap = get("relative_gap")
    noise = {"relative_gap": gap, "noise_bound": noise_bound, "k3": get("kl_sample_train_k3")}
    behind = _common_lag(by_lag)
    if within_noise:  # within rounding noise: precision, unless something more direct says otherwise
        # every datum behind the trainer and the gap beyond the floor itself: staleness a bf16 floor would hide
        if behind and _beyond_noise(sig, lag_bound):
            return Diagnosis("stale", _confidence(math.log10(gap / lag_bound) / 2), {"lag": float(behind)} | noise)
        if sampling is not None:
            return sampling
        if get("context_fade") >= CONTEXT_FADE and get("context_fade_z") >= CONTEXT_Z:
            return Diagnosis("unclear", 0.0, {name: get(name) for name in ("context_fade", "context_fade_z")} | noise)
        return Diagnosis("precision", _confidence(math.log10(noise_bound / max(gap, 1e-300))), noise)
    if facts is not None and facts.stale_prefix_cache:  # the engine says so: a fact beside a gap beyond noise
        return Diagnosis(PREFIX_CACHE, 1.0, noise, observed=_PREFIX_CACHE_SEEN)
    lags = _lag_growth(by_lag)
    if lags is not None and lags["lag_growth"] >= LAG_GROWTH:
        return Diagnosis("stale", _confidence((lags["lag_growth"] - LAG_GROWTH) / LAG_GROWTH), lags)
    if behind:  # every datum equally behind the trainer, and a gap beyond noise
        return Diagnosis("stale", _confidence(math.log10(gap / noise_bound) / 2), {"lag": float(behind)} | noise)
    # weights a few steps old look like a mild temperature, far out of date like unrelated distributions
    growing = _growing(sig, by_lag, lags, trend, noise_bound)
    if growing is not None:
        return growing
    if get("pearson") < UNRELATED_PEARSON:
        return found("unrelated", (UNRELATED_PEARSON - get("pearson")) / UNRELATED_PEARSON, "pearson")
    slope, slope_se = get("temperature"), get("temperature_se")
    slope_se = slope_se if math.isfinite(slope_se) else 0.0
    if (
        get("frac_d_pos") < TRUNCATION_POSITIVE_SHARE
        and get("is_ratio_mean") < 1.0 - TRUNCATION_SE * get("is_ratio_se")
        and not slope < TRUNCATION_MIN_SLOPE
    ):
        margin = (TRUNCATION_POSITIVE_SHARE - get("frac_d_pos")) / TRUNCATION_POSITIVE_SHARE
        return found("truncation", margin, "frac_d_pos", "is_ratio_mean", "is_ratio_se", "temperature")
    pearson, off_one = get("pearson"), abs(slope - 1.0)
    significant = off_one >= SLOPE_SE * slope_se  # a slope within its error of 1 is not a temperature
    # the margin kept against weights a few steps old (a sharpening policy moves the slope too) is not needed
    # where the versions show every datum current
    margin = CURRENT_TEMPERATURE_SLOPE if behind == 0 else TEMPERATURE_SLOPE
    if pearson >= TEMPERATURE_PEARSON and off_one >= margin and significant:
        return found("temperature", (off_one - margin) / margin, "temperature", "temperature_se", "pearson", "sd_ratio")
    # d of one sign on likely tokens and the other on unlikely ones, with the slope off 1 the same way
    agrees = significant and (slope < 1.0) == (get("temperature_sign") < 0)
    if get("sign_split") >= SIGN_SPLIT and agrees:
        margin = (get("sign_split") - SIGN_SPLIT) / (1 - SIGN_SPLIT)
        return found("temperature", margin, "sign_split", "temperature", "temperature_se")
    # a gap on the first tokens, at any size: not precision or staleness, but not named either (module docstring)
    if get("context_fade") >= CONTEXT_FADE and get("context_fade_z") >= CONTEXT_Z:
        return Diagnosis("unclear", 0.0, {name: get(name) for name in ("context_fade", "context_fade_z")} | noise)
    unclear = noise | {"token_eta2": get("token_eta2"), "pearson": pearson, "temperature": slope}
    if lags is not None or behind == 0:  # versions are known and do not show staleness
        return Diagnosis("unclear", 0.0, unclear | (lags or {}))
    # a slope off 1 with t and s tightly related: a mild temperature, or weights a few steps old
    # (training sharpens the policy as a temperature would); the numbers cannot tell them apart
    temperature_like = pearson >= 0.95 and off_one >= AMBIGUOUS_SLOPE
    # token identity: bf16 rounding of the weights leaves it too, so it is read only beyond a calibrated floor,
    # or, before the run is calibrated, above the gap no engine's rounding is taken to reach
    identity_readable = calibrated or gap > NOISE_CEILING
    if identity_readable and get("token_eta2") >= STALE_ETA2 and not temperature_like:
        evidence_numbers = {"token_eta2": get("token_eta2")} | noise
        return Diagnosis("stale", _confidence((get("token_eta2") - STALE_ETA2) / 0.2), evidence_numbers)
    return Diagnosis("unclear", 0.0, unclear)


_PREFIX_CACHE_SEEN = "its weights were reloaded after its prefix cache was last reset (the engine's own account)"


def _sampling(sig: Mapping[str, float], facts: SamplerFacts | None) -> Diagnosis | None:
    """``sampling`` when the tokens were drawn from another distribution than the logprobs describe: |z| of
    what was sampled at least ``SAMPLING_Z`` with and without its most extreme token (``held_sampling_z``), or
    the engine says it reports raw logprobs while it samples at another temperature or truncated (then an
    observation); None otherwise."""
    z = held_sampling_z(sig)
    names = ("sampling_z", "sampling_z_trimmed", "sampling_relative_bias", "sampling_temperature")
    numbers = {name: sig.get(name, math.nan) for name in names}
    said = facts is not None and facts.samples_other_than_reported
    if not (abs(z) >= SAMPLING_Z or said):
        return None
    observed = _sampling_settings(facts) if said and facts is not None else ""
    confidence = 1.0 if said else _confidence((abs(z) - SAMPLING_Z) / SAMPLING_Z)
    return Diagnosis(SAMPLING, confidence, {k: v for k, v in numbers.items() if not math.isnan(v)}, observed=observed)


def _sampling_settings(facts: SamplerFacts) -> str:
    settings = [f"temperature {facts.temperature:g}" if facts.temperature not in (None, 1.0) else "",
                f"top-p {facts.top_p:g}" if facts.top_p is not None and facts.top_p < 1.0 else "",
                f"top-k {facts.top_k}" if facts.top_k is not None and facts.top_k > 0 else ""]
    engine = f"the {facts.engine} engine" if facts.engine else "the engine"
    return f"{engine} reports {facts.logprobs_mode} while sampling with {', '.join(filter(None, settings))}"


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


def _common_lag(by_lag: Mapping[str, Any] | None) -> int | None:
    """The lag every datum with tokens had, when they all were in one lag bucket (``"4-7"`` reads 4,
    ``"8+"`` 8); else None."""
    if not by_lag:
        return None
    counted = [label for label, stratum in by_lag.items() if stratum.n_tokens > 0]
    return int(counted[0].split("-")[0].rstrip("+")) if len(counted) == 1 else None


def _trend_growth(series: Sequence[float], *, floor: float, from_start: bool = False) -> dict[str, float] | None:
    """Evidence that the relative gap has grown step after step since it was last at ``floor`` (with
    ``from_start``, since the window began when it never was); the last value is now."""
    at_floor = [i for i, value in enumerate(series) if value <= floor]
    if (at_floor and at_floor[-1] == len(series) - 1) or not (at_floor or from_start):
        return None  # in sync now, or never in sync in the window
    since = list(series[at_floor[-1] + 1 :] if at_floor else series)
    if len(since) < TREND_MIN_STEPS:
        return None
    third = max(1, len(since) // 3)
    early, late = statistics.fmean(since[:third]), statistics.fmean(since[-third:])
    growth = late / early if early > 0 else math.inf
    rho = _spearman(since)
    if growth < TREND_GROWTH or rho < TREND_SPEARMAN:
        return None
    return {"relative_gap": since[-1], "steps_growing": float(len(since)), "gap_growth": growth, "gap_spearman": rho}


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
    """Scalars to log: ``diagnosis/<cause>`` (1.0 for the named cause and the finding beyond it, else 0), the
    confidence and the signatures.

    A signature that is also a scalar metric (``is_ratio_mean``, ``kl_sample_train_k3``) is left
    out: it is logged once, under the scalar's key.

    Example:
        >>> d = Diagnosis("stale", 0.75, {"token_eta2": 0.2})
        >>> m = diagnosis_metrics(d, {"temperature": 1.0}, prefix="div/")
        >>> m["div/diagnosis/stale"], m["div/diagnosis/none"], m["div/diagnosis/confidence"], m["div/signature/temperature"]
        (1.0, 0.0, 0.75, 1.0)
    """
    named = {diagnosis.cause, diagnosis.beyond.cause if diagnosis.beyond is not None else diagnosis.cause}
    metrics = {f"{prefix}diagnosis/{cause}": float(cause in named) for cause in CAUSES}
    metrics[f"{prefix}diagnosis/confidence"] = float(diagnosis.confidence)
    metrics.update(
        {
            f"{prefix}signature/{name}": float(value)
            for name, value in signatures.items()
            if name not in SCALAR_METRICS and name not in SAMPLING_METRICS
        }
    )
    return metrics


def _confidence(margin: float) -> float:
    """0.5 at the threshold, growing with the margin (0 to 1 past it) to 1."""
    return 0.5 + 0.5 * min(max(margin, 0.0), 1.0) if math.isfinite(margin) else 0.5


def _format(evidence: Mapping[str, float]) -> str:
    shown = {name: value for name, value in evidence.items() if name not in ("shift_direction", "offset")}
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in shown.items())
