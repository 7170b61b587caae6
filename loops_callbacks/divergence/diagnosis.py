"""The likely cause of a step's divergence: the rules, as functions of the computed statistics, and what each cause
says (``Diagnosis``).

The causes the diagnosis can name: a step's ``Diagnosis``, its message and its logged metrics.

A ``Diagnosis`` holds the cause, a confidence (0 to 1) and the numbers behind it (signature numbers,
``statistics``); its ``message`` says what the cause is, its numbers and what to check. The rules
that pick the cause are in ``diagnosis``.

Examples:
    >>> found = Diagnosis("temperature", 0.8, {"temperature": 0.71})
    >>> print(found.message)
    likely cause: a temperature is applied on one side only (slope of trainer on sampler logprobs 0.71) (temperature 0.71); check that the sampler's logprobs are at temperature 1, or divide the trainer's logits by the same temperature

Why do the sampler and the trainer disagree? A likely cause per logged step, with the numbers behind it.

Each common cause leaves its own pattern in the step's signature numbers (``statistics``), so one
host-side rule, applied to every logged step, names the likeliest (``diagnose``); the rules in the
order they are tried, the noise gate and where each threshold comes from are in the docs ("Why they
diverge"). d = trainer − sampler logprob of a token, s the sampler's logprob.

* **Relative gap**: mean d² / var(s). Rounding noise scales with the logits, so this stays level
  while a model sharpens; a step whose relative gap is within the run's noise bound is
  ``precision`` (or ``none``, ``sampling``, ``unclear``), never another cause.
* **Noise floor** (``Calibration``): the median relative gap of the run's latest healthy steps;
  the bound is ``NOISE_FACTOR`` times it, the prior ``NOISE_PRIOR`` before the run is calibrated.
* **Direct evidence** (``batch``): what the monitor sees for certain about the trainer (live
  dropout, its precision); live dropout is named as an observation (confidence 1), before any
  statistical cause but ``none``.
* **What the run states of itself**, named as observed from the first step it holds, before any
  statistical rule: datums whose ``policy_version`` is more than ``max_policy_lag`` steps behind the
  trainer (stale, with the lag, whatever the size of the gap); sampler prompt ids (``sampler_prompt_ids``) that
  differ from the tokens the trainer scored before each completion (``prompt``, with where they differ); an
  engine that reports processed logprobs after a temperature or truncation (``SamplerFacts``) when the gap agrees
  with its settings.
* **Trend**: the relative gaps of the run's previous logged steps (``Calibration.recent_gaps``),
  read for a gap that grows step after step (stale weights).

A diagnosis is a hint with its numbers, not a certainty: ``unclear`` with its numbers is the answer
when no cause's pattern fits cleanly.

Examples:
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loops_callbacks.divergence.batch import DirectEvidence, SamplerFacts
from loops_callbacks.divergence.statistics import SAMPLING_METRICS, SCALAR_METRICS, held_sampling_z

IMPOSSIBLE_INPUTS = "impossible_inputs"  # the inputs are not logprobs at all: no statistical cause is judged then
DROPOUT = "dropout"  # dropout seen live in the trainer: an observation, not a guess
SAMPLING = "sampling"  # the tokens were drawn from another distribution than the logprobs describe
PREFIX_CACHE = "prefix_cache"  # the engine says its prefix cache outlived a weight reload (``SamplerFacts``)
PRECISION_BITS = "precision_bits"  # a precision diagnosis' number, not shown: 16 (a side known 16-bit), 32 (neither)
FULL_PRECISION_GAP = "full_precision_gap"  # an unrelated diagnosis' number, not shown: 1 where both sides are at full
# precision (the gap says the two sides compute different functions: weights or inputs)
PROMPT = "prompt"  # the sampler's prompt ids (``sampler_prompt_ids``) differ from the trainer's: an observation
CAUSES = (
    IMPOSSIBLE_INPUTS, "none", DROPOUT, PROMPT, "shift", SAMPLING, PREFIX_CACHE, "unrelated", "truncation", "temperature",
    "precision", "stale", "unclear",
)
"""Every cause a step can be given, in the order they are checked (``unclear`` last)."""

_TEXTS = {  # cause (and "unclear" with a context fade or too few tokens, truncation to p = 1): (what, what to check)
    IMPOSSIBLE_INPUTS: ("the inputs are not valid logprobs", "fix the inputs first (position k must hold log p of the "
                        "token predicted at k, a number <= 0); no other cause can be judged on them"),
    "none": ("no mismatch", ""),
    DROPOUT: ("observed: the trainer's logprobs include dropout noise", "compute the trainer's logprobs without dropout "
              "(model.eval() for the scoring forward, or dropout 0 in the model's config, as TRL does for RL); the "
              "sampler never applies dropout"),
    PROMPT: ("the sampler's prompt differs from the trainer's", "render the prompt once and give both sides the "
             "same ids: check the chat template, the system prompt, BOS and special tokens (added twice, or dropped) "
             "and the tokenizer on each side; every completion is scored in another context than it was sampled in"),
    "unrelated": ("sampler and trainer score unrelated distributions", "check the chat template, BOS and special "
                  "tokens and the tokenizer on both sides, and that the sampler loaded the trainer's weights at all"),
    "truncation": ("the sampler truncates (top-k / top-p) and reports renormalized logprobs", "check that the "
                   "sampler reports logprobs of the full distribution (not of the top-k / top-p renormalized one), "
                   "or apply the same truncation in the trainer"),
    "all_zero": ("every sampler logprob is exactly 0.0: a greedy (top-1) sampler's renormalized logprobs, or "
                 "logprobs never filled in", "fill in the sampler's logprob of each drawn token, of the full "
                 "distribution (a greedy sampler's raw logprobs, not its processed ones)"),
    "temperature": ("a temperature is applied on one side only", "check that the sampler's logprobs are at "
                    "temperature 1, or divide the trainer's logits by the same temperature"),
    "stale": ("the sampler's weights are out of date", "check that the sampler receives the trainer's weights every "
              "step (sync frequency, failed or partial weight loads)"),
    FULL_PRECISION_GAP: ("sampler and trainer compute different distributions: both at full precision, whose "
                         "rounding leaves relative gaps near 1e-12, and the gap is far beyond that with no temperature, "
                         "truncation or shift fitting it, so their weights or their inputs differ", "check that the "
                         "sampler's last weight load succeeded and loaded every tensor (a load that failed while "
                         "policy_version still counted, a sampler started from another checkpoint), then the prompts "
                         "both sides score (chat template, BOS and special tokens, the tokenizer: sampler_prompt_ids "
                         "says which) and the forward's inputs (attention_mask, position_ids on left-padded prompts)"),
    "precision": ("numerical precision (the engines' dtypes, kernels or reduction order differ)", "check the "
                  "sampler's dtype and kernels; a gap at this level is usually harmless"),
    "precision_16": ("numerical precision (16-bit rounding, e.g. bf16 kernels)", "check the sampler's dtype and "
                     "kernels; a gap at this level is usually harmless"),
    "precision_32": ("numerical precision (kernels and reduction order differ between the engines)", "check the "
                     "sampler's kernels; a gap at this level is usually harmless"),
    SAMPLING: ("the tokens were not drawn from the distribution the sampler's logprobs describe", "check the "
               "sampler's logprobs mode (vLLM: logprobs_mode='processed_logprobs') or the sampling settings: the "
               "importance ratio of every correction is not the behaviour policy's"),
    PREFIX_CACHE: ("the sampler's prefix cache holds KV computed with older weights", "reset the prefix cache after "
                   "every weight update (vLLM: llm.reset_prefix_cache()) or salt it per weight version"),
    "unclear": ("unclear", "no single cause's signature fits; look at the worst tokens (the worst_tokens table in W&B "
                "or TensorBoard; with any logger, KLSampleTrainMonitor.last_worst_tokens)"),
    "too_few": ("unclear: too few action tokens on this step to judge", "a logged step is judged on its own "
                "micro-batches: a larger batch or gradient accumulation gives it more; a token whose advantage is 0 "
                "is not trained on, so a group whose rewards are all equal adds none"),
    "context_fade": ("unclear: the gap sits on each completion's first tokens and fades after them", "a difference "
                     "in the prompt both sides score (chat template, BOS and special tokens, system prompt) or a "
                     "sampler's prefix / KV cache kept across a weight update leaves this; so can an engine whose "
                     "rounding grows where the first tokens' logits are larger, so check the prompts and the cache first"),
}

_SAMPLING_FIELDS = (
    "; or, where the sampler reports what it draws, that 'training_entropy' and 'training_varentropy' are of the "
    "distribution 'training_logprobs' come from (token_logprobs(..., with_entropy=True) on the same logits, at "
    "temperature 1): entropies of other logits read the same"
)


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of one logged step, how sure the rule is (0 to 1), and the numbers behind it.

    ``problems`` says what is impossible about the inputs (cause ``impossible_inputs`` only);
    ``observed`` what was seen directly about the trainer or the engine when it is the cause;
    ``beyond`` a finding that the observed dropout cannot explain (a gap that grows over the steps
    or with the policy lag, an offset), said after the observation.
    """

    cause: str
    confidence: float
    numbers: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    observed: str = ""
    beyond: Diagnosis | None = None

    @classmethod
    def impossible_inputs(cls, problems: Iterable[str]) -> Diagnosis:
        """The diagnosis of a step whose inputs are not logprobs (``guard_rail.impossible_inputs``' texts).

        Examples:
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
        """One sentence for logs and the guard rail: the cause, its numbers, what to check."""
        if self.cause == "none":
            return f"no mismatch ({_format(self.numbers)})"
        if self.cause == IMPOSSIBLE_INPUTS:
            what, check = _TEXTS[self.cause]
            return f"likely cause: {what}: {'; '.join(self.problems)}; {check}"
        beyond = f"; and beyond what dropout explains: {self.beyond._finding}" if self.beyond is not None else ""
        return f"likely cause: {self._finding}{beyond}"

    @property
    def _finding(self) -> str:
        """The cause, its numbers and what to check."""
        key = self.cause
        if self.cause == "unclear" and ("context_fade" in self.numbers or "n_action_tokens" in self.numbers):
            key = "context_fade" if "context_fade" in self.numbers else "too_few"
        if key == "truncation" and self.numbers.get("sampler_all_zero") == 1.0:
            key = "all_zero"
        if key == "precision" and self.numbers.get(PRECISION_BITS) in (16.0, 32.0):  # a side known 16-bit, or none
            key = f"precision_{int(self.numbers[PRECISION_BITS])}"
        if key == "unrelated" and self.numbers.get(FULL_PRECISION_GAP) == 1.0:
            key = FULL_PRECISION_GAP
        what, check = _shift_texts(self.numbers) if key == "shift" else _TEXTS[key]
        if self.cause == "temperature":
            what += f" (slope of trainer on sampler logprobs {self.numbers['temperature']:.2f})"
        if self.cause == SAMPLING and math.isfinite(self.numbers.get("sampling_z", math.nan)):
            side = "sharper" if self.numbers["sampling_z"] > 0 else "flatter"
            temperature = self.numbers.get("sampling_temperature", math.nan)
            estimate = f": effective temperature ≈ {temperature:.1f}" if 0.2 <= temperature <= 5.0 else ""
            what += f" (drawn {side}{estimate})"
        if self.observed:
            what += f": {self.observed}"
        elif self.cause == SAMPLING:  # inferred from the trainer's entropies, which no check can tell from the draws
            check += _SAMPLING_FIELDS
        numbers = f" ({_format(self.numbers)})" if self.numbers else ""
        return f"{what}{numbers}; {check}"


def diagnosis_metrics(diagnosis: Diagnosis, signatures: Mapping[str, float], *, prefix: str) -> dict[str, float]:
    """Scalars to log: ``diagnosis/<cause>`` (1.0 for the named cause and the finding beyond it, else 0), the
    confidence and the signature numbers.

    A signature number that is also a scalar metric (``is_ratio_mean``, ``kl_sample_train_k3``) is left
    out: it is logged once, under the scalar's key.

    Examples:
        >>> d = Diagnosis("stale", 0.75, {"token_eta2": 0.2})
        >>> m = diagnosis_metrics(d, {"temperature": 1.0}, prefix="div/")
        >>> m["div/diagnosis/stale"], m["div/diagnosis/none"], m["div/diagnosis/confidence"], m["div/signature/temperature"]
        (1.0, 0.0, 0.75, 1.0)
    """
    named = {diagnosis.cause, diagnosis.beyond.cause if diagnosis.beyond is not None else diagnosis.cause}
    metrics = {f"{prefix}diagnosis/{cause}": float(cause in named) for cause in CAUSES}
    metrics[f"{prefix}diagnosis/confidence"] = float(diagnosis.confidence)
    metrics.update({f"{prefix}signature/{name}": float(value) for name, value in signatures.items()
                    if name not in SCALAR_METRICS and name not in SAMPLING_METRICS})
    return metrics


def _shift_texts(numbers: Mapping[str, float]) -> tuple[str, str]:
    """What a shift is and what to check, with its size and direction."""
    if "left_aligned_ratio" in numbers:
        return (
            "completion-only sampler logprobs are left-aligned at position 0 instead of at the completion",
            "place the sampler's logprobs at the completion's positions (position k must hold the logprob of the "
            "token predicted at k; here the trainer's value at k matches the sampler's at k − the row's first "
            "action position)",
        )
    offset = int(round(numbers.get("offset", numbers.get("shift_direction", 1.0))))
    size = abs(offset)
    what = f"sampler logprobs are shifted by {'one position' if size == 1 else f'{size} positions'}"
    sign = "+" if offset > 0 else "−"
    check = (
        "check the alignment of logprobs with target tokens (position k must hold the logprob of the token "
        f"predicted at k; here the trainer's value at k matches the sampler's at k{sign}{size})"
    )
    return what, check


def _format(numbers: Mapping[str, float]) -> str:
    shown = {name: value for name, value in numbers.items() if name not in ("shift_direction", "offset", PRECISION_BITS,
                                                                             FULL_PRECISION_GAP)}
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in shown.items())


# the thresholds of the rules (the docs' table says what each is)
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
CURRENT_TEMPERATURE_SLOPE = 0.05  # the slope's margin from 1 where the versions show every datum current
SLOPE_SE = 3.0  # a temperature's slope is at least this many standard errors from 1
AMBIGUOUS_SLOPE = 0.1
TRUNCATION_MIN_SLOPE = 0.95
OFFSET_SHARE = 0.5
LAG_MIN_TOKENS = 32
LAG_GROWTH = 1.5
LAG_NOISE_FACTOR = 3.0  # every datum behind: a gap beyond this many times the calibrated floor is staleness
TREND_MIN_STEPS = 3
TREND_SPEARMAN = 0.5
TREND_GROWTH = 2.0
TREND_STEPS = 32
STALE_ETA2 = 0.1
SAMPLING_Z = 5.0  # |sampling_z| from which the tokens are taken as drawn from another distribution
SAMPLING_STEPS = 8  # the run's latest logged steps whose sampling z are combined (Stouffer: sum z / sqrt n),
SAMPLING_MIN_STEPS = 3  # at least this many: a bias of one sign too small for any one step (HF's default top-k 50)
WEIGHTS_GAP = 1e-6  # both sides at full precision: a relative gap this large (100x the prior) is another function
CREEP_STEPS = 8  # a gap that grew over at least this many logged steps,
CREEP_GROWTH = 3.0  # this many times over (the mean of the latest third against the first's),
CREEP_Z = 3.0  # its rank correlation with time this many standard errors above 0 (rho sqrt(n - 1); p ~ 0.001),
# is not rounding noise: rounding stays level (10 steps of steady growth at least; 16 at rho 0.8)
# the noise gate
NOISE_PRIOR = 1e-3  # the largest relative gap taken as rounding noise before the run is calibrated
NOISE_PRIOR_FULL_PRECISION = 1e-8  # the same for a float32 / float64 engine and a full-precision trainer
NOISE_FACTOR = 20.0  # once calibrated, a gap within this many times the noise floor is rounding noise
NOISE_MIN = 1e-9  # the smallest noise bound (float32 rounding alone leaves relative gaps near 1e-13)
NOISE_SE = 3.0  # beyond noise: log(gap / bound) above this many relative standard errors
NOISE_CEILING = 1e-2  # no step with a larger relative gap is taken as rounding noise, calibrated or not
NOISE_SLOPE = 0.05  # a step taken as noise has its slope of t on s this close to 1
CALIBRATION_SPREAD = 10.0  # the steps of a first calibration agree within this factor
HEALTHY_STEPS = 16  # the latest healthy steps whose median is the floor (it follows a floor that drifts)
FLOOR_FOLLOW = 3.0  # once calibrated, a healthy step's gap joins the floor only within this factor of it:
# a floor follows slow drift, never a fault that lifts the gap under a bound 20x the floor
_PREFIX_CACHE_SEEN = "its weights were reloaded after its prefix cache was last reset (the engine's own account)"


def noise_shaped(signatures: Mapping[str, float]) -> bool:
    """Whether a step's numbers are what rounding noise leaves: a relative gap at most ``NOISE_CEILING``,
    the slope of t on s within ``NOISE_SLOPE`` of 1, no sign split, no gap on the first tokens.

    Examples:
        >>> noise_shaped({"relative_gap": 2e-3, "temperature": 0.999, "sign_split": 0.3})
        True
        >>> noise_shaped({"relative_gap": 2e-3, "temperature": 0.9, "sign_split": 0.3})  # a mild temperature
        False
    """
    get = _reader(signatures)
    return (
        get("relative_gap") <= NOISE_CEILING
        and abs(get("temperature") - 1.0) <= NOISE_SLOPE
        and not get("sign_split") >= SIGN_SPLIT
        and not _fades(get)
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
    sampling_trend: Sequence[float] = (),
    max_policy_lag: int = 0,
    prompt: tuple[str, Mapping[str, float]] | None = None,
    by_server: Mapping[int, Any] | None = None,
) -> Diagnosis:
    """The likely cause of a step with these ``statistics`` (``signature_numbers``).

    ``noise_floor`` is the run's (``Calibration.noise_floor``; ``None`` before calibration: the
    prior bound, and token identity is not read). ``batch`` is what was seen directly about the
    trainer (``observe_training``): live dropout is named with confidence 1, and beside it
    (``beyond``) what dropout cannot explain: an offset, a gap growing with the policy lag or over
    the steps. ``facts`` is what the sampling engine says about itself (``SamplerFacts``).
    ``by_lag`` is the step's divergence by policy lag (``HostDivergence.by_lag``: label -> sums with
    ``n_tokens`` and ``abs_d_mean``); ``trend`` the relative gaps of the run's previous logged steps,
    oldest first, ``sampling_trend`` the sampling z (``held_sampling_z``) of those that checked what was sampled. ``max_policy_lag`` is the policy lag the run intends (1 for one-step-off-policy training):
    datums further behind (the signature numbers ``lag_min`` / ``lag_max``) are stale, observed. ``prompt`` is
    what the run's ``sampler_prompt_ids`` say where they differ from the trainer's prompts (``prompt_finding``:
    the sentence and its numbers): ``prompt``, observed, after the lag. ``by_server`` is the step's divergence by
    sampling server (``server_numbers``): a stale lag is said of the servers behind, by URL.
    """
    full_precision = (
        facts is not None and facts.dtype in ("float32", "float64")
        and not (evidence is not None and evidence.reduced_precision)
    )
    bound = noise_bound(noise_floor, NOISE_PRIOR_FULL_PRECISION if full_precision else NOISE_PRIOR)
    lag_bound = bound if noise_floor is None else max(LAG_NOISE_FACTOR * noise_floor, NOISE_MIN)
    behind = _observed_lag(signatures, max_policy_lag, bound, by_server or {})
    if behind is None and prompt is not None:  # the run's own prompts differ: named before any statistical rule
        behind = Diagnosis(PROMPT, 1.0, dict(prompt[1]), observed=prompt[0])
    statistical = behind or _statistical_cause(signatures, n_tokens, bound, lag_bound, noise_floor is not None, facts,
                                               by_lag, trend, sampling_trend, full_precision)
    if statistical.cause == "precision":  # its text names bf16 only where a side is known 16-bit
        sixteen = (signatures.get("both_16_bit_share", math.nan) >= 0.5
                   or (evidence is not None and evidence.reduced_precision)
                   or (facts is not None and "16" in (facts.dtype or "")))
        bits = 16.0 if sixteen else 32.0 if full_precision else None
        if bits is not None:
            statistical = Diagnosis("precision", statistical.confidence, statistical.numbers | {PRECISION_BITS: bits})
    if evidence is None or not evidence.dropout_active or statistical.cause == "none":
        return statistical  # no mismatch: live dropout does not reach these logprobs
    if behind is not None:
        numbers = {"dropout_modules": float(evidence.dropout_modules), "dropout_p": evidence.max_dropout_p}
        return Diagnosis(DROPOUT, 1.0, numbers, observed=evidence.facts, beyond=behind)
    numbers = {"dropout_modules": float(evidence.dropout_modules), "dropout_p": evidence.max_dropout_p,
               "k3": signatures.get("kl_sample_train_k3", math.nan)}
    beyond = None  # what live dropout cannot explain: an offset, a gap growing with the policy lag or over the steps
    if n_tokens >= MIN_TOKENS:
        beyond = _offset(signatures)
        if beyond is None and _beyond_noise(signatures, bound):
            lags = _lag_growth(by_lag)
            beyond = _stale_by_lag(lags) or _growing(signatures, by_lag, lags, trend, bound, since_floor=False)
    return Diagnosis(DROPOUT, 1.0, numbers, observed=evidence.facts, beyond=beyond)


def _statistical_cause(
    sig: Mapping[str, float], n_tokens: float, noise_bound: float, lag_bound: float, calibrated: bool,
    facts: SamplerFacts | None, by_lag: Mapping[str, Any] | None, trend: Sequence[float],
    sampling_trend: Sequence[float], full_precision: bool,
) -> Diagnosis:
    """``diagnose``'s rules in order (the docs' table), on the numbers and the engine's facts."""
    get = _reader(sig)

    def found(cause: str, margin: float, *names: str) -> Diagnosis:
        return Diagnosis(cause, _confidence(margin), {name: get(name) for name in names})

    if n_tokens < MIN_TOKENS:  # too few to weigh; seen, not weighed: every logprob equal at full precision, or
        if n_tokens and get("frac_d_zero") == 1.0 and get("both_16_bit_share") < 0.5:  # what the engine says of itself
            sampling = _sampling(sig, facts)
            return sampling if sampling is not None and sampling.observed else found("none", 1.0, "frac_d_zero")
        return Diagnosis("unclear", 0.0, {"n_action_tokens": float(n_tokens)})
    # logprobs rounded to 16 bits on both sides match exactly on most tokens even across a real gap
    zero_share, sure_at = (ZERO_SHARE_16_BIT, 1.0) if get("both_16_bit_share") >= 0.5 else (ZERO_SHARE, 0.9)
    settings = _processed_settings(sig, facts, noise_bound)  # the engine says what it applied to its logprobs
    if settings is not None:
        return settings
    sampling = _sampling(sig, facts, sampling_trend)  # named only where the logprobs agree: drawn from them?
    if sampling is not None and not sampling.observed and facts is not None and facts.stale_prefix_cache:
        # KV from older weights: the draws came from another distribution, as the engine itself says
        sampling = Diagnosis(PREFIX_CACHE, 1.0, dict(sampling.numbers), observed=_PREFIX_CACHE_SEEN)
    within_noise = not _beyond_noise(sig, noise_bound)
    # most tokens exactly equal and the rest within noise (a collapsed policy matches exactly where p = 1)
    if get("frac_d_zero") >= zero_share and within_noise:
        return sampling or found("none", (get("frac_d_zero") - zero_share) / (sure_at - zero_share), "frac_d_zero")
    offset = _offset(sig)
    if offset is not None:
        return offset
    gap = get("relative_gap")
    noise = {"relative_gap": gap, "noise_bound": noise_bound, "k3": get("kl_sample_train_k3")}
    fade = {name: get(name) for name in ("context_fade", "context_fade_z")} | noise
    behind = _common_lag(by_lag)
    if within_noise:  # within rounding noise: precision, unless something more direct says otherwise
        # every datum behind the trainer and the gap beyond the floor itself: staleness a bf16 floor would hide
        if behind and _beyond_noise(sig, lag_bound):
            return Diagnosis("stale", _confidence(math.log10(gap / lag_bound) / 2), {"lag": float(behind)} | noise)
        if sampling is not None:
            return sampling
        creeping = _creeping(gap, trend, noise)
        if creeping is not None:
            return creeping
        if _fades(get):
            return Diagnosis("unclear", 0.0, fade)
        return Diagnosis("precision", _confidence(math.log10(noise_bound / max(gap, 1e-300))), noise)
    if facts is not None and facts.stale_prefix_cache:  # the engine says so: a fact beside a gap beyond noise
        return Diagnosis(PREFIX_CACHE, 1.0, noise, observed=_PREFIX_CACHE_SEEN)
    lags = _lag_growth(by_lag)
    stale = _stale_by_lag(lags)
    if stale is not None:
        return stale
    if behind:  # every datum equally behind the trainer, and a gap beyond noise
        return Diagnosis("stale", _confidence(math.log10(gap / noise_bound) / 2), {"lag": float(behind)} | noise)
    slope, slope_se = get("temperature"), get("temperature_se")
    slope_se = slope_se if math.isfinite(slope_se) else 0.0
    # d of one sign (the sampler's logprobs renormalized over fewer tokens) outranks a gap growing over the
    # steps: truncation's relative gap grows too as training sharpens the policy, stale weights move d both ways
    if (
        get("frac_d_pos") < TRUNCATION_POSITIVE_SHARE
        and get("is_ratio_mean") < 1.0 - TRUNCATION_SE * get("is_ratio_se")
        and not slope < TRUNCATION_MIN_SLOPE
    ):
        margin = (TRUNCATION_POSITIVE_SHARE - get("frac_d_pos")) / TRUNCATION_POSITIVE_SHARE
        if get("sampler_all_zero") == 1.0:  # top-1 (greedy) logprobs, or none filled in: the text says which to check
            return found("truncation", margin, "frac_d_pos", "is_ratio_mean", "sampler_all_zero")
        return found("truncation", margin, "frac_d_pos", "is_ratio_mean", "is_ratio_se", "temperature")
    # weights a few steps old look like a mild temperature, far out of date like unrelated distributions
    growing = _growing(sig, by_lag, lags, trend, noise_bound)
    if growing is not None:
        return growing
    if get("pearson") < UNRELATED_PEARSON:
        return found("unrelated", (UNRELATED_PEARSON - get("pearson")) / UNRELATED_PEARSON, "pearson")
    creeping = _creeping(gap, trend, noise)  # versions that say current do not stop this one
    if creeping is not None:
        return creeping
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
    if _fades(get):  # a gap on the first tokens, at any size: not precision or staleness, but not named either
        return Diagnosis("unclear", 0.0, fade)
    if full_precision and gap >= WEIGHTS_GAP and not (pearson >= 0.95 and off_one >= AMBIGUOUS_SLOPE):
        # full precision on both sides rounds to relative gaps near 1e-12; this one, with no temperature, shift,
        # truncation or fade, is another function: other weights whatever the versions say (a load that failed or
        # fell short), or other inputs (a prompt that differs, a forward without the padding's positions)
        numbers = noise | {"pearson": pearson, "temperature": slope, FULL_PRECISION_GAP: 1.0}
        return Diagnosis("unrelated", _confidence(math.log10(gap / WEIGHTS_GAP) / 2), numbers)
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
        numbers = {"token_eta2": get("token_eta2")} | noise
        return Diagnosis("stale", _confidence((get("token_eta2") - STALE_ETA2) / 0.2), numbers)
    return Diagnosis("unclear", 0.0, unclear)


