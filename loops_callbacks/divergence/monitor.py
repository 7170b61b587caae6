r"""
KL Sample-Train Monitor
=======================

Logs, every optimizer step, how far the sampler's logprobs are from the trainer's on exactly the
tokens that step trained on, and stops a run whose sampler and trainer have come apart — or whose
numbers can no longer be trusted (``loops_callbacks.divergence.guard_rail``).

A logged step, top to bottom (``on_train_batch_end``):

1. ``read_step``: the step's batch and ``training_step`` output become one ``FlatBatch``;
2. ``DivergenceStats.from_batch``: its statistics, merged over the micro-batches of the window;
3. ``reduce_across_ranks`` and ``to_host``: every rank's statistics, on the host in one transfer;
4. ``step_report``: one pure function turns them into the step's report (scalars, likely cause,
   media, the guard rail's judgement), with what is seen directly about the trainer
   (``observe_training``: live dropout, precision) and the divergence by policy lag;
5. the report is delivered (``sinks``), remembered (``RunHistory``), and acted on: warnings about
   the inputs, then the guard rail's patience and action (``_act``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override

from loops_callbacks.correction import Correction
from loops_callbacks.divergence.action_tokens import FlatBatch
from loops_callbacks.divergence.diagnosis import IMPOSSIBLE_INPUTS, Calibration, Diagnosis
from loops_callbacks.divergence.evidence import SamplerFacts, observe_training
from loops_callbacks.divergence.guard_rail import DEFAULT_MAX_NONFINITE_FRACTION, GuardRail, SampleTrainDivergenceError
from loops_callbacks.divergence.lightning_loop import (
    accumulating,
    check_loop_internals,
    last_optimizer_step,
    optimizer_step_index,
)
from loops_callbacks.divergence.media import MediaOptions
from loops_callbacks.divergence.metrics import DEFAULT_PREFIX
from loops_callbacks.divergence.report import StepReport, nan_advantages_message, step_report
from loops_callbacks.divergence.run_history import RunHistory, Verdict, restore_fields, saved_fields
from loops_callbacks.divergence.shadow import no_advantage_message, parse_corrections, shadow_scalars
from loops_callbacks.divergence.sinks import deliver, deliver_text
from loops_callbacks.divergence.statistics import LOGPROB_CEILING, LOGPROB_FLOOR, DivergenceStats, HostDivergence
from loops_callbacks.divergence.strata import AHEAD_STRATUM, DEFAULT_MAX_GROUPS, Strata
from loops_callbacks.divergence.step_input import DATA_KEYS, data_keys, key_label, read_sampler_facts, read_step
from loops_callbacks.divergence.worst_tokens import Tokenizer
from loops_callbacks.reference.collectives import Group
from loops_callbacks.reference.rank_agreement import RanksDisagreeError, settings_difference
from loops_callbacks.run_warnings import RunWarnings
from loops_callbacks.validation import check_bool, check_int

__all__ = ["DATA_KEYS", "KLSampleTrainMonitor", "SampleTrainDivergenceError", "Verdict"]

GUARD_RAIL_TEXT_KEY = "guard_rail"
"""Text key (under the prefix) of the guard rail's message, at the step it acted."""
DIAGNOSIS_TEXT_KEY = "diagnosis"
"""Text key (under the prefix) of each logged step's likely cause, with its evidence."""
RUN_SUMMARY_TEXT_KEY = "run_summary"
"""Text key (under the prefix) of the end-of-run summary (``summary_lines``), at the run's last step."""

_WATCHING_NOTHING_AFTER = 3
"""Logged steps without action tokens, from the start of a run, before the monitor says so."""


