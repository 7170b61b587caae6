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
and without its most extreme token (``statistics.held_sampling_z``): the tokens were drawn from another
distribution than the trainer's, which the logprobs alone cannot show (``statistics.sampling_metrics``;
needs the trainer's entropies in the batch).

A step without masked-in action tokens is not judged (nothing to compare); the guard rail warns that the
monitor is watching nothing when the fit's first ``WATCHING_NOTHING_AFTER`` logged steps, or all of a shorter
fit's, are like that.

Examples:
    >>> totals = {"n_action_tokens": 0.0, "n_skipped_nonfinite": 64.0}
    >>> host = HostDivergence(totals, {})
    >>> rail = GuardRail(max_kl=0.05)
    >>> rail.untrusted({"n_action_tokens": 0.0}, host)
    '64 of 64 action tokens had a non-finite logprob (None, NaN or inf), more than max_nonfinite_fraction = 0.01'
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from loops_callbacks.divergence.batch import LOGPROB_FLOOR, SamplerFacts
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.statistics import SCALAR_METRICS, HostDivergence, held_sampling_z
from loops_callbacks.run_warnings import RunWarnings
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


class Verdict(enum.Enum):
    """What the guard rail did over a fit (``KLSampleTrainMonitor.verdict``)."""

    OFF = "off"
    """No bound was set (``max_kl=None``): nothing was judged."""
    NOTHING_JUDGED = "nothing judged"
    """A bound was set but no logged step had masked-in action tokens, or no step was logged."""
    NO_EXCEEDANCE = "no exceedance"
    """Every judged step (at least one) stayed within the bound."""
    WARNED = "warned"
    """Some steps exceeded and ``on_exceed="warn"`` let training go on."""
    STOPPED = "stopped"
    """The run was stopped (``on_exceed="stop"``): ``trainer.should_stop``."""
    RAISED = "raised"
    """``SampleTrainDivergenceError`` was raised (``on_exceed="raise"``)."""


_ACTIONS = {"warn": Verdict.WARNED, "stop": Verdict.STOPPED, "raise": Verdict.RAISED}

WATCHING_NOTHING_AFTER = 3
"""Logged steps without action tokens, from the start of a fit, before the guard rail says it is watching nothing."""