def _observed_lag(sig: Mapping[str, float], max_policy_lag: int, noise_bound: float,
                  by_server: Mapping[int, Any]) -> Diagnosis | None:
    """``stale``, observed, when the versions put any datum more than ``max_policy_lag`` optimizer steps behind
    the trainer (``lag_min`` / ``lag_max``: the step's datums with action tokens), whatever the gap; None when
    they do not, or were not given. The gap's size beside it says how much it matters yet; where the datums say
    which server sampled them (``by_server``), the servers behind are named by URL, with k3 on their tokens and on
    the others'."""
    low, high = sig.get("lag_min", math.nan), sig.get("lag_max", math.nan)
    if not high > max_policy_lag:  # NaN: no versions
        return None
    low = max(low, 0.0)
    lag = f"{high:.0f}" if low == high else f"{low:.0f} to {high:.0f}"
    who = "every datum" if low > max_policy_lag else "some datums"
    gap, k3 = sig.get("relative_gap", math.nan), sig.get("kl_sample_train_k3", math.nan)
    size = "beyond rounding noise" if _beyond_noise(sig, noise_bound) else "within rounding noise so far"
    said = (f"{who} sampled with weights {lag} optimizer step{'s' if high != 1 else ''} behind the trainer's (their "
            f"policy_version; max_policy_lag {max_policy_lag}); the gap is {size}")
    numbers = {"lag_min": low, "lag_max": high, "relative_gap": gap, "noise_bound": noise_bound, "k3": k3}
    stale = [server for server in by_server.values() if server.lag_max > max_policy_lag]
    if stale:
        current = [server for server in by_server.values() if not server.lag_max > max_policy_lag]
        lags = ", ".join(f"{server.url} ({_lag_range(server.lag_min, server.lag_max)} behind)" for server in stale)
        others = f"; {', '.join(server.url for server in current)} current" if current else ""
        said = (f"server{'s' if len(stale) > 1 else ''} {lags} sampled with older weights than the trainer's (their "
                f"policy_version; max_policy_lag {max_policy_lag}){others}; the gap is {size}")
        numbers |= {"stale_servers": float(len(stale)), "k3_stale_servers": _mean_k3(stale),
                    "k3_current_servers": _mean_k3(current)}
    return Diagnosis("stale", 1.0, numbers, observed=said)


