"""Why do the sampler and the trainer disagree? A likely cause per logged step, with its evidence.

Each common cause leaves its own signature in the numbers the monitor already has
(``signatures``), so one host-side rule, applied to every logged step, names the likeliest:

=================  =========================================================  ======================
cause              signature (the rule, checked in this order)                 confidence grows with
=================  =========================================================  ======================
``none``           d = 0 exactly on at least half the tokens                  share of d = 0
``shift``          shift_ratio < 0.1: s one position over matches t           how far below 0.1
``unrelated``      Pearson(t, s) < 0.3                                        how far below 0.3
``truncation``     under 2% of tokens with d > 0 and mean e^d < 1 − 3 SE      how few d > 0
``temperature``    sign_split >= 0.9 (d of one sign on p > 0.5, the other     sign_split
                   on p < 0.1); the slope of t on s estimates T
``precision``      k3 below the precision bound                               how far below the bound
``stale``          token identity explains d: token_eta2 >= 0.05              token_eta2
``unclear``        none of the above, or fewer than 64 action tokens          (0)
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
triggered it. Known confusions (``benchmarks/bench_diagnosis.py``): a slight template change can
look like precision or staleness, and weights far out of date like a template error (both make
t and s unrelated).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loops_callbacks.divergence.evidence import DirectEvidence
from loops_callbacks.divergence.metrics import SCALAR_METRICS

__all__ = ["CAUSES", "DROPOUT", "IMPOSSIBLE_INPUTS", "Calibration", "Diagnosis", "diagnose", "diagnosis_metrics"]

IMPOSSIBLE_INPUTS = "impossible_inputs"
"""The cause named when the inputs are not logprobs at all: no statistical cause is judged then."""
DROPOUT = "dropout"
"""The cause named when dropout is seen live in the trainer (``evidence``): an observation, not a guess."""
CAUSES = (IMPOSSIBLE_INPUTS, "none", DROPOUT, "shift", "unrelated", "truncation", "temperature", "precision", "stale", "unclear")
"""Every cause a step can be given, in the order they are checked (``unclear`` last)."""

MIN_TOKENS = 64
ZERO_SHARE = 0.5
SHIFT_RATIO = 0.1
UNRELATED_PEARSON = 0.3
TRUNCATION_POSITIVE_SHARE = 0.02
TRUNCATION_SE = 3.0
SIGN_SPLIT = 0.9
STALE_ETA2 = 0.05
PRECISION_MAX_K3 = 1e-3
CALIBRATION_FACTOR = 20.0

_WHAT = {
    IMPOSSIBLE_INPUTS: "the inputs are not valid logprobs",
    "none": "no mismatch",
    DROPOUT: "observed: the trainer's logprobs include dropout noise",
    "shift": "sampler logprobs are shifted by one position",
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
    "shift": "check the alignment of logprobs with target tokens (position k must hold the logprob of the "
    "token predicted at k; here the trainer's value at k matches the sampler's at k{sign}1)",
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


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of one logged step, how sure the rule is (0 to 1), and the numbers behind it.

    ``problems`` says what is impossible about the inputs (cause ``impossible_inputs`` only);
    ``observed`` what was seen directly about the trainer (``evidence.DirectEvidence.facts``).
    """

    cause: str
    confidence: float
    evidence: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    observed: str = ""

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
        what = _WHAT[self.cause]
        if self.cause == "temperature":
            what += f" (slope of trainer on sampler logprobs {self.evidence['temperature']:.2f})"
        if self.observed:
            what += f": {self.observed}"
        check = _CHECK[self.cause].format(sign="+" if self.evidence.get("shift_direction", 1.0) > 0 else "−")
        return f"likely cause: {what} ({_format(self.evidence)}); {check}"


