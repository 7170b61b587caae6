r"""
KL Sample-Train Monitor
=======================

Logs, every optimizer step, how far the sampler's logprobs are from the trainer's on exactly the
tokens that step trained on, and stops a run whose sampler and trainer have come apart — or whose
numbers can no longer be trusted (``guard_rail``).

A logged step, top to bottom (``on_train_batch_end``):

1. ``read_step``: the step's batch and ``training_step`` output become one ``FlatBatch``;
2. ``DivergenceStats.from_batch``: its statistics, merged over the step's micro-batches;
3. ``reduce_across_ranks`` and ``to_host``: every rank's statistics, on the host in one transfer;
4. ``step_report``: the step's report (metrics, likely cause, media, the guard rail's judgement);
5. the report is delivered to the loggers, remembered (``RunHistory``, ``Calibration``), its inputs are
   warned about (``report.about_step``), and the guard rail acts on it (``GuardRail.on_step``).

Lightning has no public API for two loop facts, so they are read here, as Lightning's own
``LearningRateMonitor`` reads loop internals: ``fit_loop.epoch_loop._batches_that_stepped`` (the
optimizer step a micro-batch belongs to) and ``fit_loop._should_accumulate()``; ``check_loop_internals``
fails at setup, naming the Lightning version, if a release renames them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning
import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override

from loops_callbacks.correction import Correction
from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.divergence.batch import ReadOptions, data_keys, observe_training, read_sampler_facts, read_step
from loops_callbacks.divergence.diagnosis import Calibration, Diagnosis
from loops_callbacks.divergence.guard_rail import GuardRail, SampleTrainDivergenceError, Verdict, watchable_metric
from loops_callbacks.divergence.history import RunHistory, read_state
from loops_callbacks.divergence.report import (
    TABLE_KEY, MediaOptions, ReportOptions, StepReport, Tokenizer, about_step, checked_tokenizer, deliver,
    deliver_text, step_report,
)
from loops_callbacks.divergence.statistics import (
    DEFAULT_PREFIX, DivergenceStats, StatisticsOptions, reduce_across_ranks,
)
from loops_callbacks.reference.rank_agreement import RanksDisagreeError, settings_difference
from loops_callbacks.run_warnings import RunWarnings, warn
from loops_callbacks.validation import check, check_bool, check_choice, check_int

__all__ = ["GuardRail", "KLSampleTrainMonitor", "MediaOptions", "SampleTrainDivergenceError", "Verdict"]


class KLSampleTrainMonitor(Callback):
    r"""Log sampler-vs-trainer logprob divergence once per optimizer step, and stop a run whose sampler broke.

    The metrics are those of ``loops_log_kl_sample_train`` (same keys, same formulas), computed over
    all micro-batches of an optimizer step on every rank and logged once per optimizer step — the
    numbers ``loops_compute_kl_sample_train`` gives on the concatenation of those micro-batches (rank
    0's first). Steps that are not logged cost nothing. What it reads and every key it logs: the docs'
    "The monitor" page. The ranks' monitors must share their settings: they are compared at setup, and
    ranks that differ all raise a ``RanksDisagreeError`` (a ``ValueError``) naming each setting.

    Args:
        interval: ``"optimizer_step"`` (one log per optimizer step, all its micro-batches and ranks
            together) or ``"forward_backward"`` (one log per micro-batch, as the SDK helper is called).
        log_every_n_steps: log every this many optimizer steps; ``None`` follows
            ``Trainer(log_every_n_steps=...)`` (steps n-1, 2n-1, ...). A fit that would end without a
            judged step also logs its last step, so a short run is judged too.
        prefix: prepended to every key.
        guard_rail: when to act on a logged step, and how (:class:`GuardRail`: ``max_kl``, ``kl_metric``,
            ``patience``, ``on_exceed``, ``max_nonfinite_fraction``, ``max_sampling_z``); the default has no
            bound.
        media: what is logged beside the scalars (:class:`MediaOptions`: the histogram, the worst-tokens
            table, the strata).
        tokenizer: anything with ``decode(list[int]) -> str`` to show the worst tokens as text.
        sample_size: diffs kept per logged step for percentiles and the histogram: exact up to this many
            action tokens; beyond, a uniform sample (a percentile's rank error below
            3·sqrt(q(1-q)/sample_size): ±0.09 percentile points at p99 with the default).
        keys: where to read the data, ``{name: key}`` for any of ``inputs.DATA_KEYS``.
        diagnose: name the likely cause of each logged step's divergence with its numbers (``diagnosis``):
            ``diagnosis/<cause>``, ``diagnosis/confidence``, ``signature/<name>`` and the text ``diagnosis``.
        calibration_steps: healthy logged steps from which the run's rounding-noise floor is learned
            (``Calibration``); ``0``: never, the prior bound holds.
        corrections: rollout corrections to shadow (``loops_callbacks.correction``): specs such as
            ``"sequence_mask:3.0"``, ``"geo:0.999_1.001"`` or ``Correction`` objects; each logged step
            logs what each would do, applying nothing (``shadow``). ``off_policy_mask`` reads one
            advantage per datum (``batch.read_advantages``); a sequence whose advantages cannot be read
            is not kept, and rank 0 says how many and on which ranks.
        max_policy_lag: the policy lag the run intends (``policy_version`` behind the trainer's optimizer
            steps; 1 for one-step-off-policy training): a datum further behind is stale, named as observed
            from the first step it is seen, whatever the size of the gap.

    Guard rail (on logged steps): a step exceeds when ``kl_metric`` is above ``max_kl``, and also when
    its numbers cannot be trusted: more than ``max_nonfinite_fraction`` non-finite logprobs, the metric
    NaN, infinite or impossibly negative, or inputs no sampled token can have (a logprob of -inf or +inf,
    above 0 beyond rounding or below -1e4, an entropy or varentropy that is NaN, infinite, negative or
    ruled out by the token's own logprob); the message says which. A step without masked-in action
    tokens is not judged (a run of them gets one warning). Impossible inputs get one warning per run
    naming the key and an example position, and are the step's likely cause (``impossible_inputs``).
    Checkpoints hold what the monitor learned and saw (the patience counter, the calibration, the run's
    history); not the verdict (it belongs to the fit that reached it).

    After a fit (kept by a later ``validate`` / ``test``): ``verdict`` (:class:`Verdict`),
    ``verdict_step``, ``stop_reason``, ``last_metrics`` (every number the loggers got at the last logged
    step, the diagnosis' and signature numbers too, under the same keys), ``last_worst_tokens`` (that
    step's worst-tokens table, one dict per row, whatever the logger: a CSV file holds only numbers),
    ``last_diagnosis`` and ``summary_lines()``, the run's summary, also logged as the text ``run_summary``
    when fit ends or fails.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from loops_callbacks import GuardRail, KLSampleTrainMonitor
        >>> trainer = Trainer(callbacks=[KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))])
    """

    def __init__(
        self,
        interval: Literal["optimizer_step", "forward_backward"] = "optimizer_step",
        log_every_n_steps: int | None = None,
        prefix: str = DEFAULT_PREFIX,
        guard_rail: GuardRail = GuardRail(),  # noqa: B008 - copied below: one shared default is never changed
        media: MediaOptions = MediaOptions(),  # noqa: B008
        tokenizer: Tokenizer | None = None,
        sample_size: int = 100_000,
        keys: Mapping[str, str] | None = None,
        diagnose: bool = True,
        calibration_steps: int = 5,
        corrections: Sequence[str | Correction] = (),
        max_policy_lag: int = 0,
    ) -> None:
        super().__init__()
        self.interval = check_choice("interval", interval, ("optimizer_step", "forward_backward"))
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, least=1, optional=True)
        check("prefix", prefix, str, "a str")
        check("guard_rail", guard_rail, GuardRail, "a GuardRail")
        # its own copy (a counter and a verdict of its own), the watched metric by its bare name
        self.guard_rail = dataclasses.replace(guard_rail, kl_metric=watchable_metric(guard_rail.kl_metric, prefix))
        media = check("media", media, MediaOptions, "a MediaOptions")
        tokenizer = checked_tokenizer(tokenizer)
        sample_size = check_int("sample_size", sample_size, least=1)
        diagnose = check_bool("diagnose", diagnose)
        self.calibration_steps = check_int("calibration_steps", calibration_steps, least=0)
        max_policy_lag = check_int("max_policy_lag", max_policy_lag, least=0)
        # each stage's settings in one object, handed whole; the attributes of the same names read them.
        # The statistics parse the corrections (a ValueError / TypeError naming a bad spec); the others take them.
        self.statistics = StatisticsOptions(top_n=media.rows, sample_size=sample_size, diagnose=diagnose,
                                            max_groups=media.strata_groups, corrections=corrections)
        corrections = self.statistics.corrections
        self.reading = ReadOptions(keys=data_keys(keys), with_tokens=media.rows > 0, diagnose=diagnose,
                                   max_groups=media.max_groups,
                                   datum_advantages=any(c.spec.needs_advantages for c in corrections))
        self.reporting = ReportOptions(media=media, diagnose=diagnose, tokenizer=tokenizer, corrections=corrections,
                                       max_policy_lag=max_policy_lag, prefix=prefix)
        self.warnings = RunWarnings()
        self._start_run()

    prefix = property(lambda self: self.reporting.prefix, doc="The logged metrics' prefix.")
    media = property(lambda self: self.reporting.media, doc="What is logged beside the scalars (``MediaOptions``).")
    tokenizer = property(lambda self: self.reporting.tokenizer, doc="Shows tokens as text (``None``: ids).")
    diagnose = property(lambda self: self.reporting.diagnose, doc="Whether each logged step names a likely cause.")
    corrections = property(lambda self: self.reporting.corrections, doc="The shadowed corrections, parsed.")
    max_policy_lag = property(lambda self: self.reporting.max_policy_lag, doc="The policy lag the run intends.")
    sample_size = property(lambda self: self.statistics.sample_size, doc="Diffs kept per logged step.")
    keys = property(lambda self: self.reading.keys, doc="Where each field is read (``data_keys``).")

    @property
    @override
    def state_key(self) -> str:
        # kl_metric with the prefix, as older versions named it: their checkpoints still load
        return self._generate_state_key(prefix=self.prefix, kl_metric=self.prefix + self.guard_rail.kl_metric)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # validate / test after fit keep the fit's history and verdict
            check_loop_internals(trainer)
            self._check_ranks_agree(trainer)
            self._start_run()
            self.warnings.reset()

    def _check_ranks_agree(self, trainer: pl.Trainer) -> None:
        """``RanksDisagreeError`` on every rank when the ranks' monitors differ in a setting they share (one
        small gather, before any step): which steps log, what the ranks exchange, when the guard rail acts."""
        group = ProcessGroup()
        if trainer.world_size == 1 or group.world_size != trainer.world_size:  # a strategy off torch.distributed
            return
        media = self.media
        shared = {
            "interval": self.interval, "log_every_n_steps": self._every(trainer), "prefix": self.prefix,
            "top_n": media.rows, "sample_size": self.sample_size, "diagnose": self.diagnose,
            "calibration_steps": self.calibration_steps, "max_policy_lag": self.max_policy_lag, "log_strata": media.log_strata, "max_groups": media.max_groups,
            "corrections": [c.name for c in self.corrections], "keys": self.keys, **self.guard_rail.settings(),
        }
        listed = settings_difference(group.all_gather_objects({name: repr(value) for name, value in shared.items()}))
        if listed:
            raise RanksDisagreeError(
                f"KLSampleTrainMonitor: the ranks' monitors have different settings ({listed}); every rank's "
                "monitor must have the same ones: they decide which steps are logged, what the ranks exchange at "
                "those steps and when the guard rail acts"
            )

    def _start_run(self) -> None:
        """The state of one run (set again when a fit starts; the checkpointed state is not)."""
        self.last_metrics: dict[str, float] = {}
        self.last_worst_tokens: list[dict[str, Any]] = []
        self.last_diagnosis: Diagnosis | None = None
        self.history = RunHistory()
        self.guard_rail.start_fit()
        self.calibration = Calibration(self.calibration_steps)
        self._step_stats: DivergenceStats | None = None  # the statistics of the optimizer step's micro-batches so far
        self._logged_keys: set[str] = set()  # the keys put in callback_metrics last
        self._contract_checked = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._last_step: int | None = None  # the fit's last optimizer step, when Lightning can tell it
        self.servers: list[str] = []  # the sampling servers (``sampler_server``), in the order first named

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = last_optimizer_step(trainer)
        self.history.fit_start, self.history.log_every_n_steps = trainer.global_step, self._every(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = optimizer_step_index(trainer)
        logged = self._logs_at(trainer, step)
        if not logged and self._contract_checked:
            return
        for source in (outputs, batch):  # a fleet's facts by server, in its order: the same on every rank
            fleet = source.get("sampler_facts_by_server") if isinstance(source, Mapping) else None
            for url in fleet if isinstance(fleet, Mapping) else ():
                if url not in self.servers:
                    self.servers.append(url)
        flat = read_step(outputs, batch, self.reading, optimizer_step=step if self.media.log_strata else None,
                         warnings=self.warnings, servers=self.servers)
        self._contract_checked = True  # the first batch is always read: a broken contract fails fast
        if not logged:
            return
        facts = read_sampler_facts(outputs, batch, self.keys, self.warnings)  # this rank's engine's own account
        if flat.device not in self._generators:  # the diff sample's own RNG (the user's never moves), seeded by rank
            self._generators[flat.device] = torch.Generator(device=flat.device).manual_seed(trainer.global_rank)
        generator = self._generators[flat.device]
        stats = DivergenceStats.from_batch(flat, self.statistics, generator=generator, rank=trainer.global_rank)
        self._step_stats = stats if self._step_stats is None else self._step_stats.merge(stats)
        if self.interval == "optimizer_step" and accumulating(trainer):
            return
        step_stats, self._step_stats = self._step_stats, None
        if trainer.world_size > 1:
            step_stats = reduce_across_ranks(step_stats, trainer.strategy, generator=generator)
        host = step_stats.to_host()  # the one host synchronization of a logged step
        report = step_report(
            host, self.reporting, guard_rail=self.guard_rail, calibration=self.calibration, facts=facts,
            # on every rank (the modules are the same on each), so every rank's report and guard rail agree
            evidence=observe_training(trainer, pl_module) if self.diagnose else None,
            servers=self.servers,  # the sampling servers the run has named, in slot order
        )
        self._deliver(trainer, report, step)
        self.last_metrics = {self.prefix + name: value for name, value in {**report.scalars, **report.breakdown}.items()}
        columns, rows = report.tables.get(TABLE_KEY, ((), []))
        self.last_worst_tokens = [dict(zip(columns, row, strict=True)) for row in rows]
        self.last_diagnosis = report.diagnosis
        self.history.observe(step, report.scalars, report.diagnosis)
        if report.diagnosis is not None:
            self.calibration.observe(report.diagnosis, report.signatures)
        about_step(self.warnings, self.keys, report, host, flat, step, max_groups=self.media.max_groups,
                   max_sampling_z=self.guard_rail.max_sampling_z)

        def say(message: str) -> None:  # the guard rail's message, to the loggers that show text (rank 0)
            if trainer.is_global_zero:
                deliver_text(trainer.loggers, self.prefix + "guard_rail", message, step=step, warnings=self.warnings)

        self.guard_rail.on_step(trainer, report, step, say=say, warnings=self.warnings, keys=self.keys)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard_rail.on_train_end(self.warnings, self.keys)
        self._deliver_summary(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._deliver_summary(trainer)  # after a raise too: the history is what explains it

    @property
    def verdict(self) -> Verdict:
        """What the guard rail did in this run: ``OFF``, ``NOTHING_JUDGED``, ``NO_EXCEEDANCE``, ``WARNED``,
        ``STOPPED`` or ``RAISED``."""
        return self.guard_rail.verdict

    @property
    def stop_reason(self) -> str | None:
        """The guard rail's message when it stopped this run (``on_exceed="stop"``), else ``None``."""
        return self.guard_rail.stop_reason

    @property
    def verdict_step(self) -> int | None:
        """The step at which the guard rail stopped, raised or first warned; ``None`` when it did not act."""
        return self.guard_rail.verdict_step

    def summary_lines(self) -> list[str]:
        """This run's summary as plain text, the verdict last (``RunHistory.lines``, ``GuardRail.verdict_line``):
        logged steps per likely cause with the first step of each, the last step with action tokens and its
        metrics, the last diagnosis. The same text is logged at the end of fit under ``<prefix>run_summary``."""
        history = self.history
        return [*history.lines(self.prefix), self.guard_rail.verdict_line(
            steps_trained=history.steps_trained, log_every_n_steps=history.log_every_n_steps, fit_start=history.fit_start)]

    @override
    def state_dict(self) -> dict[str, Any]:
        """What the run learned and saw, as plain data: the patience counter, the calibration, the history."""
        calibration = {"healthy_gaps": self.calibration.healthy_gaps, "recent_gaps": self.calibration.recent_gaps,
                       "recent_sampling_z": self.calibration.recent_sampling_z}
        return {**self.guard_rail.state_dict(), "calibration": calibration, "history": self.history.saved()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``; older checkpoints lack some of it (a ``stop_reason`` they saved belongs to
        the run that stopped). A damaged state is a ``ValueError`` naming the field, and nothing of it is kept; a
        field this version does not know (a newer version's) is a warning, and ignored."""
        found, unknown = read_state(state_dict)
        if unknown:
            warn(f"KLSampleTrainMonitor.load_state_dict: the checkpoint's {', '.join(unknown)} "
                 f"{'is' if len(unknown) == 1 else 'are'} not known to this version (written by a newer one?); "
                 "ignored")
        self.guard_rail.load_state_dict(found)
        for name, value in found["calibration"].items():
            setattr(self.calibration, name, value)
        self.history.restore(found["history"])

    @staticmethod
    def logs_this_step(trainer: pl.Trainer) -> bool:
        """Whether a ``KLSampleTrainMonitor`` of ``trainer`` logs the optimizer step being trained, so that what
        only the monitor reads is computed only then (the trainer's entropies cost one more vocabulary pass)::

            if KLSampleTrainMonitor.logs_this_step(self.trainer):
                fields = token_logprobs(logits, targets, with_entropy=True).outputs
            else:
                fields = {"training_logprobs": token_logprobs(logits, targets)}
        """
        step = optimizer_step_index(trainer)
        return any(isinstance(c, KLSampleTrainMonitor) and c._logs_at(trainer, step) for c in trainer.callbacks)

    def _logs_at(self, trainer: pl.Trainer, step: int) -> bool:
        """Lightning's rule (steps n-1, 2n-1, ...), and the fit's last step while the fit has judged none."""
        every = self._every(trainer)
        return (every > 0 and (step + 1) % every == 0) or (step == self._last_step and not self.guard_rail.judged_steps)

    def _every(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps

    def _deliver(self, trainer: pl.Trainer, report: StepReport, step: int) -> None:
        """Every scalar into ``callback_metrics`` (every rank; those of the previous logged step this one does not
        log are removed, so nothing reads a stale value); the report to the loggers (rank 0)."""
        logged = {self.prefix + name: value for name, value in {**report.scalars, **report.breakdown}.items()}
        for key in self._logged_keys - logged.keys():
            trainer.callback_metrics.pop(key, None)
        self._logged_keys = set(logged)
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in logged.items()})
        if trainer.is_global_zero:
            deliver(trainer.loggers, report, step=step, prefix=self.prefix, warnings=self.warnings)

    def _deliver_summary(self, trainer: pl.Trainer) -> None:
        self.history.steps_trained = trainer.global_step
        if trainer.is_global_zero:  # at or after every logged step: W&B drops steps behind its counter
            deliver_text(trainer.loggers, self.prefix + "run_summary", "\n".join(self.summary_lines()),
                         step=trainer.global_step, warnings=self.warnings, preformatted=True)


def check_loop_internals(trainer: pl.Trainer) -> None:
    """``RuntimeError`` naming the Lightning version when the loop attributes read here are gone."""
    epoch_loop = trainer.fit_loop.epoch_loop
    missing = [name for name, present in (
        ("fit_loop.epoch_loop._batches_that_stepped", isinstance(getattr(epoch_loop, "_batches_that_stepped", None), int)),
        ("fit_loop.epoch_loop._should_accumulate()", callable(getattr(epoch_loop, "_should_accumulate", None))),
    ) if not present]
    if missing:
        raise RuntimeError(
            f"KLSampleTrainMonitor reads {missing} of Lightning's training loop, which Lightning "
            f"{lightning.__version__} does not have; install a Lightning version in the range loops-callbacks "
            "declares (pip install 'lightning>=2.6,<2.7'), or report the new name"
        )


def optimizer_step_index(trainer: pl.Trainer) -> int:
    """The 0-based optimizer step this micro-batch belongs to: the step Lightning logs it under."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether more micro-batches follow before the optimizer steps (Lightning's own rule)."""
    return trainer.lightning_module.automatic_optimization and bool(trainer.fit_loop.epoch_loop._should_accumulate())


def last_optimizer_step(trainer: pl.Trainer) -> int | None:
    """The 0-based index of the fit's last optimizer step, or ``None`` when Lightning cannot tell it (an
    endless stream without ``max_steps``, an accumulation schedule)."""
    try:
        steps = trainer.estimated_stepping_batches
    except MisconfigurationException:
        return None
    return int(steps) - 1 if math.isfinite(steps) and steps >= 1 else None