def _lag_range(low: float, high: float) -> str:
    """A server's lags by bucket: ``2 steps``, ``1 to 4-7 steps``."""
    def said(lag: float) -> str:
        return {4.0: "4-7", 8.0: "8+"}.get(lag, f"{lag:.0f}")
    lags = said(high) if low == high else f"{said(low)} to {said(high)}"
    return f"{lags} step{'' if lags == '1' else 's'}"


def _mean_k3(servers: Sequence[Any]) -> float:
    """k3 over the servers' action tokens together (NaN for none)."""
    n = sum(server.n_action_tokens for server in servers)
    return sum(server.kl_sample_train_k3 * server.n_action_tokens for server in servers) / n if n else math.nan


def _processed_settings(sig: Mapping[str, float], facts: SamplerFacts | None, noise_bound: float) -> Diagnosis | None:
    """``temperature`` or ``truncation``, observed, when the engine says its logprobs are processed (after its
    temperature, top-p or top-k) while the trainer's are the model's at temperature 1, and the gap agrees: beyond
    noise, with the slope of t on s off 1 the way the temperature goes (T < 1: below 1), or d of one sign under
    truncation. None otherwise (a trainer that applies the same settings leaves no gap)."""
    if facts is None or facts.logprobs_mode != "processed_logprobs" or not facts.sampling_settings:
        return None
    if not _beyond_noise(sig, noise_bound):
        return None
    get = _reader(sig)
    engine = f"the {facts.engine} engine" if facts.engine else "the engine"
    said = (f"{engine} reports processed_logprobs, after {', '.join(facts.sampling_settings)}, where the trainer's "
            "are at temperature 1")
    slope, slope_se = get("temperature"), get("temperature_se")
    temperature = facts.temperature
    if temperature not in (None, 1.0) and (slope - 1.0) * (temperature - 1.0) > 0:
        if abs(slope - 1.0) >= SLOPE_SE * (slope_se if math.isfinite(slope_se) else 0.0):
            numbers = {name: get(name) for name in ("temperature", "temperature_se", "pearson", "kl_sample_train_k3")}
            return Diagnosis("temperature", 1.0, numbers,
                             observed=f"{said}: divide the trainer's logits by {temperature:g}")
    truncates = (facts.top_p is not None and facts.top_p < 1.0) or (facts.top_k is not None and facts.top_k > 0)
    if truncates and get("frac_d_pos") < TRUNCATION_POSITIVE_SHARE and (
            get("is_ratio_mean") < 1.0 - TRUNCATION_SE * get("is_ratio_se")):
        numbers = {name: get(name) for name in ("frac_d_pos", "is_ratio_mean", "is_ratio_se", "kl_sample_train_k3")}
        return Diagnosis("truncation", 1.0, numbers, observed=f"{said}: apply the same truncation in the trainer")
    return None


