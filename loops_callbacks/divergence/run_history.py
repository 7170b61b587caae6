"""What the divergence monitor saw over one run, and the guard rail's verdict: the end-of-run summary.

``RunHistory`` counts the logged steps per likely cause (with the step where each first appeared),
remembers the last step with action tokens, its metrics and the last diagnosis, and holds the
guard rail's ``Verdict``. ``lines`` renders it as plain text, the verdict last. ``saved_fields``
and ``restore_fields`` carry a dataclass's state through a checkpoint as plain data: the monitor
saves the run's history that way (the verdict belongs to the fit that reached it) and the
diagnosis' ``Calibration``.

Example:
    >>> from loops_callbacks.divergence.diagnosis import Diagnosis
    >>> history = RunHistory(watched="kl_sample_train_k3", max_kl=0.05)
    >>> stale = Diagnosis("stale", 0.8, {"token_eta2": 0.2})
    >>> history.observe(0, {"n_action_tokens": 64.0, "kl_sample_train_k3": 0.2}, stale)
    >>> history.observe(1, {"n_action_tokens": 0.0}, None)
    >>> history.acted(Verdict.STOPPED, 0, "kl_sample_train_k3 = 0.2 exceeded max_kl = 0.05")
    >>> print("\\n".join(history.lines(prefix="div/")))
    Sampler-vs-trainer divergence (div/*): 2 logged steps
      steps by likely cause: stale 1 (first at step 0), no action tokens 1 (first at step 1)
      last step with action tokens: 0 (the last logged step, 1, had none)
      its metrics:
        n_action_tokens      64
        kl_sample_train_k3   0.2
      last diagnosis (step 0, a hint, confidence 0.80): likely cause: the sampler's weights are out of date (token eta2 0.2); check that the sampler receives the trainer's weights every step (sync frequency, failed or partial weight loads)
    Guard rail: stopped the run at step 0: kl_sample_train_k3 = 0.2 exceeded max_kl = 0.05
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loops_callbacks.divergence.diagnosis import Diagnosis

__all__ = ["NO_ACTION_TOKENS", "CauseCount", "RunHistory", "Verdict", "restore_fields", "saved_fields"]

NO_ACTION_TOKENS = "no action tokens"
"""The label of a logged step without action tokens (nothing to diagnose)."""
NOT_DIAGNOSED = "not diagnosed"
"""The label of a logged step with action tokens when the diagnosis is off."""


class Verdict(enum.Enum):
    """What the guard rail did over a run (``KLSampleTrainMonitor.verdict``)."""

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


@dataclass
class CauseCount:
    """How many logged steps had one likely cause, and the first of them."""

    steps: int
    first_step: int


@dataclass
class RunHistory:
    """One run's history (module docstring); the monitor starts a new one when a fit starts, and a fit
    resumed from a checkpoint continues the saved one, with a verdict of its own (``FIT_FIELDS``)."""

    FIT_FIELDS: ClassVar[tuple[str, ...]] = (
        "watched", "max_kl", "fit_start", "fit_logged_steps", "judged_steps", "action", "verdict_step",
        "verdict_reason", "times_acted", "log_every_n_steps", "steps_trained",
    )
    """The settings and the guard rail's record of this fit: not saved in checkpoints."""

    watched: str
    max_kl: float | None
    max_sampling_z: float | None = None
    # the run's steps, carried across a resume
    logged_steps: int = 0
    last_step: int | None = None
    causes: dict[str, CauseCount] = field(default_factory=dict)  # in order of first appearance
    last_step_with_action_tokens: int | None = None
    metrics_with_action_tokens: dict[str, float] = field(default_factory=dict)
    last_diagnosis: Diagnosis | None = None
    last_diagnosis_step: int | None = None
    # this fit's: where it started, what the guard rail judged and did
    fit_start: int = 0
    fit_logged_steps: int = 0
    judged_steps: int = 0  # logged steps with masked-in action tokens (finite or not)
    action: Verdict | None = None  # what the guard rail did (WARNED, STOPPED, RAISED); None: nothing
    verdict_step: int | None = None
    verdict_reason: str | None = None
    times_acted: int = 0
    log_every_n_steps: int | None = None  # the logging interval, and the optimizer step the fit ended at
    steps_trained: int | None = None  # (both set by the monitor, to say why nothing was judged)

    @property
    def verdict(self) -> Verdict:
        """What the guard rail did; ``NO_EXCEEDANCE`` only when it judged at least one step."""
        if self.action is not None:
            return self.action
        if self.max_kl is None and self.max_sampling_z is None:
            return Verdict.OFF
        return Verdict.NO_EXCEEDANCE if self.judged_steps else Verdict.NOTHING_JUDGED

    def observe(self, step: int, metrics: Mapping[str, float], diagnosis: Diagnosis | None) -> None:
        """Count one logged step: its cause (or ``no action tokens``), its metrics (bare names) when it had tokens."""
        self.logged_steps += 1
        self.fit_logged_steps += 1
        self.judged_steps += int(metrics.get("n_action_tokens", 0.0) + metrics.get("n_skipped_nonfinite", 0.0) > 0)
        self.last_step = step
        has_tokens = metrics.get("n_action_tokens", 0.0) > 0
        label = diagnosis.label if diagnosis is not None else NOT_DIAGNOSED if has_tokens else NO_ACTION_TOKENS
        if label in self.causes:
            self.causes[label].steps += 1
        else:
            self.causes[label] = CauseCount(1, step)
        if has_tokens:
            self.last_step_with_action_tokens = step
            self.metrics_with_action_tokens = dict(metrics)
        if diagnosis is not None:
            self.last_diagnosis, self.last_diagnosis_step = diagnosis, step

    def acted(self, verdict: Verdict, step: int, reason: str) -> None:
        """The guard rail acted at ``step``: stopped, raised, or warned (the first warning is kept)."""
        self.times_acted += 1
        if self.action is Verdict.WARNED and verdict is Verdict.WARNED:
            return
        self.action, self.verdict_step, self.verdict_reason = verdict, step, reason

    def lines(self, prefix: str) -> list[str]:
        """The summary as plain text lines, the guard rail's verdict last; ``prefix``: the metrics' key prefix."""
        lines = [f"Sampler-vs-trainer divergence ({prefix}*): {self.logged_steps} logged steps"]
        if self.causes:
            counts = ", ".join(f"{cause} {c.steps} (first at step {c.first_step})" for cause, c in self.causes.items())
            lines.append(f"  steps by likely cause: {counts}")
        if self.last_step_with_action_tokens is None:
            if self.logged_steps:
                lines.append("  no logged step had action tokens: the monitor watched nothing")
        else:
            where = f"  last step with action tokens: {self.last_step_with_action_tokens}"
            if self.last_step != self.last_step_with_action_tokens:
                where += f" (the last logged step, {self.last_step}, had none)"
            lines.append(where)
            lines.append("  its metrics:")
            names = self.metrics_with_action_tokens
            width = max(map(len, names))
            lines += [f"    {name:{width}s}   {value + 0.0:.6g}" for name, value in names.items()]  # + 0.0: no "-0"
        if self.last_diagnosis is not None:
            kind = "observed" if self.last_diagnosis.is_observation else "a hint"
            lines.append(
                f"  last diagnosis (step {self.last_diagnosis_step}, {kind}, confidence "
                f"{self.last_diagnosis.confidence:.2f}): {self.last_diagnosis.message}"
            )
        lines.append(self.verdict_line())
        return lines

    def verdict_line(self) -> str:
        """``Guard rail: ...``: off, nothing judged (why), no exceedance, warned, stopped or raised (at which
        step, and why)."""
        if self.verdict is Verdict.OFF:
            return "Guard rail: off (max_kl not set)"
        if self.verdict is Verdict.NOTHING_JUDGED:
            return f"Guard rail: nothing judged ({self._why_nothing_judged()})"
        if self.verdict is Verdict.NO_EXCEEDANCE:
            since = f" since step {self.fit_start}" if self.fit_start else ""
            bounds = [f"{self.watched} <= {self.max_kl:g}"] if self.max_kl is not None else []
            bounds += [f"|sampling_z| <= {self.max_sampling_z:g}"] if self.max_sampling_z is not None else []
            return f"Guard rail: no exceedance ({' and '.join(bounds)} on every judged step{since})"
        if self.verdict is Verdict.WARNED:
            return (
                f"Guard rail: warned on {self.times_acted} logged step(s), first at step {self.verdict_step} "
                f"(on_exceed='warn': training went on): {self.verdict_reason}"
            )
        if self.verdict is Verdict.STOPPED:
            return f"Guard rail: stopped the run at step {self.verdict_step}: {self.verdict_reason}"
        return f"Guard rail: raised SampleTrainDivergenceError at step {self.verdict_step}: {self.verdict_reason}"

    def _why_nothing_judged(self) -> str:
        if self.fit_logged_steps:
            return "no logged step had masked-in action tokens"
        return (
            f"no step was logged: the fit ended at optimizer step {self.steps_trained}, before its first logged "
            f"step (log_every_n_steps = {self.log_every_n_steps})"
        )