class KLSampleTrainMonitor(Callback):
    r"""Log sampler-vs-trainer logprob divergence once per optimizer step, and stop a run whose sampler broke.

    The metrics are those of ``loops_log_kl_sample_train`` (same keys, same formulas), computed
    over all micro-batches of an accumulation window on every rank and logged once per optimizer
    step — the numbers ``loops_compute_kl_sample_train`` gives on the concatenation of those
    micro-batches (rank 0's first). Steps that are not logged cost nothing. The ranks' monitors
    must share their settings: they are compared once, at setup, and ranks that differ all raise a
    ``RanksDisagreeError`` (a ``ValueError``) naming each setting and each rank's value.

    Args:
        interval: ``"optimizer_step"`` (one log per optimizer step, all its micro-batches and
            ranks together) or ``"forward_backward"`` (one log per micro-batch, as the SDK helper
            is called after each ``forward_backward``).
        log_every_n_steps: log every this many optimizer steps; ``None`` follows
            ``Trainer(log_every_n_steps=...)`` (Lightning's rule: steps n-1, 2n-1, ...). A fit that
            would end without a judged step (``max_steps`` below the interval) also logs its last
            step, where Lightning logs nothing, so a short run is judged too.
        prefix: prepended to every key.
        log_histogram: log the per-token diff histogram (W&B, TensorBoard).
        max_histogram_tokens: at most this many diffs in the histogram (evenly subsampled).
        log_worst_tokens: log the worst-divergent-tokens table (W&B table, TensorBoard text).
        top_n: rows of that table.
        tokenizer: anything with ``decode(list[int]) -> str`` (a Hugging Face tokenizer) to show
            the table's tokens as text; ids are shown without one.
        sample_size: diffs kept per logged step for percentiles and the histogram. Up to this many
            action tokens per step the percentiles are exact; beyond, they come from a uniform
            sample of this size (rank error of a percentile below 3·sqrt(q(1-q)/sample_size):
            ±0.09 percentile points at p99 with the default).
        max_kl: guard rail: the bound on ``kl_metric``; ``None`` disables it (untrusted steps are
            then still warned about, never acted on).
        kl_metric: the metric the guard rail watches: one of the scalar keys below, bare
            (``"kl_sample_train_k3"``) or with the prefix; any other name is a ``ValueError``.
        patience: logged steps in a row that exceed before acting.
        on_exceed: ``"warn"``, ``"stop"`` (end training cleanly, as ``EarlyStopping`` does) or
            ``"raise"`` (:class:`SampleTrainDivergenceError`).
        max_sampling_z: guard rail: a bound on |``sampling_z``|, the check of what was sampled (off by
            default; needs ``training_entropy`` and ``training_varentropy`` in the batch, from
            ``token_logprobs(..., with_entropy=True)``): a step beyond it exceeds, as above ``max_kl``.
        max_nonfinite_fraction: a logged step whose masked-in action tokens had more than this
            share of missing, NaN or infinite logprobs exceeds (default 0.01; 0 skipped is the
            healthy case, and any skipped token is counted in ``n_skipped_nonfinite``).
        keys: where to read the data, as ``{name: key}`` for any of ``data``,
            ``training_logprobs``, ``forward_backward_output``, ``logprobs`` (the sampler's),
            ``mask``, ``advantages``, ``target_tokens``, ``input_ids``, ``policy_version``,
            ``group``; each defaults to its name.
        diagnose: on every logged step, name the likely cause of the divergence with its
            evidence (``loops_callbacks.divergence.diagnosis``): logged as
            ``diagnosis/<cause>`` indicators, ``diagnosis/confidence``, ``signature/<name>``
            numbers and the text ``diagnosis``; the guard rail's message names it too.
        calibration_steps: healthy logged steps from which the run's rounding-noise floor is learned
            (``diagnosis.Calibration``: their median relative gap; a step within 20x of it is
            precision, and no other cause is named); ``0``: never, the prior bound 1e-3 holds.
        log_strata: log the divergence by stratum (``loops_callbacks.divergence.strata``): k3,
            mean |d|, IS-ratio mean and tokens by sampler probability, by quartile of each
            datum's action tokens, by policy lag and by group.
        max_groups: groups kept apart in the strata (ids ``0`` to ``max_groups - 1``); datums with
            a larger id are pooled in ``group_other``, with one warning per run. The cost follows
            the groups given, not ``max_groups`` (across ranks: the largest group index given,
            which string labels, hashed into ``max_groups`` buckets, may bring near it).
        corrections: rollout corrections to shadow (``loops_callbacks.correction``): specs such as
            ``"sequence_mask:3.0"``, ``"token_truncate:2.0"``, ``"geo:0.999_1.001"`` (YAML-friendly)
            or ``Correction`` objects. Each logged step logs what each would do, without applying
            anything (``loops_callbacks.divergence.shadow``). ``off_policy_mask`` reads one
            advantage per datum (``advantages`` ``[B]`` or ``[B, 1]``, or a one-value field of
            each datum; per-token ``[B, T]`` advantages, as verl keeps them, or a per-position
            field of each datum, as Tinker datums carry them, give each row the value of its
            counted tokens, their mean with one warning where a row's differ: one host read per
            micro-batch of a logged step); a datum whose advantages cannot be read (none, bools, a
            shape that fits no datum) is not kept, and rank 0 says how many and on which ranks.

    Guard rail (checked on logged steps, so set ``log_every_n_steps`` to how soon a broken sync must
    be caught). A logged step exceeds when ``kl_metric`` is above ``max_kl``, and also when its
    numbers cannot be trusted: more than ``max_nonfinite_fraction`` non-finite logprobs (every
    token non-finite: the metrics are missing), the metric NaN, infinite, or negative where it
    cannot be (all but ``kl_sample_train_v1_loops``, ``diff_mean``, ``seq_log_ratio_mean``,
    ``chi2_token``), or a logprob below -1e4 (a sentinel such as ``torch.finfo(float32).min``).
    The message says which. A step without masked-in action tokens is not judged; a run whose
    logged steps all have none gets one warning (the monitor is watching nothing). Logprobs above
    1e-4 (probabilities passed as logprobs?) and sentinels get one warning per run naming the key
    and an example position; such inputs are also the step's likely cause (``impossible_inputs``),
    never a statistical cause they would mimic. Checkpoints hold what the monitor learned and saw:
    the patience counter, the diagnosis' calibration and recent k3, the run's history (so resumed
    steps are diagnosed as uninterrupted ones); not the verdict or the stop reason (they belong to the
    fit that reached them: a resumed fit judges from its first step on).

    What the guard rail did, and the run's history (reset when a fit starts, continued by a fit
    resumed from a checkpoint; kept by a later ``validate`` / ``test``):

    * ``verdict``: a :class:`Verdict`: ``OFF`` (``max_kl=None``), ``NOTHING_JUDGED`` (no logged step
      had masked-in action tokens, or none was logged: the summary says which), ``NO_EXCEEDANCE``,
      ``WARNED``, ``STOPPED`` or ``RAISED``; ``verdict_step`` is the step it stopped or raised at (or first
      warned at), ``None`` when it did not act;
    * ``stop_reason``: the guard rail's message when it stopped the run, else ``None``;
    * ``last_metrics`` and ``last_diagnosis``: those of the last logged step;
    * ``summary_lines()``: the run's summary as plain text, the verdict last: the logged steps per
      likely cause with the first step of each, the last step with action tokens and its metrics,
      the last diagnosis. It is also logged as text (``run_summary``, TensorBoard / W&B) when fit
      ends, or fails.

    Data contract (read in ``on_train_batch_end``; each key is looked up in ``training_step``'s
    returned dict first, then in the batch):

    * Padded form: ``logprobs`` (sampler, ``[B, T]``), ``mask`` (``[B, T]``, 1.0 on action
      tokens), optional ``advantages`` (``[B, T]`` or ``[B]``; a NaN advantage counts as 0, said
      once per run with how many masked-in positions of the logged step had one, every rank and
      device together), ``target_tokens``, ``input_ids``, and ``training_logprobs`` ``[B, T]``
      (position k holds the logprob of the token predicted at k)::

          def training_step(self, batch, batch_idx):
              logprobs = self.token_logprobs(batch["input_ids"], batch["target_tokens"])
              loss = ...
              return {"loss": loss, "training_logprobs": logprobs}  # the monitor detaches it

    * Loops form: the batch is a ``list[Datum]`` (or holds one under ``"data"``) and the output
      holds ``training_logprobs`` (per-datum rows or a padded ``[B, T]`` tensor) or a
      ``forward_backward_output``::

          return {"loss": loss, "forward_backward_output": ForwardBackwardOutput(...)}

      (A ``DataLoader`` of datums needs ``collate_fn=list``. The worst-tokens table's token ids
      are then read from the datums on the host: one small synchronization per micro-batch of a
      logged step, where the padded form gathers them on the device.)

    * Optional, either form: ``policy_version`` (``[B]`` ints: the version of the sampler's
      weights that generated each datum, counted in the trainer's optimizer steps, 0 for the
      initial weights) and ``group`` (``[B]`` ints >= 0: a task or environment id, or string
      labels), as lists or tensors (read with ``log_strata`` only; lists and CPU tensors are
      checked on the host, int tensors on an accelerator are used there without a host read, and
      other values on an accelerator are copied to the host: one small transfer); in the datum form
      also a one-value field of each datum's ``loss_fn_inputs``. A datum's policy lag is the
      optimizer step being trained minus its version (``step_input`` says why the trainer's step is
      the reference). These keys never stop training: a version ahead of the trainer is read as
      lag 0 and counted in the stratum ``lag_ahead``, a negative group id goes to
      ``group_other``, string labels to the bucket ``zlib.crc32(label) % max_groups`` (the same
      on every rank; labels sharing a bucket are pooled), and anything else unusable (a key on
      only some datums, a wrong count, a non-integer, a tensor on the meta device) turns that
      family off for the step; each is one warning per run naming the key, a value and its datum
      (on an accelerator: the count, after the step's host read).

    Under manual optimization each ``training_step`` is one window: return the trainer logprobs
    of everything the step trained on.

    Logged metrics (each key starts with ``prefix``, default ``optim/train-sample-div/``):

    * ``kl_sample_train_v1_loops``, ``kl_sample_train_v2_loops``, ``kl_sample_train_k3``
    * ``is_ratio_mean``, ``is_ratio_max``, ``is_ratio_min``, ``ess_fraction``, ``chi2_token``
    * ``diff_mean``, ``diff_abs_p50``, ``diff_abs_p90``, ``diff_abs_p99``, ``diff_abs_max``
    * ``frac_abs_gt_1``, ``frac_abs_gt_2``, ``frac_abs_gt_4``, ``frac_is_ratio_gt_2``,
      ``frac_is_ratio_lt_0.5``
    * ``seq_log_ratio_mean``, ``seq_is_ratio_mean``, ``seq_is_ratio_max``
    * ``entropy``, ``n_action_tokens``, ``n_sequences``, ``n_skipped_nonfinite``
    * ``per_token_diff_hist`` (W&B histogram, TensorBoard histogram)
    * ``worst_tokens`` (W&B table, TensorBoard text)
    * with ``log_strata``, in a second record at the same step: ``stratum/<name>/k3``,
      ``stratum/<name>/abs_d_mean``, ``stratum/<name>/is_ratio_mean``, ``stratum/<name>/n_tokens``
      for each stratum with tokens: ``p_lt_0.01``, ``p_0.01_0.1``, ``p_0.1_0.5``, ``p_0.5_0.9``,
      ``p_ge_0.9`` (the sampler's probability), ``pos_q1`` … ``pos_q4``, ``lag_0`` … ``lag_3``,
      ``lag_4_7``, ``lag_8_plus``, ``lag_ahead`` (versions ahead of the trainer, also in
      ``lag_0``), ``group_<id>``, ``group_other``; and the table ``strata``
      with them side by side (W&B table, TensorBoard text)
    * with ``corrections``, in that second record: ``correction/<name>/frac_tokens_masked``,
      ``frac_seqs_masked``, ``frac_tokens_clipped``, ``frac_seqs_clipped``, ``ess_tokens``,
      ``ess_seqs``, ``mean_weight`` per correction, and the raw ratio extremes before any
      truncation ``correction/raw/token_ratio_max`` / ``_min``, ``seq_ratio_max`` / ``_min``,
      ``seq_geo_ratio_max`` / ``_min``

    A step without action tokens logs only ``n_action_tokens = 0`` and the two counts. The
    scalars are also put in ``trainer.callback_metrics``, so ``EarlyStopping`` and
    ``ModelCheckpoint`` can monitor them; a stratum or correction key that a logged step does not
    log (no tokens in that stratum) is removed from there until it is logged again, so watch one
    with ``EarlyStopping(..., strict=False)``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from loops_callbacks import KLSampleTrainMonitor
        >>> trainer = Trainer(callbacks=[KLSampleTrainMonitor(max_kl=0.05, on_exceed="stop")])
    """

    def __init__(
        self,
        interval: Literal["optimizer_step", "forward_backward"] = "optimizer_step",
        log_every_n_steps: int | None = None,
        prefix: str = DEFAULT_PREFIX,
        log_histogram: bool = True,
        max_histogram_tokens: int = 50000,
        log_worst_tokens: bool = True,
        top_n: int = 20,
        tokenizer: Tokenizer | None = None,
        sample_size: int = 100_000,
        max_kl: float | None = None,
        kl_metric: str = "kl_sample_train_k3",
        patience: int = 1,
        on_exceed: Literal["warn", "stop", "raise"] = "stop",
        max_nonfinite_fraction: float = DEFAULT_MAX_NONFINITE_FRACTION,
        max_sampling_z: float | None = None,
        keys: Mapping[str, str] | None = None,
        diagnose: bool = True,
        calibration_steps: int = 5,
        log_strata: bool = True,
        max_groups: int = DEFAULT_MAX_GROUPS,
        corrections: Sequence[str | Correction] = (),
    ) -> None:
        super().__init__()
        if interval not in ("optimizer_step", "forward_backward"):
            raise ValueError(f"interval must be 'optimizer_step' or 'forward_backward', got {interval!r}")
        if on_exceed not in ("warn", "stop", "raise"):
            raise ValueError(f"on_exceed must be 'warn', 'stop' or 'raise', got {on_exceed!r}")
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, least=1)
        check_int("max_histogram_tokens", max_histogram_tokens, least=None, what=" (<= 0: no cap)")
        check_int("top_n", top_n, least=0)
        check_int("sample_size", sample_size, least=1)
        check_int("patience", patience, least=1)
        check_int("calibration_steps", calibration_steps, least=0)
        check_bool("log_histogram", log_histogram)
        check_bool("log_worst_tokens", log_worst_tokens)
        check_bool("diagnose", diagnose)
        check_bool("log_strata", log_strata)
        self.strata = Strata(max_groups) if log_strata else None  # checks max_groups
        self.max_groups = max_groups
        self.corrections = parse_corrections(corrections)  # ValueError / TypeError naming a bad spec
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode(list[int]) method, got {type(tokenizer).__name__}")
        self.interval = interval
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.media = MediaOptions(log_histogram, max_histogram_tokens, log_worst_tokens, tokenizer)
        self.top_n = top_n if log_worst_tokens else 0
        self.sample_size = sample_size
        self.guard_rail = GuardRail(max_kl, kl_metric, prefix, max_nonfinite_fraction, max_sampling_z)  # checks them
        self.max_sampling_z = self.guard_rail.max_sampling_z
        self.max_kl = self.guard_rail.max_kl
        self.kl_metric = self.guard_rail.kl_metric  # the bare name
        self.patience = patience
        self.on_exceed = on_exceed
        self.keys = data_keys(keys)
        self.diagnosing = diagnose
        self.calibration_steps = calibration_steps
        self.exceeded_steps = 0
        self.warnings = RunWarnings()
        self._start_run()

    @property
    @override
    def state_key(self) -> str:
        # kl_metric with the prefix, as older versions named it: their checkpoints still load
        return self._generate_state_key(prefix=self.prefix, kl_metric=self.prefix + self.kl_metric)

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
        group = Group()
        if trainer.world_size == 1 or group.world_size != trainer.world_size:  # a strategy off torch.distributed
            return
        shared = {
            "interval": self.interval, "log_every_n_steps": self._every(trainer), "prefix": self.prefix,
            "top_n": self.top_n, "sample_size": self.sample_size, "diagnose": self.diagnosing,
            "calibration_steps": self.calibration_steps, "log_strata": self.strata is not None,
            "max_groups": self.max_groups, "corrections": [c.name for c in self.corrections], "keys": self.keys,
            "max_kl": self.max_kl, "kl_metric": self.kl_metric, "patience": self.patience,
            "on_exceed": self.on_exceed, "max_nonfinite_fraction": self.guard_rail.max_nonfinite_fraction,
            "max_sampling_z": self.max_sampling_z,
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
        self.history = RunHistory(self.kl_metric, self.max_kl, self.max_sampling_z)
        self.calibration = Calibration(self.calibration_steps)
        self.last_diagnosis: Diagnosis | None = None
        self._window: DivergenceStats | None = None
        self._last_flat: FlatBatch | None = None
        self._facts: SamplerFacts | None = None  # what the sampling engine said about itself, last
        self._breakdown_keys: set[str] = set()  # the strata and shadow keys put in callback_metrics last
        self._contract_checked = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._last_step: int | None = None  # the fit's last optimizer step, when Lightning can tell it

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
        flat = read_step(
            outputs,
            batch,
            self.keys,
            with_tokens=self.top_n > 0,
            with_token_ids=self.diagnosing,
            optimizer_step=step if self.strata is not None else None,
            max_groups=self.strata.max_groups if self.strata is not None else DEFAULT_MAX_GROUPS,
            datum_advantages=any(c.spec.needs_advantages for c in self.corrections),
            warnings=self.warnings,
        )
        self._contract_checked = True  # the first batch is always read: a broken contract fails fast
        if not logged:
            return
        self._facts = read_sampler_facts(outputs, batch, self.keys, self.warnings)  # the window's last micro-batch
        stats = DivergenceStats.from_batch(
            flat,
            top_n=self.top_n,
            sample_size=self.sample_size,
            generator=self._generator(flat.device, trainer.global_rank),
            signatures=self.diagnosing,
            strata=self.strata,
            corrections=self.corrections,
            rank=trainer.global_rank,
        )
        self._window = stats if self._window is None else self._window.merge(stats)
        self._last_flat = flat
        if self.interval == "optimizer_step" and accumulating(trainer):
            return
        window, self._window = self._window, None
        if trainer.world_size > 1:
            window = window.reduce_across_ranks(
                trainer.strategy, generator=self._generator(window.totals.device, trainer.global_rank)
            )
        host = window.to_host()  # the one host synchronization of a logged step
        report = step_report(
            host,
            prefix=self.prefix,
            media=self.media,
            guard_rail=self.guard_rail,
            diagnosing=self.diagnosing,
            noise_floor=self.calibration.noise_floor,
            # on every rank (the modules are the same on each), so every rank's report and guard rail agree
            evidence=observe_training(trainer, pl_module) if self.diagnosing else None,
            facts=self._facts,  # this rank's engine's own account
            by_lag=host.by_lag or None,
            offsets=host.offset_sums,
            trend=self.calibration.recent_gaps,  # the relative gaps of the run's previous logged steps
        )
        shadow = shadow_scalars(host.extra_totals, host.extra_extrema, self.corrections) if self.corrections else {}
        self._deliver(trainer, report, shadow, step)
        self._remember(report, step)
        self._warn_about_inputs(report, step)
        self._warn_about_advantages(host, step)
        self._warn_about_groups(host, step)
        self._act(trainer, report, step)
        self._last_flat = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.history.fit_logged_steps and not self.history.judged_steps:
            self._warn_watching_nothing()
        self._deliver_summary(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._deliver_summary(trainer)  # after a raise too: the history is what explains it

    @property
    def verdict(self) -> Verdict:
        """What the guard rail did in this run: ``OFF``, ``NOTHING_JUDGED``, ``NO_EXCEEDANCE``, ``WARNED``,
        ``STOPPED`` or ``RAISED``."""
        return self.history.verdict

    @property
    def stop_reason(self) -> str | None:
        """The guard rail's message when it stopped this run (``on_exceed="stop"``), else ``None``."""
        return self.history.verdict_reason if self.history.verdict is Verdict.STOPPED else None

    @property
    def verdict_step(self) -> int | None:
        """The step at which the guard rail stopped, raised or first warned; ``None`` when it did not act."""
        return self.history.verdict_step

    def summary_lines(self) -> list[str]:
        """This run's summary as plain text lines, the guard rail's verdict last (``RunHistory.lines``).

        Logged steps per likely cause with the first step of each, the last step with action
        tokens and its metrics, the last diagnosis, and the verdict. The same text is logged at
        the end of fit under ``<prefix>run_summary``.
        """
        return self.history.lines(self.prefix)

    @override
    def state_dict(self) -> dict[str, Any]:
        """What the run learned and saw, as plain data: the patience counter, the diagnosis' calibration and
        trend, the run's history (``run_history.saved_fields``; not the verdict: it belongs to the fit)."""
        return {
            "exceeded_steps": self.exceeded_steps,
            "calibration": saved_fields(self.calibration, skip=("calibration_steps",)),
            "history": saved_fields(self.history, skip=RunHistory.FIT_FIELDS),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``'s state; older checkpoints lack some of it (a ``stop_reason`` they saved
        belongs to the run that stopped)."""
        self.exceeded_steps = state_dict.get("exceeded_steps", 0)
        restore_fields(self.calibration, state_dict.get("calibration", {}))
        restore_fields(self.history, state_dict.get("history", {}))

    @staticmethod
    def logs_this_step(trainer: pl.Trainer) -> bool:
        """Whether a ``KLSampleTrainMonitor`` of ``trainer`` logs the optimizer step being trained, so that what
        only the monitor reads is computed only then (the trainer's entropies cost one more pass over the
        vocabulary)::

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
        return (every > 0 and (step + 1) % every == 0) or (step == self._last_step and not self.history.judged_steps)

    def _every(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps

    def _generator(self, device: torch.device, rank: int) -> torch.Generator:
        """A private RNG for the percentile sample, so monitoring never moves the user's RNG.

        Seeded with the rank, so ranks draw independent keys (rank 0 as a single process does).
        """
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(rank)
        return self._generators[device]

    def _deliver(self, trainer: pl.Trainer, report: StepReport, breakdown: dict[str, float], step: int) -> None:
        """The report's scalars into ``callback_metrics`` (every rank); everything to the loggers (rank 0),
        ``breakdown`` (the corrections' shadow metrics) in the second record with the strata.

        The strata and shadow scalars go into ``callback_metrics`` too, so ``EarlyStopping`` and
        ``ModelCheckpoint`` can watch any logged number; those of the previous logged step that this
        one does not log (a stratum without tokens now) are removed, so nothing reads a stale value."""
        logged = report.logged(self.prefix)
        strata = report.media.strata.scalars if report.media.strata is not None else {}
        extra = {self.prefix + name: value for name, value in {**strata, **breakdown}.items()}
        for key in self._breakdown_keys - extra.keys():  # a stratum or correction without tokens now: no stale value
            trainer.callback_metrics.pop(key, None)
        self._breakdown_keys = set(extra)
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in {**logged, **extra}.items()})
        if not trainer.is_global_zero:
            return
        deliver(
            trainer.loggers,
            report,
            step=step,
            prefix=self.prefix,
            warnings=self.warnings,
            scalars=logged,
            breakdown=breakdown,
        )
        if report.diagnosis is not None:
            key = self.prefix + DIAGNOSIS_TEXT_KEY
            deliver_text(trainer.loggers, key, report.diagnosis.message, step=step, warnings=self.warnings)

    def _deliver_summary(self, trainer: pl.Trainer) -> None:
        self.history.steps_trained = trainer.global_step
        if trainer.is_global_zero:
            text, key = "\n".join(self.summary_lines()), self.prefix + RUN_SUMMARY_TEXT_KEY
            step = trainer.global_step  # at or after every logged step: W&B drops steps behind its counter
            deliver_text(trainer.loggers, key, text, step=step, warnings=self.warnings, preformatted=True)

    def _remember(self, report: StepReport, step: int) -> None:
        """The run's state after this step: last metrics and diagnosis, the history, the calibration."""
        self.last_metrics = {self.prefix + name: value for name, value in report.scalars.items()}
        self.last_diagnosis = report.diagnosis
        self.history.observe(step, report.scalars, report.diagnosis)
        if report.diagnosis is not None:
            self.calibration.observe(report.diagnosis, report.signatures)

    def _warn_about_inputs(self, report: StepReport, step: int) -> None:
        """Say once per run that the monitor watches nothing, and once per problem that the inputs are impossible."""
        if self.history.fit_logged_steps == _WATCHING_NOTHING_AFTER and not self.history.judged_steps:
            self._warn_watching_nothing()
        for problem, message in report.problems.items():
            if not self.warnings.said(problem):
                self.warnings.warn(
                    problem, f"KLSampleTrainMonitor, step {step}: {message} ({self._example(problem)})"
                )
        if self.max_sampling_z is not None and report.has_action_tokens and "sampling_z" not in report.scalars:
            entropies = [self.keys[name] for name in ("training_entropy", "training_varentropy")]
            self.warnings.warn(
                "sampling_z:missing",
                f"KLSampleTrainMonitor, step {step}: max_sampling_z = {self.max_sampling_z:g} is set but the step has "
                f"no {entropies[0]!r} and {entropies[1]!r} (token_logprobs(..., with_entropy=True) returns them): "
                "what was sampled is not checked",
            )

    def _warn_about_advantages(self, host: HostDivergence, step: int) -> None:
        """Say once per run that advantages held NaN on masked-in positions (``report.nan_advantages_message``),
        and that a correction could not read them (``shadow.no_advantage_message``).

        Counted on each rank's device with the statistics and read from the reduced totals, so a problem on
        any rank, on any device, is said (by rank 0) without a host read of its own.
        """
        label = key_label(self.keys, "advantages")
        messages = {
            f"advantages_nan:{self.keys['advantages']}": nan_advantages_message(host.totals, label),
            "advantages_unusable": no_advantage_message(host.extra_totals, host.extra_extrema, label),
        }
        for key, message in messages.items():
            if message is not None and not self.warnings.said(key):
                self.warnings.warn(key, f"KLSampleTrainMonitor, step {step}: {message}")

    def _warn_about_groups(self, host: HostDivergence, step: int) -> None:
        """Say once per run that group ids beyond ``max_groups`` are pooled as ``group_other``, and that
        versions ahead of the trainer were seen (where ``read_step`` could not say it: on an accelerator)."""
        if host.strata is not None and host.strata[AHEAD_STRATUM].n_tokens and not self.warnings.said(
            "policy_version:ahead"
        ):
            self.warnings.warn(
                "policy_version:ahead",
                f"KLSampleTrainMonitor, step {step}: {int(host.strata[AHEAD_STRATUM].n_tokens)} action tokens are "
                f"of datums whose {self.keys['policy_version']!r} is ahead of the trainer's optimizer step; they are "
                f"counted at lag 0 and in the stratum {AHEAD_STRATUM!r} (versions must count the trainer's "
                "optimizer steps, 0 for the initial weights)",
            )
        if host.strata is not None:
            self._warn_about_partial_keys(host, step)
        if host.strata is not None and "group_other" in host.strata:  # only groups with tokens are there
            self.warnings.warn(
                "group_other",
                f"KLSampleTrainMonitor, step {step}: datums with {self.keys['group']!r} >= max_groups = "
                f"{self.strata.max_groups} (or negative) are pooled in the stratum 'group_other'; raise max_groups "
                "to see them apart",
            )

    def _warn_about_partial_keys(self, host: HostDivergence, step: int) -> None:
        """Say once per run that a per-datum key covered only part of the step's action tokens.

        Each rank turns a key it cannot use off for its own datums (``read_step``), and only rank 0
        warns; this is how a problem on another rank is still said: the global sums show it.
        """
        assert host.strata is not None
        tokens = host.totals["n_action_tokens"]
        families = {
            "policy_version": sum(stratum.n_tokens for stratum in host.by_lag.values()),
            "group": sum(host.strata[name].n_tokens for name in host.strata if name.startswith("group_")),
        }
        for name, covered in families.items():
            if 0 < covered < tokens:
                self.warnings.warn(
                    f"{name}:partial",
                    f"KLSampleTrainMonitor, step {step}: {self.keys[name]!r} was usable for {int(covered)} of the "
                    f"step's {int(tokens)} action tokens (all ranks together); the rest are not in its strata. A rank "
                    "or datum gave it in a form the monitor could not read (every rank must give it for every datum)",
                )

    def _warn_watching_nothing(self) -> None:
        self.warnings.warn(
            "watching_nothing",
            f"KLSampleTrainMonitor: none of the {self.history.fit_logged_steps} logged step(s) had an action token "
            f"({self.keys['mask']!r} > 0 with a non-zero {self.keys['advantages']!r}); the monitor is watching "
            "nothing — check the mask (1.0 on the tokens the policy sampled) and the advantages",
        )

    def _example(self, problem: str) -> str:
        """Where one offending logprob sits in the step's last micro-batch, and under which key."""
        side, _, kind = problem.partition("_")
        key = self.keys["logprobs"] if side == "sampler" else self.keys["training_logprobs"]
        flat = self._last_flat
        if kind == "all_zero" or flat is None:
            return f"key {key!r}"
        values = flat.sampler if side == "sampler" else flat.trainer
        offending = flat.active & (values > LOGPROB_CEILING if kind == "above_zero" else values < LOGPROB_FLOOR)
        found = torch.nonzero(offending)
        if found.numel() == 0:
            return f"key {key!r}, in an earlier micro-batch of the step"
        index = int(found[0, 0])
        ends = torch.cumsum(flat.row_lengths, 0).cpu()
        datum = int(torch.searchsorted(ends, index, right=True))
        position = index - (int(ends[datum - 1]) if datum else 0)
        value = float(values[index])
        return f"key {key!r}, e.g. {value:.3g} at datum {datum}, position {position} of the last micro-batch"

    def _act(self, trainer: pl.Trainer, report: StepReport, step: int) -> None:
        """The guard rail's patience and action on the report's judgement: warn, stop or raise."""
        if report.exceeds is None:
            if report.untrusted is not None:  # no bound set: say it, act on nothing
                untrusted = report.untrusted
                self.warnings.warn(f"untrusted:{untrusted}", f"KLSampleTrainMonitor, step {step}: {untrusted}")
            self.exceeded_steps = 0
            return
        self.exceeded_steps += 1
        if self.exceeded_steps < self.patience:
            return
        message = (
            f"{report.exceeds} at step {step} ({self.exceeded_steps} logged step(s) in a row, "
            f"patience {self.patience}): the sampler's logprobs no longer match the trainer's — {_advice(report)}"
        )
        verdict = {"warn": Verdict.WARNED, "stop": Verdict.STOPPED, "raise": Verdict.RAISED}[self.on_exceed]
        self.history.acted(verdict, step, message)
        if self.on_exceed == "stop":
            trainer.should_stop = True
            message += " Signaling Trainer to stop."
        if trainer.is_global_zero:
            deliver_text(trainer.loggers, self.prefix + GUARD_RAIL_TEXT_KEY, message, step=step, warnings=self.warnings)
        if self.on_exceed == "raise":
            raise SampleTrainDivergenceError(message)
        self.warnings.warn(f"exceeded:{step}", message)


def _advice(report: StepReport) -> str:
    """What the guard rail's message says to check: the likely cause when there is one."""
    cause = report.diagnosis
    if cause is None and report.problems:  # diagnose=False: the inputs are still what the message names
        cause = Diagnosis.impossible_inputs(report.problems.values())
    if cause is not None and cause.cause == IMPOSSIBLE_INPUTS:
        return f"{cause.message}."  # a fact about the inputs, not a hint
    if cause is not None and cause.is_observation:
        return f"{cause.message} (observed)."  # seen directly, not inferred: no confidence to weigh
    if cause is not None and cause.cause not in ("unclear", "none"):
        return f"{cause.message} (a hint, confidence {cause.confidence:.2f})."
    return (
        "check that the sampler receives the trainer's weights, and that both use the same tokenizer, "
        "precision and sampling settings."
    )