def _creeping(gap: float, trend: Sequence[float], noise: Mapping[str, float]) -> Diagnosis | None:
    """``stale`` when the gap has grown step after step: ``CREEP_GROWTH``-fold over at least ``CREEP_STEPS`` logged
    steps (the run's trend and this step), its Spearman correlation with time ``CREEP_Z`` standard errors above 0.
    Rounding noise stays level (the relative gap is scaled to the logprobs' spread), so no bound learned from it
    excuses this; a sampler that stopped receiving the weights drifts away a little more every step, whatever its
    versions say (a load that failed while the version still counted)."""
    series = [value for value in (*trend, gap) if math.isfinite(value)]
    if len(series) < CREEP_STEPS:
        return None
    growth, rho = _growth(series)
    if growth < CREEP_GROWTH or rho * math.sqrt(len(series) - 1) < CREEP_Z:
        return None
    numbers = dict(noise) | {"steps_growing": float(len(series)), "gap_growth": growth, "gap_spearman": rho}
    return Diagnosis("stale", _confidence((growth - CREEP_GROWTH) / CREEP_GROWTH), numbers)


def _sampling(sig: Mapping[str, float], facts: SamplerFacts | None, trend: Sequence[float] = ()) -> Diagnosis | None:
    """``sampling`` when the tokens were drawn from another distribution than the logprobs describe: |z| of
    what was sampled at least ``SAMPLING_Z`` with and without its most extreme token (``held_sampling_z``), on this
    step or combined over the run's latest ``SAMPLING_STEPS`` (``trend``: their held z, oldest first), or the
    engine says it reports raw logprobs while it samples at another temperature or truncated (then an
    observation); None otherwise."""
    names = ("sampling_z", "sampling_z_trimmed", "sampling_relative_bias", "sampling_temperature")
    numbers = {name: sig[name] for name in names if not math.isnan(sig.get(name, math.nan))}
    if facts is not None and facts.samples_other_than_reported:
        engine = f"the {facts.engine} engine" if facts.engine else "the engine"
        said = f"{engine} reports {facts.logprobs_mode} while sampling with {', '.join(facts.sampling_settings)}"
        return Diagnosis(SAMPLING, 1.0, numbers, observed=said)
    z = held_sampling_z(sig)
    if not math.isnan(z) and not abs(z) >= SAMPLING_Z:  # one step short of it: the run's steps together
        steps = [value for value in (*trend[-(SAMPLING_STEPS - 1):], z) if math.isfinite(value)]
        combined = sum(steps) / math.sqrt(len(steps))
        if len(steps) >= SAMPLING_MIN_STEPS and combined * z > 0:  # this step's bias the same way
            numbers |= {"sampling_z_steps": combined, "sampling_steps": float(len(steps))}
            z = combined
    if not abs(z) >= SAMPLING_Z:  # NaN (nothing sampled to check) included
        return None
    return Diagnosis(SAMPLING, _confidence((abs(z) - SAMPLING_Z) / SAMPLING_Z), numbers)


