"""One logged step's report, from its host statistics: what the sinks deliver and the guard rail judges.

``step_report`` is a pure function of the statistics and the options: the scalar metrics, the
likely cause and its scalars, the media (histogram values and worst-token rows, built once for
every logger), what is impossible about the inputs, and the guard rail's judgement (why the step
exceeds, or why it cannot be trusted). Names are bare; the prefix is added when delivering (the
guard rail's message names the metric by its logged key).

Example:
    >>> import torch
    >>> from loops_callbacks.divergence.action_tokens import flatten_padded
    >>> from loops_callbacks.divergence.guard_rail import GuardRail
    >>> from loops_callbacks.divergence.statistics import DivergenceStats
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> report = step_report(DivergenceStats.from_batch(flat).to_host(), prefix="div/", media=MediaOptions(),
    ...                      guard_rail=GuardRail(max_kl=0.05, kl_metric="kl_sample_train_k3"), diagnosing=True)
    >>> report.scalars["kl_sample_train_v1_loops"], report.diagnosis.cause, report.exceeds
    (0.25, 'unclear', 'div/kl_sample_train_k3 = 0.0532653 exceeded max_kl = 0.05')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loops_callbacks.divergence.diagnosis import Diagnosis, diagnose, diagnosis_metrics
from loops_callbacks.divergence.evidence import DirectEvidence, SamplerFacts
from loops_callbacks.divergence.guard_rail import GuardRail, impossible_inputs
from loops_callbacks.divergence.media import MediaOptions, StepMedia, step_media
from loops_callbacks.divergence.metrics import scalar_metrics
from loops_callbacks.divergence.signatures import signature_numbers
from loops_callbacks.divergence.statistics import HostDivergence

__all__ = ["StepReport", "nan_advantages_message", "step_report"]


@dataclass(frozen=True)
class StepReport:
    """Everything one logged step says (module docstring); every name without the prefix."""

    scalars: dict[str, float]
    diagnosis: Diagnosis | None = None
    diagnosis_scalars: dict[str, float] = field(default_factory=dict)
    signatures: dict[str, float] = field(default_factory=dict)  # the numbers the diagnosis read
    media: StepMedia = field(default_factory=StepMedia)
    problems: dict[str, str] = field(default_factory=dict)  # impossible inputs, by a stable key
    exceeds: str | None = None  # why the step exceeds the guard rail; None: it does not (or no bound)
    untrusted: str | None = None  # why the numbers cannot be trusted, bound or not

    @property
    def has_action_tokens(self) -> bool:
        """Whether the step had masked-in action tokens, finite or not (something to judge)."""
        return self.scalars["n_action_tokens"] + self.scalars["n_skipped_nonfinite"] > 0

    def logged(self, prefix: str) -> dict[str, float]:
        """The scalars and the diagnosis' scalars, under ``prefix``."""
        return {prefix + name: value for name, value in {**self.scalars, **self.diagnosis_scalars}.items()}


def step_report(
    host: HostDivergence,
    *,
    prefix: str,
    media: MediaOptions,
    guard_rail: GuardRail,
    diagnosing: bool,
    noise_floor: float | None = None,
    evidence: DirectEvidence | None = None,
    facts: SamplerFacts | None = None,
    by_lag: Mapping[str, Any] | None = None,
    offsets: np.ndarray | None = None,
    trend: Sequence[float] = (),
) -> StepReport:
    """The report of the step whose statistics are ``host``.

    ``diagnosing`` names the likely cause (impossible inputs first: the statistical rule would read
    them as something else); ``noise_floor`` is the run's calibrated noise floor (``Calibration``); ``evidence``
    what was seen directly about the trainer (``evidence.observe_training``), ``facts`` what the sampling
    engine says about itself (``evidence.SamplerFacts``); ``by_lag`` the
    step's divergence by policy lag (``HostDivergence.by_lag``; ``None`` reads ``host.by_lag``
    when the statistics have it), ``offsets`` the host ``alignment.offset_sums`` vector (``None``
    reads ``host.offset_sums`` when present; else not measured) and ``trend`` the relative gaps of the
    run's previous logged steps, oldest first (``Calibration.recent_gaps``).
    """
    scalars = scalar_metrics(host, prefix="")
    problems = impossible_inputs(host)
    diagnosis, diagnosis_scalars, signatures = None, {}, {}
    if diagnosing and host.totals["n_action_tokens"] > 0:
        signatures = signature_numbers(host, offsets)
        diagnosis = _likely_cause(
            signatures,
            problems,
            host.totals["n_action_tokens"],
            noise_floor=noise_floor,
            evidence=evidence,
            facts=facts,
            by_lag=by_lag if by_lag is not None else getattr(host, "by_lag", None),
            trend=trend,
        )
        diagnosis_scalars = diagnosis_metrics(diagnosis, signatures, prefix="")
    return StepReport(
        scalars=scalars,
        diagnosis=diagnosis,
        diagnosis_scalars=diagnosis_scalars,
        signatures=signatures,
        media=step_media(host, media),
        problems=problems,
        exceeds=guard_rail.exceeds(scalars, host, prefix=prefix),
        untrusted=guard_rail.untrusted(scalars, host),
    )


def _likely_cause(
    signatures: Mapping[str, float], problems: Mapping[str, str], n_tokens: float, **context: Any
) -> Diagnosis:
    if problems:
        return Diagnosis.impossible_inputs(problems.values())
    return diagnose(signatures, n_tokens=n_tokens, **context)


def nan_advantages_message(totals: Mapping[str, float], label: str) -> str | None:
    """What to say about advantages holding NaN on masked-in positions (``n_advantage_nan``), from a
    step's totals (every micro-batch and rank together); ``None`` when there are none.

    ``label`` names the advantages key (``step_input.key_label``).

    Example:
        >>> nan_advantages_message({"n_advantage_nan": 2.0, "n_masked_in": 30.0}, "'advantages'").split(";")[0]
        "'advantages' holds NaN on 2 of the 30 masked-in positions (mask > 0) of the step, all ranks together"
        >>> nan_advantages_message({"n_advantage_nan": 0.0, "n_masked_in": 30.0}, "'advantages'") is None
        True
    """
    n_nan = totals["n_advantage_nan"]
    if not n_nan > 0:
        return None
    return (
        f"{label} holds NaN on {int(n_nan)} of the {int(totals['n_masked_in'])} masked-in positions (mask > 0) of "
        "the step, all ranks together; a NaN advantage counts as 0, so those tokens are not action tokens: the "
        "monitor's numbers leave them out, and a correction that needs advantages reads each datum's without them "
        "(0 where none is left)"
    )