@dataclass
class GuardRail:
    """When to act on a logged step, and how; the patience counter, the action and the verdict, as Lightning's
    ``EarlyStopping`` holds its own (``KLSampleTrainMonitor(guard_rail=...)`` keeps a copy: two monitors never
    share a counter).

    ``max_kl``: the bound on ``kl_metric`` (bare, ``"kl_sample_train_k3"``, or with the monitor's prefix);
    ``None``: no bound (untrusted steps are then still warned about, never acted on). ``patience``: logged
    steps in a row that exceed before acting. ``on_exceed``: ``"warn"``, ``"stop"`` (end training cleanly, as
    ``EarlyStopping`` does) or ``"raise"`` (``SampleTrainDivergenceError``). ``max_nonfinite_fraction``: a step
    whose masked-in action tokens had more than this share of missing, NaN or infinite logprobs exceeds.
    ``max_sampling_z``: a bound on |``sampling_z``|, the check of what was sampled (needs the trainer's
    entropies); ``None``: off. A step's scalars are judged by their bare names.

    ``on_step`` judges a logged step's report and acts; ``verdict``, ``verdict_step`` and ``stop_reason`` say
    what it did in the fit; ``state_dict`` holds the patience counter (``exceeded_steps``) for checkpoints.

    Example::

        >>> rail = GuardRail(max_kl=0.05, patience=2, on_exceed="warn")
        >>> rail.verdict, rail.exceeded_steps
        (<Verdict.NOTHING_JUDGED: 'nothing judged'>, 0)
    """

    max_kl: float | None = None
    kl_metric: str = "kl_sample_train_k3"
    patience: int = 1
    on_exceed: Literal["warn", "stop", "raise"] = "stop"
    max_nonfinite_fraction: float = 0.01
    max_sampling_z: float | None = None
    # what it counted and did: the counter carries through checkpoints, the rest belongs to the fit
    exceeded_steps: int = field(default=0, init=False, compare=False)
    logged_steps: int = field(default=0, init=False, compare=False)  # logged steps of the fit it was shown
    judged_steps: int = field(default=0, init=False, compare=False)  # logged steps with masked-in action tokens
    action: Verdict | None = field(default=None, init=False, compare=False)  # WARNED, STOPPED, RAISED; None: none
    verdict_step: int | None = field(default=None, init=False, compare=False)
    verdict_reason: str | None = field(default=None, init=False, compare=False)
    times_acted: int = field(default=0, init=False, compare=False)

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

    def settings(self) -> dict[str, Any]:
        """The six settings by name (what the ranks must share)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def start_fit(self) -> None:
        """A fit starts: its verdict is its own (the patience counter is the run's, restored from a checkpoint)."""
        self.logged_steps, self.judged_steps, self.times_acted = 0, 0, 0
        self.action, self.verdict_step, self.verdict_reason = None, None, None

    @property
    def verdict(self) -> Verdict:
        """What the guard rail did in this fit; ``NO_EXCEEDANCE`` only when it judged at least one step."""
        if self.action is not None:
            return self.action
        if not self.judges:
            return Verdict.OFF
        return Verdict.NO_EXCEEDANCE if self.judged_steps else Verdict.NOTHING_JUDGED

    @property
    def stop_reason(self) -> str | None:
        """The message when it stopped the run (``on_exceed="stop"``), else ``None``."""
        return self.verdict_reason if self.action is Verdict.STOPPED else None

    def on_step(self, trainer: Any, report: Any, step: int, *, say: Callable[[str], None], warnings: RunWarnings,
                keys: Mapping[str, str]) -> None:
        """Judge one logged step's report (``StepReport``: its ``exceeds``, ``untrusted``, ``problems`` and
        ``diagnosis``) and act after ``patience`` steps in a row: ``say`` the message to the loggers, then warn, set
        ``trainer.should_stop`` or raise ``SampleTrainDivergenceError``. An untrusted step without a bound is a
        warning, never an action; so is a fit whose first logged steps had no action tokens (``keys``: where the
        monitor reads the mask and the advantages, named in that warning)."""
        totals = report.scalars
        self.logged_steps += 1
        self.judged_steps += int(totals.get("n_action_tokens", 0.0) + totals.get("n_skipped_nonfinite", 0.0) > 0)
        if self.logged_steps == WATCHING_NOTHING_AFTER and not self.judged_steps:
            self._watching_nothing(warnings, keys)
        if report.exceeds is None:
            if report.untrusted is not None:  # no bound set: say it, act on nothing
                warnings.warn(f"untrusted:{report.untrusted}", f"KLSampleTrainMonitor, step {step}: {report.untrusted}")
            self.exceeded_steps = 0
            return
        self.exceeded_steps += 1
        if self.exceeded_steps < self.patience:
            return
        if report.untrusted is not None and not report.problems:  # no reading of a step its numbers cannot judge
            reading = ("a step whose numbers cannot be trusted counts as exceeding the bound; fix what makes the "
                       "logprobs unreadable (named above) first.")
        else:
            reading = f"the sampler's logprobs no longer match the trainer's — {_advice(report)}"
        message = (f"{report.exceeds} at step {step} ({self.exceeded_steps} logged step(s) in a row, patience "
                   f"{self.patience}): {reading}")
        self.times_acted += 1
        verdict = _ACTIONS[self.on_exceed]
        if not (self.action is Verdict.WARNED and verdict is Verdict.WARNED):  # the first warning is kept
            self.action, self.verdict_step, self.verdict_reason = verdict, step, message
        if self.on_exceed == "stop":
            trainer.should_stop = True
            message += " Signaling Trainer to stop."
        say(message)
        if self.on_exceed == "raise":
            raise SampleTrainDivergenceError(message)
        warnings.warn(f"exceeded:{step}", message)

    def on_train_end(self, warnings: RunWarnings, keys: Mapping[str, str]) -> None:
        """The fit ended: if it logged steps and none had action tokens, say that the monitor watched nothing."""
        if self.logged_steps and not self.judged_steps:
            self._watching_nothing(warnings, keys)

    def _watching_nothing(self, warnings: RunWarnings, keys: Mapping[str, str]) -> None:
        warnings.warn("watching_nothing", f"KLSampleTrainMonitor: none of the {self.logged_steps} logged step(s) had "
                      f"an action token ({keys['mask']!r} > 0 with a non-zero {keys['advantages']!r}); the monitor is "
                      "watching nothing — check the mask (1.0 on the tokens the policy sampled) and the advantages")

    def verdict_line(self, *, steps_trained: int | None, log_every_n_steps: int | None, fit_start: int = 0) -> str:
        """``Guard rail: ...``: off, nothing judged (why: the fit's logged steps, the step it ended at and the logging
        interval), no exceedance, warned, stopped or raised (at which step, and why)."""
        verdict = self.verdict
        if verdict is Verdict.OFF:
            return "Guard rail: off (max_kl not set)"
        if verdict is Verdict.NOTHING_JUDGED:
            why = "no logged step had masked-in action tokens" if self.logged_steps else (
                f"no step was logged: the fit ended at optimizer step {steps_trained}, before its first logged "
                f"step (log_every_n_steps = {log_every_n_steps})")
            return f"Guard rail: nothing judged ({why})"
        if verdict is Verdict.NO_EXCEEDANCE:
            bounds = [f"{self.kl_metric} <= {self.max_kl:g}"] if self.max_kl is not None else []
            bounds += [f"|sampling_z| <= {self.max_sampling_z:g}"] if self.max_sampling_z is not None else []
            since = f" since step {fit_start}" if fit_start else ""
            return f"Guard rail: no exceedance ({' and '.join(bounds)} on every judged step{since})"
        if verdict is Verdict.WARNED:
            return (f"Guard rail: warned on {self.times_acted} logged step(s), first at step {self.verdict_step} "
                    f"(on_exceed='warn': training went on): {self.verdict_reason}")
        if verdict is Verdict.STOPPED:
            return f"Guard rail: stopped the run at step {self.verdict_step}: {self.verdict_reason}"
        return f"Guard rail: raised SampleTrainDivergenceError at step {self.verdict_step}: {self.verdict_reason}"

    def state_dict(self) -> dict[str, Any]:
        """The patience counter, for a checkpoint (the verdict belongs to the fit that reached it)."""
        return {"exceeded_steps": self.exceeded_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.exceeded_steps = int(state["exceeded_steps"])


def _advice(report: Any) -> str:
    """What the guard rail's message says to check: the likely cause when there is one."""
    if report.problems:  # a fact about the inputs, not a hint: the diagnosis names it too (diagnose=False: none)
        return f"{Diagnosis.impossible_inputs(report.problems.values()).message}."
    cause = report.diagnosis
    if cause is None or cause.cause in ("unclear", "none"):
        return (
            "check that the sampler receives the trainer's weights, and that both use the same tokenizer, "
            "precision and sampling settings."
        )
    # seen directly, not inferred: no confidence to weigh
    return f"{cause.message} ({'observed' if cause.is_observation else f'a hint, confidence {cause.confidence:.2f}'})."


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
    the masked-in positions (``statistics.sampling_positions``), by a stable key."""
    given = totals.get("n_sampling_given", 0.0)
    found = {}
    for quantity in ("entropy", "varentropy"):
        counts = {kind: totals.get(f"n_{quantity}_{kind}", 0.0) for kind in ("nan", "inf", "negative")}
        if sum(counts.values()):
            parts = ", ".join(f"{count:.0f} {'NaN' if kind == 'nan' else kind}" for kind, count in counts.items() if count)
            found[f"{quantity}_invalid"] = (
                f"'training_{quantity}' is impossible at {sum(counts.values()):.0f} of {given:.0f} masked-in positions "
                f"({parts}): a{'n' if quantity == 'entropy' else ''} {quantity} is a finite number >= 0; such positions are "
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