def _offset(sig: Mapping[str, float]) -> Diagnosis | None:
    """``shift`` from the alignment offsets when measured, else from the one-position shift ratio; None: aligned."""
    get = _reader(sig)
    left, share = get("left_aligned_ratio"), get("left_aligned_share")
    if left < SHIFT_RATIO and share >= OFFSET_SHARE:
        return _shift(left, {"left_aligned_ratio": left, "left_aligned_share": share})
    if not math.isnan(get("offset")):
        ratio, offset = get("offset_ratio"), get("offset")
        if offset != 0 and get("offset_share") >= OFFSET_SHARE and ratio < SHIFT_RATIO:
            numbers = {"shift_ratio": get("shift_ratio")} if abs(offset) == 1 else {}  # the one-position number
            return _shift(ratio, numbers | {"offset": offset, "offset_share": get("offset_share"), "offset_ratio": ratio})
        return None
    if get("shift_ratio") < SHIFT_RATIO:
        return _shift(get("shift_ratio"), {"shift_ratio": get("shift_ratio"), "shift_direction": get("shift_direction")})
    return None


def _shift(ratio: float, numbers: dict[str, float]) -> Diagnosis:
    return Diagnosis("shift", _confidence(math.log10(SHIFT_RATIO / max(ratio, 1e-300)) / 2), numbers)


