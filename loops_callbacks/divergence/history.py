"""What the monitor saw over one run: its logged steps and the end-of-run summary (``RunHistory``), and the
checkpoint state that carries them (``read_state``).

``RunHistory`` counts the logged steps per likely cause (with the step where each first appeared),
remembers the last step with action tokens, its metrics and the last diagnosis; ``lines`` renders it as
plain text (the monitor puts the guard rail's verdict last). ``saved`` and ``restore`` carry the run's part
of it through a checkpoint as plain data; ``read_state`` checks a checkpoint's state.

Examples:
    >>> from loops_callbacks.divergence.diagnosis import Diagnosis
    >>> history = RunHistory()
    >>> history.observe(0, {"n_action_tokens": 64.0, "kl_sample_train_k3": 0.2}, Diagnosis("stale", 0.8, {"token_eta2": 0.2}))
    >>> history.observe(1, {"n_action_tokens": 0.0}, None)
    >>> print("\\n".join(history.lines(prefix="div/")))
    Sampler-vs-trainer divergence (div/*): 2 logged steps
      steps by likely cause: stale 1 (first at step 0), no action tokens 1 (first at step 1)
      last step with action tokens: 0 (the last logged step, 1, had none)
      its metrics:
        n_action_tokens      64
        kl_sample_train_k3   0.2
      last diagnosis (step 0, a hint, confidence 0.80): likely cause: the sampler's weights are out of date (token eta2 0.2); check that the sampler receives the trainer's weights every step (sync frequency, failed or partial weight loads)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loops_callbacks.divergence.diagnosis import Diagnosis


_RUN_FIELDS = ("logged_steps", "last_step", "causes", "last_step_with_action_tokens", "metrics_with_action_tokens",
               "last_diagnosis", "last_diagnosis_step")
"""The run's part of the history: saved in checkpoints, carried across a resume (the rest is the fit's)."""


@dataclass
class RunHistory:
    """One run's history (module docstring): the monitor starts a new one when a fit starts, and a fit resumed
    from a checkpoint continues the saved one (``_RUN_FIELDS``)."""

    logged_steps: int = 0
    last_step: int | None = None
    causes: dict[str, list[int]] = field(default_factory=dict)  # label: [steps, first step], in order of appearance
    last_step_with_action_tokens: int | None = None
    metrics_with_action_tokens: dict[str, float] = field(default_factory=dict)
    last_diagnosis: Diagnosis | None = None
    last_diagnosis_step: int | None = None
    fit_start: int = 0  # where this fit started
    log_every_n_steps: int | None = None  # the logging interval and the optimizer step the fit ended at,
    steps_trained: int | None = None  # to say why nothing was judged

    def observe(self, step: int, metrics: Mapping[str, float], diagnosis: Diagnosis | None) -> None:
        """Count one logged step: its cause (or ``no action tokens``), its metrics (bare names) when it had tokens."""
        self.logged_steps += 1
        self.last_step = step
        has_tokens = metrics.get("n_action_tokens", 0.0) > 0
        label = diagnosis.label if diagnosis is not None else "not diagnosed" if has_tokens else "no action tokens"
        self.causes.setdefault(label, [0, step])[0] += 1
        if has_tokens:
            self.last_step_with_action_tokens, self.metrics_with_action_tokens = step, dict(metrics)
        if diagnosis is not None:
            self.last_diagnosis, self.last_diagnosis_step = diagnosis, step

    def saved(self) -> dict[str, Any]:
        """The run's part (``_RUN_FIELDS``) as plain data, for a checkpoint ``torch.load(weights_only=True)`` reads."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name in _RUN_FIELDS}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continue the run ``saved`` describes (``read_state``'s ``history``); what an older checkpoint lacks keeps
        its value."""
        for name in saved.keys() & set(_RUN_FIELDS):
            setattr(self, name, _diagnosis(saved[name]) if name == "last_diagnosis" else saved[name])

    def lines(self, prefix: str) -> list[str]:
        """The summary as plain text lines; ``prefix``: the metrics' key prefix."""
        lines = [f"Sampler-vs-trainer divergence ({prefix}*): {self.logged_steps} logged steps"]
        if self.causes:
            counts = ", ".join(f"{cause} {steps} (first at step {first})" for cause, (steps, first) in self.causes.items())
            lines.append(f"  steps by likely cause: {counts}")
        if self.last_step_with_action_tokens is None:
            if self.logged_steps:
                lines.append("  no logged step had action tokens: the monitor watched nothing")
        else:
            where = f"  last step with action tokens: {self.last_step_with_action_tokens}"
            if self.last_step != self.last_step_with_action_tokens:
                where += f" (the last logged step, {self.last_step}, had none)"
            width = max(map(len, self.metrics_with_action_tokens))
            lines += [where, "  its metrics:"] + [f"    {name:{width}s}   {value + 0.0:.6g}"  # + 0.0: no "-0"
                                                  for name, value in self.metrics_with_action_tokens.items()]
        if self.last_diagnosis is not None:
            kind = "observed" if self.last_diagnosis.is_observation else "a hint"
            lines.append(f"  last diagnosis (step {self.last_diagnosis_step}, {kind}, confidence "
                         f"{self.last_diagnosis.confidence:.2f}): {self.last_diagnosis.message}")
        return lines