def saved_fields(state: Any, *, skip: Collection[str] = ()) -> dict[str, Any]:
    """The dataclass ``state``'s fields but ``skip`` as plain data, for a checkpoint that
    ``torch.load(weights_only=True)`` reads: dataclasses as dicts, enums as their values, deques and
    tuples as lists. ``restore_fields`` reads it back.

    Example:
        >>> history = RunHistory("kl_sample_train_k3", max_kl=0.05)
        >>> history.observe(3, {"n_action_tokens": 8.0}, Diagnosis("stale", 0.8, {"token_eta2": 0.2}))
        >>> saved = saved_fields(history, skip=RunHistory.FIT_FIELDS)
        >>> saved["causes"], saved["last_diagnosis"]["evidence"]
        ({'stale': {'steps': 1, 'first_step': 3}}, {'token_eta2': 0.2})
        >>> resumed = RunHistory("kl_sample_train_k3", max_kl=0.05)
        >>> restore_fields(resumed, saved)
        >>> resumed.causes["stale"], resumed.last_diagnosis == history.last_diagnosis
        (CauseCount(steps=1, first_step=3), True)
    """
    return {f.name: _plain(getattr(state, f.name)) for f in dataclasses.fields(state) if f.name not in skip}


def restore_fields(state: Any, saved: Mapping[str, Any]) -> None:
    """Set the dataclass ``state``'s fields from ``saved_fields``' data, typed as the fields declare;
    a field ``saved`` lacks (an older checkpoint) keeps its value, a name ``state`` lacks is ignored."""
    hints = typing.get_type_hints(type(state))
    for f in dataclasses.fields(state):
        if f.name in saved:
            current, value = getattr(state, f.name), _typed(hints[f.name], saved[f.name])
            if isinstance(current, collections.deque):  # its length bound is the field's, not the data's
                value = collections.deque(value, current.maxlen)
            setattr(state, f.name, value)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, collections.deque)):
        return [_plain(item) for item in value]
    return value


def _typed(hint: Any, value: Any) -> Any:
    """``value`` (plain data) as the type ``hint`` declares: dataclasses, enums, dicts, lists, tuples, deques."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        return _typed(next(arg for arg in args if arg is not type(None)), value)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{name: _typed(hints[name], item) for name, item in value.items() if name in hints})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is dict:
        return {key: _typed(args[1], item) for key, item in value.items()}
    if origin in (list, tuple, collections.deque):
        return origin(_typed(args[0], item) for item in value)
    return value