def _lag_growth(by_lag: Mapping[str, Any] | None) -> dict[str, float] | None:
    """Mean |d| per lag bucket with enough tokens, and its growth from the lowest to the highest lag.

    None when fewer than two buckets have ``LAG_MIN_TOKENS`` tokens (nothing to compare).
    """
    kept = [(label, stratum) for label, stratum in (by_lag or {}).items() if stratum.n_tokens >= LAG_MIN_TOKENS]
    if len(kept) < 2:
        return None
    means = [stratum.abs_d_mean for _, stratum in kept]
    growth = means[-1] / means[0] if means[0] > 0 else (math.inf if means[-1] > 0 else 1.0)
    rising = all(later >= 0.9 * earlier for earlier, later in zip(means, means[1:]))
    numbers = {f"abs_d_lag_{label}": mean for (label, _), mean in zip(kept, means)}
    numbers["lag_growth"] = growth if rising else min(growth, 1.0)
    return numbers


def _stale_by_lag(lags: dict[str, float] | None) -> Diagnosis | None:
    """``stale`` when mean |d| grows at least ``LAG_GROWTH``-fold from the lowest to the highest lag."""
    if lags is None or lags["lag_growth"] < LAG_GROWTH:
        return None
    return Diagnosis("stale", _confidence((lags["lag_growth"] - LAG_GROWTH) / LAG_GROWTH), lags)