@dataclass
class Calibration:
    """The precision bound, learned from the first healthy logged steps of a run (module docstring)."""

    calibration_steps: int = 5
    healthy_k3: list[float] = field(default_factory=list)

    @property
    def precision_max_k3(self) -> float:
        if len(self.healthy_k3) < self.calibration_steps:
            return PRECISION_MAX_K3
        floor = statistics.median(self.healthy_k3)
        return min(PRECISION_MAX_K3, max(CALIBRATION_FACTOR * floor, 1e-9))

    def observe(self, diagnosis: Diagnosis, k3: float) -> None:
        """Learn from a step while calibrating: only steps that look healthy count."""
        if len(self.healthy_k3) < self.calibration_steps and diagnosis.cause in ("none", "precision") and math.isfinite(k3):
            self.healthy_k3.append(max(k3, 0.0))


def diagnose(
    signatures: Mapping[str, float],
    *,
    n_tokens: float,
    precision_max_k3: float = PRECISION_MAX_K3,
    evidence: DirectEvidence | None = None,
) -> Diagnosis:
    """The likely cause of a step with these ``signatures`` (``signatures.signature_numbers``).

    ``evidence`` is what was seen directly about the trainer (``evidence.observe_training``): live
    dropout is named before any statistical cause, with confidence 1, unless d = 0 on most tokens
    (then the dropout does not reach the logprobs).
    """
    sig = dict(signatures)

    def get(name: str) -> float:
        return sig.get(name, math.nan)

    def found(cause: str, margin: float, *names: str) -> Diagnosis:
        return Diagnosis(cause, _confidence(margin), {name: get(name) for name in names})

    if evidence is not None and evidence.dropout_active and not get("frac_d_zero") >= ZERO_SHARE:
        numbers = {"dropout_modules": float(evidence.dropout_modules), "dropout_p": evidence.max_dropout_p}
        numbers["k3"] = get("kl_sample_train_k3")
        return Diagnosis(DROPOUT, 1.0, numbers, observed=evidence.facts)
    if n_tokens < MIN_TOKENS:
        return Diagnosis("unclear", 0.0, {"n_action_tokens": float(n_tokens)})
    if get("frac_d_zero") >= ZERO_SHARE:
        return found("none", (get("frac_d_zero") - ZERO_SHARE) / 0.4, "frac_d_zero")
    if get("shift_ratio") < SHIFT_RATIO:
        return found("shift", math.log10(SHIFT_RATIO / max(get("shift_ratio"), 1e-300)) / 2, "shift_ratio", "shift_direction")
    if get("pearson") < UNRELATED_PEARSON:
        return found("unrelated", (UNRELATED_PEARSON - get("pearson")) / UNRELATED_PEARSON, "pearson")
    if get("frac_d_pos") < TRUNCATION_POSITIVE_SHARE and get("is_ratio_mean") < 1.0 - TRUNCATION_SE * get("is_ratio_se"):
        margin = (TRUNCATION_POSITIVE_SHARE - get("frac_d_pos")) / TRUNCATION_POSITIVE_SHARE
        return found("truncation", margin, "frac_d_pos", "is_ratio_mean", "is_ratio_se")
    if get("sign_split") >= SIGN_SPLIT:
        return found("temperature", (get("sign_split") - SIGN_SPLIT) / (1 - SIGN_SPLIT), "sign_split", "temperature")
    k3 = get("kl_sample_train_k3")
    if k3 < precision_max_k3:
        margin = math.log10(precision_max_k3 / max(k3, 1e-300))
        evidence = {"k3": k3, "k3_bound": precision_max_k3, "token_eta2": get("token_eta2")}
        return Diagnosis("precision", _confidence(margin), evidence)
    if get("token_eta2") >= STALE_ETA2:
        evidence = {"token_eta2": get("token_eta2"), "k3": k3}
        return Diagnosis("stale", _confidence((get("token_eta2") - STALE_ETA2) / 0.2), evidence)
    return Diagnosis("unclear", 0.0, {"k3": k3, "token_eta2": get("token_eta2"), "pearson": get("pearson")})


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
    shown = {name: value for name, value in evidence.items() if name != "shift_direction"}
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in shown.items())