def _diagnosis(saved: Mapping[str, Any] | None) -> Diagnosis | None:
    """A ``Diagnosis`` from its ``dataclasses.asdict`` data (checked by ``read_state``)."""
    if saved is None:
        return None
    fields = {**saved, "problems": tuple(saved.get("problems", ())), "beyond": _diagnosis(saved.get("beyond"))}
    if "evidence" in fields:  # the name of ``numbers`` in older checkpoints
        fields["numbers"] = fields.pop("evidence")
    return Diagnosis(**fields)


_OLDER_FIELDS = {"": {"stop_reason"}, "history": {"max_sampling_z"}, "diagnosis": {"evidence"}}
"""Fields older versions saved that this one reads no more (or under another name): known, not a newer version's."""


class _State:
    """``read_state``'s walk: each refused value a ``ValueError`` naming its field, each unknown field noted."""

    def __init__(self) -> None:
        self.unknown: list[str] = []

    def refuse(self, path: str, what: str, value: Any) -> None:
        shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:77]}..."
        raise ValueError(f"KLSampleTrainMonitor.load_state_dict: {path!r} must be {what}, got {shown} "
                         "(the checkpoint is damaged: its monitor state cannot be read)")

    def mapping(self, value: Any, path: str, known: Any = None, older: Any = frozenset()) -> Mapping[str, Any]:
        """``value`` if it is a mapping; its fields not in ``known`` or ``older`` are noted (``None``: any name)."""
        if not isinstance(value, Mapping):
            self.refuse(path, "a mapping", value)
        for name in value if known is not None else ():
            if name not in known and name not in older:
                where = f" of {path!r}" if path else ""
                self.unknown.append(f"field {name!r}{where}")
        return value

    def count(self, value: Any, path: str, *, optional: bool = False) -> int | None:
        if optional and value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.refuse(path, "an int >= 0" + (" or None" if optional else ""), value)
        return value

    def number(self, value: Any, path: str, least: float = -math.inf, most: float = math.inf) -> float:
        """``value`` as a float: a real number in ``[least, most]``; NaN only where nothing bounds it (a metric)."""
        bounded = least > -math.inf or most < math.inf
        real = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not real or not (least <= value <= most or math.isnan(value) and not bounded):
            bound = f" in [{least:g}, {most:g}]" if most < math.inf else f" >= {least:g}" if bounded else ""
            self.refuse(path, f"a number{bound}", value)
        return float(value)

    def numbers(self, value: Any, path: str, least: float = -math.inf) -> list[float]:
        if not isinstance(value, (list, tuple)):
            self.refuse(path, "a list of numbers", value)
        return [self.number(item, f"{path}[{i}]", least) for i, item in enumerate(value)]

    def text(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            self.refuse(path, "a str", value)
        return value

    def diagnosis(self, value: Any, path: str) -> dict[str, Any] | None:
        if value is None:
            return None
        fields = self.mapping(value, path, {f.name for f in dataclasses.fields(Diagnosis)}, _OLDER_FIELDS["diagnosis"])
        numbers_key = "numbers" if "numbers" in fields or "evidence" not in fields else "evidence"
        numbers = self.mapping(fields.get(numbers_key, {}), f"{path}.{numbers_key}")
        problems = fields.get("problems", ())
        if not isinstance(problems, (list, tuple)):
            self.refuse(f"{path}.problems", "a list of str", problems)
        return {
            "cause": self.text(fields.get("cause"), f"{path}.cause"),
            "confidence": self.number(fields.get("confidence"), f"{path}.confidence", 0.0, 1.0),
            "numbers": {self.text(k, f"{path}.{numbers_key}"): self.number(v, f"{path}.{numbers_key}.{k}")
                        for k, v in numbers.items()},
            "problems": tuple(self.text(item, f"{path}.problems[{i}]") for i, item in enumerate(problems)),
            "observed": self.text(fields.get("observed", ""), f"{path}.observed"),
            "beyond": self.diagnosis(fields.get("beyond"), f"{path}.beyond"),
        }

    def cause_count(self, value: Any, path: str) -> list[int]:
        if isinstance(value, Mapping) and set(value) == {"steps", "first_step"}:  # an older checkpoint's form
            value = [value["steps"], value["first_step"]]
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            self.refuse(path, "[steps, first step]", value)
        return [self.count(value[0], f"{path}[0]"), self.count(value[1], f"{path}[1]")]


def read_state(state: Any) -> tuple[dict[str, Any], list[str]]:
    """The monitor's checkpoint ``state`` (``KLSampleTrainMonitor.state_dict``) checked field by field: the patience
    counter, the calibration's fields and the history's (``_RUN_FIELDS``), each as the monitor keeps it, and the
    fields this version does not know (a newer version's). A value that cannot be is a ``ValueError`` naming its
    field; a field an older checkpoint lacks is left out (the monitor keeps its own value)."""
    walk = _State()
    if not isinstance(state, Mapping):
        raise ValueError(f"KLSampleTrainMonitor.load_state_dict: the state must be a mapping, got "
                         f"{type(state).__name__}")
    walk.mapping(state, "", ("exceeded_steps", "calibration", "history"), _OLDER_FIELDS[""])
    found: dict[str, Any] = {"exceeded_steps": walk.count(state.get("exceeded_steps", 0), "exceeded_steps"),
                             "calibration": {}, "history": {}}
    calibration = walk.mapping(state.get("calibration", {}), "calibration",
                               ("healthy_gaps", "recent_gaps", "recent_sampling_z"))
    for name in ("healthy_gaps", "recent_gaps"):
        if name in calibration:
            found["calibration"][name] = walk.numbers(calibration[name], f"calibration.{name}", least=0.0)
    if "recent_sampling_z" in calibration:  # older checkpoints lack it
        found["calibration"]["recent_sampling_z"] = walk.numbers(calibration["recent_sampling_z"],
                                                                 "calibration.recent_sampling_z")
    history = walk.mapping(state.get("history", {}), "history", _RUN_FIELDS, _OLDER_FIELDS["history"])
    read = {
        "logged_steps": lambda v, p: walk.count(v, p),
        "last_step": lambda v, p: walk.count(v, p, optional=True),
        "causes": lambda v, p: {walk.text(k, p): walk.cause_count(c, f"{p}.{k}")
                                for k, c in walk.mapping(v, p).items()},
        "last_step_with_action_tokens": lambda v, p: walk.count(v, p, optional=True),
        "metrics_with_action_tokens": lambda v, p: {walk.text(k, p): walk.number(m, f"{p}.{k}")
                                                    for k, m in walk.mapping(v, p).items()},
        "last_diagnosis": walk.diagnosis,
        "last_diagnosis_step": lambda v, p: walk.count(v, p, optional=True),
    }
    for name in _RUN_FIELDS:
        if name in history:
            found["history"][name] = read[name](history[name], f"history.{name}")
    return found, walk.unknown