def _common_lag(by_lag: Mapping[str, Any] | None) -> int | None:
    """The lag every datum with tokens had, when they all were in one lag bucket (``"4-7"`` reads 4,
    ``"8+"`` 8); else None."""
    counted = [label for label, stratum in (by_lag or {}).items() if stratum.n_tokens > 0]
    return int(counted[0].split("-")[0].rstrip("+")) if len(counted) == 1 else None


def _growing(
    sig: Mapping[str, float], by_lag: Mapping[str, Any] | None, lags: dict[str, float] | None,
    trend: Sequence[float], noise_bound: float, *, since_floor: bool = True,
) -> Diagnosis | None:
    """``stale`` when the relative gap has grown step after step, unless the versions show every datum
    current or a gap flat across lags (versions outrank the trend). ``since_floor``: only since it was last
    at the noise bound, and not when it is there now or never was over the trend (beside live dropout, whose
    noise lifts it off: over the whole trend). The last value of the series is this step's."""
    if _common_lag(by_lag) == 0 or (lags is not None and lags["lag_growth"] < LAG_GROWTH):
        return None
    series = [*trend, sig.get("relative_gap", math.nan)]
    at_floor = [i for i, value in enumerate(series) if value <= noise_bound]
    if since_floor and (not at_floor or at_floor[-1] == len(series) - 1):
        return None  # never in sync over the trend, or in sync now
    since = series[at_floor[-1] + 1 :] if since_floor else series
    if len(since) < TREND_MIN_STEPS:
        return None
    growth, rho = _growth(since)
    if growth < TREND_GROWTH or rho < TREND_SPEARMAN:
        return None
    numbers = {"relative_gap": since[-1], "steps_growing": float(len(since)), "gap_growth": growth, "gap_spearman": rho}
    return Diagnosis("stale", _confidence((growth - TREND_GROWTH) / TREND_GROWTH), numbers)


def _growth(series: Sequence[float]) -> tuple[float, float]:
    """How much a series grew (the mean of its latest third over its first third's) and how steadily (Spearman)."""
    third = max(1, len(series) // 3)
    early, late = statistics.fmean(series[:third]), statistics.fmean(series[-third:])
    return (late / early if early > 0 else math.inf), _spearman(series)


def _spearman(values: Sequence[float]) -> float:
    """Spearman's rank correlation of ``values`` with their order (ties ranked by position)."""
    n = len(values)
    mean = (n - 1) / 2
    spread = sum((i - mean) ** 2 for i in range(n))
    by_rank = sorted(range(n), key=values.__getitem__)  # by_rank[r]: the position of rank r
    return sum((i - mean) * (r - mean) for r, i in enumerate(by_rank)) / spread if spread else 0.0


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


def noise_bound(floor: float | None, prior: float = NOISE_PRIOR) -> float:
    """The largest relative gap taken as rounding noise: ``NOISE_FACTOR`` x the run's noise ``floor``, ``prior``
    before the run is calibrated (``floor`` None)."""
    return prior if floor is None else max(NOISE_FACTOR * floor, NOISE_MIN)


def _fades(get: Callable[[str], float]) -> bool:
    """Whether the gap sits on the completions' first tokens (the signature number ``context_fade``)."""
    return get("context_fade") >= CONTEXT_FADE and get("context_fade_z") >= CONTEXT_Z


def _reader(numbers: Mapping[str, float]) -> Callable[[str], float]:
    return lambda name: numbers.get(name, math.nan)


def _confidence(margin: float) -> float:
    """0.5 at the threshold, growing with the margin (0 to 1 past it) to 1."""
    return 0.5 + 0.5 * min(max(margin, 0.0), 1.0) if math.isfinite(margin) else 0.5


@dataclass
class Calibration:
    """What the monitor learns over a run for the diagnosis: the run's noise floor and its trend.

    ``healthy_gaps`` holds the relative gaps of the latest ``HEALTHY_STEPS`` steps taken as healthy;
    the floor is their median once ``calibration_steps`` of them agree. ``recent_gaps`` holds the
    last ``TREND_STEPS`` relative gaps, ``recent_sampling_z`` the sampling z of the last ``SAMPLING_STEPS`` steps
    that checked what was sampled. Every field is plain data: the monitor's checkpoint state is
    these fields.

    Examples:
        >>> calibration = Calibration(calibration_steps=2)
        >>> calibration.noise_floor is None  # the prior bound holds until calibrated
        True
        >>> for gap in (2e-5, 3e-5):
        ...     calibration.observe(Diagnosis("precision", 0.9), {"relative_gap": gap})
        >>> calibration.noise_floor
        2.5e-05
    """

    calibration_steps: int = 5
    healthy_gaps: list[float] = field(default_factory=list)
    recent_gaps: list[float] = field(default_factory=list)
    recent_sampling_z: list[float] = field(default_factory=list)

    @property
    def calibrated(self) -> bool:
        """Whether the floor is known (never, with ``calibration_steps=0``: the prior bound then holds)."""
        return self.calibration_steps > 0 and len(self.healthy_gaps) >= self.calibration_steps

    @property
    def noise_floor(self) -> float | None:
        """The median relative gap of the healthy steps; ``None`` until calibrated."""
        return statistics.median(self.healthy_gaps) if self.calibrated else None

    def observe(self, diagnosis: Diagnosis, signatures: Mapping[str, float]) -> None:
        """Learn from a step: its relative gap joins the trend; a healthy one sets the floor.

        A step is healthy when named ``none`` or ``precision``; while the run is not calibrated yet,
        also an ``unclear`` step whose every number is rounding noise's (``noise_shaped``): a bf16
        engine's floor can sit above the prior. The first floor is taken only from steps that agree
        (the largest within ``CALIBRATION_SPREAD`` x the smallest): a gap growing from step 0 does not. An
        ``unclear`` step judged against the full-precision prior (a float32 engine, whose rounding leaves gaps
        near 1e-12) never calibrates: a gap of 1e-3 there is no engine's rounding. Once
        calibrated, a healthy step joins only within ``FLOOR_FOLLOW`` x the floor: the floor never learns a fault.
        """
        sampling_z = held_sampling_z(signatures)
        if math.isfinite(sampling_z):
            self.recent_sampling_z = [*self.recent_sampling_z, sampling_z][-SAMPLING_STEPS:]
        gap = signatures.get("relative_gap", math.nan)
        if not math.isfinite(gap):
            return
        self.recent_gaps = [*self.recent_gaps, gap][-TREND_STEPS:]
        healthy = diagnosis.cause in ("none", "precision") or (  # a 16-bit engine's floor above the prior; not
            not self.calibrated and diagnosis.cause == "unclear" and noise_shaped(signatures)  # a float32 engine's
            and diagnosis.numbers.get("noise_bound", NOISE_PRIOR) >= NOISE_PRIOR
        )
        floor = self.noise_floor
        if not healthy or (floor is not None and gap > FLOOR_FOLLOW * max(floor, NOISE_MIN / NOISE_FACTOR)):
            return
        gaps = [*self.healthy_gaps, gap][-HEALTHY_STEPS:]
        if len(self.healthy_gaps) < self.calibration_steps:  # not calibrated: keep the latest steps that agree
            while len(gaps) > 1 and max(gaps) > CALIBRATION_SPREAD * max(min(gaps), NOISE_MIN / NOISE_FACTOR):
                gaps = gaps[1:]
        self.healthy_gaps = gaps
